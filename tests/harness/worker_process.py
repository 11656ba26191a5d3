"""The runtime worker as a real process on a unix socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from modelforge_node_agent.work import WorkerClient, WorkerUnavailable

WORKER_COMMAND = [sys.executable, "-m", "modelforge_worker"]


def worker_env(socket_path: Path, mode: str = "cpu", **extra: str) -> dict[str, str]:
    """A clean environment: nothing MODELFORGE_*, NVIDIA_* or FAKE_NVML_* leaks in."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("MODELFORGE_", "NVIDIA_", "FAKE_NVML_", "LD_LIBRARY_PATH"))
    }
    env["MODELFORGE_WORKER_SOCKET"] = str(socket_path)
    env["MODELFORGE_WORKER_ACCELERATOR_MODE"] = mode
    env.update(extra)
    return env


class WorkerProcess:
    """``python -m modelforge_worker`` in the background; stdout and stderr to one log."""

    def __init__(self, env: dict[str, str], log_path: Path, wait: bool = True) -> None:
        self.socket_path = Path(env["MODELFORGE_WORKER_SOCKET"])
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            WORKER_COMMAND, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.client = WorkerClient(self.socket_path)
        if wait:
            self.wait_until_answering()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until_answering(self, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, (
                f"worker exited {self.process.returncode}:\n{self.log()}"
            )
            try:
                return self.client.info()
            except WorkerUnavailable:
                assert time.monotonic() < deadline, f"worker did not answer:\n{self.log()}"
                time.sleep(0.05)

    def terminate(self, timeout: float = 10) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
