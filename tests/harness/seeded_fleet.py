"""Fleets for the console tests and the bench: nodes with inventories and telemetry history."""

from __future__ import annotations

import json
import uuid

from modelforge_appliance.fleet.telemetry import TelemetryHistory
from modelforge_appliance.identity.credentials import Caller
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import Node

H100 = "NVIDIA H100 80GB HBM3"


def inventory(gpus: int) -> str:
    return json.dumps(
        {
            "agent_version": "0.1.0",
            "accelerators": [
                {
                    "index": i,
                    "name": H100,
                    "uuid": f"GPU-{i:02d}",
                    "memory_total_bytes": 80 * 2**30,
                    "driver_version": "550.54.15",
                    "pci_bus_id": f"00000000:{i + 10:02X}:00.0",
                }
                for i in range(gpus)
            ],
        }
    )


def add_nodes(store: Store, count: int, gpus: int = 8) -> list[str]:
    """``count`` enrolled nodes in one transaction, with liveness spread over every state."""
    now = store.clock.now()
    rows, ids = [], []
    for n in range(count):
        node_id = str(uuid.UUID(int=n + 1))
        ids.append(node_id)
        # Mostly online; every 10th stale, every 25th offline, every 50th never heartbeated.
        beat = now - (40 if n % 10 == 9 else 200 if n % 25 == 24 else 2)
        rows.append(
            {
                "node_id": node_id,
                "display_name": f"GPU node {n:04d}",
                "hostname": f"gpu-{n:04d}",
                "accelerator_mode": "nvidia",
                "agent_version": "0.1.0",
                "protocol_version": 1,
                "production_eligible": False,
                "cordoned": n % 40 == 0,
                "created_at": now - count + n,
                "enrolled_at": now - count + n,
                "last_heartbeat_at": None if n % 50 == 49 else beat,
                "health": json.dumps({"status": "ok", "gpu_probe": "ok"}),
                "inventory": inventory(gpus),
                "inventory_at": now - 5,
            }
        )
    with store.write():
        for start in range(0, len(rows), 200):
            Node.insert_many(rows[start : start + 200]).execute()
    return ids


def add_telemetry_hour(history: TelemetryHistory, clock, node_id: str, gpus: int = 8) -> None:
    """An hour of samples at 10 s for each GPU of one node, ending at the clock's now."""
    clock.advance(-3600)
    caller = Caller("none", node_id, "nvidia")
    for step in range(360):
        samples = [
            {
                "uuid": f"GPU-{i:02d}",
                "index": i,
                "utilization_gpu_percent": (step * (i + 3) + 17 * i) % 101,
                "memory_used_bytes": (20 + (step + 9 * i) % 50) * 2**30,
                "memory_total_bytes": 80 * 2**30,
                "temperature_c": 45 + (step // 6 + i) % 30,
                "power_w": 150.0 + (step * 7 + 40 * i) % 500,
            }
            for i in range(gpus)
        ]
        history.record(caller, samples)
        clock.advance(10)
