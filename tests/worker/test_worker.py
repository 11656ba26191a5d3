"""The Runtime Worker as a real process: its socket, its protocol, and the smoke capability."""

from __future__ import annotations

import os
import socket
import stat
import subprocess

import pytest

from modelforge_contract import (
    EXIT_OK,
    EXIT_USAGE,
    HEADER_WORKER_PROTOCOL,
    SMOKE_FAILED,
    WORK_INPUT_INVALID,
    WORK_TIMED_OUT,
    WORKER_PROTOCOL_INCOMPATIBLE,
)
from modelforge_node_agent.work import WorkerClient, _UnixConnection
from tests.harness.nvml import a100_mig, h100_80g_x8, with_failure, write_nvml_config
from tests.harness.worker_process import WORKER_COMMAND, WorkerProcess, worker_env


def run_smoke(worker: WorkerProcess, matrix_size: int = 16, timeout: int = 60) -> dict:
    return worker.client.run(
        {
            "capability": "smoke",
            "input": {"matrix_size": matrix_size},
            "timeout_seconds": timeout,
            "work_id": "test",
        }
    )


def raw_post(path, body: bytes, headers: dict) -> tuple[int, dict]:
    import json

    connection = _UnixConnection(path, 10)
    connection.request("POST", "/v1/run", body=body, headers=headers)
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    return response.status, answer


def test_socket_is_0660_answers_info_and_goes_away_on_sigterm(socket_dir, tmp_path):
    path = socket_dir / "worker.sock"
    worker = WorkerProcess(worker_env(path), tmp_path / "worker.log")
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
        info = worker.client.info()
        assert info == {
            **info,
            "protocol": 1,
            "accelerator_mode": "cpu",
            "compatibility": "COMPATIBLE",
        }
        assert "smoke" in info["capabilities"]
        # A second worker on the same path refuses to start rather than steal it.
        second = subprocess.run(
            WORKER_COMMAND, env=worker_env(path), capture_output=True, text=True, timeout=30
        )
        assert second.returncode == EXIT_USAGE
        assert "already listens" in second.stderr
        assert worker.terminate() == EXIT_OK
        assert not path.exists()
    finally:
        worker.close()
    # No network port: the worker's only listening socket is the unix one.
    assert "0.0.0.0" not in worker.log() and "127.0.0.1" not in worker.log()


def test_stale_socket_is_replaced_and_a_non_socket_refused(socket_dir, tmp_path):
    stale = socket_dir / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()  # bound, never listened: what a killed worker leaves
    with WorkerProcess(worker_env(stale), tmp_path / "a.log") as worker:
        assert worker.client.info()["protocol"] == 1
    plain = socket_dir / "plain"
    plain.write_text("not a socket")
    refused = subprocess.run(
        WORKER_COMMAND, env=worker_env(plain), capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == EXIT_USAGE
    assert "is not a socket" in refused.stderr
    assert plain.read_text() == "not a socket"


def test_settings_are_checked(socket_dir):
    env = worker_env(socket_dir / "w.sock", MODELFORGE_WORKER_SOCKT="x")
    result = subprocess.run(WORKER_COMMAND, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == EXIT_USAGE
    assert "did you mean MODELFORGE_WORKER_SOCKET" in result.stderr
    env = worker_env(socket_dir / "w.sock", mode="gpu")
    result = subprocess.run(WORKER_COMMAND, env=env, capture_output=True, text=True, timeout=30)
    assert (result.returncode, "MODELFORGE_WORKER_ACCELERATOR_MODE" in result.stderr) == (2, True)
    help_text = subprocess.run(
        [*WORKER_COMMAND, "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    assert "MODELFORGE_WORKER_SOCKET" in help_text and "0660" in help_text


def test_runs_need_a_compatible_worker_protocol(socket_dir, tmp_path):
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        body = b'{"capability": "smoke", "input": {}, "timeout_seconds": 5}'
        json_type = {"Content-Type": "application/json"}
        for header, answer in ((None, "UNKNOWN"), ("2", "TOO_NEW"), ("0", "TOO_OLD")):
            headers = {**json_type, **({HEADER_WORKER_PROTOCOL: header} if header else {})}
            status, refusal = raw_post(worker.socket_path, body, headers)
            assert (status, refusal["compatibility"]) == (426, answer)
            assert refusal["error"]["code"] == WORKER_PROTOCOL_INCOMPATIBLE
        headers = {**json_type, HEADER_WORKER_PROTOCOL: "1"}
        status, refusal = raw_post(worker.socket_path, b'{"capability": 1}', headers)
        assert (status, refusal["error"]["code"]) == (400, WORK_INPUT_INVALID)
        assert "POST /v1/run -> 426" in worker.log()
        assert "smoke" not in worker.log().split("426")[0]  # no body in the log


def test_cpu_smoke_names_what_it_checked_and_enforces_its_timeout(socket_dir, tmp_path):
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        answer = run_smoke(worker, matrix_size=32)
        assert (answer["outcome"], answer["error"]) == ("succeeded", None)
        result = answer["result"]
        assert result["mode"] == "cpu"
        assert result["computation"]["verified"] is True
        assert result["computation"]["matrix_size"] == 32
        assert [line.split(":")[0] for line in result["checked"]] == ["cpu", "computation"]
        assert "computation: 32x32" in answer["log_tail"]
        slow = run_smoke(worker, matrix_size=512, timeout=1)
        assert (slow["outcome"], slow["error"]["code"]) == ("failed", WORK_TIMED_OUT)
        bad = worker.client.run(
            {
                "capability": "smoke",
                "input": {"matrix_size": "big"},
                "timeout_seconds": 5,
                "work_id": "x",
            }
        )
        assert bad["error"]["code"] == WORK_INPUT_INVALID


def nvidia_worker(socket_dir, tmp_path, fake_nvml_dir, host, name="w") -> WorkerProcess:
    config = write_nvml_config(host, tmp_path / f"{name}.conf")
    env = worker_env(
        socket_dir / f"{name}.sock",
        mode="nvidia",
        LD_LIBRARY_PATH=str(fake_nvml_dir),
        FAKE_NVML_CONFIG=str(config),
    )
    return WorkerProcess(env, tmp_path / f"{name}.log")


def test_nvidia_smoke_queries_every_gpu_and_computes_on_each(socket_dir, tmp_path, fake_nvml_dir):
    host = h100_80g_x8()
    with nvidia_worker(socket_dir, tmp_path, fake_nvml_dir, host) as worker:
        answer = run_smoke(worker)
    assert answer["outcome"] == "succeeded", answer["error"]
    gpus = answer["result"]["gpus"]
    assert [gpu["uuid"] for gpu in gpus] == [device["uuid"] for device in host["devices"]]
    assert all(gpu["compute"]["mismatches"] == 0 for gpu in gpus)
    assert all(gpu["compute"]["elements"] >= 2**20 for gpu in gpus)
    checked = answer["result"]["checked"]
    assert sum(line.startswith("nvml: GPU") for line in checked) == 8
    assert sum(line.startswith("cuda: saxpy") for line in checked) == 8


def test_mig_gpu_reports_no_utilisation_instead_of_inventing_one(
    socket_dir, tmp_path, fake_nvml_dir
):
    with nvidia_worker(socket_dir, tmp_path, fake_nvml_dir, a100_mig()) as worker:
        answer = run_smoke(worker)
    assert answer["outcome"] == "succeeded", answer["error"]
    assert answer["result"]["gpus"][0]["utilization_gpu_percent"] is None


def _named(host: dict, index: int, cuda: bool = True) -> str:
    """How a failure names GPU ``index`` of the test host: NVML index, UUID, PCI bus id and
    (for CUDA) the ordinal. The test hosts number CUDA devices as NVML does."""
    gpu = host["devices"][index]
    suffix = f", CUDA device {index}" if cuda else ""
    return f"GPU {index} (UUID {gpu['uuid']}, PCI {gpu['pci']['bus_id']}{suffix})"


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (
            lambda h: with_failure(h, "nvmlDeviceGetMemoryInfo", "NVML_ERROR_GPU_IS_LOST", 3),
            lambda h: [
                f"NVML query failed for {_named(h, 3, cuda=False)}: "
                "nvmlDeviceGetMemoryInfo: GPU is lost"
            ],
        ),
        (
            lambda h: _cuda_failure(h, 5, "cuLaunchKernel", 719),
            lambda h: [
                f"the GPU computation failed on {_named(h, 5)}: "
                "cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED"
            ],
        ),
        (
            lambda h: _cuda_failure(h, 2, "cuCtxCreate_v2", 101),
            lambda h: [f"on {_named(h, 2)}: cuCtxCreate_v2 failed"],
        ),
        (lambda h: _miscompute(h, 6), lambda h: [f"{_named(h, 6)} computed 1 of"]),
        (
            # The kernel fails, then freeing its memory fails too: the first error is named.
            lambda h: _cuda_failure(h, 4, "cuLaunchKernel", 719, cuMemFree_v2=999),
            lambda h: [f"on {_named(h, 4)}: cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED"],
        ),
    ],
    ids=["gpu-lost", "kernel-launch", "no-context", "wrong-answer", "cleanup-fails-too"],
)
def test_nvidia_smoke_fails_closed_naming_the_gpu_and_the_call(
    socket_dir, tmp_path, fake_nvml_dir, breakage, expected
):
    """Messages named no GPU: on an 8-GPU host "cuLaunchKernel failed" and "GPU is lost"
    left the operator to guess which board."""
    host = breakage(h100_80g_x8())
    with nvidia_worker(socket_dir, tmp_path, fake_nvml_dir, host) as worker:
        answer = run_smoke(worker)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", SMOKE_FAILED)
    for text in expected(host):
        assert text in answer["error"]["message"], answer["error"]["message"]
    assert "cuMemFree" not in answer["error"]["message"]


def test_nvidia_smoke_without_the_cuda_driver_fails(socket_dir, tmp_path, fake_nvml_dir):
    nvml_only = tmp_path / "nvml-only"
    nvml_only.mkdir()
    (nvml_only / "libnvidia-ml.so.1").symlink_to(fake_nvml_dir / "libnvidia-ml.so.1")
    with nvidia_worker(socket_dir, tmp_path, nvml_only, h100_80g_x8()) as worker:
        answer = run_smoke(worker)
    assert answer["error"]["code"] == SMOKE_FAILED
    assert "libcuda.so.1" in answer["error"]["message"]


def _cuda_failure(host: dict, device: int, call: str, code: int, **more: int) -> dict:
    host["devices"][device]["cuda_failures"] = {call: code, **more}
    return host


def _miscompute(host: dict, device: int) -> dict:
    host["devices"][device]["cuda_miscompute"] = True
    return host


def test_unknown_capability_fails_the_item_with_its_code(socket_dir, tmp_path):
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        answer = WorkerClient(worker.socket_path).run(
            {"capability": "teleport", "input": {}, "timeout_seconds": 5, "work_id": "x"}
        )
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", "CAPABILITY_UNKNOWN")


def test_every_worker_setting_is_documented():
    from pathlib import Path

    from modelforge_worker.settings import SETTINGS

    text = (Path(__file__).resolve().parents[2] / "docs" / "work.md").read_text()
    for spec in SETTINGS:
        assert f"`{spec.name}`" in text, f"{spec.name} is missing from docs/work.md"
