"""A fleet of simulated agents against ``modelforge serve``: each agent keeps its own
keep-alive connection and heartbeats every interval, beside sockets that trickle headers
and sockets that say nothing.

    .venv/bin/python bench/fleet.py                      # 1,000 then 5,000 agents, 10 s interval
    .venv/bin/python bench/fleet.py --agents 300 --interval 3 --rounds 5

For each fleet size: heartbeats answered within their interval, late and failed, latency
from the moment each was due, reconnects, and the server's CPU, peak RSS and open file
descriptors while the whole fleet is connected. Then, side by side in the same run, the
cost of one request on a server holding N idle connections with waitress's own poll loop
and with the control plane's epoll loop (connections.EventLoop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import socket
import threading
import time

from _fleet import (
    enroll_fleet,
    mint_tokens,
    process_footprint,
    raise_file_limit,
    run_fleet,
)
from _load import (
    modelforge,
    modelforge_env,
    process_usage,
    start_modelforge,
    temp_state,
    wait_until_serving,
)


class Sampler(threading.Thread):
    """Samples a process's RSS and descriptor count once a second; keeps the peaks."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_rss, self.peak_fds = pid, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                rss, fds = process_footprint(self.pid)
            except OSError:
                return
            self.peak_rss, self.peak_fds = max(self.peak_rss, rss), max(self.peak_fds, fds)


def fleet_run(agents: int, interval: float, rounds: int, tricklers: int, idle: int) -> str:
    state = temp_state()
    env = modelforge_env(
        state,
        MODELFORGE_HEARTBEAT_INTERVAL_SECONDS=str(int(interval)),
        MODELFORGE_NODE_STALE_AFTER_SECONDS=str(int(3 * interval)),
        MODELFORGE_NODE_OFFLINE_AFTER_SECONDS=str(int(9 * interval)),
        MODELFORGE_IDLE_TIMEOUT_SECONDS=str(int(6 * interval)),
        MODELFORGE_REQUEST_TIMEOUT_SECONDS="5",
    )
    admin = json.loads(modelforge(env, "init", "--json"))["admin_token"]
    port, server = start_modelforge(env)
    try:
        tokens = mint_tokens(
            f"sqlite:///{state}/modelforge.sqlite3", f"http://127.0.0.1:{port}", agents
        )
        wait_until_serving(port, server)
        began = time.monotonic()
        nodes = asyncio.run(enroll_fleet(port, tokens))
        enrolled_in = time.monotonic() - began
        idle_rss, idle_fds = process_footprint(server.pid)
        sampler = Sampler(server.pid)
        sampler.start()
        cpu_before, _ = process_usage(server.pid)
        began = time.monotonic()
        result = asyncio.run(
            run_fleet(port, nodes, interval, rounds, tricklers=tricklers, idle=idle)
        )
        elapsed = time.monotonic() - began
        cpu_after, _ = process_usage(server.pid)
        sampler.stop.set()
        sampler.join()
        online = _online(port, admin)
    finally:
        server.terminate()
        server.wait(timeout=30)
    cpu = 100 * (cpu_after - cpu_before) / elapsed
    if result.failures:
        kinds = sorted({failure.split(": ", 1)[1] for failure in result.failures})
        print(f"  {agents} agents, first failures: {', '.join(kinds)}", flush=True)
    return (
        f"| {agents:,} | {result.in_time:,}/{result.total:,} ({100 * result.in_time_ratio:.2f} %) | "
        f"{result.late} | {result.failed} | {result.reconnects} | "
        f"{result.percentile(0.5):.1f} / {result.percentile(0.99):.1f} / {max(result.latencies_ms, default=0):.0f} ms | "
        f"{online:,} | {cpu:.0f} % | {idle_rss / 2**20:.0f} → {sampler.peak_rss / 2**20:.0f} MiB | "
        f"{idle_fds} → {sampler.peak_fds:,} | {sum(result.tricklers_cut)} / {sum(result.idle_closed)} |"
        f"  (enrolled in {enrolled_in:.0f} s)"
    )


def _online(port: int, admin: str) -> int:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v1/admin/hardware/nodes",
        headers={"X-ModelForge-Admin-Token": admin},
    )
    nodes = json.load(urllib.request.urlopen(request, timeout=60))["nodes"]
    return sum(node["liveness"] == "online" for node in nodes)


def _trivial_app(environ, start_response):
    start_response("200 OK", [("Content-Length", "2")])
    return [b"ok"]


def loop_cost(idle_connections: int, use_epoll: bool, requests: int = 300) -> float:
    """Milliseconds per request on one connection while ``idle_connections`` others are open."""
    import waitress
    from waitress import wasyncore

    from modelforge_appliance.runtime.connections import EventLoop

    server = waitress.create_server(
        _trivial_app,
        host="127.0.0.1",
        port=0,
        connection_limit=idle_connections + 100,
        channel_timeout=600,
    )
    stop = threading.Event()
    loop = EventLoop(server._map)

    def serve() -> None:
        while not stop.is_set():
            if use_epoll:
                loop.turn(0.1)
            else:
                wasyncore.poll2(0.1, server._map)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    idle = [
        socket.create_connection(("127.0.0.1", server.effective_port))
        for _ in range(idle_connections)
    ]
    while len(server.active_channels) < idle_connections:
        time.sleep(0.05)
    probe = socket.create_connection(("127.0.0.1", server.effective_port))
    began = time.perf_counter()
    for _ in range(requests):
        probe.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b"ok"):
            data += probe.recv(4096)
    took = (time.perf_counter() - began) * 1000 / requests
    stop.set()
    thread.join()
    for sock in [*idle, probe]:
        sock.close()
    for dispatcher in list(server._map.values()):
        dispatcher.close()
    loop.close()
    server.task_dispatcher.shutdown()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between heartbeats")
    parser.add_argument("--rounds", type=int, default=3, help="heartbeats per agent")
    parser.add_argument("--tricklers", type=int, default=100)
    parser.add_argument("--idle", type=int, default=100)
    parser.add_argument("--loop-connections", type=int, nargs="*", default=[1000, 5000])
    args = parser.parse_args()
    raise_file_limit(max(args.agents) + args.tricklers + args.idle + 1000)

    print(
        "| agents | answered in time | late | failed | reconnects | latency p50 / p99 / max "
        "| online after | server CPU | server RSS idle → peak | server fds idle → peak "
        "| tricklers cut / idle closed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for agents in args.agents:
        print(fleet_run(agents, args.interval, args.rounds, args.tricklers, args.idle), flush=True)

    if args.loop_connections and hasattr(select, "epoll"):
        print("\n| idle connections | waitress poll loop | epoll loop | ratio |")
        print("|---|---|---|---|")
        for count in args.loop_connections:
            poll = loop_cost(count, use_epoll=False)
            epoll = loop_cost(count, use_epoll=True)
            print(
                f"| {count:,} | {poll:.2f} ms/request | {epoll:.2f} ms/request | {poll / epoll:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
