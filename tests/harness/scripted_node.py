"""A node that speaks the agent's work API step by step, for the control-plane work tests."""

from __future__ import annotations

from typing import Any

from modelforge_contract import (
    PATH_AGENT_WORK_CLAIM,
    PATH_AGENT_WORK_COMPLETE,
    PATH_AGENT_WORK_RENEW,
    WORKER_PROTOCOL_VERSION,
    work_path,
)

from .control_plane import new_identity

GIB = 2**30
WORK = "/api/v1/admin/work"


def gpu(index: int, memory_gib: int = 80, name: str = "NVIDIA H100 80GB HBM3") -> dict:
    return {
        "index": index,
        "name": name,
        "uuid": f"GPU-{index:08d}-0000-0000-0000-{memory_gib:012d}",
        "memory_total_bytes": memory_gib * GIB,
        "driver_version": "550.54.15",
        "pci_bus_id": f"00000000:{index + 16:02x}:00.0",
    }


def worker_health(protocol: int | None = WORKER_PROTOCOL_VERSION, reachable: bool = True):
    return {
        "reachable": reachable,
        "protocol": protocol,
        "version": "0.1.0",
        "capabilities": ["smoke", "container"],
        "accelerator_mode": "nvidia",
    }


class WorkNode:
    """An enrolled node: heartbeat, inventory and the three work calls, driven by the test."""

    def __init__(
        self, cp, hostname: str, gpus: list[dict] | None = None, mode: str = "nvidia"
    ) -> None:
        self.cp, self.hostname = cp, hostname
        self.gpus = [gpu(0), gpu(1)] if gpus is None else gpus
        response = cp.enroll(
            cp.mint(hostname)["token"],
            hostname=hostname,
            identity=new_identity(),
            accelerator_mode=mode,
        )
        assert response.status_code == 201, response.text
        self.node_id = response.json()["node_id"]
        self.credential = response.json()["credential"]

    def heartbeat(self, worker: dict | None = None, status: str = "ok") -> None:
        health = {"status": status, "gpu_probe": "ok", "worker": worker or worker_health()}
        body = {"node_id": self.node_id, "agent_version": "0.1.0", "health": health}
        response = self.cp.agent("POST", "/api/v1/agent/heartbeat", self.credential, json=body)
        assert response.status_code == 200, response.text

    def inventory(self) -> None:
        response = self.publish(self.gpus)
        assert response.status_code == 200, response.text

    def publish(self, gpus: list[dict]):
        """An inventory listing ``gpus``, answered as it is."""
        body = {"node_id": self.node_id, "agent_version": "0.1.0", "accelerators": gpus}
        return self.cp.agent("PUT", "/api/v1/agent/inventory", self.credential, json=body)

    def ready(self) -> WorkNode:
        self.heartbeat()
        self.inventory()
        return self

    def claim(self, capabilities=("smoke", "container"), work_slots=None, **kwargs):
        """A claim as the agent sends it; without ``work_slots`` as agents before it did."""
        body = {"node_id": self.node_id, "capabilities": list(capabilities)}
        if work_slots is not None:
            body["work_slots"] = work_slots
        return self.cp.agent("POST", PATH_AGENT_WORK_CLAIM, self.credential, json=body, **kwargs)

    def lease(self) -> dict[str, Any]:
        response = self.claim()
        assert response.status_code == 200, (response.status_code, response.headers)
        return response.json()["lease"]

    def renew(self, lease: dict):
        path = work_path(PATH_AGENT_WORK_RENEW, lease["work_id"])
        body = {"node_id": self.node_id, "lease_id": lease["lease_id"]}
        return self.cp.agent("POST", path, self.credential, json=body)

    def complete(self, lease: dict, outcome: str = "succeeded", **extra):
        path = work_path(PATH_AGENT_WORK_COMPLETE, lease["work_id"])
        body = {
            "node_id": self.node_id,
            "lease_id": lease["lease_id"],
            "outcome": outcome,
            "result": {"ok": outcome == "succeeded"},
            "log_tail": "line one\nline two\n",
            **extra,
        }
        return self.cp.agent("POST", path, self.credential, json=body)


def submit(cp, capability: str = "smoke", **body) -> dict:
    response = cp.admin("POST", WORK, json={"capability": capability, **body})
    assert response.status_code in (200, 201), response.text
    return response.json()


def item(cp, work_id: str) -> dict:
    response = cp.admin("GET", f"{WORK}/{work_id}")
    assert response.status_code == 200, response.text
    return response.json()


def work_events(cp) -> list[dict]:
    """Every work.* audit event, oldest first."""
    events, before = [], None
    while True:
        query = f"?limit=500&before={before}" if before else "?limit=500"
        page = cp.admin("GET", f"/api/v1/admin/audit-events{query}").json()
        events += page["events"]
        before = page["next_before"]
        if before is None:
            break
    return [e for e in reversed(events) if e["action"].startswith("work.")]
