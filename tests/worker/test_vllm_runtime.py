"""The ``vllm`` runtime against the real dockerd, with a small local image standing in for
vLLM's (built here from one static C program; nothing is pulled) that takes vLLM's
arguments and answers ``GET /v1/models`` naming the served model."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from modelforge_contract import IMAGE_NOT_FOUND
from modelforge_contract.deployments import RUNTIME_LAUNCH_FAILED, RUNTIME_VLLM
from modelforge_worker.runtimes import LaunchFailed, ServeSpec, vllm
from tests.harness.agent_process import wait_until
from tests.harness.docker_watch import DockerStartWatch
from tests.harness.vllm_stand_in import build_vllm_stand_in

pytestmark = pytest.mark.docker

GPUS = ("GPU-00000002-0000-0000-0000-000000000080", "GPU-00000006-0000-0000-0000-000000000080")


@pytest.fixture(scope="module")
def stand_in(docker_client, tmp_path_factory):
    image = build_vllm_stand_in(docker_client, tmp_path_factory.mktemp("stand-in"))
    yield image
    # By tag: another suite's build of the same files is the same image id.
    docker_client.images.remove(image.tag)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    return model


@pytest.fixture
def server_id(docker_client):
    server = f"srv-{secrets.token_hex(6)}"
    yield server
    for container in containers_of(docker_client, server):
        container.remove(force=True)


def containers_of(docker_client, server: str) -> list:
    label = f"{vllm.LABEL_SERVER_ID}={server}"
    return docker_client.containers.list(all=True, ignore_removed=True, filters={"label": label})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spec_of(server, model_dir, image_id, **changes) -> ServeSpec:
    fields = {
        "server_id": server,
        "runtime": RUNTIME_VLLM,
        "served_name": "tiny-chat",
        "model_dir": model_dir,
        "model_file": None,
        "gpus": (),
        "port": free_port(),
        "context_length": 2048,
        "args": ("--dtype", "float16"),
        "image_id": image_id,
        "accelerator_mode": "cpu",
        **changes,
    }
    return ServeSpec(**fields)


def get_json(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return json.loads(answer.read())


def models_listed(port: int):
    try:
        return get_json(port, "/v1/models")
    except OSError:
        return None


def test_launch_serves_on_loopback_read_only_fenced_and_is_found_again_and_stopped(
    docker_client, stand_in, model_dir, server_id
):
    spec = spec_of(server_id, model_dir, stand_in.id)
    assert vllm.available() is None
    before = time.time()
    launched = vllm.launch(spec)
    try:
        listed = wait_until(lambda: models_listed(spec.port), timeout=60, what="/v1/models")
        assert [m["id"] for m in listed["data"]] == ["tiny-chat"]
        assert listed["data"][0]["max_model_len"] == 2048
        assert launched.exit_reason() is None
        assert "stand-in vllm serving tiny-chat on 127.0.0.1:" in launched.log_tail()
        container_id = launched.ident()["container_id"]
        inspected = docker_client.api.inspect_container(container_id)
        assert inspected["Config"]["Cmd"] == [
            "--model", "/model", "--served-model-name", "tiny-chat", "--host", "127.0.0.1",
            "--port", str(spec.port), "--max-model-len", "2048", "--dtype", "float16",
        ]  # fmt: skip
        assert inspected["Image"] == stand_in.id  # by id, as pinned
        host = inspected["HostConfig"]
        assert host["NetworkMode"] == "host" and not host["DeviceRequests"]
        assert host["ReadonlyRootfs"] is True and "/tmp" in host["Tmpfs"]
        assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
        assert host["PidsLimit"] == vllm.PIDS_LIMIT and host["Privileged"] is False
        [mount] = [m for m in inspected["Mounts"] if m["Destination"] == "/model"]
        assert (mount["Source"], mount["RW"]) == (str(model_dir), False)
        assert "HF_HUB_OFFLINE=1" in inspected["Config"]["Env"]
        # From inside: the model is there, read-only, read as the directory's owner.
        probe = get_json(spec.port, "/probe")
        assert probe["model_write"] == "Read-only file system"
        assert sorted(probe["model_files"]) == ["config.json", "model.safetensors"]
        assert (probe["uid"], probe["gid"]) == (
            os.stat(model_dir).st_uid,
            os.stat(model_dir).st_gid,
        )
        assert not (model_dir / "written-by-the-runtime").exists()

        # A worker started again finds it by its label, with the spec it was launched with.
        found = vllm.find(server_id)
        assert found is not None and found.ident() == {"container_id": container_id}
        assert found.spec == spec and found.exit_reason() is None
        # dockerd's own start time: after the launch began, before it returned (order only).
        assert before <= found.started_at <= launched.started_at
        assert server_id in [s.spec.server_id for s in vllm.running()]
        assert vllm.find(f"srv-{secrets.token_hex(6)}") is None
    finally:
        launched.stop(10)
    assert containers_of(docker_client, server_id) == []
    assert vllm.find(server_id) is None
    assert launched.exit_reason() is not None
    assert models_listed(spec.port) is None


def test_a_server_with_gpus_gets_exactly_its_uuids(
    docker_client, stand_in, model_dir, server_id, monkeypatch
):
    """dockerd holds exactly the spec's UUIDs (read from dockerd between create and start).
    This host has no NVIDIA container runtime, so dockerd refuses to start it: LaunchFailed
    with dockerd's reason, and nothing is left."""
    watch = DockerStartWatch(docker_client)
    monkeypatch.setenv("DOCKER_HOST", watch.url)
    spec = spec_of(server_id, model_dir, stand_in.id, gpus=GPUS, accelerator_mode="nvidia")
    try:
        if "nvidia" in docker_client.info().get("Runtimes", {}):
            pytest.skip("this host has the NVIDIA runtime: scripts/gpu-check-serve.sh checks it")
        with pytest.raises(LaunchFailed) as failed:
            vllm.launch(spec)
        assert failed.value.code == RUNTIME_LAUNCH_FAILED
        assert failed.value.message.startswith("dockerd could not start the container: ")
        assert "device driver" in failed.value.message
        [seen] = watch.started.values()
        assert seen["HostConfig"]["DeviceRequests"] == [
            {"Driver": "", "Count": 0, "DeviceIDs": list(GPUS), "Capabilities": [["gpu"]],
             "Options": {}}
        ]  # fmt: skip
        assert seen["Config"]["Labels"][vllm.LABEL_SERVER_ID] == server_id
    finally:
        watch.close()
    assert containers_of(docker_client, server_id) == []


def test_an_exited_runtime_says_how_and_keeps_its_log(
    docker_client, stand_in, model_dir, server_id
):
    spec = spec_of(server_id, model_dir, stand_in.id, args=("--stand-in-exit", "3"))
    launched = vllm.launch(spec)
    try:
        reason = wait_until(launched.exit_reason, timeout=60, what="the runtime exiting")
        assert reason == "exited with status 3"
        assert "stand-in exiting with 3" in launched.log_tail()
        assert vllm.find(server_id) is None  # only running ones are adopted
        # Launching it again replaces what the ended run left (one container per server).
        again = vllm.launch(spec_of(server_id, model_dir, stand_in.id))
        assert len(containers_of(docker_client, server_id)) == 1
        again.stop(10)
    finally:
        launched.stop(10)
    assert containers_of(docker_client, server_id) == []


def test_a_missing_image_a_reserved_argument_and_gpus_on_cpu_are_refused(
    docker_client, stand_in, model_dir, server_id
):
    absent = "sha256:" + "0" * 64
    cases = [
        (spec_of(server_id, model_dir, absent), IMAGE_NOT_FOUND, "never pulls"),
        (spec_of(server_id, model_dir, None), IMAGE_NOT_FOUND, "by id"),
        (spec_of(server_id, model_dir, "vllm/vllm-openai:latest"), IMAGE_NOT_FOUND, "by id"),
        (
            spec_of(server_id, model_dir, stand_in.id, args=("--host=0.0.0.0",)),
            RUNTIME_LAUNCH_FAILED,
            "--host",
        ),
        (spec_of(server_id, model_dir, stand_in.id, gpus=GPUS), "GPUS_ON_CPU_NODE", "cpu mode"),
    ]
    for spec, code, says in cases:
        with pytest.raises(LaunchFailed) as failed:
            vllm.launch(spec)
        assert failed.value.code == code and says in failed.value.message, failed.value.message
    assert containers_of(docker_client, server_id) == []
    assert docker_client.images.list(name="vllm/vllm-openai") == []


def test_through_the_worker_a_killed_worker_s_successor_adopts_the_container(
    docker_client, stand_in, model_dir, server_id, socket_dir, tmp_path
):
    """A container outlives a worker that dies without stopping it (SIGKILL): the next
    worker lists it again and answers a launch of the same server with it, never a second
    container; its stop removes it."""
    from modelforge_contract.deployments import WORKER_PATH_SERVER_STOP, WORKER_PATH_SERVERS
    from tests.harness.worker_process import WorkerProcess, worker_env

    body = {
        "server_id": server_id,
        "runtime": RUNTIME_VLLM,
        "served_name": "tiny-chat",
        "model_dir": str(model_dir),
        "model_file": None,
        "gpus": [],
        "context_length": None,
        "args": [],
        "image_id": stand_in.id,
    }
    env = worker_env(socket_dir / "w.sock")
    first = WorkerProcess(env, tmp_path / "w1.log")
    try:
        assert "vllm" in first.client.info()["runtimes"]
        status, answer = first.client._request("POST", WORKER_PATH_SERVERS, body, 60)
        assert status == 200, answer
        launched = answer["server"]
        listed = wait_until(lambda: models_listed(launched["port"]), timeout=60, what="models")
        assert [m["id"] for m in listed["data"]] == ["tiny-chat"]
        first.process.kill()
        first.process.wait(10)
    finally:
        first.close()
    second = WorkerProcess(env, tmp_path / "w2.log")
    try:
        status, answer = second.client._request("GET", WORKER_PATH_SERVERS, None, 60)
        assert status == 200, answer
        [adopted] = [s for s in answer["servers"] if s["server_id"] == server_id]
        assert adopted["ident"] == launched["ident"] and adopted["port"] == launched["port"]
        assert adopted["exit"] is None
        status, again = second.client._request("POST", WORKER_PATH_SERVERS, body, 60)
        assert status == 200 and again["server"]["ident"] == launched["ident"], again
        assert len(containers_of(docker_client, server_id)) == 1
        status, stopped = second.client._request(
            "POST", WORKER_PATH_SERVER_STOP, {"server_id": server_id}, 60
        )
        assert (status, stopped["stopped"]) == (200, True), stopped
    finally:
        second.close()
    assert containers_of(docker_client, server_id) == []
