"""1,000 concurrent claims of one enrollment token, from separate processes, against
``modelforge serve`` on SQLite and on PostgreSQL: exactly one may win.

    .venv/bin/python bench/enroll_contention.py [--claims 1000] [--postgres-url URL]

PostgreSQL runs when --postgres-url (or MF_TEST_POSTGRES_URL, which scripts/test sets)
names a server; each run uses a fresh database on it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import secrets
import subprocess
import time
from urllib.parse import urlsplit, urlunsplit

from _load import (
    json_body,
    modelforge,
    modelforge_env,
    start_modelforge,
    temp_state,
    wait_until_serving,
)


def claim(port: int, token: str, index: int, barrier, results) -> None:
    body = json_body(
        {
            "token": token,
            "hostname": f"racer-{index}",
            "agent_version": "bench",
            "accelerator_mode": "cpu",
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.connect()
    barrier.wait(timeout=120)
    began = time.perf_counter()
    conn.request(
        "POST",
        "/api/v1/agent/enroll",
        body=body,
        headers={"Content-Type": "application/json", "X-ModelForge-Agent-Protocol": "1"},
    )
    response = conn.getresponse()
    answer = json.loads(response.read())
    code = answer.get("error", {}).get("code")
    results.put((response.status, code, (time.perf_counter() - began) * 1000))


def run(label: str, claims: int, database_url: str | None) -> None:
    extra = {"MODELFORGE_DATABASE_URL": database_url} if database_url else {}
    env = modelforge_env(temp_state(), **extra)
    admin = json.loads(modelforge(env, "init", "--json"))["admin_token"]
    port, server = start_modelforge(env, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(port, server)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request(
            "POST",
            "/api/v1/admin/node-enrollments",
            body=json_body({"display_name": "race", "expires_in_seconds": 900}),
            headers={"X-ModelForge-Admin-Token": admin, "Content-Type": "application/json"},
        )
        token = json.loads(conn.getresponse().read())["token"]
        context = multiprocessing.get_context("fork")
        barrier, results = context.Barrier(claims + 1), context.Queue()
        workers = [
            context.Process(target=claim, args=(port, token, i, barrier, results))
            for i in range(claims)
        ]
        for worker in workers:
            worker.start()
        barrier.wait(timeout=120)
        began = time.perf_counter()
        outcomes = [results.get(timeout=300) for _ in workers]
        total = time.perf_counter() - began
        for worker in workers:
            worker.join()
        conn.request(
            "GET", "/api/v1/admin/hardware/nodes", headers={"X-ModelForge-Admin-Token": admin}
        )
        nodes = json.loads(conn.getresponse().read())["nodes"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    winners = [o for o in outcomes if o[0] == 201]
    refusals = sorted(ms for status, _, ms in outcomes if status != 201)
    codes = sorted({code for _, code, _ in outcomes if code})
    p = lambda q: refusals[min(len(refusals) - 1, int(len(refusals) * q))]  # noqa: E731
    print(
        f"{label:10} {claims} claims in {total:.2f}s: {len(winners)} winner, "
        f"{len(refusals)} refused {codes}, {len(nodes)} node(s); refusal latency "
        f"p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {refusals[-1]:.1f} ms"
    )
    if len(winners) != 1 or len(nodes) != 1:
        raise SystemExit(f"{label}: expected exactly one winner and one node")


def on_fresh_postgres(url: str, claims: int) -> None:
    """Run against a new database on the server, dropped afterwards."""
    import psycopg2

    name = f"mf_bench_{secrets.token_hex(4)}"
    conn = psycopg2.connect(url)
    conn.autocommit = True
    try:
        conn.cursor().execute(f'CREATE DATABASE "{name}"')
        run("PostgreSQL", claims, urlunsplit(urlsplit(url)._replace(path=f"/{name}")))
    finally:
        conn.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--postgres-url", default=os.environ.get("MF_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    run("SQLite", args.claims, None)
    if args.postgres_url:
        on_fresh_postgres(args.postgres_url, args.claims)
    else:
        print("PostgreSQL: skipped (no --postgres-url or MF_TEST_POSTGRES_URL)")


if __name__ == "__main__":
    main()
