"""Readiness of a node: is it really able to take work, and if not, what to do next; and the
node list, which carries every node's readiness beside its liveness.

A node is not ready merely because it connected: each check must pass on its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from modelforge_contract import (
    ACCEPTED_PROTOCOL_VERSIONS,
    COMPATIBLE,
    ONLINE,
    READINESS_CHECKS,
    WORKER_COMPATIBILITY_NEXT_STEPS,
    compatibility_of,
    worker_compatibility_of,
)

from ..core.settings import Settings
from ..store.database import Store
from ..store.tables import Credential, Node
from . import hardware
from .nodes import get_node, liveness_of, node_view


def worker_answer(health: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """The compatibility of the worker the agent reported, and what it reported."""
    worker = (health or {}).get("worker")
    if not worker or not worker.get("reachable"):
        return "UNREACHABLE" if worker else "UNREPORTED", worker
    return worker_compatibility_of(worker.get("protocol")), worker


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    next_step: str | None = None


def _connection(node: Node, active: Credential | None, now: float, settings: Settings) -> Check:
    liveness = liveness_of(node, now, settings)
    if active is None:
        return Check(
            "connection",
            False,
            "the node has no active credential",
            "Re-enroll the agent with a fresh enrollment token; it keeps its node id.",
        )
    if (
        active.last_used_at is None
        or node.last_heartbeat_at is None
        or (active.last_used_at < node.last_heartbeat_at)
    ):
        return Check(
            "connection",
            False,
            "no heartbeat with the current credential yet",
            "Start the agent with its state volume and check its log for "
            "'HTTP 401' or 'ConnectError' lines.",
        )
    if liveness != ONLINE:
        return Check(
            "connection",
            False,
            f"the node is {liveness}: its last heartbeat is too old",
            "Check that the agent runs and reaches the control plane (docs/runbooks/node-loss.md).",
        )
    return Check("connection", True, "heartbeating with the current credential")


def _inventory(node: Node, now: float, settings: Settings) -> Check:
    if node.inventory_at is None or node.inventory_at < node.enrolled_at:
        return Check(
            "inventory_age",
            False,
            "no inventory measured since the node's enrollment or the last restore",
            "Wait for the agent to publish its inventory; restart it if none arrives.",
        )
    age = now - node.inventory_at
    if age > settings.inventory_max_age_seconds:
        return Check(
            "inventory_age",
            False,
            f"the inventory is {age:.0f}s old",
            "Restart the agent so it measures and publishes its inventory again.",
        )
    return Check("inventory_age", True, f"inventory measured {age:.0f}s ago")


def _hardware(node: Node) -> Check:
    """Trust on first use (fleet/hardware.py): the published accelerators are the accepted."""
    changes = hardware.describe_pending(node)
    if changes is not None:
        return Check(
            "hardware",
            False,
            f"the published accelerators differ from the accepted ones: {changes}",
            "Check the node's hardware; if the change is expected, accept it: "
            f"modelforge nodes accept-hardware {node.node_id} (or Accept hardware on its "
            "console page).",
        )
    accepted = hardware.accepted_accelerators(node)
    if accepted is None:
        return Check("hardware", True, "no inventory yet: the first one becomes the baseline")
    return Check("hardware", True, f"{len(accepted)} accelerator(s), as accepted")


def _protocol(node: Node) -> Check:
    answer = compatibility_of(str(node.protocol_version))
    if node.protocol_version not in ACCEPTED_PROTOCOL_VERSIONS:
        return Check(
            "protocol",
            False,
            f"agent protocol {node.protocol_version} is {answer}",
            "Run a node agent release that speaks agent protocol 1.",
        )
    return Check("protocol", True, f"agent protocol {node.protocol_version} is {answer}")


def _agent_health(health: dict[str, Any] | None, worker: Check) -> Check:
    if health is None:
        return Check(
            "agent_health",
            False,
            "the agent has not reported its health",
            "Wait for the first heartbeat.",
        )
    preflight = health.get("preflight")
    gpu_failed = health["gpu_probe"] == "failed" or preflight == "failed"
    if health["status"] != "ok" or gpu_failed:
        message = health.get("message") or "no message"
        if not gpu_failed and not worker.ok:
            # Degraded because of the runtime worker: its check says what to do, not NVML's.
            return Check(
                "agent_health",
                False,
                f"agent reports {health['status']} because of its runtime worker: {message}",
                worker.next_step,
            )
        return Check(
            "agent_health",
            False,
            f"agent reports {health['status']}, GPU probe {health['gpu_probe']}: {message}",
            "Run the agent's --preflight on the node and fix what it names.",
        )
    return Check("agent_health", True, f"agent reports ok, GPU probe {health['gpu_probe']}")


def needs_telemetry(node: Node) -> bool:
    if node.accelerator_mode == "nvidia":
        return True
    inventory = json.loads(node.inventory) if node.inventory else {}
    return node.accelerator_mode == "auto" and bool(inventory.get("accelerators"))


def _telemetry(node: Node, now: float, settings: Settings) -> Check:
    if not needs_telemetry(node):
        return Check("telemetry_age", True, "not applicable: the node has no NVIDIA GPU")
    if node.telemetry_at is None or node.telemetry_at < node.enrolled_at:
        return Check(
            "telemetry_age",
            False,
            "no telemetry since the node's enrollment",
            "Check the agent's log for NVML errors; run --preflight on the node.",
        )
    age = now - node.telemetry_at
    if age > settings.telemetry_max_age_seconds:
        return Check(
            "telemetry_age",
            False,
            f"the last telemetry is {age:.0f}s old",
            "Check the agent's log for telemetry errors; restart the agent.",
        )
    return Check("telemetry_age", True, f"telemetry {age:.0f}s old")


def expected_worker_mode(node: Node, health: dict[str, Any] | None) -> str:
    """The accelerator mode the node's worker must run in: the node's own, or for ``auto``
    what its agent found (a GPU probe that does not apply means no GPU)."""
    if node.accelerator_mode != "auto":
        return node.accelerator_mode
    return "cpu" if (health or {}).get("gpu_probe") == "not_applicable" else "nvidia"


def _worker(node: Node, health: dict[str, Any] | None) -> Check:
    """The runtime worker beside the agent, as the agent last reported it (issue 13)."""
    answer, worker = worker_answer(health)
    if answer == "UNREPORTED":
        return Check(
            "worker",
            False,
            "the agent has not reported a runtime worker (UNKNOWN)",
            WORKER_COMPATIBILITY_NEXT_STEPS["UNKNOWN"],
        )
    if answer == "UNREACHABLE":
        return Check(
            "worker",
            False,
            "the runtime worker does not answer on its socket (UNKNOWN)",
            "Start modelforge-runtime-worker on the node and check that "
            "MODELFORGE_AGENT_WORKER_SOCKET and MODELFORGE_WORKER_SOCKET name the same path.",
        )
    version = worker.get("version") or "unknown version"
    detail = f"worker {version}, protocol {worker.get('protocol')} is {answer}"
    if answer != COMPATIBLE:
        return Check("worker", False, detail, WORKER_COMPATIBILITY_NEXT_STEPS[answer])
    mode, expected = worker.get("accelerator_mode"), expected_worker_mode(node, health)
    if mode is not None and mode != expected:
        return Check(
            "worker",
            False,
            f"{detail}, but it runs in {mode} mode and this node is {expected}",
            f"Set MODELFORGE_WORKER_ACCELERATOR_MODE={expected} where the runtime worker runs "
            "(its -cpu image has no GPU support; nvidia needs the GPU image) and restart it.",
        )
    if worker.get("message"):  # the agent found it unusable for another reason
        return Check(
            "worker",
            False,
            f"{detail}, but the agent does not use it: {worker['message']}",
            "Fix what the agent names, then restart the runtime worker.",
        )
    capabilities = ", ".join(worker.get("capabilities") or []) or "none"
    return Check("worker", True, f"{detail}; capabilities: {capabilities}")


def _tunnel(health: dict[str, Any] | None) -> Check:
    """The agent's tunnel, as its last heartbeat reported it (docs/architecture.md §12)."""
    state = (health or {}).get("tunnel")
    if state is None:
        return Check(
            "tunnel",
            True,
            "not reported yet: an agent reports it once its first tunnel attempt has ended "
            "(one from before the relay never does)",
        )
    if state != "up":
        return Check(
            "tunnel",
            False,
            "the agent's tunnel to the control plane is down: no client request reaches it",
            "Check the agent's log for the tunnel's error; a reverse proxy must pass the "
            "WebSocket upgrade of /api/v1/agent/tunnel (docs/reverse-proxy.md).",
        )
    return Check("tunnel", True, "the agent's tunnel is up")


def _cordoned(node: Node) -> Check:
    if node.cordoned:
        return Check(
            "cordoned",
            False,
            "the node is cordoned: it is monitored but gets no new work",
            f"Uncordon it when it may take work again: modelforge nodes uncordon {node.node_id}",
        )
    return Check("cordoned", True, "the node is not cordoned")


def checks_of(node: Node, active: Credential | None, now: float, settings: Settings) -> list[Check]:
    """Every readiness check of ``node``, in READINESS_CHECKS order; ``active`` is its newest
    unrevoked credential (None when it has none)."""
    if node.decommissioned_at is not None:
        return [Check(name, False, "the node is decommissioned") for name in READINESS_CHECKS]
    health = json.loads(node.health) if node.health else None
    worker = _worker(node, health)
    return [
        _connection(node, active, now, settings),
        _inventory(node, now, settings),
        _hardware(node),
        _protocol(node),
        _agent_health(health, worker),
        _telemetry(node, now, settings),
        worker,
        _tunnel(health),
        _cordoned(node),
    ]


def readiness_of(store: Store, settings: Settings, node_id: str) -> dict[str, Any]:
    """The readiness answer for exactly this node id (docs/architecture.md §3)."""
    node = get_node(store, node_id)
    with store.connection():
        active = (
            Credential.select()
            .where((Credential.node == node) & Credential.revoked_at.is_null())
            .order_by(Credential.created_at.desc())
            .first()
        )
    checks = checks_of(node, active, store.clock.now(), settings)
    return {
        "node_id": node.node_id,
        "ready": all(check.ok for check in checks),
        "checks": [asdict(check) for check in checks],
    }


def summary_of(checks: list[Check]) -> dict[str, Any]:
    """What the node list carries of a node's readiness: whether it is ready and the names
    of its failing checks, in check order (the node's readiness answer has the details)."""
    failing = [check.name for check in checks if not check.ok]
    return {"ready": not failing, "failing": failing}


def list_nodes(store: Store, settings: Settings) -> list[dict[str, Any]]:
    """Every node with its liveness and readiness, oldest first.

    Two queries for the whole fleet, however large: the nodes, and every unrevoked
    credential (the connection check's only other input), never one query per node.
    """
    with store.connection():
        rows = list(Node.select().order_by(Node.created_at, Node.node_id))
        credentials = Credential.select(
            Credential.node, Credential.created_at, Credential.last_used_at
        ).where(Credential.revoked_at.is_null())
        active: dict[str, Credential] = {}
        for credential in credentials.order_by(Credential.created_at):
            active[credential.node_id] = credential  # the newest one wins
    now = store.clock.now()
    return [
        {
            **node_view(row, now, settings),
            "readiness": summary_of(checks_of(row, active.get(row.node_id), now, settings)),
        }
        for row in rows
    ]
