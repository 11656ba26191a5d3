"""A ``vllm`` deployment on real nodes and the real dockerd (issue 25), with a small local
image standing in for vLLM's (tests/harness/vllm_stand_in.py; nothing is pulled): on a CPU
node it serves and is found ready by its agent; on the test NVML library's eight GPUs its
container gets exactly its lease's GPU UUIDs in HostConfig.DeviceRequests."""

from __future__ import annotations

import pytest

from modelforge_contract.deployments import PATH_ADMIN_DEPLOYMENTS
from modelforge_contract.models import PATH_ADMIN_MODELS
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import make_settings, serve
from tests.harness.docker_watch import DockerStartWatch
from tests.harness.nvml import h100_80g_x8
from tests.harness.vllm_stand_in import build_vllm_stand_in
from tests.harness.work_node import short_dir

from .test_serve import deployment, replicate, serving_node, wait_servers, worker_servers

pytestmark = pytest.mark.docker


@pytest.fixture
def cp(tmp_path):
    settings = make_settings(tmp_path / "cp", heartbeat_interval_seconds=1)
    with serve(settings) as plane:
        yield plane


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


DEPLOYMENTS = PATH_ADMIN_DEPLOYMENTS
LABEL = "modelforge.server_id"


@pytest.fixture(scope="module")
def stand_in(docker_client, tmp_path_factory):
    image = build_vllm_stand_in(docker_client, tmp_path_factory.mktemp("stand-in"))
    yield image
    docker_client.images.remove(image.tag)  # by tag: another build may share the id


@pytest.fixture
def directory_model(cp, tmp_path):
    source = tmp_path / "hf-model"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (source / "model.safetensors").write_bytes(b"\0" * 4096)
    answer = cp.admin(
        "POST", PATH_ADMIN_MODELS, json={"name": "tiny", "source": {"path": str(source)}}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def containers(docker_client, server_id):
    return docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL}={server_id}"}
    )


def vllm_node(cp, tmp_path, sockets, name, binary, **extra):
    node = serving_node(cp, tmp_path, sockets, name, binary, **extra)
    wait_until(
        lambda: "vllm" in node.worker.client.info().get("runtimes", []),
        what="the worker offering vllm",
    )
    return node


def test_a_vllm_deployment_serves_on_a_cpu_node_and_undeploy_removes_its_container(
    cp, tmp_path, sockets, directory_model, stand_in, docker_client, llama_server_binary
):
    node = vllm_node(cp, tmp_path, sockets, "vllm-cpu", llama_server_binary)
    try:
        replicate(cp, [node])
        body = {
            "name": "tiny-vllm",
            "model": "tiny",
            "runtime": "vllm",
            "node_ids": [node.node_id],
            "settings": {"image_id": stand_in.id, "context_length": 2048},
        }
        made = cp.admin("POST", DEPLOYMENTS, json=body)
        assert made.status_code == 201, made.text
        assert made.json()["settings"]["model_file"] is None  # vLLM loads the directory
        shown = wait_servers(cp, "tiny-vllm", "running")  # its /v1/models names the deployment
        server_id = shown["servers"][0]["server_id"]
        [container] = containers(docker_client, server_id)
        command = container.attrs["Config"]["Cmd"]
        assert command[command.index("--served-model-name") + 1] == "tiny-vllm"
        assert command[command.index("--host") + 1] == "127.0.0.1"
        assert command[command.index("--max-model-len") + 1] == "2048"
        assert container.attrs["HostConfig"]["DeviceRequests"] in (None, [])
        [mount] = container.attrs["Mounts"]
        assert (mount["Destination"], mount["RW"]) == ("/model", False)
        assert cp.admin("DELETE", f"{DEPLOYMENTS}/tiny-vllm").status_code == 200
        wait_until(lambda: deployment(cp, "tiny-vllm") is None, timeout=90, what="undeployed")
        assert containers(docker_client, server_id) == [] and worker_servers(node) == {}
        log = node.agent.log()
        assert "asks it stopped" in log and "SERVER_LEASE_LOST" not in log
    finally:
        node.close()
        for container in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": LABEL}
        ):
            container.remove(force=True)


def test_a_vllm_server_s_container_gets_exactly_its_lease_s_gpus(
    cp, tmp_path, sockets, directory_model, stand_in, docker_client, llama_server_binary,
    fake_nvml_dir, monkeypatch,
):  # fmt: skip
    watch = DockerStartWatch(docker_client)
    monkeypatch.setenv("DOCKER_HOST", watch.url)  # the worker process inherits it
    node = vllm_node(
        cp, tmp_path, sockets, "vllm-gpu", llama_server_binary, mode="nvidia",
        host=h100_80g_x8(), fake_nvml_dir=fake_nvml_dir,
    )  # fmt: skip
    try:
        replicate(cp, [node])
        body = {
            "name": "gpu-vllm",
            "model": "tiny",
            "runtime": "vllm",
            "node_ids": [node.node_id],
            "gpu_count": 2,
            "settings": {"image_id": stand_in.id},
        }
        made = cp.admin("POST", DEPLOYMENTS, json=body)
        assert made.status_code == 201, made.text
        gpus = made.json()["servers"][0]["gpus"]
        assert len(gpus) == 2
        wait_until(lambda: watch.started, timeout=90, what="the container asked to start")
        [requests] = watch.device_requests()
        assert [r["DeviceIDs"] for r in requests] == [gpus]  # exactly its own, never "all"
        assert requests[0]["Capabilities"] == [["gpu"]] and requests[0]["Count"] == 0
        if "nvidia" not in docker_client.info().get("Runtimes", {}):
            # This host has no NVIDIA runtime: dockerd refuses the start, and says so. It is
            # tried again after a backoff (never failed), so installing the runtime mends it.
            shown = wait_servers(cp, "gpu-vllm", "backoff", timeout=90)
            [server] = shown["servers"]
            assert server["error"]["code"] == "RUNTIME_LAUNCH_FAILED"
            assert "device driver" in server["error"]["message"]
            assert server["restarts"] >= 1 and server["next_attempt_at"]
    finally:
        node.close()
        watch.close()
        for container in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": LABEL}
        ):
            container.remove(force=True)
