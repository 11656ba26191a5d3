"""Members change live (issue 34), on real nodes: clients keep calling one
deployment through the control plane while a second node joins it (its real agent and
worker start a real llama-server, and it takes requests) and the first leaves (its runtime
process ends); no request fails. And one member's agent killed: the other takes the load, no
request fails, and the killed node's member serves again once its agent is back, with no
admin call."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from tests.harness.agent_process import AgentProcess, wait_until
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


def last_task(port: int) -> int:
    """The newest task id the llama-server on ``port`` has run (-1: none yet)."""
    slots = requests.get(f"http://127.0.0.1:{port}/slots", timeout=10).json()
    tasks = [slot.get("id_task") for slot in slots if isinstance(slot.get("id_task"), int)]
    return max(tasks, default=-1)


def served_any(port: int) -> bool:
    """Whether the llama-server on ``port`` has run a task (a slot with an id_task)."""
    return last_task(port) >= 0


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


def test_one_member_s_agent_killed_the_other_takes_the_load_and_it_serves_again_on_return(
    cp,  # noqa: F811 - test_serve's fixtures, imported above
    tmp_path,
    sockets,  # noqa: F811
    model,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    first = serving_node(cp, tmp_path, sockets, "kill-a", llama_server_binary)
    second = serving_node(cp, tmp_path, sockets, "kill-b", llama_server_binary)
    clients = None
    try:
        replicate(cp, [first, second])
        assert deploy(cp, NAME, [first, second]).status_code == 201
        wait_servers(cp, NAME, "running", count=2, timeout=120)
        hub = cp.server.app.hub
        for node in (first, second):
            wait_until(lambda n=node: hub.connected(n.node_id), timeout=60, what="tunnels")
        _, key = create_api_key(cp.store, "kill", "tests")
        clients = Clients(cp.url, key)
        clients.thread.start()
        wait_until(lambda: clients.count() >= 6, timeout=60, what="requests flowing")
        port_first = only_server(first)["port"]

        # The first node's agent dies (no goodbye on its tunnel): its member waits, the
        # second answers every request meanwhile.
        first.agent.process.send_signal(signal.SIGKILL)
        first.agent.process.wait(timeout=10)

        def first_waits() -> bool:
            servers = {s["node_id"]: s["state"] for s in deployment(cp, NAME)["servers"]}
            return servers == {first.node_id: "waiting", second.node_id: "running"}

        wait_until(first_waits, timeout=60, what="the killed node's member waiting")
        assert deployment(cp, NAME)["state"] == "degraded"
        during = clients.count()
        wait_until(lambda: clients.count() >= during + 10, timeout=90, what="served by one")

        # The agent comes back: no admin call, its member runs again and takes requests.
        task_before = last_task(port_first)  # the runtime ran on, unwatched
        returned = time.monotonic()
        first.agent.close()
        first.agent = AgentProcess(first.agent.env, tmp_path / "kill-a" / "agent-2.log")
        wait_servers(cp, NAME, "running", count=2, timeout=90)
        wait_until(lambda: hub.connected(first.node_id), timeout=60, what="its tunnel again")
        wait_until(lambda: last_task(port_first) > task_before, timeout=60, what="it answers again")
        print(f"from the agent's return to its first relayed answer: "
              f"{time.monotonic() - returned:.2f} s")  # fmt: skip
        answers = clients.stop()
        failed = [(status, text[:200]) for status, text in answers if status != 200]
        assert failed == [] and len(answers) >= 20, (len(answers), failed[:3])
        shown = deployment(cp, NAME)
        assert shown["state"] == "running"
        assert [s["restarts"] for s in shown["servers"]] == [0, 0]  # adopted, not restarted
        events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
        assert not [e for e in events if e["action"].startswith("deployment.restart")]
    finally:
        if clients is not None:
            clients.stopped.set()
        first.close()
        second.close()
