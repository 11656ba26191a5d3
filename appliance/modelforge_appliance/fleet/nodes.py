"""Nodes and their liveness; what agents publish about them (heartbeat, inventory, telemetry)."""

from __future__ import annotations

import json
from typing import Any

from modelforge_contract import (
    DECOMMISSIONED,
    INVENTORY_EMPTY,
    NODE_DECOMMISSIONED,
    OFFLINE,
    ONLINE,
    PENDING,
    STALE,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound
from ..core.settings import Settings
from ..core.validation import DISPLAY_NAME, WORK_SLOTS_FIELDS, check_value
from ..identity.credentials import Caller
from ..store import audit
from ..store.database import Store
from ..store.tables import Credential, Node
from . import hardware


def liveness_of(node: Node, now: float, settings: Settings) -> str:
    """Invariant 7: computed at read time from the control plane's own timestamps."""
    if node.decommissioned_at is not None:
        return DECOMMISSIONED
    if node.last_heartbeat_at is None:
        return PENDING
    silent_for = now - node.last_heartbeat_at
    if silent_for < settings.stale_after_seconds:
        return ONLINE
    if silent_for < settings.offline_after_seconds:
        return STALE
    return OFFLINE


def _json_or(value: str | None, empty: Any) -> Any:
    return json.loads(value) if value else empty


def node_view(node: Node, now: float, settings: Settings) -> dict[str, Any]:
    inventory = _json_or(node.inventory, {})
    return {
        "node_id": node.node_id,
        "display_name": node.display_name,
        "hostname": node.hostname,
        "liveness": liveness_of(node, now, settings),
        "last_heartbeat_at": isoformat(node.last_heartbeat_at),
        "production_eligible": node.production_eligible,
        "cordoned": node.cordoned,
        "accelerator_mode": node.accelerator_mode,
        "agent_version": node.agent_version,
        "protocol_version": node.protocol_version,
        "health": _json_or(node.health, None),
        "accelerators": inventory.get("accelerators", []),
        "storage_roots": inventory.get("storage_roots", []),
        "worker_version": inventory.get("worker_version"),
        "inventory_at": isoformat(node.inventory_at),
        "telemetry": _json_or(node.telemetry, None),
        "telemetry_at": isoformat(node.telemetry_at),
        "enrolled_at": isoformat(node.enrolled_at),
        "created_at": isoformat(node.created_at),
        "decommissioned_at": isoformat(node.decommissioned_at),
        "host": inventory.get("host"),
        "source_address": node.source_address,
        # The most items it may hold leased at once, and whether that is its own maximum
        # (`modelforge nodes set-work-slots`) or MODELFORGE_WORK_SLOTS_PER_NODE.
        "work_slots_max": (
            settings.work_slots_per_node if node.work_slots_max is None else node.work_slots_max
        ),
        "work_slots_max_source": "default" if node.work_slots_max is None else "node",
        # Accelerators published unlike the accepted ``accelerators``, held for an
        # administrator (fleet/hardware.py).
        "hardware": hardware.hardware_view(node),
    }


def get_node(store: Store, node_id: str) -> Node:
    with store.connection():
        node = Node.get_or_none(Node.node_id == node_id)
    if node is None:
        raise NotFound(f"no node {node_id}")
    return node


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def record_inventory(
    store: Store, caller: Caller, inventory: dict[str, Any], source_address: str | None = None
) -> float:
    """Store a published inventory; its accelerators only when they match the accepted
    ones or are the node's first (fleet/hardware.py), otherwise they wait for an admin."""
    # Invariant 9: an nvidia node never publishes an empty inventory.
    if caller.accelerator_mode == "nvidia" and not inventory.get("accelerators"):
        raise Invalid(
            "an nvidia node must report at least one accelerator",
            code=INVENTORY_EMPTY,
            next_step="Run the agent's --preflight; it refuses to start without a GPU.",
        )
    accelerators = inventory.get("accelerators") or []
    hardware.check_published(caller.accelerator_mode, accelerators)
    now = store.clock.now()
    # A node's models are its replicas' rows (models/replicas.py), not part of its inventory.
    stored = {key: value for key, value in inventory.items() if key not in ("node_id", "models")}
    with store.write():
        # Read where it is written (locked on PostgreSQL), so an accept and an inventory
        # that meet each see the other's outcome.
        query = Node.select(
            Node.inventory, Node.pending_accelerators, Node.hardware_changed_at
        ).where(Node.node_id == caller.node_id)
        node = (query if store.is_sqlite else query.for_update()).get()
        Node.update(
            **hardware.columns_for(node, stored, now),
            inventory_at=now,
            **source_update(source_address),
        ).where(Node.node_id == caller.node_id).execute()
        _follow_hostname(store, caller.node_id, (inventory.get("host") or {}).get("hostname"))
        mark_credential_used(caller, now)
    return now


def _follow_hostname(store: Store, node_id: str, reported: str | None) -> None:
    """Inside the inventory's write: the node's hostname becomes what its agent reports (a
    node joined from a throw-away container, renamed, or moved), audited when it changes."""
    if not reported:
        return
    reported = reported.lower()
    changed = (
        Node.update(hostname=reported)
        .where((Node.node_id == node_id) & (Node.hostname != reported))
        .execute()
    )
    if changed:
        audit.record(store, f"node:{node_id}", "node.hostname_changed", node_id=node_id,
                     hostname=reported)  # fmt: skip


def source_update(address: str | None) -> dict[str, str]:
    """The column update for the caller's address, when the server saw one."""
    return {"source_address": address[:64]} if address else {}


def mark_credential_used(caller: Caller, now: float) -> None:
    """Move the credential's last use forward (inside the caller's transaction)."""
    Credential.update(last_used_at=now).where(
        (Credential.credential_id == caller.credential_id)
        & (Credential.last_used_at.is_null() | (Credential.last_used_at < now))
    ).execute()


def set_cordoned(store: Store, node_id: str, cordoned: bool, actor: str) -> Node:
    """Cordon (no new work, still monitored) or uncordon a node; audited when it changes.

    Only the cordon column is written, by a conditional update, so a concurrent
    decommission or re-enrollment is never overwritten with what this call read. A
    decommissioned node stays cordoned: uncordoning it is refused (409).
    """
    with store.write():
        changed = (
            Node.update(cordoned=cordoned)
            .where(
                (Node.node_id == node_id)
                & (Node.cordoned != cordoned)
                & Node.decommissioned_at.is_null()
            )
            .execute()
        )
        if not changed and not cordoned:
            node = get_node(store, node_id)
            if node.decommissioned_at is not None:
                raise Conflict(
                    f"node {node_id} is decommissioned; it stays cordoned",
                    code=NODE_DECOMMISSIONED,
                    next_step="Enroll the hardware as a new node to return it to service.",
                )
        if changed:
            audit.record(
                store, actor, "node.cordoned" if cordoned else "node.uncordoned", node_id=node_id
            )
    return get_node(store, node_id)


def set_work_slots(store: Store, node_id: str, work_slots_max: int | None, actor: str) -> Node:
    """Set the most items the node may hold leased at once (None: back to the default).

    Takes effect at its next claim; leases it already holds are kept until they end.
    Audited when it changes, with the value before. A conditional update on that value:
    of two changes at once, the first to commit is the one recorded, and the other answer
    shows it.
    """
    check_value(work_slots_max, WORK_SLOTS_FIELDS["work_slots_max"], "work_slots_max")
    with store.write():
        previous = get_node(store, node_id).work_slots_max
        if previous != work_slots_max:
            unchanged = (
                Node.work_slots_max.is_null()
                if previous is None
                else Node.work_slots_max == previous
            )
            changed = (
                Node.update(work_slots_max=work_slots_max)
                .where((Node.node_id == node_id) & unchanged)
                .execute()
            )
            if changed:
                audit.record(
                    store,
                    actor,
                    "node.work_slots_set",
                    node_id=node_id,
                    previous=previous,
                    work_slots_max=work_slots_max,
                )
    return get_node(store, node_id)


def rename_node(store: Store, node_id: str, display_name: str, actor: str) -> Node:
    """Give a node another display name (its id and hostname stay); audited when it changes."""
    check_value(display_name, DISPLAY_NAME, "display_name")
    node = get_node(store, node_id)
    with store.write():
        changed = (
            Node.update(display_name=display_name)
            .where((Node.node_id == node_id) & (Node.display_name != display_name))
            .execute()
        )
        if changed:
            audit.record(
                store,
                actor,
                "node.renamed",
                node_id=node_id,
                previous=node.display_name,
                display_name=display_name,
            )
    return get_node(store, node_id)
