"""1,000 items, 10 agents with their workers as real processes, on SQLite and PostgreSQL:
every item completes exactly once and no item is ever leased to two nodes at once, as the
audit trail tells it (issue 13)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from modelforge_appliance.core.sealing import WorkKeys
from modelforge_appliance.store.tables import AuditEvent, WorkLease
from modelforge_appliance.work import items, leases
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import serve
from tests.harness.work_node import short_dir, start_node

ITEMS = 1000
AGENTS = 10


def check_the_audit_trail(store, work_ids: set[str]) -> Counter:
    """Walk every work event in order; return completions per node."""
    held: dict[str, tuple[str, str] | None] = defaultdict(lambda: None)
    completed: Counter = Counter()
    by_node: Counter = Counter()
    with store.connection():
        events = list(
            AuditEvent.select().where(AuditEvent.action.startswith("work.")).order_by(AuditEvent.id)
        )
    for event in events:
        detail = json.loads(event.detail)
        work_id = detail["work_id"]
        if event.action == "work.leased":
            assert held[work_id] is None, f"{work_id} leased while {held[work_id]} held it"
            held[work_id] = (detail["lease_id"], event.node_id)
        elif event.action in ("work.lease_expired", "work.lease_returned"):
            assert held[work_id] is not None and held[work_id][0] == detail["lease_id"]
            held[work_id] = None
        elif event.action == "work.completed":
            assert held[work_id] == (detail["lease_id"], event.node_id), work_id
            assert detail["outcome"] == "succeeded"
            held[work_id] = None
            completed[work_id] += 1
            by_node[event.node_id] += 1
        else:
            assert event.action == "work.submitted"
    assert set(completed) == work_ids
    assert set(completed.values()) == {1}, "an item completed more than once"
    assert not any(held.values())
    return by_node


def check_lease_history(store, work_ids: set[str]) -> None:
    """The lease rows agree: per item, one lease ends before the next begins."""
    with store.connection():
        rows = list(WorkLease.select().order_by(WorkLease.granted_at, WorkLease.lease_id))
    per_item = defaultdict(list)
    for row in rows:
        per_item[row.work_id].append(row)
    assert set(per_item) == work_ids
    for history in per_item.values():
        assert all(lease.ended_at is not None for lease in history)
        for earlier, later in zip(history, history[1:], strict=False):
            assert earlier.ended_at <= later.granted_at
        assert [lease.end_reason for lease in history][-1] == "completed"


@pytest.mark.slow
def test_a_thousand_items_on_ten_agents_complete_exactly_once(settings, tmp_path):
    with serve(settings) as cp, short_dir() as sockets:
        submission = items.Submission("smoke", {"matrix_size": 2}, items.normalise_constraints({}),
                                     60, 3, None)  # fmt: skip
        work_ids = {
            items.submit_work(
                cp.store, submission, "test", WorkKeys.of(cp.settings.state_dir)
            ).item.work_id
            for _ in range(ITEMS)
        }
        nodes = []
        try:
            for i in range(AGENTS):
                nodes.append(start_node(cp, tmp_path / f"n{i}", sockets, f"fleet-{i}"))

            def all_done():
                leases.expire_leases(cp.store)
                counts = items.counts_by_state(cp.store)
                assert counts["failed"] == 0 and counts["cancelled"] == 0, counts
                return counts["succeeded"] == ITEMS

            wait_until(all_done, timeout=900, what=f"{ITEMS} items to finish")
        finally:
            for node in nodes:
                node.close()
        by_node = check_the_audit_trail(cp.store, work_ids)
        check_lease_history(cp.store, work_ids)
        assert sum(by_node.values()) == ITEMS
        assert set(by_node) <= {node.node_id for node in nodes}
