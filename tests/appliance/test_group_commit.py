"""Group commit (Store.grouped): completions share one flushed transaction, each keeps its own
result, and one that fails leaves the others standing."""

from __future__ import annotations

import threading

import pytest

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.store import audit
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import AuditEvent


@pytest.fixture
def store(database_url):
    store = Store(database_url, Clock())
    store.migrate()
    yield store
    store.close()


def test_many_threads_each_get_their_own_result_and_a_failure_stays_its_own(store):
    barrier = threading.Barrier(24)
    answers: dict[int, object] = {}

    def change(i: int):
        audit.record(store, "test", "grouped", index=i)
        if i % 6 == 0:
            raise ValueError(f"change {i} refused")  # after writing: its savepoint is undone
        return i * 10

    def send(i: int) -> None:
        barrier.wait()
        try:
            answers[i] = store.grouped(lambda: change(i))
        except ValueError as exc:
            answers[i] = str(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {i: (f"change {i} refused" if i % 6 == 0 else i * 10) for i in range(24)}
    with store.connection():
        kept = sorted(
            int(e.detail.split(":")[1].rstrip("}"))
            for e in AuditEvent.select().where(AuditEvent.action == "grouped")
        )
    assert kept == [i for i in range(24) if i % 6 != 0]
