"""The work plane end to end: control plane, agent process, worker process (issue 13)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingUnixStreamServer

import pytest

from modelforge_appliance.work import items
from modelforge_contract import (
    LEASE_LOST,
    PATH_AGENT_WORK_COMPLETE,
    WORKER_PATH_INFO,
    work_path,
)
from modelforge_contract.deployments import WORKER_PATH_SERVERS
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import error_code, make_settings, run_cli, serve, store_env
from tests.harness.nvml import h100_80g_x8
from tests.harness.work_node import WORK, short_dir, start_node, wait_for_state, wait_until_ready

NODES = "/api/v1/admin/hardware/nodes"


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


def cli(cp, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env=store_env(cp.settings), timeout=180)


def test_cpu_smoke_end_to_end_as_the_runbook_runs_it(control_plane, tmp_path, sockets):
    cp = control_plane
    node = start_node(cp, tmp_path / "n1", sockets, "cpu-node-1")
    try:
        ready = wait_until_ready(cp, node)
        worker_check = {c["name"]: c for c in ready["checks"]}["worker"]
        assert "COMPATIBLE" in worker_check["detail"]
        # docs/runbooks/node-loss.md: the capability smoke against the recovered node.
        done = cli(cp, "work", "submit", "smoke", "--node", node.node_id, "--wait", "--json")
        assert done.returncode == 0, done.stderr
        item = json.loads(done.stdout)
        assert (item["state"], item["node_id"], item["attempts"]) == (
            "succeeded",
            node.node_id,
            1,
        )
        assert item["result"]["mode"] == "cpu"
        assert [line.split(":")[0] for line in item["result"]["checked"]] == ["cpu", "computation"]
        assert "computation:" in item["log_tail"]
        shown = cli(cp, "work", "show", item["work_id"])
        assert shown.returncode == 0 and "succeeded" in shown.stdout
        listed = json.loads(cli(cp, "work", "list", "--json").stdout)
        assert [i["work_id"] for i in listed["work"]] == [item["work_id"]]
        log = node.agent.log()
        assert f"work {item['work_id']} leased: smoke" in log
        assert f"work {item['work_id']} succeeded" in log
        assert "checksum" not in log  # the agent never logs a body
        assert node.credential not in log and node.credential.split("_", 2)[2] not in log
        assert (
            node.worker is not None and "POST /v1/run -> 200 smoke succeeded" in node.worker.log()
        )
    finally:
        node.close()


def test_nvidia_smoke_end_to_end_through_the_test_nvml_library(
    sqlite_control_plane, tmp_path, sockets, fake_nvml_dir
):
    cp = sqlite_control_plane
    host = h100_80g_x8()
    node = start_node(
        cp, tmp_path / "gpu", sockets, "gpu-node-1", mode="nvidia", host=host,
        fake_nvml_dir=fake_nvml_dir,
    )  # fmt: skip
    try:
        wait_until_ready(cp, node)
        body = {
            "capability": "smoke",
            "constraints": {"gpu_count": 8, "gpu_name": "H100", "min_gpu_memory_bytes": 80 * 10**9},
        }
        submitted = cp.admin("POST", WORK, json=body).json()
        item = wait_for_state(cp.store, submitted["work_id"])
        assert item["state"] == "succeeded", item
        gpus = item["result"]["gpus"]
        assert [gpu["uuid"] for gpu in gpus] == [d["uuid"] for d in host["devices"]]
        assert all(gpu["compute"]["mismatches"] == 0 for gpu in gpus)
        assert sum(line.startswith("cuda: saxpy") for line in item["result"]["checked"]) == 8
    finally:
        node.close()


def test_an_agent_without_its_worker_reports_degraded_and_claims_nothing(
    sqlite_control_plane, tmp_path, sockets
):
    cp = sqlite_control_plane
    node = start_node(cp, tmp_path / "n1", sockets, "cpu-node-1", with_worker=False)
    try:

        def degraded():
            if not (node.state_volume / "identity.json").exists():
                return None
            view = cp.admin("GET", f"{NODES}/{node.node_id}").json()
            health = view.get("health") or {}
            return view if health.get("status") == "degraded" and view["inventory_at"] else None

        view = wait_until(degraded, timeout=60, what="degraded health")
        assert "does not answer" in view["health"]["message"]
        assert view["health"]["worker"]["reachable"] is False
        checks = cp.admin("GET", f"{NODES}/{node.node_id}/readiness").json()["checks"]
        worker_check = {c["name"]: c for c in checks}["worker"]
        assert (
            worker_check["ok"] is False
            and "MODELFORGE_AGENT_WORKER_SOCKET" in worker_check["next_step"]
        )
        submitted = cp.admin("POST", WORK, json={"capability": "smoke"}).json()
        assert "does not answer" in node.agent.log()

        from tests.harness.worker_process import WorkerProcess, worker_env

        started_at = cp.store.clock.now()
        node.worker = WorkerProcess(worker_env(sockets / "cpu-node-1.sock"), tmp_path / "w.log")
        item = wait_for_state(cp.store, submitted["work_id"])
        assert item["state"] == "succeeded"
        leased = [
            e for e in cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
            if e["action"] == "work.leased"
        ]  # fmt: skip
        # Claimed only once its worker answered.
        assert len(leased) == 1
        assert items.work_view(items.get_work(cp.store, submitted["work_id"]))["attempts"] == 1
        assert item["started_at"] >= _iso(started_at)
    finally:
        node.close()


def _iso(epoch: float) -> str:
    from modelforge_appliance.core.clock import isoformat

    return isoformat(epoch)


class _BusyWorker(ThreadingUnixStreamServer):
    """A worker stand-in that answers /v1/info compatibly, lists no servers and holds every
    run open.

    It keeps the agent mid-item for as long as the test needs, so killing the agent then
    depends on nothing the test does not control (a real run could finish first).
    """

    daemon_threads = True

    def __init__(self, path) -> None:
        self.release = threading.Event()
        self.runs = threading.Event()
        super().__init__(str(path), _BusyHandler)


class _BusyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == WORKER_PATH_SERVERS:  # the agent's serve loop: no servers here
            answer: dict = {"servers": []}
        else:
            assert self.path == WORKER_PATH_INFO
            answer = {
                "worker_version": "0.1.0",
                "protocol": 1,
                "capabilities": ["smoke"],
                "accelerator_mode": "cpu",
            }
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.runs.set()
        self.server.release.wait(120)
        self.close_connection = True


def test_sigkilled_agent_loses_its_lease_and_another_node_finishes(tmp_path, clock):
    settings = make_settings(tmp_path / "cp", work_lease_seconds=10)
    with serve(settings, clock) as cp, short_dir() as sockets:
        busy = _BusyWorker(sockets / "busy.sock")
        threading.Thread(target=busy.serve_forever, daemon=True).start()
        first = start_node(cp, tmp_path / "a", sockets, "node-a", with_worker=False,
                           worker_socket=str(sockets / "busy.sock"))  # fmt: skip
        second = None
        try:
            wait_until_ready(cp, first)
            submitted = cp.admin("POST", WORK, json={"capability": "smoke"}).json()
            assert busy.runs.wait(60), first.agent.log()
            held = items.work_view(items.get_work(cp.store, submitted["work_id"]))
            assert (held["state"], held["node_id"]) == ("leased", first.node_id)
            first.agent.process.send_signal(signal.SIGKILL)
            first.agent.process.wait(timeout=10)
            credential, first_node = first.credential, first.node_id

            second = start_node(cp, tmp_path / "b", sockets, "node-b")
            wait_until_ready(cp, second)
            clock.advance(settings.work_lease_seconds + 1)  # the lease runs out on its own
            item = wait_for_state(cp.store, submitted["work_id"])
            assert (item["state"], item["node_id"], item["attempts"]) == (
                "succeeded",
                second.node_id,
                2,
            )
            # The first node's late completion changes nothing.
            late = cp.agent(
                "POST",
                work_path(PATH_AGENT_WORK_COMPLETE, submitted["work_id"]),
                credential,
                json={
                    "node_id": first_node,
                    "lease_id": held["lease_id"],
                    "outcome": "failed",
                    "result": {"late": True},
                },
            )
            assert (late.status_code, error_code(late)) == (409, LEASE_LOST)
            assert items.work_view(items.get_work(cp.store, submitted["work_id"])) == item
            events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
            actions = [(e["action"], e["node_id"]) for e in reversed(events)
                       if e["action"].startswith("work.")]  # fmt: skip
            assert actions == [
                ("work.submitted", None),
                ("work.leased", first_node),
                ("work.lease_expired", first_node),
                ("work.leased", second.node_id),
                ("work.completed", second.node_id),
            ]
        finally:
            busy.release.set()
            busy.shutdown()
            busy.server_close()
            first.close()
            if second is not None:
                second.close()
