"""The relay (issue 26) against the same runtime called directly, side by side in one run.

    .venv/bin/python bench/relay.py [--quick] [--no-llama] [--only small,sse,...]
        [--agent-grace SECONDS] [--llama-server PATH] [--keep]
    MF_BENCH_PROFILE=DIR ...   # cProfile (CPU per thread) of the control plane and agent

Four processes on 127.0.0.1: a real control plane (its own process, so its RSS is its own:
the test harness's ``serve`` on SQLite with one scripted node holding a running server
of deployment ``svc`` through the real serve-lease routes, and an API key); the node
agent's real ``TunnelClient`` (a process of its own, as on a node); a stdlib origin
standing in for the runtime; and this process, the client. Every figure is measured both
ways in the same run, direct to the origin and through the control plane's port, and
the difference or ratio is printed:

- a small non-streamed request: p50 / p99 (goal: at most +0.8 ms p50);
- SSE events: each event stamped by the origin with the system-wide monotonic clock when
  written, paced, and the delay to the client compared (goal: at most +0.2 ms per event);
  and the time per event when the origin writes them back to back;
- bulk: a 100 MB answer (SSE of 64 KiB events: a JSON body is scrubbed whole and bounded
  at 64 MiB by the agent), MB/s (goal: at least 500 MB/s);
- stalled readers: clients that stop reading a large stream; the control plane's RSS
  growth per stream (goal: at most the window + 1 MiB), with the hub's own buffered bytes;
- another stream while they stall: small-request p50 / p99 (goal: p99 under 50 ms);
- 64 concurrent streams: time to the first event of each (goal: under 100 ms each);
- an agent restart: SIGKILL, a fresh agent process, the time to the first relayed answer
  (and how many requests sent meanwhile got no answer in 2 s);
- the real ``llama-server`` (scripts/llama-server-build) with the tiny generated GGUF:
  streamed tokens/s direct and relayed.

Everything shares the machine's cores with the client and whatever else runs: the load
average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from _load import llama_server_binary, process_usage

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHAT = "/v1/chat/completions"
PROTOCOL = 1  # the agent protocol the heartbeats name (modelforge_contract.PROTOCOL_VERSION)
MIB = 1 << 20
DEPLOYMENT = "svc"
SMALL_ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1764633600,
        "model": DEPLOYMENT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The quick brown fox jumps."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15},
    }
).encode()


# -- the roles: control plane, agent, origin (each its own process) ------------------------


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def profile_threads(role: str) -> None:
    """With MF_BENCH_PROFILE=DIR, profile every thread of this role (cProfile, merged) and
    write DIR/ROLE.prof when it ends: ``python -m pstats DIR/cp.prof``."""
    where = os.environ.get("MF_BENCH_PROFILE")
    if not where:
        return
    import atexit
    import cProfile
    import pstats

    # CPU time of each thread, not wall time: waiting threads cost nothing here.
    profiles = [cProfile.Profile(time.thread_time)]
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)
        profiles.append(profile)
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()

    threading.Thread.run = run  # type: ignore[method-assign]

    def dump() -> None:
        pstats.Stats(*profiles).dump_stats(str(Path(where) / f"{role}.prof"))

    atexit.register(dump)
    profiles[0].enable()


def role_cp(work: Path) -> None:
    """The control plane, set up as tests/appliance/test_relay.py does, then served until
    stdin closes; the hub's stats are written to stats.json every 0.1 s."""
    from dataclasses import replace

    from modelforge_appliance.identity.api_keys import KeyLimits, create_api_key
    from tests.appliance.test_deployments import ServingNode, deploy, held, tiny_model
    from tests.harness.control_plane import make_settings, serve

    # The default threads: relayed streams wait on the relay's loop (docs/architecture.md §12).
    profile_threads("cp")
    settings = replace(make_settings(work / "cp"), serve_lease_seconds=600)
    with serve(settings) as cp:
        model = tiny_model(cp, work)
        node = ServingNode(cp, "bench-node")
        held(cp, model, node)
        made = deploy(cp, DEPLOYMENT, [node])
        assert made.status_code == 201, made.text
        [entry] = node.servers()
        server_id = entry["server_id"]
        lease = node.claim_server(server_id).json()["lease"]
        node.renew_server(server_id, lease["lease_id"], "running")
        _, key = create_api_key(cp.store, "bench", "bench")
        # The same calls with every limit of a key on (none of them reached): scope, requests
        # a minute, tokens a day (issue 36), to measure what holding them costs.
        limits = KeyLimits((DEPLOYMENT,), None, 1_000_000, 10**12)
        _, limited_key = create_api_key(cp.store, "bench-limited", "bench", limits)
        info = {
            "url": cp.url,
            "port": int(cp.url.rsplit(":", 1)[1]),
            "credential": node.credential,
            "node_id": node.node_id,
            "server_id": server_id,
            "key": key,
            "limited_key": limited_key,
        }
        (work / "cp.json.tmp").write_text(json.dumps(info))
        (work / "cp.json.tmp").rename(work / "cp.json")
        done = threading.Event()

        def keep_alive() -> None:  # the node stays online and its lease held
            while not done.wait(5):
                node.heartbeat_answer()
                node.renew_server(server_id, lease["lease_id"], "running")

        def stats() -> None:
            while not done.wait(0.1):
                stats = {
                    **cp.server.app.hub.stats(),
                    "in_flight": cp.server.app.relay.shares.in_flight,
                }
                (work / "stats.tmp").write_text(json.dumps(stats))
                (work / "stats.tmp").rename(work / "stats.json")

        threading.Thread(target=keep_alive, daemon=True).start()
        threading.Thread(target=stats, daemon=True).start()
        sys.stdin.read()
        done.set()


def role_agent(work: Path, origin_port: int, grace: float) -> None:
    """Only the agent's tunnel client, to the one server, until killed."""
    from modelforge_node_agent.settings import load_settings
    from modelforge_node_agent.tunnel import TunnelClient

    logging.basicConfig(level=logging.INFO)
    profile_threads("agent")

    info = json.loads((work / "cp.json").read_text())
    settings = load_settings(
        {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": info["url"],
            "MODELFORGE_AGENT_STATE_VOLUME": str(work / "agent-state"),
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
        }
    )
    model_dir = str(settings.artifacts_dir / "models" / ("a" * 64))
    target = (origin_port, DEPLOYMENT, model_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    TunnelClient(
        settings,
        lambda: info["credential"],
        lambda sid: target if sid == info["server_id"] else None,
        threading.Event(),
        steps=(0.05, 0.1, 0.2),
        grace=grace,
    ).start()
    while not stop.wait(0.5):
        pass


class OriginHandler(BaseHTTPRequestHandler):
    """A runtime stand-in: the request's ``bench`` field says what to answer."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as llama-server's cpp-httplib and waitress do

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        kind = body.get("bench", "small")
        if kind == "small":
            head = (
                f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(SMALL_ANSWER)}\r\n\r\n"
            ).encode()
            self.wfile.write(head + SMALL_ANSWER)
            return
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Connection: close\r\n\r\n"
        )
        self.close_connection = True
        events, size, gap = int(body["events"]), int(body.get("size", 100)), body.get("gap")
        filler = b"x" * max(0, size - 40)
        try:
            if kind == "stamped":  # each event carries when it was written
                for _ in range(events):
                    if gap:
                        time.sleep(gap)
                    self.wfile.write(b'data: {"t": %.9f}\n\n' % time.perf_counter())
            else:
                event = b'data: {"c": "' + filler + b'"}\n\n'
                for _ in range(events):
                    self.wfile.write(event)
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass


class OriginServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: read when it listens, so a class attribute


def role_origin(work: Path) -> None:
    server = OriginServer(("127.0.0.1", 0), OriginHandler)
    (work / "origin.port").write_text(str(server.server_address[1]))
    server.serve_forever()


# -- the client side ---------------------------------------------------------------------


def wait_file(path: Path, process: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise SystemExit(f"{path.name}: its process exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{path.name} did not appear")
        time.sleep(0.02)
    return path.read_text()


class Target:
    """Where a request goes: the origin itself, or the control plane's port with the key."""

    def __init__(self, label: str, port: int, key: str | None = None) -> None:
        self.label, self.port = label, port
        self.auth = f"Authorization: Bearer {key}\r\n" if key else ""

    def request(self, body: dict[str, Any]) -> bytes:
        data = json.dumps({"model": DEPLOYMENT, "messages": [], **body}).encode()
        return (
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{self.auth}Content-Length: {len(data)}\r\n\r\n"
        ).encode() + data

    def connect(self, timeout: float = 60) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def read_head(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str]]:
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit(f"connection closed before the head: {bytes(buffer[:200])!r}")
        buffer += chunk
    end = buffer.index(b"\r\n\r\n") + 4
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    del buffer[:end]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def small_once(target: Target, sock: socket.socket, payload: bytes) -> float:
    """One keep-alive request and its whole answer; the seconds it took."""
    began = time.perf_counter()
    sock.sendall(payload)
    buffer = bytearray()
    status, headers = read_head(sock, buffer)
    length = int(headers["content-length"])
    while len(buffer) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise SystemExit("closed mid-answer")
        buffer += chunk
    took = time.perf_counter() - began
    if status != 200:
        raise SystemExit(f"{target.label}: {status} {bytes(buffer[:300])!r}")
    return took


def small_latencies(targets: list[Target], count: int) -> dict[str, list[float]]:
    """``count`` small requests to each target, interleaved, one keep-alive connection each."""
    socks = {t.label: t.connect() for t in targets}
    payloads = {t.label: t.request({"bench": "small"}) for t in targets}
    out: dict[str, list[float]] = {t.label: [] for t in targets}
    for index in range(count + count // 10):
        for target in targets:
            took = small_once(target, socks[target.label], payloads[target.label])
            if index >= count // 10:  # the first tenth warms up
                out[target.label].append(took * 1000)
    for sock in socks.values():
        sock.close()
    return out


def stream_body(target: Target, body: dict[str, Any], on_chunk=None) -> tuple[float, int]:
    """A streamed request read to its end: (seconds from sending to the end, body bytes)."""
    sock = target.connect()
    began = time.perf_counter()
    sock.sendall(target.request(body))
    buffer = bytearray()
    status, _ = read_head(sock, buffer)
    if status != 200:
        raise SystemExit(f"{target.label}: {status} {bytes(buffer[:300])!r}")
    total = len(buffer)
    if on_chunk is not None and buffer:
        on_chunk(bytes(buffer))
    scratch = bytearray(4 * MIB)
    view = memoryview(scratch)
    tail = bytes(buffer[-32:])
    while True:
        got = sock.recv_into(view)
        if not got:
            break
        total += got
        if on_chunk is not None:
            on_chunk(bytes(view[:got]))
        else:
            tail = (tail + bytes(view[max(0, got - 32) : got]))[-32:]
        # waitress ends a chunked answer with 0\r\n\r\n and keeps the connection
        if on_chunk is None and tail.endswith(b"[DONE]\n\n\r\n0\r\n\r\n"):
            break
    took = time.perf_counter() - began
    sock.close()
    return took, total


class EventClock:
    """Arrival minus written time of each stamped event (one monotonic clock, one machine)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.delays: list[float] = []
        self.done = False

    def __call__(self, chunk: bytes) -> None:
        now = time.perf_counter()
        self.buffer += chunk
        while True:
            at = self.buffer.find(b'data: {"t": ')
            if at < 0:
                break
            end = self.buffer.find(b"}", at)
            if end < 0:
                break
            self.delays.append((now - float(self.buffer[at + 12 : end])) * 1000)
            del self.buffer[: end + 1]
        if b"[DONE]" in self.buffer:
            self.done = True


def stamped_events(target: Target, events: int, gap: float) -> list[float]:
    clock = EventClock()
    sock = target.connect()
    sock.sendall(target.request({"bench": "stamped", "events": events, "gap": gap}))
    buffer = bytearray()
    read_head(sock, buffer)
    clock(bytes(buffer))
    while not clock.done:
        chunk = sock.recv(65536)
        if not chunk:
            break
        clock(chunk)
    sock.close()
    return clock.delays[events // 10 :]


def first_events(target: Target, streams: int) -> list[float]:
    """``streams`` SSE requests sent at once from one thread (no GIL between the clients):
    milliseconds from each request's send to its first event."""
    socks = [target.connect() for _ in range(streams)]
    payload = target.request({"bench": "sse", "events": 4, "size": 100})
    selector = selectors.DefaultSelector()
    sent: dict[int, float] = {}
    seen: dict[int, bytearray] = {}
    first: dict[int, float] = {}
    for sock in socks:
        sock.setblocking(False)
        sent[sock.fileno()] = time.perf_counter()
        sock.sendall(payload)
        seen[sock.fileno()] = bytearray()
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + 60
    while len(first) < streams and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1):
            sock = key.fileobj
            fd = sock.fileno()
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            now = time.perf_counter()
            seen[fd] += chunk
            if b"data: " in seen[fd] and fd not in first:
                first[fd] = (now - sent[fd]) * 1000
            if not chunk or fd in first:
                selector.unregister(sock)
    for sock in socks:
        sock.close()
    if len(first) < streams:
        for fd, body in seen.items():  # what those got instead, to tell a refusal from a hang
            if fd not in first:
                print(f"  a stream without a first event got {bytes(body[:300])!r}")
        raise SystemExit(f"{target.label}: {streams - len(first)} stream(s) had no first event")
    return sorted(first.values())


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.log = open(work / "processes.log", "ab")  # noqa: SIM115 - closed in close()
        self.processes: list[subprocess.Popen] = []
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.hung = 0  # requests that got no answer within 2 s around an agent restart

    def spawn(self, *role: str, stdin: bool = False) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, __file__, "--role", *role, "--work", str(self.work)],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        self.processes.append(process)
        return process

    def row(self, what: str, direct: str, relayed: str, added: str, goal: str) -> None:
        self.rows.append((what, direct, relayed, added, goal))
        print(f"{what}: direct {direct}; relayed {relayed}; {added} (goal {goal})", flush=True)

    def hub_stats(self) -> dict[str, Any]:
        return json.loads((self.work / "stats.json").read_text())

    def start_agent(self, port: int) -> subprocess.Popen:
        grace = str(self.args.agent_grace)
        return self.spawn("agent", "--origin-port", str(port), "--agent-grace", grace)

    def first_answer(self, began: float, timeout: float = 60) -> float:
        """Seconds from ``began`` until a relayed small request answers 200."""
        payload = self.relayed.request({"bench": "small"})
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                # A request caught by the restart may hang (bench/README.md): give up on
                # it after 2 s, count it, and send another.
                with self.relayed.connect(timeout=2) as sock:
                    sock.sendall(payload)
                    buffer = bytearray()
                    status, _ = read_head(sock, buffer)
                if status == 200:
                    return time.perf_counter() - began
                last = (status, bytes(buffer[:200]))
            except TimeoutError as failure:
                last = failure
                self.hung += 1
            except (OSError, SystemExit) as failure:
                last = failure
            time.sleep(0.002)
        raise SystemExit(f"no relayed answer after the agent restart (last: {last!r})")

    def run(self) -> None:
        quick = self.args.quick
        print(f"load average at start: {load_average()} ({os.cpu_count()} CPUs)", flush=True)
        self.cp = self.spawn("cp", stdin=True)
        self.origin = self.spawn("origin")
        info = json.loads(wait_file(self.work / "cp.json", self.cp))
        origin_port = int(wait_file(self.work / "origin.port", self.origin))
        self.direct = Target("direct", origin_port)
        self.relayed = Target("relayed", info["port"], info["key"])
        began = time.perf_counter()
        self.agent = self.start_agent(origin_port)
        first = self.first_answer(began)
        print(f"agent process started -> first relayed answer: {first * 1000:.0f} ms")
        self.origin_port = origin_port
        parts = {
            "small": self.small,
            "sse": self.sse,
            "bulk": self.bulk,
            "stall": lambda: self.stalled(4 if quick else 8),
            "concurrent": self.concurrent,
            "many": self.many,
            "limits": self.limits,
            "restart": self.restarts,
            "llama": self.llama,
        }
        chosen = self.args.only.split(",") if self.args.only else list(parts)
        if self.args.no_llama and "llama" in chosen:
            chosen.remove("llama")
        for name in chosen:
            parts[name]()
        print(f"load average at the end: {load_average()}")
        print()
        print("| measurement | direct | relayed | added / ratio | goal |")
        print("|---|---|---|---|---|")
        for row in self.rows:
            print("| " + " | ".join(row) + " |")

    def small(self) -> None:
        quick, both = self.args.quick, [self.direct, self.relayed]
        count = 300 if quick else 2000
        before = self.cpu()
        lat = small_latencies(both, count)
        print("  small, both ways: " + self.cpu_line(before, "request pair", count * 1.1))
        d50, d99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
        r50, r99 = pct(lat["relayed"], 0.5), pct(lat["relayed"], 0.99)
        self.row(
            "small request p50 / p99",
            f"{d50:.2f} / {d99:.2f} ms",
            f"{r50:.2f} / {r99:.2f} ms",
            f"+{r50 - d50:.2f} / +{r99 - d99:.2f} ms",
            "≤ +0.8 ms p50",
        )

    def limits(self) -> None:
        """Small requests with a key without limits and one with every limit on, side by
        side (interleaved, one keep-alive connection each)."""
        info = json.loads((self.work / "cp.json").read_text())
        limited = Target("limited", info["port"], info["limited_key"])
        count = 300 if self.args.quick else 2000
        lat = small_latencies([self.relayed, limited], count)
        r50, r99 = pct(lat["relayed"], 0.5), pct(lat["relayed"], 0.99)
        l50, l99 = pct(lat["limited"], 0.5), pct(lat["limited"], 0.99)
        self.row(
            "small request p50 / p99, a key without limits | with every limit on",
            f"{r50:.2f} / {r99:.2f} ms",
            f"{l50:.2f} / {l99:.2f} ms",
            f"+{l50 - r50:.2f} / +{l99 - r99:.2f} ms",
            "the limits cost little",
        )

    def sse(self) -> None:
        """Stamped events 1 ms apart (each one's delay), then back to back."""
        quick, both = self.args.quick, [self.direct, self.relayed]
        events = 300 if quick else 2000
        delays = {}
        for target in both:
            before = self.cpu()
            delays[target.label] = stamped_events(target, events, 0.001)
            print(f"  SSE {target.label}: " + self.cpu_line(before, "event", events))
        d, r = statistics.median(delays["direct"]), statistics.median(delays["relayed"])
        self.row(
            f"SSE event delay, 1 ms apart, p50 / p99 ({events} events)",
            f"{d:.3f} / {pct(delays['direct'], 0.99):.3f} ms",
            f"{r:.3f} / {pct(delays['relayed'], 0.99):.3f} ms",
            f"+{r - d:.3f} ms p50",
            "≤ +0.2 ms",
        )
        count = 5000 if quick else 20000
        per = {}
        for target in both:
            runs = [stream_body(target, {"bench": "sse", "events": count})[0] for _ in range(3)]
            per[target.label] = min(runs) / count * 1000
        self.row(
            f"SSE events back to back ({count} × 100 B, best of 3; they coalesce into "
            "reads, so a throughput figure)",
            f"{per['direct'] * 1000:.1f} µs",
            f"{per['relayed'] * 1000:.1f} µs",
            f"+{(per['relayed'] - per['direct']) * 1000:.1f} µs",
            "≤ +200 µs",
        )

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the control plane, the agent, the origin and this
        process."""
        return {
            "cp": process_usage(self.cp.pid)[0],
            "agent": process_usage(self.agent.pid)[0],
            "origin": process_usage(self.origin.pid)[0],
            "client": sum(os.times()[:2]),
        }

    def cpu_line(self, before: dict[str, float], what: str, count: float) -> str:
        after = self.cpu()
        return ", ".join(f"{k} {(after[k] - before[k]) / count * 1e6:,.0f}" for k in after) + (
            f" CPU µs per {what}"
        )

    def bulk(self) -> None:
        quick, both = self.args.quick, [self.direct, self.relayed]
        size = 64 * 1024
        bulk = (25 if quick else 100) * 1_000_000 // size
        speed = {}
        for target in both:
            before, runs = self.cpu(), []
            for _ in range(2 if quick else 3):
                runs.append(stream_body(target, {"bench": "sse", "events": bulk, "size": size}))
            print(
                f"  bulk {target.label}: "
                + self.cpu_line(before, "MB", sum(total for _, total in runs) / 1e6)
            )
            took, total = min(runs)
            speed[target.label] = total / took / 1e6
        self.row(
            f"bulk {bulk * size / 1e6:.0f} MB answer (64 KiB SSE events, best of 3)",
            f"{speed['direct']:,.0f} MB/s",
            f"{speed['relayed']:,.0f} MB/s",
            f"ratio {speed['relayed'] / speed['direct']:.2f}",
            "≥ 500 MB/s",
        )

    def concurrent(self) -> None:
        both = [self.direct, self.relayed]
        firsts = {t.label: first_events(t, 64) for t in both}
        self.row(
            "64 concurrent streams: first event p50 / max",
            f"{pct(firsts['direct'], 0.5):.1f} / {firsts['direct'][-1]:.1f} ms",
            f"{pct(firsts['relayed'], 0.5):.1f} / {firsts['relayed'][-1]:.1f} ms",
            f"+{firsts['relayed'][-1] - firsts['direct'][-1]:.1f} ms max",
            "< 100 ms each",
        )

    def many(self, count: int = 1000) -> None:
        """``count`` SSE streams sent at once (one key, one node: the node's slots stream,
        the rest wait for one at the control plane); /healthz and the node's heartbeat are
        timed meanwhile, and every stream must end with its [DONE]."""
        payload = self.relayed.request({"bench": "stamped", "events": 5, "gap": 0.05})
        selector = selectors.DefaultSelector()
        seen: dict[int, bytearray] = {}
        began = time.perf_counter()
        for _ in range(count):
            sock = self.relayed.connect()
            sock.sendall(payload)
            sock.setblocking(False)
            seen[sock.fileno()] = bytearray()
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        while self.hub_stats().get("in_flight", 0) < count // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = self.hub_stats()
        health, beats = self.api_latencies(50)
        done = 0
        while done < count and time.monotonic() < deadline + 120:
            for key, _ in selector.select(timeout=1):
                sock = key.fileobj
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    continue
                seen[sock.fileno()] += chunk
                if not chunk or seen[sock.fileno()].endswith(b"\r\n0\r\n\r\n"):
                    selector.unregister(sock)
                    sock.close()
                    done += 1
        took = time.perf_counter() - began
        complete = sum(1 for body in seen.values() if b"data: [DONE]" in body)
        print(
            f"{count} streams at once: {held.get('in_flight')} in flight, {held['streams']} on "
            f"the node's tunnel when measured; {complete} complete in {took:.1f} s",
            flush=True,
        )
        self.row(
            f"{count} concurrent SSE streams: /healthz and heartbeat p50 / p99 meanwhile",
            "—",
            f"{pct(health, 0.5):.1f} / {pct(health, 0.99):.1f} ms; "
            f"{pct(beats, 0.5):.1f} / {pct(beats, 0.99):.1f} ms",
            f"{complete} of {count} complete",
            "p99 < 100 ms, all complete",
        )

    def api_latencies(self, count: int) -> tuple[list[float], list[float]]:
        """``count`` /healthz and ``count`` heartbeats, interleaved: milliseconds each."""
        info = json.loads((self.work / "cp.json").read_text())
        beat = json.dumps(
            {
                "node_id": info["node_id"],
                "agent_version": "0.1.0",
                "health": {"status": "ok", "gpu_probe": "not_applicable"},
            }
        ).encode()
        requests_ = {
            "health": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            "beat": (
                f"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {info['credential']}\r\n"
                f"X-ModelForge-Agent-Protocol: {PROTOCOL}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(beat)}\r\n\r\n"
            ).encode()
            + beat,
        }
        out: dict[str, list[float]] = {"health": [], "beat": []}
        socks = {name: Target(name, info["port"]).connect() for name in requests_}
        for _ in range(count):
            for name, payload in requests_.items():
                sock, began, buffer = socks[name], time.perf_counter(), bytearray()
                sock.sendall(payload)
                status, headers = read_head(sock, buffer)
                while len(buffer) < int(headers.get("content-length", 0)):
                    buffer += sock.recv(65536)
                if status != 200:
                    raise SystemExit(f"{name}: {status} {bytes(buffer[:300])!r}")
                out[name].append((time.perf_counter() - began) * 1000)
        for sock in socks.values():
            sock.close()
        return out["health"], out["beat"]

    def restarts(self) -> None:
        origin_port, restarts, self.hung = self.origin_port, [], 0
        for _ in range(2 if self.args.quick else 5):
            self.agent.kill()
            self.agent.wait()
            began = time.perf_counter()
            self.agent = self.start_agent(origin_port)
            restarts.append(self.first_answer(began) * 1000)
        self.row(
            "agent restart (SIGKILL, new process) -> first relayed answer",
            "—",
            f"{statistics.median(restarts):.0f} ms median ({min(restarts):.0f}–"
            f"{max(restarts):.0f}) of {len(restarts)}",
            f"{self.hung} request(s) hung (no answer in 2 s)",
            "no hang",
        )

    def stalled(self, count: int) -> None:
        """``count`` clients that stop reading a stream far larger than any buffer."""
        body = {"bench": "sse", "events": 4000, "size": 64 * 1024}  # 256 MiB each
        # Warm up: as many streams read to the end, so threads and buffers exist.
        threads = [
            threading.Thread(target=stream_body, args=(self.relayed, body)) for _ in range(count)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(1)
        before = rss_of(self.cp.pid)
        socks = []
        for _ in range(count):
            sock = self.relayed.connect()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.sendall(self.relayed.request(body))
            sock.recv(65536)  # the head and the first bytes; then it reads no more
            socks.append(sock)
        # Until the relay stops moving bytes (the window is spent everywhere).
        peak, steady_since, last = before, time.monotonic(), -1
        while time.monotonic() - steady_since < 2:
            time.sleep(0.2)
            rss = rss_of(self.cp.pid)
            peak = max(peak, rss)
            buffered = self.hub_stats()["buffered_bytes"]
            if buffered != last:
                last, steady_since = buffered, time.monotonic()
        stats = self.hub_stats()
        grown = (peak - before) / count
        print(
            f"{count} stalled streams: control plane RSS {before / MIB:.1f} -> "
            f"{peak / MIB:.1f} MiB; hub buffered {stats['buffered_bytes'] / MIB:.2f} MiB "
            f"in {stats['streams']} stream(s)",
            flush=True,
        )
        self.row(
            f"control plane RSS growth per stalled stream ({count} stalled)",
            "—",
            f"{grown / MIB:+.2f} MiB (hub holds {stats['buffered_bytes'] / count / MIB:.2f})",
            "",
            "≤ 2 MiB (window + 1 MiB)",
        )
        # Another stream on the same tunnel while they stall.
        lat = small_latencies([self.direct, self.relayed], 200 if self.args.quick else 1000)
        d, r = lat["direct"], lat["relayed"]
        self.row(
            "small request p50 / p99 while they stall",
            f"{pct(d, 0.5):.2f} / {pct(d, 0.99):.2f} ms",
            f"{pct(r, 0.5):.2f} / {pct(r, 0.99):.2f} ms",
            f"+{pct(r, 0.5) - pct(d, 0.5):.2f} / +{pct(r, 0.99) - pct(d, 0.99):.2f} ms",
            "p99 < 50 ms",
        )
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 30
        while self.hub_stats()["streams"] and time.monotonic() < deadline:
            time.sleep(0.1)

    def llama(self) -> None:
        from tests.harness.llama import GREEDY, LlamaServer
        from tests.harness.tiny_gguf import write_tiny_gguf

        binary = llama_server_binary(self.args.llama_server)
        model = write_tiny_gguf(self.work / "tiny.gguf")
        server = LlamaServer(Path(binary), model, self.work / "llama.log", context_length=512)
        try:
            server.wait_healthy()
            self.agent.kill()
            self.agent.wait()
            self.agent = self.start_agent(server.port)
            direct = Target("direct", server.port)
            tokens = 64 if self.args.quick else 200
            body = {
                "messages": [{"role": "user", "content": "zebra quartz"}],
                "max_tokens": tokens,
                "stream": True,
                **GREEDY,
            }
            self.first_answer_llama(body)
            rates: dict[str, list[float]] = {"direct": [], "relayed": []}
            for _ in range(3 if self.args.quick else 5):
                for target in (direct, self.relayed):
                    got = bytearray()
                    took, _ = stream_until_done(target, body, got.extend)
                    rates[target.label].append(got.count(b'"delta":{"content":') / took)
            d, r = statistics.median(rates["direct"]), statistics.median(rates["relayed"])
            self.row(
                f"llama-server, tiny GGUF, streamed {tokens} tokens (median of runs)",
                f"{d:,.0f} tokens/s",
                f"{r:,.0f} tokens/s",
                f"ratio {r / d:.2f}",
                "",
            )
        finally:
            server.stop()

    def first_answer_llama(self, body: dict[str, Any]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                stream_until_done(self.relayed, body, lambda chunk: None)
                return
            except SystemExit:
                time.sleep(0.05)
        raise SystemExit("the relay to llama-server did not answer")

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                if process.stdin is not None:
                    process.stdin.close()
                    try:
                        process.wait(timeout=10)
                        continue
                    except subprocess.TimeoutExpired:
                        pass
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.log.close()


def stream_until_done(target: Target, body: dict[str, Any], on_chunk) -> tuple[float, int]:
    """A streamed request read until its ``[DONE]`` event (whatever keeps the connection)."""
    seen = bytearray()
    done = threading.Event()

    def chunk(data: bytes) -> None:
        on_chunk(data)
        seen.extend(data[-64:])
        del seen[:-64]
        if b"[DONE]" in seen:
            done.set()

    sock = target.connect()
    began = time.perf_counter()
    sock.sendall(target.request(body))
    buffer = bytearray()
    status, _ = read_head(sock, buffer)
    if status != 200:
        raise SystemExit(f"{target.label}: {status} {bytes(buffer[:300])!r}")
    chunk(bytes(buffer))
    while not done.is_set():
        data = sock.recv(65536)
        if not data:
            break
        chunk(data)
    took = time.perf_counter() - began
    sock.close()
    return took, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller runs")
    parser.add_argument("--no-llama", action="store_true", help="skip the llama-server part")
    parser.add_argument(
        "--llama-server", help="the llama-server binary (default: scripts/llama-server-build)"
    )
    parser.add_argument(
        "--agent-grace",
        type=float,
        default=30.0,
        help="the agent's resume grace in seconds (default 30, the agent's own)",
    )
    parser.add_argument(
        "--only",
        help="comma-separated parts: small,sse,bulk,stall,concurrent,many,limits,restart,llama",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--role", choices=("cp", "agent", "origin"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--origin-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "cp":
        return role_cp(args.work)
    if args.role == "agent":
        return role_agent(args.work, args.origin_port, args.agent_grace)
    if args.role == "origin":
        return role_origin(args.work)
    work = Path(tempfile.mkdtemp(prefix="mfb-relay-", dir="/var/tmp"))
    bench = Bench(args, work)
    try:
        bench.run()
    finally:
        bench.close()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
