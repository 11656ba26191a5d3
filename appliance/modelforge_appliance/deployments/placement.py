"""Where a deployment's servers may run, and which GPUs each gets (by UUID, never "all").

Every member is checked against freshly measured state: the node's liveness, cordon,
protocol, worker and inventory as a work claim checks them (work/placement.py), the
runtimes its worker reports, and a ``present`` replica of the model measured since its
enrollment or the last restore (models/replicas.py). GPUs are the node's measured
accelerators less those held by its other active servers and leased work items, unless the
deployment shares GPUs.
"""

from __future__ import annotations

import json
from typing import Any

from modelforge_contract import ONLINE
from modelforge_contract.deployments import (
    GPUS_UNAVAILABLE,
    MODEL_MISSING,
    RUNTIME_UNSUPPORTED,
    SERVER_ACTIVE_STATES,
)
from modelforge_contract.models import NODE_NOT_ELIGIBLE

from ..core.errors import Conflict, NotFound
from ..core.settings import Settings
from ..fleet.nodes import liveness_of
from ..models.replicas import shown_state
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model, ModelReplica, Node
from ..work.placement import gpus_in_use_by_work, ineligibility, node_gpus, reported_by

# What each claim reason (work/placement.py) means for a deployment's member.
_WHY = {
    "not_online": "is {liveness}",
    "cordoned": "is cordoned",
    "hardware": "has a hardware change waiting for an administrator",
    "protocol": "speaks an agent protocol this control plane does not accept",
    "worker": "has no compatible runtime worker",
    "agent_health": "reports degraded health",
    "inventory_age": "has no fresh inventory since its enrollment (or the last restore)",
}


def check_member(
    node: Node | None,
    node_id: str,
    runtime: str,
    now: float,
    settings: Settings,
    pending: tuple[float, str] | None = None,
) -> Node:
    """The node, eligible to run a server of ``runtime`` now; 404 or 409 otherwise.
    ``pending`` is its newest heartbeat not yet in the store (time, health JSON)."""
    if node is None:
        raise NotFound(f"no node {node_id}")
    reported = reported_by(node, *(pending or (None, None)))
    reason = ineligibility(node, reported, now, settings)
    if reason is not None:
        seen = Node(**{**node.__data__, "last_heartbeat_at": reported.last_heartbeat_at})
        liveness = liveness_of(seen, now, settings)
        why = _WHY.get(reason, reason).format(liveness=liveness)
        raise Conflict(
            f"node {node.display_name} ({node.node_id}) {why}; it cannot run a server now",
            code=NODE_NOT_ELIGIBLE,
            next_step="Bring the node online and ready (`modelforge nodes show NODE` says "
            "what it lacks), or choose another node.",
            extra={"node_id": node.node_id, "reason": reason, "liveness": liveness},
        )
    worker = (reported.health or {}).get("worker") or {}
    runtimes = worker.get("runtimes") or []
    if runtime not in runtimes:
        refuse_runtime(node, runtime, runtimes)
    return node


def refuse_runtime(node: Node, runtime: str, runtimes: list[str]) -> None:
    """409 RUNTIME_UNSUPPORTED: the node's worker does not offer ``runtime``."""
    offered = ", ".join(runtimes) or "none"
    raise Conflict(
        f"the runtime worker of node {node.display_name} ({node.node_id}) does not offer "
        f"the {runtime} runtime (it offers: {offered})",
        code=RUNTIME_UNSUPPORTED,
        next_step="Install the runtime on the node (docs/deployments.md, 'Runtimes') and "
        "wait for its worker to report it, or choose another runtime or node.",
        extra={"node_id": node.node_id, "runtimes": runtimes},
    )


def missing_on(store: Store, model: Model, nodes: list[Node]) -> list[Node]:
    """The nodes that have not reported the model present (inside the caller's
    transaction)."""
    replicas = {
        r.node_id: r
        for r in ModelReplica.select().where(
            (ModelReplica.model == model.model_id)
            & ModelReplica.node.in_([n.node_id for n in nodes])
        )
    }
    return [
        node
        for node in nodes
        if node.node_id not in replicas or shown_state(replicas[node.node_id], node) != "present"
    ]


def refuse_missing(model: Model, missing: list[Node]) -> None:
    shown = ", ".join(f"{n.display_name} ({n.node_id})" for n in missing)
    raise Conflict(
        f"model {model.name} revision {model.revision} is not present on {shown}; nothing "
        "was started",
        code=MODEL_MISSING,
        next_step=f"Replicate it first (modelforge models replicate {model.name} NODE…), or "
        "deploy with --replicate to replicate and then start.",
        extra={"node_ids": [n.node_id for n in missing]},
    )


def gpus_held(node_id: str) -> set[str]:
    """GPU UUIDs the node's active servers hold (inside the caller's transaction)."""
    held: set[str] = set()
    for (gpus,) in (
        DeploymentServer.select(DeploymentServer.gpus)
        .where(
            (DeploymentServer.node == node_id) & DeploymentServer.state.in_(SERVER_ACTIVE_STATES)
        )
        .tuples()
    ):
        held.update(json.loads(gpus))
    return held


def idle_unload_seconds(deployment: Any) -> int | None:
    """A deployment's ``settings.idle_unload_seconds`` (load on demand, idle.py), or None."""
    value = (json.loads(deployment.settings) or {}).get("idle_unload_seconds")
    return int(value) if isinstance(value, int) and value >= 1 else None


def gpus_held_apart(node_id: str) -> tuple[set[str], set[str]]:
    """The GPU UUIDs the node's active servers hold, apart: those of deployments that never
    unload, and those of deployments that unload when idle (inside the caller's
    transaction). Idle-capable deployments may name the same GPUs (idle.py)."""
    hard: set[str] = set()
    soft: set[str] = set()
    rows = (
        DeploymentServer.select(DeploymentServer.gpus, Deployment.settings)
        .join(Deployment)
        .where(
            (DeploymentServer.node == node_id) & DeploymentServer.state.in_(SERVER_ACTIVE_STATES)
        )
    )
    for row in rows:
        (soft if idle_unload_seconds(row.deployment) else hard).update(json.loads(row.gpus))
    return hard, soft


def pick_gpus(node: Node, count: int | None, share: bool, held: set[str]) -> list[str]:
    """``count`` of the node's measured GPUs (in index order) that no other active server
    or leased item holds; ``None``: one on a node with GPUs, none without. 409
    GPUS_UNAVAILABLE when too few are free."""
    gpus: list[dict[str, Any]] = sorted(node_gpus(node), key=lambda g: g.get("index", 0))
    wanted = (1 if gpus else 0) if count is None else count
    if wanted == 0:
        return []
    free = [g["uuid"] for g in gpus if g.get("uuid") and (share or g["uuid"] not in held)]
    if len(free) < wanted:
        raise Conflict(
            f"node {node.display_name} ({node.node_id}) has {len(free)} free GPU(s) of "
            f"{len(gpus)}; the deployment asks {wanted} per server",
            code=GPUS_UNAVAILABLE,
            next_step="Stop a deployment or work item holding its GPUs, ask fewer GPUs "
            "(--gpus), or choose another node.",
            extra={"node_id": node.node_id, "free": len(free), "asked": wanted},
        )
    return free[:wanted]


def node_is_online(node: Node, now: float, settings: Settings) -> bool:
    return liveness_of(node, now, settings) == ONLINE


def gpus_of_work(store: Store, node_id: str) -> set[str]:
    """GPU UUIDs the node's leased work items hold (inside the caller's transaction)."""
    return gpus_in_use_by_work(store, node_id)
