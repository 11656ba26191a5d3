"""A fleet against the real ``modelforge serve``: 1,000 simulated agents, each with its own
keep-alive connection, heartbeating on a compressed interval, while 100 sockets trickle
headers and 100 more say nothing.

The interval is compressed from 10 s to 5 s: 200 heartbeats a second, a fifth of what
bench/heartbeat.py measures on two cores, so a busy machine still has every heartbeat's
whole interval to answer it. The test counts outcomes; it never asserts a latency.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import requests

from bench._fleet import enroll_fleet, mint_tokens, raise_file_limit, run_fleet
from tests.harness.control_plane import free_port, wait_until_answering

AGENTS = 1000
INTERVAL = 5.0
ROUNDS = 4
TRICKLERS = 100
IDLE = 100


@pytest.mark.slow
def test_a_thousand_agents_beside_two_hundred_hostile_sockets(tmp_path):
    raise_file_limit(4096)  # 1,200 client sockets here; the server raises its own
    port = free_port()
    state = tmp_path / "state"
    env = {
        "PATH": "/usr/bin:/bin",
        "MODELFORGE_STATE_DIR": str(state),
        "MODELFORGE_LOG_LEVEL": "WARNING",
        "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": str(int(INTERVAL)),
        "MODELFORGE_NODE_STALE_AFTER_SECONDS": str(int(3 * INTERVAL)),
        "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": str(int(6 * INTERVAL)),
        "MODELFORGE_IDLE_TIMEOUT_SECONDS": str(int(4 * INTERVAL)),
        "MODELFORGE_REQUEST_TIMEOUT_SECONDS": "2",
        "MODELFORGE_CONNECTION_LIMIT": "3000",
        # Every simulated agent, and every hostile socket, comes from 127.0.0.1: one address
        # may hold them all here (test_connections.py tests the per-address share).
        "MODELFORGE_CONNECTIONS_PER_ADDRESS": "3000",
    }
    cli = [sys.executable, "-m", "modelforge_appliance.cli"]
    admin = json.loads(
        subprocess.run(
            [*cli, "init", "--json"], env=env, capture_output=True, text=True, check=True
        ).stdout
    )["admin_token"]
    origin = f"http://127.0.0.1:{port}"
    tokens = mint_tokens(f"sqlite:///{state}/modelforge.sqlite3", origin, AGENTS)
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*cli, "serve", "--listen", f"127.0.0.1:{port}"], env=env, stdout=log, stderr=log
        )
    try:
        wait_until_answering(f"{origin}/healthz", server, log_path)
        nodes = asyncio.run(enroll_fleet(port, tokens))
        assert len(nodes) == AGENTS
        result = asyncio.run(
            run_fleet(port, nodes, INTERVAL, ROUNDS, tricklers=TRICKLERS, idle=IDLE)
        )
        fleet = requests.get(
            f"{origin}/api/v1/admin/hardware/nodes",
            headers={"X-ModelForge-Admin-Token": admin},
            timeout=30,
        ).json()["nodes"]
        metrics = requests.get(
            f"{origin}/metrics", headers={"X-ModelForge-Admin-Token": admin}, timeout=30
        ).text
    finally:
        server.terminate()
        server.wait(timeout=30)

    summary = (
        f"{result.in_time}/{result.total} in time, {result.late} late, {result.failed} failed, "
        f"{result.reconnects} reconnects, p99 {result.percentile(0.99):.0f} ms; "
        f"{result.failures[:5]}\n{log_path.read_text()[-2000:]}"
    )
    assert result.total == AGENTS * ROUNDS, summary
    assert result.in_time_ratio >= 0.999, summary
    assert result.reconnects <= AGENTS * ROUNDS * 0.001, summary
    assert len(fleet) == AGENTS
    assert {node["liveness"] for node in fleet} == {"online"}, summary
    # The hostile sockets were there all along, and were cut off, not served for ever.
    assert all(cuts >= 1 for cuts in result.tricklers_cut), result.tricklers_cut
    assert all(closes >= 1 for closes in result.idle_closed), result.idle_closed
    assert 'modelforge_connections_closed_total{reason="request_timeout"}' in metrics
