"""One node's credential cannot flood the store, the server's memory or a node page (issue 21).

An agent-shaped client with a real enrolled credential (tests/harness/scripted_node.py)
talks to a real waitress server over a real store; the control plane's clock is the test's,
so "fast" and "slow" are what the test says they are, never what the machine managed.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from modelforge_appliance.fleet import alerts, telemetry
from modelforge_appliance.fleet.heartbeats import WRITE_BURST
from modelforge_appliance.identity.credentials import Caller
from modelforge_appliance.store.tables import GpuSample, Node, TelemetryFlood
from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION
from tests.harness.control_plane import error_code, serve
from tests.harness.scripted_node import WorkNode, gpu

TELEMETRY = "/api/v1/agent/telemetry"
HEARTBEAT = "/api/v1/agent/heartbeat"
NODES = "/api/v1/admin/hardware/nodes"


class Agent(WorkNode):
    """A scripted node that also publishes telemetry, over one keep-alive connection."""

    def __init__(self, cp, hostname: str, gpus: int = 8) -> None:
        super().__init__(cp, hostname, [gpu(i) for i in range(gpus)])
        self.session = requests.Session()
        self.session.headers.update(
            {
                HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
                "Authorization": f"Bearer {self.credential}",
            }
        )

    def sample(self, accelerator: dict, step: int = 0) -> dict:
        return {
            "uuid": accelerator["uuid"],
            "index": accelerator["index"],
            "utilization_gpu_percent": step % 101,
            "memory_used_bytes": 2**30,
            "memory_total_bytes": accelerator["memory_total_bytes"],
            "temperature_c": 50,
            "power_w": 300.5,
        }

    def telemetry(self, samples: list[dict] | None = None, step: int = 0) -> requests.Response:
        if samples is None:
            samples = [self.sample(a, step) for a in self.gpus]
        body = {"node_id": self.node_id, "samples": samples}
        return self.session.post(self.cp.url + TELEMETRY, json=body, timeout=30)

    def beat(self) -> requests.Response:
        health = {"status": "ok", "gpu_probe": "ok"}
        body = {"node_id": self.node_id, "agent_version": "0.1.0", "health": health}
        return self.session.post(self.cp.url + HEARTBEAT, json=body, timeout=30)


def stored_samples(cp, node_id: str) -> list[GpuSample]:
    with cp.store.connection():
        return list(GpuSample.select().where(GpuSample.node_id == node_id).order_by(GpuSample.at))


def metric(cp, name: str, **labels: str) -> float | None:
    text = cp.admin("GET", "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def store_bytes(cp) -> int:
    path = Path(cp.store.sqlite_path)
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def floods(cp) -> list[dict]:
    answer = cp.admin("GET", "/api/v1/admin/alerts")
    assert answer.status_code == 200, answer.text
    return [a for a in answer.json()["alerts"] if a["kind"] == "telemetry_flood"]


# -- telemetry: the rate -----------------------------------------------------------------------


def test_a_telemetry_flood_keeps_only_the_rate_and_raises_one_alert(clocked_control_plane, clock):
    cp = clocked_control_plane
    node = Agent(cp, "gpu-flood").ready()
    quiet = Agent(cp, "gpu-quiet").ready()
    interval = cp.settings.telemetry_min_interval_seconds
    began = clock.now()
    flood = 400
    answers = [node.telemetry(step=n) for n in range(flood)]  # all at one instant
    assert {a.status_code for a in answers} == {200}
    stored = [a.json()["stored"] for a in answers]
    assert stored == [True] * telemetry.TELEMETRY_BURST + [False] * (
        flood - telemetry.TELEMETRY_BURST
    )
    assert all("server_time" in a.json() and a.json()["compatibility"] for a in answers)
    # Only the burst reached the store: 3 publications × 8 GPUs, not 400 × 8.
    assert len(stored_samples(cp, node.node_id)) == telemetry.TELEMETRY_BURST * 8
    dropped = flood - telemetry.TELEMETRY_BURST

    # The cost is counted: in the node's detail, in the metrics, as one alert.
    detail = cp.admin("GET", f"{NODES}/{node.node_id}").json()["telemetry_dropped"]
    assert detail["publications"] == dropped and detail["samples"] == dropped * 8
    assert detail["flooding_since"] is not None
    assert metric(cp, "modelforge_telemetry_dropped_samples_total", node_id=node.node_id) == (
        dropped * 8
    )
    [alert] = floods(cp)
    assert alert["node_id"] == node.node_id and alert["severity"] == "warning"
    assert alert["since"] == detail["flooding_since"]
    # The command line reads the same store (modelforge alerts).
    [same] = [
        a for a in alerts.active_alerts(cp.store, cp.settings) if a["kind"] == "telemetry_flood"
    ]
    assert same["node_id"] == node.node_id

    # Keeping up the flood keeps one alert; one publication per interval is still kept.
    for second in range(1, 31):
        clock.advance(1)
        kept = [node.telemetry(step=n).json()["stored"] for n in range(5)]
        assert kept.count(True) == (1 if second % interval == 0 else 0), second
    assert len(stored_samples(cp, node.node_id)) == (telemetry.TELEMETRY_BURST + 30 // interval) * 8
    [alert] = floods(cp)
    assert alert["since"] == detail["flooding_since"]
    with cp.store.connection():
        record = TelemetryFlood.get_by_id(node.node_id)
    assert record.since == began
    assert record.dropped_publications >= dropped  # later drops ride on kept publications

    # Back at the agent's own pace (15 s), the alert clears; the count stays.
    for _ in range(6):
        clock.advance(15)
        assert node.telemetry().json()["stored"] is True
    assert floods(cp) == []
    detail = cp.admin("GET", f"{NODES}/{node.node_id}").json()["telemetry_dropped"]
    assert detail["flooding_since"] is None and detail["publications"] == dropped + 30 * 5 - 6
    # The other node was never touched by its neighbour's flood.
    assert quiet.telemetry().json()["stored"] is True
    assert cp.admin("GET", f"{NODES}/{quiet.node_id}").json()["telemetry_dropped"] == {
        "publications": 0,
        "samples": 0,
        "last_at": None,
        "flooding_since": None,
    }


def test_a_flood_grows_the_store_file_by_a_bounded_amount(sqlite_settings, clock, capsys):
    with serve(sqlite_settings, clock) as cp:
        node = Agent(cp, "gpu-flood").ready()
        assert node.telemetry().json()["stored"] is True
        with cp.store.connection():
            cp.store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        before = store_bytes(cp)
        for _ in range(60):  # a minute of 50 publications a second
            for n in range(50):
                assert node.telemetry(step=n).status_code == 200
            clock.advance(1)
        grown = store_bytes(cp) - before
        rows = len(stored_samples(cp, node.node_id))
    with capsys.disabled():
        print(f"\n3,000 publications × 8 GPUs in a minute: {rows} rows, store +{grown} bytes")
    # The burst (one spent before), then one every 5 s of the 59 that passed.
    assert rows == (telemetry.TELEMETRY_BURST + 59 // 5) * 8
    # Fifteen small transactions (each a few WAL pages), not 3,000.
    assert grown < 1024 * 1024, grown


# -- telemetry: only the inventory's GPUs ------------------------------------------------------


def test_telemetry_for_gpus_outside_the_inventory_is_refused(clocked_control_plane):
    cp = clocked_control_plane
    node = Agent(cp, "gpu-a", gpus=2)
    before_inventory = node.telemetry()
    assert before_inventory.status_code == 400
    assert error_code(before_inventory) == "TELEMETRY_GPU_UNKNOWN"
    node.ready()
    good = [node.sample(a) for a in node.gpus]
    stranger = {**good[0], "uuid": "GPU-not-in-the-inventory", "index": 7}
    for samples, code in (
        ([*good, stranger], "TELEMETRY_GPU_UNKNOWN"),
        ([good[0], good[0]], "TELEMETRY_GPU_DUPLICATE"),
        ([{**good[0], "uuid": good[0]["uuid"].lower()}], "TELEMETRY_GPU_UNKNOWN"),
    ):
        refused = node.telemetry(samples)
        assert refused.status_code == 400, refused.text
        assert error_code(refused) == code
        assert "samples[" in refused.json()["error"]["message"]
    # Nothing stored, nothing counted against the rate.
    assert stored_samples(cp, node.node_id) == []
    with cp.store.connection():
        assert Node.get_by_id(node.node_id).telemetry is None
    assert [node.telemetry(good).json()["stored"] for _ in range(3)] == [True] * 3
    # A cpu node's inventory has no GPU: it may publish no telemetry at all.
    enrolled = cp.enroll(cp.mint("cpu")["token"], hostname="cpu-a").json()
    body = {"node_id": enrolled["node_id"], "samples": [good[0]]}
    cpu = cp.agent("POST", TELEMETRY, enrolled["credential"], json=body)
    assert cpu.status_code == 400 and error_code(cpu) == "TELEMETRY_GPU_UNKNOWN"


# -- telemetry: the size cap -------------------------------------------------------------------


@pytest.fixture
def capped(settings, clock):
    cap = 1000
    with serve(
        replace(settings, telemetry_max_samples_per_node=cap, telemetry_retention_seconds=86400),
        clock,
    ) as cp:
        yield cp


def test_the_size_cap_keeps_each_nodes_newest_samples(capped, clock):
    cp, cap = capped, capped.settings.telemetry_max_samples_per_node
    node, neighbour = Agent(capped, "gpu-big").ready(), Agent(capped, "gpu-small").ready()
    assert neighbour.telemetry().json()["stored"] is True
    published = []
    for step in range(400):  # 3,200 samples, well within the retention
        clock.advance(cp.settings.telemetry_min_interval_seconds)
        published.append(clock.now())
        assert node.telemetry(step=step).json()["stored"] is True
        if step % 10 == 9:
            assert len(stored_samples(cp, node.node_id)) <= cap, step
    rows = stored_samples(cp, node.node_id)
    assert cap - cap // 10 <= len(rows) <= cap
    # Oldest first: what is left is exactly the newest publications, every GPU of each.
    kept = sorted({row.at for row in rows})
    assert kept == published[-len(kept) :]
    assert all(sum(1 for row in rows if row.at == at) == 8 for at in kept)
    # The cap is per node: the neighbour's old samples are untouched.
    assert len(stored_samples(cp, neighbour.node_id)) == 8


def test_after_a_restart_a_node_over_the_cap_is_trimmed_within_a_tenth(capped, clock):
    cp, cap = capped, capped.settings.telemetry_max_samples_per_node
    node = Agent(capped, "gpu-big").ready()
    caller = Caller(node.credential, node.node_id, "nvidia")
    samples = [node.sample(a) for a in node.gpus]
    # Another process's history (a restart forgets the counts) filled the node past its cap.
    earlier = telemetry.TelemetryHistory(cp.store, cp.settings)
    earlier._estimates[node.node_id] = -(10**9)  # never counted: it wrote blindly
    for _ in range(200):
        clock.advance(5)
        earlier.record(caller, samples)
    assert len(stored_samples(cp, node.node_id)) == 1600
    highest = 0
    for step in range(cap // 10 // 8 + 1):
        clock.advance(5)
        assert node.telemetry(step=step).json()["stored"] is True
        highest = max(highest, len(stored_samples(cp, node.node_id)))
    assert len(stored_samples(cp, node.node_id)) <= cap
    assert highest <= 1600 + cap // 10 + 8


# -- the history answer ------------------------------------------------------------------------


def test_the_history_answer_is_bounded_whatever_was_stored(clocked_control_plane, clock, capsys):
    cp = clocked_control_plane
    node = Agent(cp, "gpu-a", gpus=8).ready()
    now = clock.now()
    points = telemetry.HISTORY_MAX_POINTS
    # Four samples in every slice of the hour, for each of 8 GPUs, plus 100 GPUs long gone.
    width = telemetry.DEFAULT_WINDOW_SECONDS / points
    rows = [
        {
            "node_id": node.node_id,
            "gpu_uuid": a["uuid"],
            "gpu_index": a["index"],
            "at": now - telemetry.DEFAULT_WINDOW_SECONDS + (s + 0.5) * width / 4,
            "utilization_gpu_percent": 10 * (s % 4),  # 0, 10, 20, 30: a mean of 15
            "memory_used_bytes": 2**30,
            "memory_total_bytes": 80 * 2**30,
            "temperature_c": 50,
            "power_w": 100.0 + s % 2,
        }
        for a in node.gpus
        for s in range(4 * points)
    ]
    rows += [
        {
            "node_id": node.node_id,
            "gpu_uuid": f"GPU-gone-{g:03d}",
            "gpu_index": 100 + g,
            "at": now - 3000 + g,
            "memory_used_bytes": 1,
        }
        for g in range(100)
    ]
    with cp.store.write():
        for start in range(0, len(rows), 500):
            GpuSample.insert_many(rows[start : start + 500]).execute()
    answer = cp.admin("GET", f"{NODES}/{node.node_id}/telemetry")
    assert answer.status_code == 200
    body = answer.json()
    with capsys.disabled():
        print(f"\n{len(rows)} stored samples: a {len(answer.content)}-byte answer")
    assert body["max_points"] == points
    assert len(body["gpus"]) == telemetry.HISTORY_MAX_GPUS
    assert body["gpus_left_out"] == 8 + 100 - telemetry.HISTORY_MAX_GPUS
    charted = [g for g in body["gpus"] if g["uuid"].startswith("GPU-0")]
    assert len(charted) == 8  # the GPUs seen last are kept
    for gpu_history in charted:
        assert len(gpu_history["samples"]) == points
        assert {s["utilization_gpu_percent"] for s in gpu_history["samples"]} == {15}
        assert {s["power_w"] for s in gpu_history["samples"]} == {100.5}
        assert {s["memory_total_bytes"] for s in gpu_history["samples"]} == {80 * 2**30}
        stamps = [s["at"] for s in gpu_history["samples"]]
        assert stamps == sorted(stamps)
    assert len(answer.content) < 1024 * 1024
    # Any window: never more than the bound per GPU.
    since = int(now) - 86400
    day = cp.admin("GET", f"{NODES}/{node.node_id}/telemetry?since={since}").json()
    assert max(len(g["samples"]) for g in day["gpus"]) <= points


# -- heartbeats --------------------------------------------------------------------------------


@contextlib.contextmanager
def heartbeat_writes(cp):
    """Counts, in the store itself, every UPDATE that moves a node's last heartbeat."""
    conn = sqlite3.connect(cp.store.sqlite_path, timeout=30)
    try:
        conn.executescript(
            "CREATE TABLE test_beat_write (node_id TEXT, at REAL);"
            "CREATE TRIGGER test_count_beats AFTER UPDATE OF last_heartbeat_at ON node "
            "BEGIN INSERT INTO test_beat_write VALUES (NEW.node_id, NEW.last_heartbeat_at); END;"
        )

        def count(node_id: str) -> int:
            cp.heartbeats.flush()
            sql = "SELECT COUNT(*) FROM test_beat_write WHERE node_id = ?"
            return conn.execute(sql, (node_id,)).fetchone()[0]

        yield count
    finally:
        conn.close()


def test_a_heartbeat_flood_is_answered_without_a_write_each(sqlite_settings, clock, capsys):
    with serve(sqlite_settings, clock) as cp:
        interval = cp.settings.heartbeat_interval_seconds
        node, steady = Agent(cp, "gpu-flood"), Agent(cp, "gpu-steady")
        with heartbeat_writes(cp) as writes:
            beats, step = 3000, 0.02  # 3,000 heartbeats over one simulated minute
            for _ in range(beats):
                answer = node.beat()
                assert answer.status_code == 200
                clock.advance(step)
            body = answer.json()
            assert body["heartbeat_interval_seconds"] == interval
            assert body["compatibility"] == "COMPATIBLE" and "server_time" in body
            flood_writes = writes(node.node_id)
            # A burst, then one every half interval: not one per heartbeat, nor per second.
            assert flood_writes <= WRITE_BURST + beats * step / (interval / 2) + 1, flood_writes
            # Liveness is unchanged: the flooding node reads online, its stored heartbeat at
            # most half an interval behind its newest.
            view = cp.admin("GET", f"{NODES}/{node.node_id}").json()
            assert view["liveness"] == "online"
            with cp.store.connection():
                last = Node.get_by_id(node.node_id).last_heartbeat_at
            assert clock.now() - last <= interval / 2 + step
            held = beats - metric(cp, "modelforge_heartbeats_unwritten_total")
            assert flood_writes <= held <= WRITE_BURST + beats * step / (interval / 2) + 1
            # An agent keeping its interval has every heartbeat written.
            for n in range(1, 11):
                assert steady.beat().status_code == 200
                assert writes(steady.node_id) == n
                clock.advance(interval)
    with capsys.disabled():
        print(f"\n{beats} heartbeats in a simulated minute: {flood_writes} heartbeat writes")
