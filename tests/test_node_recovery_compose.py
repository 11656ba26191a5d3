"""docker-compose.node-recovery.yml gives the rehearsal node a Runtime Worker that can serve a
deployment: one network namespace with the agent (a runtime listens on 127.0.0.1 there, where
the agent polls its readiness), the worker socket, and the agent's artifact root at the same
path, read-only for the worker (docs/deployments.md, "Where a runtime listens"). Starting it
against the release images is tests/release/test_end_to_end.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.harness.compose import compose_v1_binary, config_as_data, gpu_reservation
from tests.harness.control_plane import clean_env

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "docker-compose.node-recovery.yml"
AGENT, WORKER = "node-agent-rehearsal", "runtime-worker-rehearsal"
SOCKET_DIR = "/run/modelforge-worker"
ARTIFACTS = "/var/lib/modelforge-artifacts"


def recovery_model(**env: str) -> dict:
    result = subprocess.run(
        [compose_v1_binary(), "-f", str(FILE), "config"],
        env=clean_env(MODELFORGE_AGENT_CONTROL_PLANE_URL="http://127.0.0.1:8000", **env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return config_as_data(result.stdout)


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only), from v1's "source:target:mode" strings."""
    found = {}
    for volume in service["volumes"]:
        source, target, mode = volume.split(":")
        found[target] = (source, mode == "ro")
    return found


def test_the_rehearsal_worker_shares_the_agents_network_socket_and_artifacts():
    model = recovery_model()
    agent, worker = model["services"][AGENT], model["services"][WORKER]
    # One network namespace: the worker starts first (the socket volume takes its image's
    # directory, owned by its user), the agent joins it.
    assert agent["network_mode"] == f"service:{WORKER}"
    assert WORKER in agent["depends_on"]
    assert "network_mode" not in worker
    socket = f"{SOCKET_DIR}/worker.sock"
    assert worker["environment"]["MODELFORGE_WORKER_SOCKET"] == socket
    assert agent["environment"]["MODELFORGE_AGENT_WORKER_SOCKET"] == socket
    assert (
        mounts(worker)[SOCKET_DIR]
        == mounts(agent)[SOCKET_DIR]
        == (
            "rehearsal-worker-socket",
            False,
        )
    )
    # The artifact root at the same path in both, read-only for the worker.
    assert agent["environment"]["MODELFORGE_AGENT_ARTIFACT_ROOT"] == ARTIFACTS
    assert mounts(agent)[ARTIFACTS] == ("rehearsal-artifacts", False)
    assert mounts(worker)[ARTIFACTS] == ("rehearsal-artifacts", True)
    # Never the agent's identity in the worker.
    assert "/var/lib/modelforge-node-agent" not in mounts(worker)
    volume = model["volumes"]["rehearsal-artifacts"]["driver_opts"]
    assert volume["type"] == "tmpfs" and "uid=65532" in volume["o"]  # the images' user


def test_the_rehearsal_worker_is_a_locked_down_cpu_worker_from_the_cpu_image():
    model = recovery_model()
    worker = model["services"][WORKER]
    assert worker["image"] == "modelforge-runtime-worker-cpu:local"
    assert worker["build"]["dockerfile"] == (
        "packaging/images/modelforge-runtime-worker-cpu.Dockerfile"
    )
    assert (ROOT / worker["build"]["dockerfile"]).is_file()
    assert worker["environment"]["MODELFORGE_WORKER_ACCELERATOR_MODE"] == "cpu"
    assert worker["pull_policy"] == "never" and worker["read_only"] is True
    assert worker["cap_drop"] == ["ALL"] and gpu_reservation(worker) == []
    chosen = recovery_model(MODELFORGE_RUNTIME_WORKER_IMAGE="modelforge-runtime-worker-cpu:1.3.0")
    assert chosen["services"][WORKER]["image"] == "modelforge-runtime-worker-cpu:1.3.0"
