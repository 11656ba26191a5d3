"""Placement: which node may claim now, and which queued items its measured inventory fits.

A node claims only while it is online, uncordoned, speaks an accepted agent protocol, reports
a compatible runtime worker and healthy agent, and holds an inventory measured since its
enrollment (never a restored snapshot) within MODELFORGE_INVENTORY_MAX_AGE_SECONDS
(docs/architecture.md §5; invariant 7 and invariant 8), has no hardware change waiting for an
administrator, and holds fewer leases than its work slots allow. Items fit its accepted
accelerators that no other leased item of the node (nor anything the caller names, such as
a deployment's servers) holds: an item asking N GPUs is given N UUIDs, never "all GPUs".
Reading only: the claim itself is in leases.py.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from modelforge_contract import (
    ACCEPTED_PROTOCOL_VERSIONS,
    COMPATIBLE,
    ONLINE,
)

from ..core.settings import Settings
from ..fleet.nodes import liveness_of
from ..fleet.readiness import worker_answer
from ..store.database import Store
from ..store.tables import Node, WorkItem

FIRST_BATCH = 8
CANDIDATE_BATCH = 256


@dataclass(frozen=True)
class Reported:
    """What the node last said about itself: its heartbeat time and health."""

    last_heartbeat_at: float | None
    health: dict[str, Any] | None


def reported_by(node: Node, pending_at: float | None, pending_health: str | None) -> Reported:
    """The node's newest heartbeat: the stored one, or one still waiting in the buffer."""
    if pending_at is not None and (
        node.last_heartbeat_at is None or pending_at >= node.last_heartbeat_at
    ):
        return Reported(pending_at, json.loads(pending_health) if pending_health else None)
    return Reported(node.last_heartbeat_at, json.loads(node.health) if node.health else None)


def ineligibility(node: Node, reported: Reported, now: float, settings: Settings) -> str | None:
    """Why this node may not claim now (one of CLAIM_REASONS), or None when it may."""
    seen = Node(**{**node.__data__, "last_heartbeat_at": reported.last_heartbeat_at})
    if liveness_of(seen, now, settings) != ONLINE:  # invariant 7
        return "not_online"
    if node.cordoned:
        return "cordoned"
    # Accelerators unlike the accepted ones wait for an administrator (fleet/hardware.py).
    if node.pending_accelerators is not None:
        return "hardware"
    if node.protocol_version not in ACCEPTED_PROTOCOL_VERSIONS:  # invariant 8
        return "protocol"
    if worker_answer(reported.health)[0] != COMPATIBLE:
        return "worker"
    health = reported.health or {}
    if health.get("status") != "ok" or health.get("gpu_probe") == "failed":
        return "agent_health"
    # Freshly measured, never a restored snapshot (a restore clears inventory_at).
    if (
        node.inventory_at is None
        or node.inventory_at < node.enrolled_at
        or now - node.inventory_at > settings.inventory_max_age_seconds
    ):
        return "inventory_age"
    return None


def work_slots(node: Node, reported: int, settings: Settings) -> int:
    """How many items the node may hold leased at once: the work slots its agent reports,
    never more than the administrator's maximum for it (MODELFORGE_WORK_SLOTS_PER_NODE
    unless ``modelforge nodes set-work-slots`` set another)."""
    allowed = node.work_slots_max
    return min(reported, settings.work_slots_per_node if allowed is None else allowed)


def node_gpus(node: Node) -> list[dict[str, Any]]:
    inventory = json.loads(node.inventory) if node.inventory else {}
    return list(inventory.get("accelerators") or [])


@dataclass(frozen=True)
class Candidate:
    """The columns placement reads: a queued item's constraints, nothing heavier."""

    work_id: str
    gpu_count: int
    min_gpu_memory_bytes: int | None
    gpu_name: str | None
    node_ids: str | None
    attempts: int


def fitting_gpus(item: Candidate | WorkItem, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The node's measured GPUs that meet the item's memory and name constraints."""
    return [
        gpu
        for gpu in gpus
        if (
            item.min_gpu_memory_bytes is None
            or gpu.get("memory_total_bytes", 0) >= item.min_gpu_memory_bytes
        )
        and (item.gpu_name is None or item.gpu_name.lower() in str(gpu.get("name", "")).lower())
    ]


def pick_gpus(
    item: Candidate | WorkItem,
    node_id: str,
    gpus: list[dict[str, Any]],
    held: Collection[str] = (),
) -> list[str] | None:
    """The UUIDs of exactly ``item.gpu_count`` of the node's measured GPUs that meet every
    constraint of the item and that nothing in ``held`` holds (lowest index first), or None
    when the item does not fit the node now. An item asking no GPU gets ``[]``."""
    if item.node_ids and node_id not in json.loads(item.node_ids):
        return None
    if item.gpu_count == 0:
        return []
    free = [
        gpu
        for gpu in fitting_gpus(item, gpus)
        if isinstance(gpu.get("uuid"), str) and gpu["uuid"] not in held
    ]
    if len(free) < item.gpu_count:
        return None
    free.sort(key=lambda gpu: (gpu.get("index", 0), gpu["uuid"]))
    return [gpu["uuid"] for gpu in free[: item.gpu_count]]


def fits(
    item: Candidate | WorkItem,
    node_id: str,
    gpus: list[dict[str, Any]],
    held: Collection[str] = (),
) -> bool:
    """Whether the node's measured GPUs, less those in ``held``, meet every constraint."""
    return pick_gpus(item, node_id, gpus, held) is not None


_HELD_BY_WORK_SQL = (
    "SELECT gpu_uuids FROM work_item WHERE node_id = ? AND state = 'leased' "
    "AND gpu_uuids IS NOT NULL"
)


def gpus_in_use_by_work(store: Store, node_id: str) -> set[str]:
    """The UUIDs of the GPUs the node's leased work items hold, inside the caller's
    connection or transaction (the claim reads it in the write transaction that leases)."""
    sql = _HELD_BY_WORK_SQL.replace("?", store.db.param)
    held: set[str] = set()
    for (uuids,) in store.db.execute_sql(sql, (node_id,)).fetchall():
        held.update(uuid for uuid in json.loads(uuids) if isinstance(uuid, str))
    return held


_CANDIDATES_SQL = (
    "SELECT work_id, gpu_count, min_gpu_memory_bytes, gpu_name, node_ids, attempts "
    "FROM work_item WHERE state = 'queued' AND capability IN ({capabilities}) "
    "AND gpu_count <= ? AND (min_gpu_memory_bytes IS NULL OR min_gpu_memory_bytes <= ?) "
    "AND (node_ids IS NULL OR node_ids LIKE ? ESCAPE '!') "
    "ORDER BY created_at, work_id LIMIT ? OFFSET ?"
)


def scan_candidates(
    store: Store,
    node_id: str,
    capabilities: list[str],
    gpus: list[dict[str, Any]],
    held: Collection[str] = (),
) -> Iterator[Candidate]:
    """Queued items the node might fit with its GPUs that ``held`` leaves free, oldest
    first, in growing batches (the first one usually fits, and a long queue is never read
    whole); ``pick_gpus`` makes the exact decision."""
    gpus = [gpu for gpu in gpus if gpu.get("uuid") not in held]
    largest = max((gpu.get("memory_total_bytes", 0) for gpu in gpus), default=0)
    quoted = json.dumps(node_id).replace("!", "!!").replace("%", "!%").replace("_", "!_")
    sql = _CANDIDATES_SQL.format(capabilities=", ".join("?" * len(capabilities)))
    sql = sql.replace("?", store.db.param)
    offset, size = 0, FIRST_BATCH
    while True:
        params = (*capabilities, len(gpus), largest, f"%{quoted}%", size, offset)
        batch = [Candidate(*row) for row in store.db.execute_sql(sql, params).fetchall()]
        yield from batch
        if len(batch) < size:
            return
        offset += size
        size = min(size * 4, CANDIDATE_BATCH)
