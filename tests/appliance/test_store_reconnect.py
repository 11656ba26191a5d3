"""A PostgreSQL restart, or a backend killed under it, costs each thread of the control plane
at most one failed call: the store replaces a connection the server dropped before reusing
it, the heartbeat flusher recovers by itself, nothing acknowledged is lost, and nobody has
to call /healthz for any of it.

The server here is the test's own (tests/harness/private_postgres.py), so restarting it
disturbs no other test. One serving thread makes the order of calls the order of requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg2
import pytest

from modelforge_appliance.core.clock import isoformat
from modelforge_contract import PATH_ADMIN_NODES
from tests.harness.control_plane import ControlPlane, make_settings, serve
from tests.harness.private_postgres import PrivatePostgres, private_postgres

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres():
    with private_postgres() as server:
        yield server


def terminate_backends(server: PrivatePostgres) -> None:
    conn = psycopg2.connect(server.url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND datname IS NOT NULL"
            )
            assert cur.fetchone()[0] >= 2  # the serving thread's and the flusher's
    finally:
        conn.close()


def stored_heartbeat(server: PrivatePostgres, node_id: str) -> float | None:
    conn = psycopg2.connect(server.url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT last_heartbeat_at FROM node WHERE node_id = %s", (node_id,))
            return cur.fetchone()[0]
    finally:
        conn.close()


def through_an_outage(
    tmp_path, server: PrivatePostgres, outage: Callable[[PrivatePostgres], None]
) -> tuple[list[int], ControlPlane]:
    settings = make_settings(
        tmp_path / "state",
        server.url,
        threads=1,
        heartbeat_interval_seconds=1,
    )
    with serve(settings) as cp:
        enrolled = cp.enroll(cp.mint()["token"])
        assert enrolled.status_code == 201, enrolled.text
        node_id, credential = enrolled.json()["node_id"], enrolled.json()["credential"]

        def call(index: int) -> int:
            if index % 2:
                return cp.admin("GET", PATH_ADMIN_NODES).status_code
            return cp.heartbeat(credential, node_id).status_code

        before = [call(i) for i in range(6)]
        assert before == [200] * 6
        cp.heartbeats.flush()  # the flusher's work, so both threads hold a connection
        outage(server)
        after = []
        acknowledged = None
        for index in range(10):
            if index % 2:
                after.append(cp.admin("GET", PATH_ADMIN_NODES).status_code)
                continue
            # A node's heartbeats are written at most every half interval (a faster one is
            # answered and not written): these come slower, so each one answered is written.
            time.sleep(0.6)
            beat = cp.heartbeat(credential, node_id)
            after.append(beat.status_code)
            if beat.status_code == 200:
                acknowledged = beat.json()["server_time"]
        # The flusher thread writes what was acknowledged on its own (the test only waits).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stored = stored_heartbeat(server, node_id)
            if stored is not None and isoformat(stored) == acknowledged:
                break
            time.sleep(0.2)
        assert isoformat(stored_heartbeat(server, node_id)) == acknowledged
        return after, cp


@pytest.mark.parametrize(
    "outage",
    [terminate_backends, PrivatePostgres.restart],
    ids=["pg_terminate_backend", "pg_ctl restart -m fast"],
)
def test_each_thread_fails_at_most_one_call_and_nothing_acknowledged_is_lost(
    tmp_path, postgres, outage, caplog
):
    after, _ = through_an_outage(tmp_path, postgres, outage)
    # The serving thread: its first call after the outage may fail (503), none after it.
    assert after[0] in (200, 503)
    assert after[1:] == [200] * (len(after) - 1), after
    assert "reconnecting" in caplog.text or after[0] == 503
