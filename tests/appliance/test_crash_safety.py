"""SIGKILL in the middle of enrollment and heartbeat load: nothing acknowledged is lost,
nothing half-written is visible, no heartbeat acknowledged before an admin read (which
flushes) goes missing, and the only heartbeats that can go missing at all are those
accepted within one flush interval of the newest acknowledged one.

Nothing here depends on how fast this machine is: the load runs until the server's own
timestamps show enough progress, and the heartbeat bound is checked against those
timestamps, never against the test's wall clock."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from dataclasses import replace
from datetime import datetime

import pytest
import requests

from modelforge_appliance.fleet.heartbeats import FLUSH_INTERVAL_SECONDS
from modelforge_appliance.store.tables import Node
from tests.harness.control_plane import new_identity

from .test_agent_auth import enroll_node
from .test_backup_restore import AGENT, Host

# A guard against a load that never starts (a broken server), not a measurement.
LOAD_PATIENCE_SECONDS = 180
# The load's heartbeat interval, and how far apart it sends one node's heartbeats: more than
# the half interval a node's heartbeats may be written at, so every one is held for the
# store (a faster one is answered without a write at all: fleet/heartbeats.py).
INTERVAL_SECONDS = 1
SPACING_SECONDS = 0.6


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Load:
    """Enrollments and heartbeats from several threads, remembering every acknowledgement."""

    def __init__(self, host: Host, tokens: list[str]) -> None:
        self.host, self.tokens = host, tokens
        self.enrolled: list[dict] = []
        self.last_ack: dict[str, float] = {}
        self.beaten: dict[str, float] = {}  # node id -> when the load last sent it one
        self.acks = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def heartbeat(self, node: dict) -> float | None:
        """One heartbeat; the server time it was acknowledged at, or None."""
        body = {
            "node_id": node["node_id"],
            "agent_version": "1",
            "health": {"status": "ok", "gpu_probe": "not_applicable"},
        }
        headers = {**AGENT, "Authorization": f"Bearer {node['credential']}"}
        response = requests.post(
            f"{self.host.url}/api/v1/agent/heartbeat", json=body, headers=headers, timeout=30
        )
        if response.status_code != 200:
            return None
        acked = epoch(response.json()["server_time"])
        with self.lock:
            self.last_ack[node["node_id"]] = acked
            self.acks += 1
        return acked

    def newest_ack(self) -> float:
        with self.lock:
            return max(self.last_ack.values(), default=0.0)

    def enroll_loop(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                if not self.tokens:
                    return
                token = self.tokens.pop()
            body = {
                "token": token,
                "hostname": f"gpu-{len(self.tokens)}",
                "agent_version": "1",
                "accelerator_mode": "cpu",
                "identity": new_identity(),
            }
            try:
                response = requests.post(
                    f"{self.host.url}/api/v1/agent/enroll", json=body, headers=AGENT, timeout=30
                )
            except requests.RequestException:
                return  # the server died under us: this one was never acknowledged
            if response.status_code == 201:
                with self.lock:
                    self.enrolled.append(response.json())

    def heartbeat_loop(self, offset: int) -> None:
        i = offset
        while not self.stop.is_set():
            with self.lock:
                nodes = list(self.enrolled)
            if not nodes:
                time.sleep(0.01)
                continue
            node = nodes[i % len(nodes)]
            i += 1
            with self.lock:
                now = time.monotonic()
                due = now - self.beaten.get(node["node_id"], -SPACING_SECONDS) >= SPACING_SECONDS
                if due:
                    self.beaten[node["node_id"]] = now
            if not due:
                if i % len(nodes) == 0:
                    time.sleep(0.005)  # every node beat recently
                continue
            try:
                self.heartbeat(node)
            except requests.RequestException:
                return


@pytest.mark.slow
def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path):
    host = Host(tmp_path)
    host.env["MODELFORGE_HEARTBEAT_INTERVAL_SECONDS"] = str(INTERVAL_SECONDS)
    load = Load(host, [])
    threads = [threading.Thread(target=load.enroll_loop) for _ in range(3)]
    threads += [threading.Thread(target=load.heartbeat_loop, args=(i,)) for i in range(3)]
    with host.serving() as server:
        # One node beats once and falls silent: by the kill its heartbeat is older than a
        # flush interval, so it must be in the store, however starved the flusher was.
        quiet = enroll(host, host.mint())
        quiet_ack = load.heartbeat(quiet)
        assert quiet_ack is not None
        load.tokens = [host.mint() for _ in range(150)]
        for thread in threads:
            thread.start()
        patience = time.monotonic() + LOAD_PATIENCE_SECONDS
        while not (
            len(load.enrolled) >= 10
            and load.acks >= 100
            and load.newest_ack() > quiet_ack + 2 * FLUSH_INTERVAL_SECONDS
        ):
            assert time.monotonic() < patience, "the load did not get going"
            assert server.poll() is None, host.log.read_text()
            time.sleep(0.05)
        # Readers of liveness flush first: every heartbeat acknowledged before this admin
        # read was answered is in the store.
        with load.lock:
            flushed = dict(load.last_ack)
        nodes = requests.get(
            f"{host.url}/api/v1/admin/hardware/nodes", headers=host.admin, timeout=30
        )
        assert nodes.status_code == 200
        server.send_signal(signal.SIGKILL)
        killed_at = time.time()
        server.wait(timeout=10)
        load.stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert len(load.enrolled) >= 10 and len(load.last_ack) >= 5

    db = sqlite3.connect(tmp_path / "state" / "modelforge.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    # Nothing half-written: every consumed token names its node, every node has exactly one
    # active credential and its claim in the audit trail.
    assert db.execute(
        "SELECT COUNT(*) FROM enrollment_token WHERE consumed_at IS NOT NULL AND node_id IS NULL"
    ).fetchone() == (0,)
    per_node = db.execute(
        "SELECT n.node_id, COUNT(c.credential_id) FROM node n LEFT JOIN "
        "credential c ON c.node_id = n.node_id AND c.revoked_at IS NULL "
        "GROUP BY n.node_id"
    ).fetchall()
    assert per_node and all(count == 1 for _, count in per_node)
    claims = {
        row[0]
        for row in db.execute("SELECT node_id FROM audit_event WHERE action = 'enrollment.claimed'")
    }
    assert claims == {node_id for node_id, _ in per_node}
    stored = dict(db.execute("SELECT node_id, last_heartbeat_at FROM node"))
    db.close()
    # Nothing acknowledged before the admin read is lost (answers carry milliseconds).
    assert flushed, "no heartbeat was acknowledged before the admin read"
    for node_id, acked in flushed.items():
        assert stored[node_id] is not None and stored[node_id] >= acked - 0.001
    # Only heartbeats accepted within one flush interval of the newest acknowledged one can
    # be lost: every older acknowledgement is in the store (server timestamps only).
    newest = load.newest_ack()
    # (server_time is shown in milliseconds, truncated: the stored value is not below it)
    assert quiet_ack <= stored[quiet["node_id"]] < quiet_ack + 0.001
    for node_id, acked in load.last_ack.items():
        assert acked <= killed_at
        if acked <= newest - FLUSH_INTERVAL_SECONDS:
            assert stored[node_id] is not None and stored[node_id] >= acked, node_id

    with host.serving():
        # Every acknowledged enrollment exists, with a credential that works.
        for node in load.enrolled:
            assert host.publish(node) == 200, node["node_id"]


def enroll(host: Host, token: str) -> dict:
    body = {
        "token": token,
        "hostname": "gpu-quiet",
        "agent_version": "1",
        "accelerator_mode": "cpu",
        "identity": new_identity(),
    }
    response = requests.post(
        f"{host.url}/api/v1/agent/enroll", json=body, headers=AGENT, timeout=30
    )
    assert response.status_code == 201, response.text
    return response.json()


def stored_heartbeat(cp, node: dict) -> float | None:
    with cp.store.connection():
        return Node.get_by_id(node["node_id"]).last_heartbeat_at


def test_heartbeat_bound_holds_without_the_flusher_thread(clocked_control_plane, clock):
    """The flusher thread may never get the CPU: the deadline alone keeps the bound."""
    cp = clocked_control_plane
    cp.heartbeats.stop()  # as if starved for good: from here only the deadline writes
    first, second = enroll_node(cp), enroll_node(cp, hostname="gpu-node-2")
    before = stored_heartbeat(cp, first)

    answer = cp.heartbeat(first["credential"], first["node_id"])
    assert answer.status_code == 200
    first_at = epoch(answer.json()["server_time"])
    clock.advance(FLUSH_INTERVAL_SECONDS / 2)
    assert cp.heartbeat(second["credential"], second["node_id"]).status_code == 200
    # Within the interval the first may stay in memory (that is the batching)...
    assert stored_heartbeat(cp, first) == before
    clock.advance(FLUSH_INTERVAL_SECONDS / 2)
    # ...but a heartbeat a full interval younger is not acknowledged before it is written.
    assert cp.heartbeat(second["credential"], second["node_id"]).status_code == 200
    assert stored_heartbeat(cp, first) == first_at
    assert stored_heartbeat(cp, second) is not None


def test_a_batch_the_store_refuses_is_dropped_not_retried_forever(sqlite_control_plane):
    """A heartbeat batch the store refused stayed in the buffer and was retried on every
    flush, forever, so no later heartbeat of any node was written: it is dropped (and
    logged), and the next batch is written."""
    cp = sqlite_control_plane
    node = enroll_node(cp)
    assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
    # Whatever makes the store refuse a batch, later batches must still be written.
    buffer = cp.heartbeats
    poisoned = next(iter(buffer._pending.values()))
    buffer._pending[node["node_id"]] = replace(poisoned, health=object())
    assert buffer.flush() == 1  # dropped, logged
    assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
    assert buffer.flush() == 1
    with cp.store.connection():
        assert Node.get_by_id(node["node_id"]).last_heartbeat_at is not None
