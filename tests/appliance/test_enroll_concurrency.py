"""Invariant 2: one token, one identity — decided by a conditional update, under real load."""

from __future__ import annotations

import multiprocessing
import threading

import requests

from modelforge_appliance.store.tables import Credential, Node
from modelforge_contract import ENROLLMENT_TOKEN_CONSUMED, HEADER_AGENT_PROTOCOL
from tests.harness.control_plane import new_identity

CLAIMS = 60


def _claim(url: str, token: str, index: int) -> tuple[int, str | None]:
    body = {
        "token": token,
        "hostname": f"racer-{index}",
        "agent_version": "0.1.0",
        "accelerator_mode": "cpu",
        "identity": new_identity(),
    }
    response = requests.post(
        f"{url}/api/v1/agent/enroll", json=body, headers={HEADER_AGENT_PROTOCOL: "1"}, timeout=60
    )
    code = None if response.status_code == 201 else response.json()["error"]["code"]
    return response.status_code, code


def _claim_in_process(url, token, index, barrier, results) -> None:
    barrier.wait(timeout=60)
    results.put(_claim(url, token, index))


def _assert_exactly_one_winner(control_plane, outcomes: list[tuple[int, str | None]]) -> None:
    statuses = sorted(status for status, _ in outcomes)
    assert statuses.count(201) == 1, statuses
    refusals = [(status, code) for status, code in outcomes if status != 201]
    assert refusals == [(410, ENROLLMENT_TOKEN_CONSUMED)] * (CLAIMS - 1)
    with control_plane.store.connection():
        assert Node.select().count() == 1
        assert Credential.select().where(Credential.revoked_at.is_null()).count() == 1


def test_sixty_threads_claim_one_token_and_exactly_one_wins(control_plane):
    token = control_plane.mint()["token"]
    barrier = threading.Barrier(CLAIMS)
    outcomes: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def race(index: int) -> None:
        barrier.wait(timeout=60)
        outcome = _claim(control_plane.url, token, index)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(CLAIMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outcomes) == CLAIMS
    _assert_exactly_one_winner(control_plane, outcomes)


def test_sixty_processes_claim_one_token_and_exactly_one_wins(control_plane):
    token = control_plane.mint()["token"]
    # Not "fork": this process runs waitress threads, and a child forked from a threaded
    # process can inherit a held lock (CPython 3.12+ warns). The forkserver is forked once,
    # before any thread, and makes the children.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    barrier = context.Barrier(CLAIMS)
    results = context.Queue()
    processes = [
        context.Process(
            target=_claim_in_process, args=(control_plane.url, token, i, barrier, results)
        )
        for i in range(CLAIMS)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in range(CLAIMS)]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    _assert_exactly_one_winner(control_plane, outcomes)
