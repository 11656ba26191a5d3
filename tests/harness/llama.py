"""llama.cpp's real ``llama-server`` for the tests: where it is, launching it, talking to it.

scripts/test builds the static binary with scripts/llama-server-build and exports its path
as ``MF_TEST_LLAMA_SERVER``; without it the tests that need the binary skip on a
workstation and fail in CI (``tests.harness.control_plane.unavailable``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import requests

from tests.harness.control_plane import unavailable

LLAMA_SERVER_ENV = "MF_TEST_LLAMA_SERVER"
# Greedy and seeded: the same text from the tiny GGUF every run.
GREEDY = {"temperature": 0.0, "top_k": 1, "seed": 42}
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def llama_server_path() -> Path:
    """The binary scripts/test built: ``MF_TEST_LLAMA_SERVER``; skip locally, fail in CI."""
    value = os.environ.get(LLAMA_SERVER_ENV, "")
    if not value:
        unavailable(
            f"{LLAMA_SERVER_ENV} is not set: scripts/test builds llama-server with "
            "scripts/llama-server-build and sets it (or export it to that script's output)"
        )
    path = Path(value)
    if not (path.is_file() and os.access(path, os.X_OK)):
        unavailable(f"{LLAMA_SERVER_ENV}={value} is not an executable file")
    return path


class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1; stdout and stderr go to ``log_path``."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        log_path: Path,
        alias: str = "tiny",
        context_length: int = 256,
        args: tuple[str, ...] = (),
    ) -> None:
        self.log_path = log_path
        self.port: int | None = None
        self.command = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            # the server binds a free port itself and logs it ("listening on …")
            "--port",
            "0",
            "--alias",
            alias,
            "-c",
            str(context_length),
            "--threads",
            "2",
            *args,
        ]
        self._log = log_path.open("ab")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("llama-server has not said where it listens yet")
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Poll until ``GET /health`` answers 200; return the seconds since the launch."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited {self.process.returncode}:\n{self.log_text()[-4000:]}"
                )
            if self.port is None:
                found = _LISTENING.search(self.log_text())
                if found:
                    self.port = int(found.group(1))
            if self.port is not None:
                try:
                    if requests.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                        return time.monotonic() - self.started
                except requests.RequestException:
                    pass
            time.sleep(0.01)
        raise TimeoutError(f"llama-server not healthy in {timeout}s:\n{self.log_text()[-4000:]}")

    def post(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        answer = requests.post(self.base_url + path, json=body, timeout=timeout)
        answer.raise_for_status()
        return answer.json()

    def stream(self, path: str, body: dict[str, Any], timeout: float = 60.0) -> list[dict]:
        """POST with ``stream: true``; the server-sent events' JSON payloads, in order."""
        events = []
        with requests.post(
            self.base_url + path, json={**body, "stream": True}, timeout=timeout, stream=True
        ) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines(decode_unicode=True):
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        return events

    def complete(self, prompt: str, max_tokens: int = 16) -> str:
        """A greedy ``/v1/completions``: its text."""
        answer = self.post(
            "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **GREEDY}
        )
        return answer["choices"][0]["text"]

    def listening_addresses(self) -> list[str]:
        """The TCP addresses the process listens on, read from /proc (``host:port``)."""
        return listening_addresses(self.process.pid)

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def listening_addresses(pid: int) -> list[str]:
    """Every listening TCP socket of ``pid`` as ``address:port`` (IPv4 dotted, IPv6 hex)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            if table == "tcp":
                address = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
            found.append(f"{address}:{int(port, 16)}")
    return found
