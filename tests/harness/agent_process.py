"""Real processes for the agent suite: the agent as a subprocess, a control plane that restarts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.core.settings import Settings
from modelforge_appliance.fleet import readiness
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.runtime.server import create_server, run_until
from modelforge_appliance.store import audit
from modelforge_appliance.store.database import Store

from .control_plane import ControlPlane, free_port
from .nvml import write_nvml_config

AGENT_COMMAND = [sys.executable, "-m", "modelforge_node_agent.main"]


def agent_env(**settings: str | Path | None) -> dict[str, str]:
    """A clean environment: nothing MODELFORGE_* or NVIDIA_* leaks in from the test run."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("MODELFORGE_", "NVIDIA_", "FAKE_NVML_", "LD_LIBRARY_PATH"))
    }
    for name, value in settings.items():
        if value is not None:
            env[name if name.isupper() else f"MODELFORGE_AGENT_{name.upper()}"] = str(value)
    return env


def nvml_env(library_dir: Path, host: dict[str, Any] | None, work: Path) -> dict[str, str]:
    """Variables that make the real pynvml load the test library impersonating ``host``."""
    work.mkdir(parents=True, exist_ok=True)
    env = {"LD_LIBRARY_PATH": str(library_dir), "FAKE_NVML_CALL_LOG": str(work / "nvml-calls")}
    if host is not None:
        env["FAKE_NVML_CONFIG"] = str(write_nvml_config(host, work / "nvml.conf"))
    return env


def run_agent(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*AGENT_COMMAND, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


class AgentProcess:
    """The agent running in the background; its stdout and stderr go to one log file."""

    def __init__(
        self, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> None:
        self.log_path, self.env, self.command = log_path, env, command
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            command or AGENT_COMMAND, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 20, count: int = 1) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            found = re.findall(pattern, self.log())
            if len(found) >= count:
                return found
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"{pattern!r} x{count} not in the agent log "
                    f"(exit {self.process.poll()}):\n{self.log()}"
                )
            time.sleep(0.05)

    def wait(self, timeout: float = 20) -> int:
        return self.process.wait(timeout=timeout)

    def terminate(self, timeout: float = 60) -> tuple[int, float]:
        """SIGTERM; the exit status and how long the agent took to go."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(timeout=timeout)
        return status, time.monotonic() - started

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_until(check: Callable[[], Any], timeout: float = 20, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class RestartableControlPlane:
    """The real control plane on one fixed port; ``stop()`` and ``start()`` are a restart.

    Each start opens the store afresh from the same SQLite file, as a restarted
    ``modelforge serve`` would.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        store = Store(settings.database_url, Clock())
        store.migrate()
        _, self.admin_token = admin_tokens.create_admin_token(store, "tests", audit.CLI_ACTOR)
        store.close()
        self.server = None
        self.store: Store | None = None
        self.start()

    @property
    def plane(self) -> ControlPlane:
        """The support helpers (mint, admin calls) for the running control plane."""
        assert self.store is not None, "the control plane is stopped"
        return ControlPlane(self.url, self.settings, self.store, self.admin_token)

    def start(self) -> None:
        self.store = Store(self.settings.database_url, Clock())
        self.store.migrate()
        self.server = create_server(self.settings, self.store, "127.0.0.1", self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=run_until, args=(self.server, self._stop), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self.server is not None:
            # As when the process stops: the listening socket and every open keep-alive
            # connection go away, and acknowledged heartbeats are written.
            self._stop.set()
            self._thread.join(timeout=10)
            assert not self._thread.is_alive(), "the control plane did not stop"
            self.server = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def nodes(self) -> list[dict[str, Any]]:
        """The fleet with liveness and readiness, from the store (also while the server is down)."""
        if self.store is not None:
            self.server.heartbeats.flush()  # as every admin read does
            return readiness.list_nodes(self.store, self.settings)
        # The appliance binds its models to one global database, so only one Store may be
        # open per process: open one for this read only while the server is stopped.
        store = Store(self.settings.database_url, Clock())
        try:
            return readiness.list_nodes(store, self.settings)
        finally:
            with contextlib.suppress(Exception):
                store.close()
