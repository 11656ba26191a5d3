"""1,000 trivial work items through ``modelforge serve``, 10 node agents and their 10 runtime
workers, all real processes; side by side with the same items sent straight to the workers
(the floor: what the workers alone can do) in the same run.

    .venv/bin/python bench/work.py [--items 1000] [--agents 10] [--database-url postgresql://…]

Prints completed items/s, claims/s, end-to-end latency (submission to completion, p50/p99)
and the ratio to the floor. Goal on 2 cores: >= 200 completed items/s with 10 agents on SQLite.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from _load import (
    json_body,
    modelforge,
    modelforge_env,
    process_usage,
    start_modelforge,
    temp_state,
    wait_until_serving,
)

from modelforge_node_agent.work import WorkerClient, WorkerUnavailable

ITEM = {"capability": "smoke", "input": {"matrix_size": 2}, "timeout_seconds": 60}


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "NVIDIA_"))}


def start_worker(socket: Path, log) -> subprocess.Popen:
    env = {**clean_env(), "MODELFORGE_WORKER_SOCKET": str(socket),
           "MODELFORGE_WORKER_ACCELERATOR_MODE": "cpu", "MODELFORGE_WORKER_LOG_LEVEL": "WARNING"}  # fmt: skip
    process = subprocess.Popen([sys.executable, "-m", "modelforge_worker"], env=env,
                               stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    client = WorkerClient(socket)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.info()
            return process
        except WorkerUnavailable:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("a worker did not start") from None
            time.sleep(0.05)


def floor(sockets: list[Path], items: int) -> tuple[float, list[float]]:
    """The same items straight to the workers over their sockets, one thread per worker."""
    latencies: list[float] = []
    lock = threading.Lock()

    def drive(socket: Path, count: int) -> None:
        client = WorkerClient(socket)
        for i in range(count):
            began = time.perf_counter()
            client.run({**ITEM, "work_id": f"floor-{i}"})
            with lock:
                latencies.append((time.perf_counter() - began) * 1000)

    share = [items // len(sockets) + (i < items % len(sockets)) for i in range(len(sockets))]
    threads = [
        threading.Thread(target=drive, args=(s, n)) for s, n in zip(sockets, share, strict=True)
    ]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, latencies


class Admin:
    def __init__(self, port: int, token: str) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"X-ModelForge-Admin-Token": token, "Content-Type": "application/json"}

    def call(self, method: str, path: str, body=None) -> dict:
        self.connection.request(method, path, body=json_body(body) if body is not None else None,
                                headers=self.headers)  # fmt: skip
        response = self.connection.getresponse()
        raw = response.read()
        if response.status >= 300:
            raise SystemExit(f"{method} {path} -> {response.status}: {raw[:200]!r}")
        return json.loads(raw) if raw else {}


def fresh_database(server_url: str):
    """A new database on the server: (its URL, a function that drops it)."""
    import secrets
    from urllib.parse import urlsplit, urlunsplit

    import psycopg2

    name = f"mf_bench_{secrets.token_hex(4)}"
    admin = psycopg2.connect(server_url)
    admin.autocommit = True
    with admin.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()

    return urlunsplit(urlsplit(server_url)._replace(path=f"/{name}")), drop


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument(
        "--database-url",
        help="postgresql://… of a server: a fresh database is made there and dropped after "
        "(default: SQLite in a temp dir)",
    )
    parser.add_argument("--poll", default="0.05", help="agents' MODELFORGE_AGENT_WORK_POLL_SECONDS")
    args = parser.parse_args()

    state = temp_state()
    sockets_dir = Path(tempfile.mkdtemp(prefix="mfb-", dir="/tmp"))
    database = fresh_database(args.database_url) if args.database_url else None
    extra = {"MODELFORGE_DATABASE_URL": database[0]} if database else {}
    env = modelforge_env(state, **extra)
    admin_token = json.loads(modelforge(env, "init", "--json"))["admin_token"]
    log = open(Path(state) / "processes.log", "ab")  # noqa: SIM115 - closed in finally
    port, server = start_modelforge(env, stdout=log, stderr=subprocess.STDOUT)
    processes: list[subprocess.Popen] = []
    try:
        wait_until_serving(port, server)
        url = f"http://127.0.0.1:{port}"
        admin = Admin(port, admin_token)
        sockets = [sockets_dir / f"w{i}.sock" for i in range(args.agents)]
        for socket in sockets:
            processes.append(start_worker(socket, log))

        floor_seconds, floor_latencies = floor(sockets, args.items)

        for i, socket in enumerate(sockets):
            token = admin.call("POST", "/api/v1/admin/node-enrollments",
                               {"display_name": f"bench-{i}", "expires_in_seconds": 900})["token"]  # fmt: skip
            agent_env = {
                **clean_env(),
                "MODELFORGE_AGENT_CONTROL_PLANE_URL": url,
                "MODELFORGE_AGENT_ENROLLMENT_TOKEN": token,
                "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
                "MODELFORGE_AGENT_STATE_VOLUME": str(Path(state) / f"agent-{i}"),
                "MODELFORGE_AGENT_HOSTNAME": f"bench-{i}",
                "MODELFORGE_AGENT_WORKER_SOCKET": str(socket),
                "MODELFORGE_AGENT_WORK_POLL_SECONDS": args.poll,
                "MODELFORGE_AGENT_WORKER_CHECK_SECONDS": "1",
                "MODELFORGE_AGENT_LOG_LEVEL": "WARNING",
            }
            processes.append(subprocess.Popen([sys.executable, "-m", "modelforge_node_agent.main"],
                                              env=agent_env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            nodes = admin.call("GET", "/api/v1/admin/hardware/nodes")["nodes"]
            ready = [n for n in nodes
                     if admin.call("GET", f"/api/v1/admin/hardware/nodes/{n['node_id']}/readiness")["ready"]]  # fmt: skip
            if len(ready) == args.agents:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(ready)} of {args.agents} nodes became ready")
            time.sleep(0.5)
        print(f"{args.agents} nodes ready", flush=True)

        # Queue everything while the nodes are cordoned, then let them go at once: what is
        # measured is the work plane (claims, runs, completions), not the submission.
        node_ids = [n["node_id"] for n in nodes]
        for node_id in node_ids:
            admin.call("POST", f"/api/v1/admin/hardware/nodes/{node_id}/cordon")
        began = time.time()
        for i in range(args.items):
            admin.call("POST", "/api/v1/admin/work", {**ITEM, "idempotency_key": f"bench-{i}"})
        submitted = time.time()
        cpu_before, _ = process_usage(server.pid)
        fleet_before = [process_usage(process.pid)[0] for process in processes]
        released = time.time()
        for node_id in node_ids:
            admin.call("POST", f"/api/v1/admin/hardware/nodes/{node_id}/uncordon")
        # Waiting asks only whether anything is still queued or leased (one row at most per
        # answer): reading all 1,000 items every second cost the server about a tenth of its
        # time in the window it is measured in. The items are read once, afterwards.
        while any(
            admin.call("GET", f"/api/v1/admin/work?state={state}&limit=1")["work"]
            for state in ("queued", "leased")
        ):
            time.sleep(0.25)
        cpu_after, rss = process_usage(server.pid)
        fleet_after = [process_usage(process.pid)[0] for process in processes]
        items, before = [], None
        while True:
            page = admin.call(
                "GET", "/api/v1/admin/work?limit=500" + (f"&before={before}" if before else "")
            )
            items += page["work"]
            before = page["next_before"]
            if before is None:
                break
        metrics = admin.connection
        metrics.request("GET", "/metrics", headers=admin.headers)
        exposition = metrics.getresponse().read().decode()
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)
        log.close()
        shutil.rmtree(sockets_dir, ignore_errors=True)
        if database:
            database[1]()

    failed = [item for item in items if item["state"] != "succeeded"]
    last = max(epoch(item["finished_at"]) for item in items)
    span = last - released
    queued = [(epoch(i["finished_at"]) - released) * 1000 for i in items]
    running = [(epoch(i["finished_at"]) - epoch(i["started_at"])) * 1000 for i in items]
    counts = {}
    for line in exposition.splitlines():
        if line.startswith("modelforge_work_claims_total{"):
            result = line.split('result="')[1].split('"')[0]
            counts[result] = float(line.rsplit(" ", 1)[1])
    claims = sum(counts.values())
    store = "PostgreSQL" if args.database_url else "SQLite"
    floor_rate = args.items / floor_seconds
    rate = args.items / span
    print(f"store {store}, {args.items} items, {args.agents} agents + {args.agents} workers")
    print(f"floor (straight to the workers):   {floor_rate:6.0f} items/s  per item p50 "
          f"{percentile(floor_latencies, 0.5):6.1f} ms  p99 {percentile(floor_latencies, 0.99):6.1f} ms")  # fmt: skip
    print(f"through the control plane:         {rate:6.0f} items/s  lease to completion p50 "
          f"{percentile(running, 0.5):6.1f} ms  p99 {percentile(running, 0.99):6.1f} ms")  # fmt: skip
    print(f"release to completion (queue wait included): p50 {percentile(queued, 0.5):.0f} ms, "
          f"p99 {percentile(queued, 0.99):.0f} ms, all {span:.2f} s")  # fmt: skip
    results = ", ".join(f"{name} {count:.0f}" for name, count in sorted(counts.items()))
    print(f"claims: {claims:.0f} in all ({results}), {counts.get('leased', 0) / span:.0f} leased/s; "
          f"submitting {args.items} took {submitted - began:.2f}s; server CPU "
          f"{100 * (cpu_after - cpu_before) / span:.0f}%, RSS {rss / 2**20:.0f} MiB")  # fmt: skip
    # processes: the workers first, then the agents
    used = [after - before for before, after in zip(fleet_before, fleet_after, strict=True)]
    print(f"CPU in the window (of {os.cpu_count()} cores): server "
          f"{100 * (cpu_after - cpu_before) / span:.0f}%, agents "
          f"{100 * sum(used[args.agents:]) / span:.0f}%, workers "
          f"{100 * sum(used[: args.agents]) / span:.0f}%")  # fmt: skip
    print(f"ratio to the floor: {rate / floor_rate:.2f}")
    sums, totals = {}, {}
    for line in exposition.splitlines():
        if line.startswith("modelforge_request_duration_seconds_sum{"):
            sums[line.split("{")[1].split("}")[0]] = float(line.rsplit(" ", 1)[1])
        if line.startswith("modelforge_request_duration_seconds_count{"):
            totals[line.split("{")[1].split("}")[0]] = float(line.rsplit(" ", 1)[1])
    for labels, count in sorted(totals.items()):
        if "/work" in labels and count:
            print(
                f"  server time {labels}: {count:.0f} requests, mean {1000 * sums[labels] / count:.1f} ms"
            )
    if failed:
        raise SystemExit(f"{len(failed)} items did not succeed")


if __name__ == "__main__":
    main()
