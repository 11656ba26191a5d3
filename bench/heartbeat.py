"""Sustained authenticated heartbeats against ``modelforge serve`` on SQLite, side by side
with a bare bottle-on-waitress endpoint (the framework floor) in the same run.

    .venv/bin/python bench/heartbeat.py [--nodes 500] [--clients 4] [--seconds 10]

Prints heartbeats/s, p50/p99 latency, server CPU and memory for both, and the ratio.
Target on a 2-core machine: >= 1,000 heartbeats/s, p99 < 100 ms, ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

from _load import (
    free_port,
    json_body,
    modelforge,
    modelforge_env,
    run_load,
    start_modelforge,
    temp_state,
    wait_until_serving,
)

FLOOR_APP = """
import json, sys, bottle, waitress
app = bottle.Bottle()
@app.post("/api/v1/agent/heartbeat")
def heartbeat():
    body = json.loads(bottle.request.body.read())
    bottle.response.content_type = "application/json"
    return json.dumps({"server_time": "now", "node_id": body["node_id"]})
waitress.serve(app, host="127.0.0.1", port=int(sys.argv[1]), threads=int(sys.argv[2]), _quiet=True)
"""


def enroll_nodes(url: str, admin: str, count: int) -> list[tuple[str, str]]:
    nodes = []
    for i in range(count):
        request = urllib.request.Request(
            f"{url}/api/v1/admin/node-enrollments",
            data=json_body({"display_name": f"bench-{i}", "expires_in_seconds": 900}),
            headers={"X-ModelForge-Admin-Token": admin, "Content-Type": "application/json"},
        )
        token = json.load(urllib.request.urlopen(request))["token"]
        request = urllib.request.Request(
            f"{url}/api/v1/agent/enroll",
            data=json_body(
                {
                    "token": token,
                    "hostname": f"bench-{i}",
                    "agent_version": "bench",
                    "accelerator_mode": "cpu",
                }
            ),
            headers={"X-ModelForge-Agent-Protocol": "1", "Content-Type": "application/json"},
        )
        answer = json.load(urllib.request.urlopen(request))
        nodes.append((answer["node_id"], answer["credential"]))
    return nodes


def heartbeat_requests(nodes):
    bodies, headers = [], []
    for node_id, credential in nodes:
        bodies.append(
            json_body(
                {
                    "node_id": node_id,
                    "agent_version": "bench",
                    "health": {"status": "ok", "gpu_probe": "not_applicable"},
                }
            )
        )
        headers.append(
            {
                "Authorization": f"Bearer {credential}",
                "Content-Type": "application/json",
                "X-ModelForge-Agent-Protocol": "1",
            }
        )
    return bodies, headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500, help="simulated agents")
    parser.add_argument("--clients", type=int, default=4, help="load processes (keep-alive)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per target")
    parser.add_argument("--threads", type=int, default=8, help="waitress threads, both servers")
    args = parser.parse_args()

    state = temp_state()
    env = modelforge_env(state, MODELFORGE_THREADS=str(args.threads))
    admin = json.loads(modelforge(env, "init", "--json"))["admin_token"]
    port, server = start_modelforge(env)
    floor_port = free_port()
    floor = subprocess.Popen([sys.executable, "-c", FLOOR_APP, str(floor_port), str(args.threads)])
    try:
        wait_until_serving(port, server)
        wait_until_serving(floor_port, floor)
        began = time.monotonic()
        nodes = enroll_nodes(f"http://127.0.0.1:{port}", admin, args.nodes)
        print(f"enrolled {len(nodes)} nodes in {time.monotonic() - began:.1f}s", flush=True)
        bodies, headers = heartbeat_requests(nodes)
        path = "/api/v1/agent/heartbeat"
        floor_result = run_load(
            "bare bottle+waitress",
            floor_port,
            floor.pid,
            path,
            "POST",
            bodies,
            headers,
            args.clients,
            args.seconds,
        )
        result = run_load(
            "modelforge heartbeat",
            port,
            server.pid,
            path,
            "POST",
            bodies,
            headers,
            args.clients,
            args.seconds,
        )
    finally:
        for process in (server, floor):
            process.terminate()
            process.wait(timeout=10)
    print(floor_result.line())
    print(result.line())
    print(
        f"ratio to the floor: {result.rate / floor_result.rate:.2f}  "
        f"({args.nodes} nodes, {args.clients} clients, {args.threads} threads, "
        f"{args.seconds:.0f}s each)"
    )
    if result.errors:
        raise SystemExit(f"{result.errors} heartbeats failed")


if __name__ == "__main__":
    main()
