"""One hostile client against the connection front: idle sockets from one address, and
half-sent bodies, while another address asks /healthz. Prints the figures bench/README.md
quotes.

    .venv/bin/python bench/flood.py                  # 10,000 idle sockets, 1,000 bodies
    .venv/bin/python bench/flood.py --idle 2000 --bodies 200

The control plane runs in this process (waitress on 127.0.0.1, the default settings but for
the state directory), so its RSS is this process's: the hostile sockets' bytes live in
kernel buffers, the server's copies in ours. /healthz comes from 127.0.0.2, the flood from
127.0.0.1 (every 127/8 address is this host).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tests.harness.control_plane import make_settings, serve  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def healthz_ms(port: int) -> float:
    began = time.perf_counter()
    sock = socket.socket()
    sock.settimeout(30)
    sock.bind(("127.0.0.2", 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:80]
    return (time.perf_counter() - began) * 1000


class Prober:
    """/healthz from another address, every 50 ms, for as long as the flood lasts."""

    def __init__(self, port: int) -> None:
        self.port, self.times, self.stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.times.append(healthz_ms(self.port))

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def summary(self) -> str:
        times = sorted(self.times)
        p50 = statistics.median(times)
        return (
            f"/healthz from another address: {len(times)} answers, median {p50:.1f} ms, "
            f"max {times[-1]:.1f} ms"
        )


def in_child(function, *args):
    """Run the flood in a process of its own: it must not share this one's GIL."""
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=lambda: answers.put(function(*args)))
    child.start()
    result = answers.get()
    child.join()
    return result


def idle_flood(port: int, count: int) -> tuple[int, int]:
    """Open ``count`` sockets from one address and leave them idle; (held, refused)."""
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (count + 1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    held, refused, socks = 0, 0, []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            refused += 1
            sock.close()
            continue
        socks.append(sock)
    time.sleep(1)  # let the server answer the refused ones
    for sock in socks:
        sock.setblocking(False)
        try:
            sock.recv(1 << 16)  # an answer (503) or the end: not held
        except BlockingIOError:
            held += 1
            continue
        except OSError:
            pass
        refused += 1
    for sock in socks:
        sock.close()
    return held, refused


def body_flood(port: int, count: int, body: int) -> int:
    """``count`` connections each sending half of a ``body``-byte request; refused count."""
    head = (
        "POST /api/v1/agent/enroll HTTP/1.1\r\nHost: x\r\nX-ModelForge-Agent-Protocol: 1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {body}\r\n\r\n"
    ).encode()
    half = b"x" * (body // 2)
    socks: list[socket.socket] = []
    lock = threading.Lock()

    def send() -> None:
        sock = socket.socket()
        sock.settimeout(30)
        sock.bind(("127.0.0.3", 0))
        sock.connect(("127.0.0.1", port))
        with contextlib.suppress(OSError):  # refused mid-body: the server stopped reading
            sock.sendall(head + half)
        with lock:
            socks.append(sock)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda _: send(), range(count)))
    time.sleep(1)
    refused = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            if sock.recv(1 << 16).startswith(b"HTTP/1.1 503"):
                refused += 1
        except OSError:
            pass
    for sock in socks:
        sock.close()
    return refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=10_000)
    parser.add_argument("--bodies", type=int, default=1_000)
    parser.add_argument("--body-mib", type=float, default=1.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    with tempfile.TemporaryDirectory() as state, serve(make_settings(Path(state))) as cp:
        port = int(cp.url.rsplit(":", 1)[1])
        settings = cp.settings
        print(
            f"connection limit {settings.connection_limit}, per address "
            f"{settings.connections_per_address}, buffered bound "
            f"{settings.max_buffered_bytes / 2**20:.0f} MiB, body limit "
            f"{settings.max_body_bytes / 2**20:.0f} MiB"
        )
        with Prober(port) as probe:
            began = time.perf_counter()
            held, refused = in_child(idle_flood, port, args.idle)
            took = time.perf_counter() - began
        print(
            f"{args.idle} idle sockets from one address in {took:.1f} s: {held} held, "
            f"{refused} refused or closed"
        )
        print("  " + probe.summary())
        before = rss_mib()
        body = int(args.body_mib * 2**20)
        with Prober(port) as probe:
            refused = in_child(body_flood, port, args.bodies, min(body, settings.max_body_bytes))
            peak = rss_mib()
        print(
            f"{args.bodies} half-sent {args.body_mib:g} MiB bodies: {refused} answered 503 "
            f"SERVER_BUSY; RSS {before:.0f} -> {peak:.0f} MiB (+{peak - before:.0f} MiB; "
            f"bound {settings.max_buffered_bytes / 2**20:.0f} MiB)"
        )
        print("  " + probe.summary())


if __name__ == "__main__":
    main()
