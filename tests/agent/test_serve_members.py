"""Members change live (issue 34), on real nodes: clients keep calling one
deployment through the control plane while a second node joins it (its real agent and
worker start a real llama-server, and it takes requests) and the first leaves (its runtime
process ends); no request fails."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from tests.harness.agent_process import wait_until
from tests.harness.llama import GREEDY

from .test_serve import (  # noqa: F401
    DEPLOYMENTS,
    cp,
    deploy,
    deployment,
    llama_processes,
    model,
    replicate,
    serving_node,
    sockets,
    wait_servers,
    worker_servers,
)

pytestmark = pytest.mark.slow

NAME = "tiny-live"


class Clients:
    """Sequential completions through the control plane, one after another until stopped,
    each answer kept (status, text)."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.answers: list[tuple[int, str]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def call(self) -> tuple[int, str]:
        answer = requests.post(
            f"{self.url}/v1/completions",
            json={"model": NAME, "prompt": "Once upon a time", "max_tokens": 8, **GREEDY},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=60,
        )
        return answer.status_code, answer.text

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.answers.append(self.call())
            time.sleep(0.02)

    def count(self) -> int:
        return len(self.answers)

    def stop(self) -> list[tuple[int, str]]:
        self.stopped.set()
        self.thread.join(timeout=90)
        return self.answers


def served_any(port: int) -> bool:
    """Whether the llama-server on ``port`` has run a task (a slot with an id_task)."""
    slots = requests.get(f"http://127.0.0.1:{port}/slots", timeout=10).json()
    return any(slot.get("id_task") is not None for slot in slots)


def only_server(node) -> dict:
    [server] = worker_servers(node).values()
    return server


def test_a_node_joins_and_another_leaves_while_requests_flow_and_none_fails(
    cp,  # noqa: F811 - test_serve's fixtures, imported above
    tmp_path,
    sockets,  # noqa: F811
    model,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    first = serving_node(cp, tmp_path, sockets, "live-a", llama_server_binary)
    second = serving_node(cp, tmp_path, sockets, "live-b", llama_server_binary)
    clients = None
    try:
        replicate(cp, [first, second])
        assert deploy(cp, NAME, [first]).status_code == 201
        wait_servers(cp, NAME, "running")
        hub = cp.server.app.hub
        wait_until(lambda: hub.connected(first.node_id), timeout=60, what="first tunnel")
        _, key = create_api_key(cp.store, "live", "tests")
        clients = Clients(cp.url, key)
        clients.thread.start()
        wait_until(lambda: clients.count() >= 5, timeout=60, what="requests flowing")

        # The second node joins: it starts, runs and takes requests; the first serves on.
        joined = cp.admin(
            "POST", f"{DEPLOYMENTS}/{NAME}/servers", json={"node_ids": [second.node_id]}
        )
        assert joined.status_code == 200, joined.text
        wait_servers(cp, NAME, "running", count=2, timeout=120)
        wait_until(lambda: hub.connected(second.node_id), timeout=60, what="second tunnel")
        port_second = only_server(second)["port"]
        burst_answers: list[tuple[int, str]] = []

        def second_takes_some() -> bool:
            # Requests go to the running server with the fewest in flight: two more beside
            # the sequential client spread over both members (within the test control
            # plane's relay streams).
            def one() -> None:
                burst_answers.append(clients.call())

            burst = [threading.Thread(target=one) for _ in range(2)]
            for thread in burst:
                thread.start()
            for thread in burst:
                thread.join(timeout=60)
            return served_any(port_second)

        wait_until(second_takes_some, timeout=60, what="the second member answers requests")

        # The first leaves: its server stops and goes; its runtime process ends.
        pid_first = only_server(first)["ident"]["pid"]
        before_removal = clients.count()
        left = cp.admin("DELETE", f"{DEPLOYMENTS}/{NAME}/servers/{first.node_id}")
        assert left.status_code == 200, left.text

        def gone() -> bool:
            shown = deployment(cp, NAME)
            return [s["node_id"] for s in shown["servers"]] == [second.node_id]

        wait_until(gone, timeout=60, what="the first member gone")
        wait_until(lambda: worker_servers(first) == {}, timeout=60, what="first runtime stopped")
        wait_until(
            lambda: pid_first not in llama_processes(llama_server_binary),
            timeout=30,
            what="the first runtime's process gone",
        )
        assert llama_processes(llama_server_binary) == [only_server(second)["ident"]["pid"]]
        wait_until(
            lambda: clients.count() >= before_removal + 20, timeout=60, what="requests after"
        )
        answers = clients.stop() + burst_answers
        shown = deployment(cp, NAME)
        assert shown["state"] == "running" and shown["servers"][0]["node_id"] == second.node_id
        # Clients called the same name throughout, and every request was answered.
        failed = [(status, text[:200]) for status, text in answers if status != 200]
        assert failed == [] and len(answers) >= 25, (len(answers), failed[:3])
        events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
        done = {e["action"] for e in events}
        assert {"deployment.members_added", "deployment.member_removed", "server.removed"} <= done
    finally:
        if clients is not None:
            clients.stopped.set()
        first.close()
        second.close()
