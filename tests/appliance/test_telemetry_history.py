"""Telemetry history for the console's charts: the endpoint, and retention that stays bounded.

The load runs on the injectable clock: an hour of publications takes no hour.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.fleet import telemetry
from modelforge_appliance.identity.credentials import Caller
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import GpuSample
from tests.harness.control_plane import error_code


def sample(index: int, utilization: int, uuid_prefix: str = "GPU") -> dict:
    return {
        "uuid": f"{uuid_prefix}-{index}",
        "index": index,
        "utilization_gpu_percent": utilization,
        "memory_used_bytes": 1000 * (index + 1),
        "memory_total_bytes": 80 * 2**30,
        "temperature_c": 40 + index,
        "power_w": 100.5 + index,
    }


def accelerator(index: int, uuid_prefix: str = "GPU") -> dict:
    return {
        "index": index,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"{uuid_prefix}-{index}",
        "memory_total_bytes": 80 * 2**30,
        "driver_version": "550.54.15",
        "pci_bus_id": f"00000000:{index + 16:02x}:00.0",
    }


def publish_inventory(cp, node_id: str, credential: str, gpus: int, uuid_prefix="GPU") -> None:
    accelerators = [accelerator(i, uuid_prefix) for i in range(gpus)]
    body = {"node_id": node_id, "agent_version": "0.1.0", "accelerators": accelerators}
    response = cp.agent("PUT", "/api/v1/agent/inventory", credential, json=body)
    assert response.status_code == 200, response.text


def test_history_answers_each_gpus_samples_since_a_time(clocked_control_plane, clock):
    cp = clocked_control_plane
    enrolled = cp.enroll(cp.mint()["token"], accelerator_mode="nvidia").json()
    node_id, credential = enrolled["node_id"], enrolled["credential"]
    publish_inventory(cp, node_id, credential, gpus=2)
    start = clock.now()
    for step in range(4):
        published = cp.agent(
            "POST",
            "/api/v1/agent/telemetry",
            credential,
            json={"node_id": node_id, "samples": [sample(1, step * 10), sample(0, step)]},
        )
        assert published.status_code == 200, published.text
        clock.advance(10)
    path = f"/api/v1/admin/hardware/nodes/{node_id}/telemetry"
    recent = cp.admin("GET", f"{path}?since={int(start) + 15}").json()
    assert recent["node_id"] == node_id
    assert [gpu["uuid"] for gpu in recent["gpus"]] == ["GPU-0", "GPU-1"]  # by index
    gpu1 = recent["gpus"][1]
    assert gpu1["index"] == 1
    assert [s["utilization_gpu_percent"] for s in gpu1["samples"]] == [20, 30]
    first = gpu1["samples"][0]
    assert set(first) >= {
        "at",
        "utilization_gpu_percent",
        "memory_used_bytes",
        "temperature_c",
        "power_w",
    }
    assert first["memory_used_bytes"] == 2000 and first["temperature_c"] == 41
    assert first["power_w"] == 101.5 and first["at"].endswith("Z")
    # Without since: the last hour.
    hour = cp.admin("GET", path).json()
    assert [len(gpu["samples"]) for gpu in hour["gpus"]] == [4, 4]
    clock.advance(3600)
    assert cp.admin("GET", path).json()["gpus"] == []
    # The latest publication is still the node's telemetry.
    node = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}").json()
    assert node["telemetry"]["samples"][0]["uuid"] == "GPU-1"


def test_history_refusals(sqlite_control_plane):
    cp = sqlite_control_plane
    unknown = cp.admin("GET", "/api/v1/admin/hardware/nodes/nope/telemetry")
    assert unknown.status_code == 404
    node_id = cp.enroll(cp.mint()["token"]).json()["node_id"]
    bad = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}/telemetry?since=yesterday")
    assert bad.status_code == 400 and error_code(bad) == "QUERY_INVALID"
    anonymous = cp.agent("GET", f"/api/v1/admin/hardware/nodes/{node_id}/telemetry")
    assert anonymous.status_code == 401


def test_pruning_deletes_in_bounded_batches_oldest_first(database_url, tmp_path):
    clock = ManualClock()
    store = Store(database_url, clock)
    store.migrate()
    try:
        old = [
            {
                "node_id": "n",
                "gpu_uuid": "G",
                "gpu_index": 0,
                "at": 1000.0 + i,
                "memory_used_bytes": i,
            }
            for i in range(telemetry.PRUNE_BATCH_ROWS + 500)
        ]
        with store.write():
            for chunk in range(0, len(old), 500):
                GpuSample.insert_many(old[chunk : chunk + 500]).execute()
            GpuSample.create(node_id="n", gpu_uuid="G", gpu_index=0, at=5000.0, memory_used_bytes=1)
        assert telemetry.prune_batch(store, older_than=4000.0) == telemetry.PRUNE_BATCH_ROWS
        with store.connection():
            left = sorted(row.at for row in GpuSample.select())
        assert left[0] == 1000.0 + telemetry.PRUNE_BATCH_ROWS  # the oldest went first
        assert telemetry.prune_all(store, older_than=4000.0) == 500
        with store.connection():
            assert [row.at for row in GpuSample.select()] == [5000.0]
    finally:
        store.close()


@pytest.mark.slow
def test_retention_keeps_the_table_bounded_under_half_an_hour_of_fleet_load(database_url, settings):
    """50 nodes × 8 GPUs publishing every 10 s for half a simulated hour, 10 min retention:
    the window fills once and is pruned through two more."""
    retention, interval, nodes, gpus, duration = 600, 10, 50, 8, 1800
    clock = ManualClock()
    store = Store(database_url, clock)
    store.migrate()
    try:
        history = telemetry.TelemetryHistory(
            store, replace(settings, telemetry_retention_seconds=retention)
        )
        callers = [Caller(f"cred-{n}", f"node-{n:02d}", "nvidia") for n in range(nodes)]
        samples = [sample(i, 50, uuid_prefix="GPU") for i in range(gpus)]
        # At most retention + one prune interval + one publication round of rows, plus a
        # batch still being worked through.
        per_second = nodes * gpus / interval
        bound = (retention + telemetry.PRUNE_EVERY_SECONDS + interval) * per_second
        highest = 0
        for tick in range(duration // interval):
            for caller in callers:
                history.record(caller, samples)
            clock.advance(interval)
            if tick % 6 == 5:
                with store.connection():
                    count = GpuSample.select().count()
                highest = max(highest, count)
                assert count <= bound + telemetry.PRUNE_BATCH_ROWS, (tick, count)
        with store.connection():
            count = GpuSample.select().count()
            oldest = GpuSample.select(GpuSample.at).order_by(GpuSample.at).first().at
        assert highest > retention * per_second  # the window really filled
        assert count <= bound
        assert clock.now() - oldest <= retention + telemetry.PRUNE_EVERY_SECONDS + 2 * interval
    finally:
        store.close()
