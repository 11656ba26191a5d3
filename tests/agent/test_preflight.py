"""The NVIDIA startup contract through the real pynvml bindings over the test NVML library."""

from __future__ import annotations

import ctypes.util
import socket
import threading

import pytest

from modelforge_contract import EXIT_NVIDIA_PREFLIGHT, EXIT_OK
from tests.harness.agent_process import AgentProcess, agent_env, nvml_env, run_agent, wait_until
from tests.harness.nvml import (
    a100_mig,
    consumer_rtx_4090,
    h100_80g_x8,
    with_failure,
    without_devices,
)

CODE_WORDS = ("NVIDIA_NVML_UNAVAILABLE", "NVIDIA_DEVICE_NOT_FOUND", "NVIDIA_TELEMETRY_UNAVAILABLE")

HOSTS = {
    "library absent": None,
    "init failure": with_failure(
        h100_80g_x8(), "nvmlInitWithFlags", "NVML_ERROR_DRIVER_NOT_LOADED"
    ),
    "zero devices": without_devices(h100_80g_x8()),
    "telemetry call unsupported": with_failure(
        h100_80g_x8(), "nvmlDeviceGetUtilizationRates", "NVML_ERROR_NOT_SUPPORTED", device=3
    ),
    "healthy 8-GPU host": h100_80g_x8(),
}
# (case, mode, NVIDIA evidence on the host) -> (exit status, code word or None)
MATRIX = [
    ("library absent", "nvidia", False, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_NVML_UNAVAILABLE"),
    ("library absent", "auto", True, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_NVML_UNAVAILABLE"),
    ("library absent", "auto", False, EXIT_OK, None),
    ("library absent", "cpu", True, EXIT_OK, None),
    ("init failure", "nvidia", False, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_NVML_UNAVAILABLE"),
    ("init failure", "auto", True, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_NVML_UNAVAILABLE"),
    ("init failure", "cpu", True, EXIT_OK, None),
    ("zero devices", "nvidia", False, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_DEVICE_NOT_FOUND"),
    ("zero devices", "auto", True, EXIT_NVIDIA_PREFLIGHT, "NVIDIA_DEVICE_NOT_FOUND"),
    ("zero devices", "cpu", True, EXIT_OK, None),
    (
        "telemetry call unsupported",
        "nvidia",
        False,
        EXIT_NVIDIA_PREFLIGHT,
        "NVIDIA_TELEMETRY_UNAVAILABLE",
    ),
    (
        "telemetry call unsupported",
        "auto",
        True,
        EXIT_NVIDIA_PREFLIGHT,
        "NVIDIA_TELEMETRY_UNAVAILABLE",
    ),
    ("telemetry call unsupported", "cpu", True, EXIT_OK, None),
    ("healthy 8-GPU host", "nvidia", False, EXIT_OK, None),
    ("healthy 8-GPU host", "auto", True, EXIT_OK, None),
    ("healthy 8-GPU host", "auto", False, EXIT_OK, None),
    ("healthy 8-GPU host", "cpu", True, EXIT_OK, None),
]


@pytest.fixture(scope="module", autouse=True)
def no_system_nvml():
    """'library absent' means absent: a host with a real NVML cannot run this matrix."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real libnvidia-ml; the absent-library case cannot hold")


def preflight(fake_nvml_dir, tmp_path, host, mode, evidence, **extra):
    devices = tmp_path / "dev"
    devices.mkdir(exist_ok=True)
    if evidence:
        (devices / "nvidia0").touch()
    library = fake_nvml_dir if host is not None else tmp_path / "no-library"
    library.mkdir(exist_ok=True)
    env = agent_env(
        accelerator_mode=mode,
        device_dir=devices,
        state_volume=tmp_path / "state",
        **nvml_env(library, host, tmp_path / "nvml"),
        **extra,
    )
    result = run_agent(env, "--preflight")
    calls = tmp_path / "nvml" / "nvml-calls"
    return result, result.stdout + result.stderr, calls.read_text() if calls.exists() else ""


@pytest.mark.parametrize(("case", "mode", "evidence", "status", "word"), MATRIX)
def test_preflight_matrix(fake_nvml_dir, tmp_path, case, mode, evidence, status, word):
    result, output, calls = preflight(fake_nvml_dir, tmp_path, HOSTS[case], mode, evidence)
    assert result.returncode == status, output
    found = [w for w in CODE_WORDS for _ in range(output.count(w))]
    assert found == ([word] if word else []), output
    if word:
        assert "Next step:" in output
    uses_nvml = mode == "nvidia" or (mode == "auto" and evidence)
    if not uses_nvml:
        # cpu (and auto without NVIDIA evidence) never touches NVML.
        assert calls == "", calls
    elif HOSTS[case] is not None:
        # The real bindings found the test library through the normal search path.
        assert calls.splitlines()[0] == "nvmlInitWithFlags"
    assert not (tmp_path / "state").exists(), "--preflight must not touch the state volume"


def test_healthy_host_summary_names_every_gpu(fake_nvml_dir, tmp_path):
    result, output, _ = preflight(fake_nvml_dir, tmp_path, h100_80g_x8(), "nvidia", False)
    assert result.returncode == EXIT_OK, output
    assert "8 GPU(s) (NVIDIA H100 80GB HBM3), driver 550.54.15, CUDA 12.4" in output


def test_auto_mode_sees_nvidia_visible_devices(fake_nvml_dir, tmp_path):
    host = without_devices(consumer_rtx_4090())
    result, output, calls = preflight(
        fake_nvml_dir, tmp_path, host, "auto", False, NVIDIA_VISIBLE_DEVICES="all"
    )
    assert result.returncode == EXIT_NVIDIA_PREFLIGHT, output
    assert "NVIDIA_DEVICE_NOT_FOUND" in output
    assert "NVIDIA_VISIBLE_DEVICES=all seen" in output
    assert calls


def test_unsupported_power_reading_is_left_out_not_invented(fake_nvml_dir, tmp_path):
    host = with_failure(consumer_rtx_4090(), "nvmlDeviceGetPowerUsage", "NVML_ERROR_NOT_SUPPORTED")
    result, output, calls = preflight(fake_nvml_dir, tmp_path, host, "nvidia", False)
    assert result.returncode == EXIT_OK, output
    assert "nvmlDeviceGetPowerUsage" in calls


def test_mig_gpu_reports_null_utilization_and_passes(fake_nvml_dir, tmp_path):
    result, output, _ = preflight(fake_nvml_dir, tmp_path, a100_mig(), "nvidia", False)
    assert result.returncode == EXIT_OK, output


def test_utilization_missing_outside_mig_fails_closed(fake_nvml_dir, tmp_path):
    host = with_failure(
        consumer_rtx_4090(), "nvmlDeviceGetUtilizationRates", "NVML_ERROR_NOT_SUPPORTED"
    )
    result, output, _ = preflight(fake_nvml_dir, tmp_path, host, "nvidia", False)
    assert result.returncode == EXIT_NVIDIA_PREFLIGHT, output
    assert output.count("NVIDIA_TELEMETRY_UNAVAILABLE") == 1


def test_lost_gpu_is_device_not_found(fake_nvml_dir, tmp_path):
    host = with_failure(h100_80g_x8(), "nvmlDeviceGetUUID", "NVML_ERROR_GPU_IS_LOST", device=5)
    result, output, _ = preflight(fake_nvml_dir, tmp_path, host, "nvidia", False)
    assert result.returncode == EXIT_NVIDIA_PREFLIGHT, output
    assert "NVIDIA_DEVICE_NOT_FOUND" in output and "GPU 5" in output


class ConnectionRecorder:
    """A listening socket that counts every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.accepted = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=2)
        self.sock.close()


@pytest.mark.parametrize("mode", ["nvidia", "cpu"])
def test_preflight_opens_no_connection_and_never_enrolls(fake_nvml_dir, tmp_path, mode):
    recorder = ConnectionRecorder()
    token = "mfe_0123456789abcdef_" + "A" * 43
    try:
        result, output, _ = preflight(
            fake_nvml_dir,
            tmp_path,
            h100_80g_x8(),
            mode,
            False,
            control_plane_url=recorder.url,
            enrollment_token=token,
        )
        assert result.returncode == EXIT_OK, output
        assert recorder.accepted == 0
        assert not (tmp_path / "state").exists()
        # The control: without --preflight the same settings do reach the recorder.
        env = agent_env(
            control_plane_url=recorder.url,
            enrollment_token=token,
            accelerator_mode="cpu",
            state_volume=tmp_path / "control",
        )
        with AgentProcess(env, tmp_path / "control.log") as agent:
            wait_until(lambda: recorder.accepted > 0, what="the agent to dial the recorder")
            assert agent.terminate()[0] == EXIT_OK
    finally:
        recorder.close()
