"""Shared pieces of the load generators: servers as subprocesses, keep-alive clients, numbers."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("server did not start")


def llama_server_binary(given: str | None) -> Path:
    """``given``, else the binary scripts/llama-server-build prints (building it once)."""
    if given:
        return Path(given)
    built = subprocess.run(
        [str(ROOT / "scripts" / "llama-server-build")], check=True, capture_output=True, text=True
    )
    return Path(built.stdout.strip().splitlines()[-1])


def process_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds used, resident bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


@dataclass
class Result:
    label: str
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]
    server_cpu_seconds: float
    server_rss_bytes: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")

    def line(self) -> str:
        return (
            f"{self.label:28} {self.rate:9.0f} req/s  p50 {self.percentile(0.50):6.2f} ms  "
            f"p99 {self.percentile(0.99):6.2f} ms  errors {self.errors:4d}  server CPU "
            f"{100 * self.server_cpu_seconds / self.seconds:5.0f}%  RSS "
            f"{self.server_rss_bytes / 2**20:6.1f} MiB"
        )


def _client(port, path, method, bodies, headers_list, seconds, start_at, out) -> None:
    """One keep-alive connection sending its requests in turn until time is up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    latencies, errors, sent, i = [], 0, 0, 0
    while time.time() < start_at:
        time.sleep(0.001)
    stop = start_at + seconds
    while time.time() < stop:
        body, headers = bodies[i % len(bodies)], headers_list[i % len(headers_list)]
        i += 1
        began = time.perf_counter()
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            ok = response.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        latencies.append((time.perf_counter() - began) * 1000)
        sent += 1
        errors += not ok
    conn.close()
    out.put((sent, errors, latencies))


def run_load(label, port, server_pid, path, method, bodies, headers_list, clients, seconds):
    """Drive the endpoint from ``clients`` processes, each with one keep-alive connection."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    start_at = time.time() + 0.5
    per_client = [
        (bodies[i::clients] or bodies, headers_list[i::clients] or headers_list)
        for i in range(clients)
    ]
    workers = [
        context.Process(target=_client, args=(port, path, method, b, h, seconds, start_at, out))
        for b, h in per_client
    ]
    for worker in workers:
        worker.start()
    while time.time() < start_at:
        time.sleep(0.001)
    cpu_before, _ = process_usage(server_pid)
    gathered = [out.get(timeout=seconds + 60) for _ in workers]
    cpu_after, rss = process_usage(server_pid)
    for worker in workers:
        worker.join()
    latencies = [ms for _, _, chunk in gathered for ms in chunk]
    return Result(
        label,
        sum(g[0] for g in gathered),
        sum(g[1] for g in gathered),
        seconds,
        latencies,
        cpu_after - cpu_before,
        rss,
    )


def modelforge_env(state_dir: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_STATE_DIR"] = state_dir
    env["MODELFORGE_LOG_LEVEL"] = "WARNING"
    env.update(extra)
    return env


def modelforge(env: dict, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def temp_state() -> str:
    return tempfile.mkdtemp(prefix="modelforge-bench-")


def json_body(value) -> bytes:
    return json.dumps(value).encode()


def start_modelforge(env: dict, **popen: object) -> tuple[int, subprocess.Popen]:
    """``modelforge serve`` on a free loopback port: (port, process); wait_until_serving next."""
    port = free_port()
    command = [sys.executable, "-m", "modelforge_appliance.cli", "serve", "--listen",
               f"127.0.0.1:{port}"]  # fmt: skip
    # Every simulated agent comes from 127.0.0.1: one address may hold the whole fleet here.
    env = {
        "MODELFORGE_CONNECTIONS_PER_ADDRESS": env.get("MODELFORGE_CONNECTION_LIMIT", "10000"),
        **env,
    }
    return port, subprocess.Popen(command, env=env, **popen)
