"""A whole node for the work tests: a real agent process beside a real worker process."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modelforge_appliance.work import items, leases

from .agent_process import AgentProcess, agent_env, nvml_env, wait_until
from .nvml import write_nvml_config
from .worker_process import WorkerProcess, worker_env

WORK = "/api/v1/admin/work"


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="mfn-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fast_agent_settings(socket: Path) -> dict[str, str]:
    """The agent's work loop driven quickly for tests (no assertion depends on it)."""
    return {
        "worker_socket": str(socket),
        "work_poll_seconds": "0.05",
        "worker_check_seconds": "0.5",
    }


@dataclass
class Node:
    agent: AgentProcess
    worker: WorkerProcess | None
    state_volume: Path

    @property
    def node_id(self) -> str:
        import json

        return json.loads((self.state_volume / "identity.json").read_text())["node_id"]

    @property
    def credential(self) -> str:
        import json

        return json.loads((self.state_volume / "identity.json").read_text())["credential"]

    def close(self) -> None:
        self.agent.close()
        if self.worker is not None:
            self.worker.close()


def start_node(
    cp,
    work_dir: Path,
    sockets: Path,
    name: str,
    *,
    mode: str = "cpu",
    host: dict | None = None,
    fake_nvml_dir: Path | None = None,
    with_worker: bool = True,
    worker_settings: dict[str, str] | None = None,
    **agent_settings: str,
) -> Node:
    """Enroll a fresh node: its worker first (when asked), then its agent."""
    work_dir.mkdir(parents=True, exist_ok=True)
    socket = sockets / f"{name}.sock"
    gpu_env: dict[str, str] = {}
    if mode == "nvidia":
        gpu_env = nvml_env(fake_nvml_dir, host, work_dir / "nvml")
    worker = None
    if with_worker:
        worker_gpu = {}
        if mode == "nvidia":
            config = write_nvml_config(host, work_dir / "worker-nvml.conf")
            worker_gpu = {"LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_CONFIG": str(config)}
        env = worker_env(socket, mode, **worker_gpu, **(worker_settings or {}))
        worker = WorkerProcess(env, work_dir / "worker.log")
    state = work_dir / "state"
    env = agent_env(
        control_plane_url=cp.url,
        enrollment_token=cp.mint(name)["token"],
        accelerator_mode=mode,
        state_volume=state,
        hostname=name,
        telemetry_interval_seconds=1,
        **{**fast_agent_settings(socket), **agent_settings},
        **gpu_env,
    )
    return Node(AgentProcess(env, work_dir / "agent.log"), worker, state)


def wait_until_ready(cp, node: Node, timeout: float = 60) -> dict:
    def ready():
        if not (node.state_volume / "identity.json").exists():
            return None
        try:
            node_id = node.node_id
        except (KeyError, ValueError):
            return None
        if not node_id:
            return None
        answer = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}/readiness").json()
        return answer if answer.get("ready") else None

    try:
        return wait_until(ready, timeout=timeout, what="node ready")
    except AssertionError:
        raise AssertionError(f"node not ready; agent log:\n{node.agent.log()}") from None


def wait_for_state(store, work_id: str, states=("succeeded", "failed", "cancelled"), timeout=120):
    def finished():
        leases.expire_leases(store)
        view = items.work_view(items.get_work(store, work_id))
        return view if view["state"] in states else None

    return wait_until(finished, timeout=timeout, what=f"work {work_id} in {states}")
