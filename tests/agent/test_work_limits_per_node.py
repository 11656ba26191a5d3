"""The real agent against the control plane's limits per node (issue 21): it reports its work
slots with each claim, so it is leased no more than those and the node's maximum; and a 429
on a claim is a refusal like any other, so the slot backs off and claims again."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingUnixStreamServer

from modelforge_contract import PATH_AGENT_WORK_CLAIM, WORKER_PATH_INFO, WORKER_PATH_RUN
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import serve
from tests.harness.work_node import WORK, short_dir, start_node, wait_for_state, wait_until_ready

NODES = "/api/v1/admin/hardware/nodes"
REFUSED = f"HTTP 429 on POST {PATH_AGENT_WORK_CLAIM}"


class HeldWorker(ThreadingUnixStreamServer):
    """A worker stand-in that holds every run until the test releases them, then answers
    each as succeeded: how many items the agent runs at once is then the test's to see."""

    daemon_threads = True

    def __init__(self, path) -> None:
        self.release = threading.Event()
        self.held: list[str] = []  # work ids of the runs started
        self.lock = threading.Lock()
        super().__init__(str(path), _HeldHandler)

    def running(self) -> int:
        with self.lock:
            return len(self.held)


class _HeldHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802
        assert self.path == WORKER_PATH_INFO
        self._answer(
            {
                "worker_version": "0.1.0",
                "protocol": 1,
                "capabilities": ["smoke"],
                "accelerator_mode": "cpu",
                "running": self.server.running(),
                "compatibility": "COMPATIBLE",
            }
        )

    def do_POST(self) -> None:  # noqa: N802
        run = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != WORKER_PATH_RUN:
            self._answer({"compatibility": "COMPATIBLE"})
            return
        with self.server.lock:
            self.server.held.append(run["work_id"])
        self.server.release.wait(120)
        self._answer(
            {
                "outcome": "succeeded",
                "result": {"held": True},
                "log_tail": "",
                "error": None,
                "compatibility": "COMPATIBLE",
            }
        )


def test_the_agent_reports_its_slots_and_gets_no_more_than_the_node_may_hold(
    sqlite_control_plane, tmp_path
):
    cp = sqlite_control_plane
    with short_dir() as sockets:
        worker = HeldWorker(sockets / "held.sock")
        threading.Thread(target=worker.serve_forever, daemon=True).start()
        node = start_node(
            cp, tmp_path / "n1", sockets, "cpu-node-1", with_worker=False,
            worker_socket=str(sockets / "held.sock"), work_slots="3",
        )  # fmt: skip
        try:
            wait_until_ready(cp, node)
            work_ids = [
                cp.admin("POST", WORK, json={"capability": "smoke"}).json()["work_id"]
                for _ in range(3)
            ]
            # Three slots ask; the node's maximum (2 by default) is what it gets.
            wait_until(
                lambda: worker.running() == 2 and "(slots_full)" in node.agent.log(),
                timeout=60,
                what="two runs held and a third slot told slots_full",
            )
            states = [cp.admin("GET", f"{WORK}/{w}").json()["state"] for w in work_ids]
            assert sorted(states) == ["leased", "leased", "queued"]
            # Raised for this node, the third slot's next claim gets the third item: the
            # agent said it runs three.
            raised = cp.admin(
                "PUT", f"{NODES}/{node.node_id}/work-slots", json={"work_slots_max": 8}
            )
            assert raised.status_code == 200
            wait_until(lambda: worker.running() == 3, timeout=60, what="a third run")
            worker.release.set()
            for work_id in work_ids:
                assert wait_for_state(cp.store, work_id)["state"] == "succeeded"
        finally:
            worker.release.set()
            node.close()
            worker.shutdown()
            worker.server_close()


def test_the_agent_keeps_claiming_after_a_429(sqlite_settings, tmp_path):
    # One claim a second, and an idle agent that asks every 50 ms: it is refused at once.
    with serve(replace(sqlite_settings, work_claims_per_second=1)) as cp, short_dir() as sockets:
        node = start_node(cp, tmp_path / "n1", sockets, "cpu-node-1")
        try:
            wait_until_ready(cp, node)
            wait_until(lambda: REFUSED in node.agent.log(), timeout=60, what="a refused claim")
            body = {"capability": "smoke", "constraints": {"node_ids": [node.node_id]}}
            submitted = cp.admin("POST", WORK, json=body).json()
            done = wait_for_state(cp.store, submitted["work_id"])
            assert (done["state"], done["completed_by_node_id"]) == ("succeeded", node.node_id)
            log = node.agent.log()
            assert log.index(REFUSED) < log.index(f"work {submitted['work_id']} leased")
            assert "work slot stopped" not in log
            metrics = cp.admin("GET", "/metrics").text.splitlines()
            limited = [m for m in metrics if 'work_claims_total{result="rate_limited"}' in m]
            assert limited and float(limited[0].split()[-1]) >= 1
        finally:
            node.close()
