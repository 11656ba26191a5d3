"""A simulated fleet against a real ``modelforge serve``: asyncio agents that each keep one
keep-alive connection and heartbeat on a fixed interval, plus hostile sockets that trickle
headers or say nothing. Used by bench/fleet.py and tests/appliance/test_fleet.py.

Only the standard library: the agents speak HTTP/1.1 by hand over asyncio streams, so one
process holds thousands of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
ENROLL_PATH = "/api/v1/agent/enroll"


def raise_file_limit(wanted: int) -> int:
    """Raise this process's soft open-files limit towards ``wanted``; return what it is now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def mint_tokens(database_url: str, origin: str, count: int) -> list[str]:
    """``count`` enrollment tokens locked to ``origin``, minted in one transaction."""
    from modelforge_appliance.core.clock import Clock
    from modelforge_appliance.identity import enrollment
    from modelforge_appliance.store import audit
    from modelforge_appliance.store.database import Store

    store = Store(database_url, Clock())
    store.migrate()
    try:
        with store.write():
            return [
                enrollment.mint_enrollment_token(
                    store,
                    display_name=f"fleet-{i}",
                    expires_in_seconds=3600,
                    api_origin=origin,
                    actor=audit.CLI_ACTOR,
                ).token
                for i in range(count)
            ]
    finally:
        store.close()


def request_bytes(port: int, path: str, body: dict, headers: dict[str, str]) -> bytes:
    raw = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(raw)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + raw


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def enroll_fleet(
    port: int, tokens: list[str], concurrency: int = 16
) -> list[tuple[str, str]]:
    """Enroll one node per token through the real API; (node_id, credential) each."""
    queue = list(enumerate(tokens))
    enrolled: list[tuple[str, str] | None] = [None] * len(tokens)

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                i, token = queue.pop()
                body = {
                    "token": token,
                    "hostname": f"fleet-{i}",
                    "agent_version": "fleet",
                    "accelerator_mode": "cpu",
                }
                writer.write(
                    request_bytes(port, ENROLL_PATH, body, {"X-ModelForge-Agent-Protocol": "1"})
                )
                status, raw = await read_answer(reader)
                if status != 201:
                    raise RuntimeError(f"enrollment {i} answered {status}: {raw[:200]!r}")
                answer = json.loads(raw)
                enrolled[i] = (answer["node_id"], answer["credential"])
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [node for node in enrolled if node is not None]


@dataclass
class FleetResult:
    agents: int
    rounds: int
    interval: float
    in_time: int = 0
    late: int = 0
    failed: int = 0
    reconnects: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    tricklers_cut: list[int] = field(default_factory=list)
    idle_closed: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.in_time + self.late + self.failed

    @property
    def in_time_ratio(self) -> float:
        return self.in_time / self.total if self.total else 0.0

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")


async def _agent(port, node, index, result: FleetResult, start: float, stop_at: float) -> None:
    node_id, credential = node
    headers = {"X-ModelForge-Agent-Protocol": "1", "Authorization": f"Bearer {credential}"}
    request = request_bytes(
        port,
        HEARTBEAT_PATH,
        {
            "node_id": node_id,
            "agent_version": "fleet",
            "health": {"status": "ok", "gpu_probe": "not_applicable"},
        },
        headers,
    )
    reader = writer = None
    # Spread the fleet evenly over one interval, as agents started at random times would be.
    due = start + result.interval * index / result.agents
    for _ in range(result.rounds):
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        deadline = due + result.interval
        outcome = "failed"
        for _attempt in range(2):  # one reconnect if the kept connection was closed meanwhile
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                remaining = max(0.01, deadline - time.monotonic())
                status, _ = await asyncio.wait_for(read_answer(reader), remaining)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:  # noqa: UP041 - distinct on 3.10
                if writer is not None:
                    writer.close()
                reader = writer = None
                result.reconnects += 1
                if len(result.failures) < 20:
                    result.failures.append(f"agent {index}: {type(exc).__name__}")
                if time.monotonic() >= deadline:
                    break
                continue
            if status == 200:
                answered = time.monotonic()
                result.latencies_ms.append((answered - due) * 1000)
                outcome = "in_time" if answered <= deadline else "late"
            elif len(result.failures) < 20:
                result.failures.append(f"agent {index}: HTTP {status}")
            break
        setattr(result, outcome, getattr(result, outcome) + 1)
        due += result.interval
    if writer is not None:
        writer.close()


async def _hostile(
    port: int, trickle_every: float | None, counts: list[int], slot: int, stop_at: float
) -> None:
    """A socket that trickles a request's headers a byte at a time (or, with None, says
    nothing); it reconnects each time the server cuts it off, and counts the cuts."""
    while time.monotonic() < stop_at:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            if trickle_every is not None:
                writer.write(b"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
            while time.monotonic() < stop_at and not reader.at_eof():
                await asyncio.sleep(trickle_every or 0.25)
                if trickle_every is not None and not reader.at_eof():
                    writer.write(b"a")
                    await writer.drain()
            if reader.at_eof() and time.monotonic() < stop_at:
                counts[slot] += 1  # the server closed it
        except OSError:
            if time.monotonic() < stop_at:
                counts[slot] += 1  # reset by the server
        finally:
            writer.close()


async def run_fleet(
    port: int,
    nodes: list[tuple[str, str]],
    interval: float,
    rounds: int,
    tricklers: int = 0,
    idle: int = 0,
    trickle_every: float = 0.5,
) -> FleetResult:
    """Every node heartbeats ``rounds`` times, one every ``interval`` seconds, each over its
    own keep-alive connection; the hostile sockets run for as long."""
    result = FleetResult(agents=len(nodes), rounds=rounds, interval=interval)
    result.tricklers_cut = [0] * tricklers
    result.idle_closed = [0] * idle
    start = time.monotonic() + 1.0
    stop_at = start + interval * rounds
    tasks = [
        _hostile(port, trickle_every, result.tricklers_cut, i, stop_at) for i in range(tricklers)
    ]
    tasks += [_hostile(port, None, result.idle_closed, i, stop_at) for i in range(idle)]
    tasks += [_agent(port, node, i, result, start, stop_at) for i, node in enumerate(nodes)]
    await asyncio.gather(*tasks)
    return result


def process_footprint(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a process, from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))
