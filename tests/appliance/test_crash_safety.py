"""SIGKILL in the middle of enrollment and heartbeat load: nothing acknowledged is lost,
nothing half-written is visible, and no heartbeat acknowledged before a flush goes missing."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from datetime import datetime

import requests

from ..support import new_identity
from .test_backup_restore import AGENT, Host


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Load:
    """Enrollments and heartbeats from several threads, remembering every acknowledgement."""

    def __init__(self, host: Host, tokens: list[str]) -> None:
        self.host, self.tokens = host, tokens
        self.enrolled: list[dict] = []
        self.last_ack: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

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
                    f"{self.host.url}/api/v1/agent/enroll", json=body, headers=AGENT, timeout=5
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
            body = {
                "node_id": node["node_id"],
                "agent_version": "1",
                "health": {"status": "ok", "gpu_probe": "not_applicable"},
            }
            headers = {**AGENT, "Authorization": f"Bearer {node['credential']}"}
            try:
                response = requests.post(
                    f"{self.host.url}/api/v1/agent/heartbeat", json=body, headers=headers, timeout=5
                )
            except requests.RequestException:
                return
            if response.status_code == 200:
                with self.lock:
                    self.last_ack[node["node_id"]] = epoch(response.json()["server_time"])


def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path):
    host = Host(tmp_path)
    load = Load(host, [])
    threads = [threading.Thread(target=load.enroll_loop) for _ in range(3)]
    threads += [threading.Thread(target=load.heartbeat_loop, args=(i,)) for i in range(3)]
    with host.serving() as server:
        load.tokens = [host.mint() for _ in range(150)]
        for thread in threads:
            thread.start()
        time.sleep(2.5)
        # Readers of liveness flush first: every heartbeat acknowledged before this admin
        # read was answered is in the store. Later ones may die with the process (at most a
        # flush interval of them, but how long a flush takes depends on the machine's load).
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
            thread.join(timeout=10)
    assert len(load.enrolled) >= 10 and len(load.last_ack) >= 5, "the load did not get going"

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
    # Nothing acknowledged before the last flush is lost (answers carry milliseconds).
    stored = dict(db.execute("SELECT node_id, last_heartbeat_at FROM node"))
    db.close()
    assert flushed, "no heartbeat was acknowledged before the admin read"
    for node_id, acked in flushed.items():
        assert stored[node_id] is not None and stored[node_id] >= acked - 0.001
    for acked in load.last_ack.values():
        assert acked <= killed_at

    with host.serving():
        # Every acknowledged enrollment exists, with a credential that works.
        for node in load.enrolled:
            assert host.publish(node) == 200, node["node_id"]
