"""Readiness right after a restore: the heartbeat answer asks each reconnecting agent to
publish its inventory again, so every node is ready within two heartbeat intervals instead of
after the agent's next periodic publication (an unchanged inventory: every 1,800 s). Each
node is whole: its agent beside a real runtime worker (readiness checks the worker too)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import threading

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.runtime.server import create_server, run_until
from modelforge_appliance.store.database import Store
from modelforge_contract import EXIT_CHECK_FAILED, PATH_AGENT_HEARTBEAT, PATH_AGENT_INVENTORY
from tests.harness.agent_process import AgentProcess, RestartableControlPlane, agent_env, wait_until
from tests.harness.control_plane import make_settings, run_cli, store_env
from tests.harness.work_node import short_dir
from tests.harness.worker_process import WorkerProcess, worker_env


class RecordingControlPlane(RestartableControlPlane):
    """The real control plane, noting (path, node id, status) of every agent call in order."""

    def __init__(self, settings) -> None:
        self.calls: list[tuple[str, str | None, int]] = []
        self._calls_lock = threading.Lock()
        super().__init__(settings)

    def _recording(self, app):
        def wsgi(environ, start_response):
            length = int(environ.get("CONTENT_LENGTH") or 0)
            raw = environ["wsgi.input"].read(length) if length else b""
            environ["wsgi.input"] = io.BytesIO(raw)
            try:
                node_id = json.loads(raw).get("node_id") if raw else None
            except ValueError:
                node_id = None

            def start(status, headers, exc_info=None):
                with self._calls_lock:
                    self.calls.append((environ["PATH_INFO"], node_id, int(status.split()[0])))
                return start_response(status, headers, exc_info)

            return app(environ, start)

        return wsgi

    def start(self) -> None:
        self.store = Store(self.settings.database_url, Clock())
        self.store.migrate()
        # The real server (its front takes the agents' tunnels), every HTTP call recorded.
        self.server = create_server(self.settings, self.store, "127.0.0.1", self.port)
        self.server.application = self._recording(self.server.application)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=run_until, args=(self.server, self._stop), daemon=True
        )
        self._thread.start()


def cli(settings, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env=store_env(settings), check=True)


def ready(cp, node_id: str) -> bool:
    answer = cp.plane.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}/readiness")
    return answer.status_code == 200 and answer.json()["ready"]


def test_every_reconnecting_node_is_ready_within_two_heartbeat_intervals(tmp_path):
    with contextlib.ExitStack() as stack:
        _ready_again_after_a_restore(tmp_path, stack)


def _ready_again_after_a_restore(tmp_path, stack: contextlib.ExitStack) -> None:
    settings = make_settings(
        tmp_path / "cp",
        heartbeat_interval_seconds=1,
        stale_after_seconds=3,
        offline_after_seconds=6,
    )
    cp = RecordingControlPlane(settings)
    agents, workers = [], []
    sockets = stack.enter_context(short_dir())
    try:
        for name in ("a", "b"):
            socket = sockets / f"{name}.sock"
            workers.append(WorkerProcess(worker_env(socket), tmp_path / f"{name}-worker.log"))
            env = agent_env(
                control_plane_url=cp.url,
                enrollment_token=cp.plane.mint(f"gpu-{name}")["token"],
                accelerator_mode="cpu",
                hostname=f"gpu-{name}",
                state_volume=tmp_path / name,
                # Long: only a request from the control plane publishes it again in time.
                inventory_interval_seconds=86400,
                worker_socket=socket,
            )
            agents.append(AgentProcess(env, tmp_path / f"{name}.log"))
        wait_until(lambda: len(cp.nodes()) == 2, what="both nodes enrolled")
        node_ids = [node["node_id"] for node in cp.nodes()]
        wait_until(lambda: all(ready(cp, n) for n in node_ids), what="both ready", timeout=30)

        backup = tmp_path / "backup.sqlite3"
        cli(settings, "backup", str(backup))
        cp.stop()
        cli(settings, "restore", str(backup), "--yes")
        # Nothing measured since the restore: no node is ready (asked of the store while the
        # server is down; once it runs, the agents may reconnect before any question).
        for node_id in node_ids:
            answer = run_cli("nodes", "readiness", node_id, "--json", env=store_env(settings))
            assert answer.returncode == EXIT_CHECK_FAILED, answer.stderr
            assert json.loads(answer.stdout)["ready"] is False
        with cp._calls_lock:
            cp.calls.clear()
        cp.start()
        wait_until(lambda: all(ready(cp, n) for n in node_ids), what="ready again", timeout=60)

        for node_id in node_ids:
            with cp._calls_lock:
                mine = [(path, code) for path, owner, code in cp.calls if owner == node_id]
            beats = [
                i
                for i, (path, code) in enumerate(mine)
                if path == PATH_AGENT_HEARTBEAT and code == 200
            ]
            published = [
                i
                for i, (path, code) in enumerate(mine)
                if path == PATH_AGENT_INVENTORY and code == 200
            ]
            assert beats and published, mine
            # The first answered heartbeat asks; the inventory follows before the third one.
            answered_before = [i for i in beats if i < published[0]]
            assert 1 <= len(answered_before) <= 2, mine
        for agent in agents:
            assert "inventory published" in agent.log()
    finally:
        for agent in agents:
            if agent.process.poll() is None:
                agent.terminate()
            agent.close()
        for worker in workers:
            worker.close()
        cp.stop()
