"""The compose files are valid for Compose v1 (Debian's docker-compose) and say what the
docs promise: image selection, durable state, the private CA, the worker's socket and GPUs.
Starting them against real images is tests/release/test_end_to_end.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness.compose import compose_v1_binary, config_as_data, gpu_reservation
from tests.harness.control_plane import IN_CI, clean_env

ROOT = Path(__file__).resolve().parents[1]


def compose_config(path: Path, **env: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        if IN_CI:
            pytest.fail("docker-compose is missing: scripts/test installs it as root")
        pytest.skip("docker-compose is not installed")
    return subprocess.run(
        [binary, "-f", str(path), "config"],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_node_recovery_compose_file_is_valid_and_needs_a_control_plane_url():
    path = ROOT / "docker-compose.node-recovery.yml"
    refused = compose_config(path)
    assert refused.returncode != 0
    assert "set MODELFORGE_AGENT_CONTROL_PLANE_URL" in refused.stderr
    config = compose_config(path, MODELFORGE_AGENT_CONTROL_PLANE_URL="http://127.0.0.1:8000")
    assert config.returncode == 0, config.stderr
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE: cpu" in config.stdout
    assert "rehearsal-agent-state:/var/lib/modelforge-node-agent" in config.stdout
    assert "mfe_" not in path.read_text() and "mfc_" not in path.read_text()


# -- the release compose files ------------------------------------------------------------------

COMPOSE_FILES = (
    "docker-compose.yml",
    "docker-compose.node-agent.yml",
    "docker-compose.node-agent.private-ca.yml",
    "docker-compose.runtime-worker.yml",
    "docker-compose.gpu.yml",
    "docker-compose.node-recovery.yml",
)


def compose_model(tmp_path: Path, *files: str, **env: str) -> dict:
    """``docker-compose config`` of FILES, as data; fails the test with v1's message."""
    binary = compose_v1_binary()
    env_file = tmp_path / "modelforge-node.env"
    env_file.write_text("MODELFORGE_AGENT_CONTROL_PLANE_URL=http://cp.lan:8000\n")
    argv = [binary]
    for name in files:
        argv += ["-f", str(ROOT / name)]
    result = subprocess.run(
        [*argv, "config"],
        env=clean_env(MODELFORGE_NODE_AGENT_ENV_FILE=str(env_file), **env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return config_as_data(result.stdout)


def test_every_image_falls_back_to_a_local_source_build_never_latest():
    for name in COMPOSE_FILES:
        text = (ROOT / name).read_text()
        settings = "\n".join(line.split("#")[0] for line in text.splitlines())
        assert "latest" not in settings, name
        for line in settings.splitlines():
            if line.strip().startswith("image:"):
                assert re.fullmatch(
                    r"\s*image: \$\{MODELFORGE_\w+_IMAGE:-modelforge-[a-z-]+:local\}", line
                ), line
        assert "mfe_" not in text and "mfc_" not in text, name


@pytest.mark.parametrize(
    ("files", "service", "variable", "image"),
    [
        (
            ["docker-compose.yml"],
            "control-plane",
            "MODELFORGE_CONTROL_PLANE_IMAGE",
            "modelforge-control-plane",
        ),
        (
            ["docker-compose.node-agent.yml"],
            "node-agent",
            "MODELFORGE_NODE_AGENT_IMAGE",
            "modelforge-node-agent",
        ),
        (
            ["docker-compose.node-agent.yml", "docker-compose.runtime-worker.yml"],
            "runtime-worker",
            "MODELFORGE_RUNTIME_WORKER_IMAGE",
            "modelforge-runtime-worker",
        ),
    ],
)
def test_a_variable_selects_the_image_and_build_stays_for_source_builds(
    tmp_path, files, service, variable, image
):
    default = compose_model(tmp_path, *files)["services"][service]
    assert default["image"] == f"{image}:local"
    assert default["build"]["dockerfile"] == f"packaging/images/{image}.Dockerfile"
    assert (ROOT / default["build"]["dockerfile"]).is_file()
    chosen = compose_model(tmp_path, *files, **{variable: f"{image}:1.3.0-rc.1"})["services"][
        service
    ]
    assert chosen["image"] == f"{image}:1.3.0-rc.1"


def test_the_control_plane_keeps_its_store_in_a_volume_and_runs_locked_down(tmp_path):
    model = compose_model(
        tmp_path, "docker-compose.yml", MODELFORGE_PUBLIC_API_ORIGIN="http://10.0.0.5:8000"
    )
    service = model["services"]["control-plane"]
    assert service["environment"]["MODELFORGE_PUBLIC_API_ORIGIN"] == "http://10.0.0.5:8000"
    assert any(
        v["target"] == "/var/lib/modelforge" and v["type"] == "volume" for v in _volumes(service)
    )
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
    assert "control-plane-state" in model["volumes"]


def _volumes(service: dict) -> list[dict]:
    # v1 prints short-syntax volumes as "source:target[:mode]" strings.
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *_ = volume.split(":")
            kind = "bind" if source.startswith("/") else "volume"
            out.append(
                {
                    "source": source,
                    "target": target,
                    "type": kind,
                    "read_only": volume.endswith(":ro"),
                }
            )
        else:
            out.append(volume)
    return out


def test_the_agent_state_volume_is_durable_and_the_token_comes_from_the_shell(tmp_path):
    model = compose_model(tmp_path, "docker-compose.node-agent.yml")
    agent = model["services"]["node-agent"]
    (state,) = [v for v in _volumes(agent) if v["target"] == "/var/lib/modelforge-node-agent"]
    assert state["type"] == "volume" and state["source"] == "node-agent-state"
    assert "node-agent-state" in model["volumes"]  # a named volume: `down` keeps it
    assert agent["environment"]["MODELFORGE_AGENT_ENROLLMENT_TOKEN"] == ""
    assert agent["read_only"] is True and agent["cap_drop"] == ["ALL"]
    assert not gpu_reservation(agent)  # a CPU-only node runs this file alone
    # On Unraid the state goes to appdata instead.
    bound = compose_model(
        tmp_path,
        "docker-compose.node-agent.yml",
        MODELFORGE_NODE_AGENT_STATE="/mnt/user/appdata/modelforge/agent-state",
    )
    (state,) = [
        v
        for v in _volumes(bound["services"]["node-agent"])
        if v["target"] == "/var/lib/modelforge-node-agent"
    ]
    assert state["type"] == "bind" and state["source"] == "/mnt/user/appdata/modelforge/agent-state"


def test_the_agent_container_reports_the_host_name_it_is_given(tmp_path):
    """The enrollment's env file leaves the host name to the machine, and a container's own is
    its id (new at every recreate): the operator's MODELFORGE_NODE_AGENT_HOSTNAME names it."""
    named = compose_model(
        tmp_path, "docker-compose.node-agent.yml", MODELFORGE_NODE_AGENT_HOSTNAME="gpu-7"
    )
    assert named["services"]["node-agent"]["hostname"] == "gpu-7"
    unnamed = compose_model(tmp_path, "docker-compose.node-agent.yml")
    assert not unnamed["services"]["node-agent"].get("hostname")  # Docker's default


def test_the_private_ca_file_mounts_the_ca_and_maps_the_control_plane_host(tmp_path):
    files = ("docker-compose.node-agent.yml", "docker-compose.node-agent.private-ca.yml")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    agent = compose_model(
        tmp_path,
        *files,
        MODELFORGE_AGENT_CA_CERT_PATH=str(ca),
        MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS="192.168.1.10",
    )["services"]["node-agent"]
    (mount,) = [v for v in _volumes(agent) if v["target"] == "/etc/modelforge-node-agent/ca.pem"]
    assert mount["source"] == str(ca) and mount["read_only"] is True
    assert (
        agent["environment"]["MODELFORGE_AGENT_CA_CERT_PATH"] == "/etc/modelforge-node-agent/ca.pem"
    )
    assert agent["environment"]["MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS"] == "192.168.1.10"
    assert agent["environment"]["MODELFORGE_AGENT_TLS_VERIFY"] == "true"
    assert any(v["target"] == "/var/lib/modelforge-node-agent" for v in _volumes(agent))


def test_the_private_ca_file_says_which_variable_is_missing(tmp_path):
    binary = shutil.which("docker-compose") or pytest.skip("docker-compose is not installed")
    (tmp_path / "modelforge-node.env").write_text("")
    result = subprocess.run(
        [
            binary,
            "-f",
            "docker-compose.node-agent.yml",
            "-f",
            "docker-compose.node-agent.private-ca.yml",
            "config",
        ],
        env={
            "PATH": os.environ["PATH"],
            "MODELFORGE_NODE_AGENT_ENV_FILE": str(tmp_path / "modelforge-node.env"),
        },
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode != 0
    assert "set MODELFORGE_AGENT_" in result.stderr


def test_the_runtime_worker_shares_a_socket_volume_with_the_agent_and_no_gpus(tmp_path):
    model = compose_model(
        tmp_path,
        "docker-compose.node-agent.yml",
        "docker-compose.runtime-worker.yml",
        MODELFORGE_WORKER_ACCELERATOR_MODE="cpu",
    )
    worker, agent = model["services"]["runtime-worker"], model["services"]["node-agent"]
    for service in (worker, agent):
        assert any(
            v["source"] == "worker-socket" and v["target"] == "/run/modelforge-worker"
            for v in _volumes(service)
        )
        assert gpu_reservation(service) == []  # a CPU node has no nvidia driver to select
    socket = "/run/modelforge-worker/worker.sock"
    assert worker["environment"]["MODELFORGE_WORKER_SOCKET"] == socket
    assert agent["environment"]["MODELFORGE_AGENT_WORKER_SOCKET"] == socket  # the agent finds it
    assert worker["environment"]["MODELFORGE_WORKER_ACCELERATOR_MODE"] == "cpu"
    # The worker starts first, so the volume takes its image's socket directory (its user's).
    assert "runtime-worker" in agent["depends_on"]
    assert worker["read_only"] is True and worker["cap_drop"] == ["ALL"]
    assert worker["security_opt"] == ["no-new-privileges:true"]


ARTIFACT_ROOT = "/var/lib/modelforge-artifacts"


def test_the_agent_polls_runtimes_in_the_workers_namespace_and_the_worker_reads_its_models(
    tmp_path,
):
    """A model runtime the worker starts listens on 127.0.0.1 of the worker's namespace, where
    the agent polls its readiness, and opens the model directory the agent names at the same
    path: the agent joins the worker's network namespace (as in the recovery compose file),
    the node's host name moves to the worker (Docker refuses one on a container in another's
    namespace, which takes that one's), and the artifact root is its own volume, apart from
    the identity, mounted read-only in the worker."""
    files = ("docker-compose.node-agent.yml",)
    alone = compose_model(tmp_path, *files, MODELFORGE_NODE_AGENT_HOSTNAME="gpu-7")
    agent = alone["services"]["node-agent"]
    assert agent["environment"]["MODELFORGE_AGENT_ARTIFACT_ROOT"] == ARTIFACT_ROOT
    (artifacts,) = [v for v in _volumes(agent) if v["target"] == ARTIFACT_ROOT]
    assert artifacts["source"] == "node-agent-artifacts" and not artifacts["read_only"]
    assert "node-agent-artifacts" in alone["volumes"]  # named: `down` keeps the models
    assert agent["hostname"] == "gpu-7" and "network_mode" not in agent  # no worker yet

    model = compose_model(
        tmp_path,
        *files,
        "docker-compose.runtime-worker.yml",
        MODELFORGE_NODE_AGENT_HOSTNAME="gpu-7",
    )
    worker, agent = model["services"]["runtime-worker"], model["services"]["node-agent"]
    assert agent["network_mode"] == "service:runtime-worker"
    assert "network_mode" not in worker  # the node's network, which the agent dials out on
    assert worker["hostname"] == "gpu-7" and not agent.get("hostname")
    (shared,) = [v for v in _volumes(worker) if v["target"] == ARTIFACT_ROOT]
    assert shared["source"] == "node-agent-artifacts" and shared["read_only"]
    assert not [v for v in _volumes(worker) if v["target"] == "/var/lib/modelforge-node-agent"]
    assert not worker.get("ports") and not agent.get("ports")  # nothing is published
    # On Unraid the models go to appdata, the same directory in both.
    bound = compose_model(
        tmp_path,
        *files,
        "docker-compose.runtime-worker.yml",
        MODELFORGE_NODE_AGENT_ARTIFACTS="/mnt/user/appdata/modelforge/artifacts",
    )["services"]
    for name, read_only in (("node-agent", False), ("runtime-worker", True)):
        (mount,) = [v for v in _volumes(bound[name]) if v["target"] == ARTIFACT_ROOT]
        assert mount["source"] == "/mnt/user/appdata/modelforge/artifacts", name
        assert mount["type"] == "bind" and mount["read_only"] is read_only, name


def test_every_node_compose_file_puts_the_agent_in_the_workers_namespace():
    """One way across the compose files: the agent joins the worker's namespace."""
    for name in ("docker-compose.runtime-worker.yml", "docker-compose.node-recovery.yml"):
        text = (ROOT / name).read_text()
        assert re.search(r'network_mode: "service:runtime-worker[\w-]*"', text), name
        assert "network_mode: none" not in text and "network_mode: host" not in text, name
        assert f":{ARTIFACT_ROOT}:ro" in text, name


def test_the_node_side_files_create_nothing_of_the_control_planes(tmp_path):
    """A node runs the node-side files alone, as every documented command names them: no
    control-plane service and no control-plane-state volume appear on a GPU host."""
    model = compose_model(
        tmp_path,
        "docker-compose.node-agent.yml",
        "docker-compose.runtime-worker.yml",
        "docker-compose.gpu.yml",
    )
    assert set(model["services"]) == {"node-agent", "runtime-worker"}
    assert set(model["volumes"]) == {"node-agent-state", "node-agent-artifacts", "worker-socket"}
    for name in COMPOSE_FILES[1:]:
        assert "-f docker-compose.yml" not in (ROOT / name).read_text(), name
    assert "-f docker-compose.yml" not in (ROOT / "docs" / "node-agent.md").read_text()


def test_the_gpu_file_gives_the_agent_and_the_worker_the_nvidia_gpus(tmp_path):
    model = compose_model(
        tmp_path,
        "docker-compose.node-agent.yml",
        "docker-compose.runtime-worker.yml",
        "docker-compose.gpu.yml",
    )
    worker, agent = model["services"]["runtime-worker"], model["services"]["node-agent"]
    for service in (worker, agent):
        (gpus,) = gpu_reservation(service)
        assert gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"]
    assert worker["environment"]["MODELFORGE_WORKER_ACCELERATOR_MODE"] == "nvidia"
