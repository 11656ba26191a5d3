"""Hardware held for an administrator: trust on first use, as SSH does with host keys.

A node's first inventory is its accepted baseline. A later one whose accelerators differ in
what identifies them — a GPU new or gone (by UUID), or one whose name or memory changed —
is not taken as it is: the node's ``inventory`` keeps the accepted accelerators (what
placement fits work to and telemetry must name), the published ones wait in
``pending_accelerators``, and until an administrator accepts them (``accept_hardware``:
``modelforge nodes accept-hardware``, ``POST …/accept-hardware``, the console's node page;
audited as ``node.hardware_accepted``) the node claims no new work (claim reason
``hardware``), its ``hardware`` readiness check fails and a ``hardware_changed`` alert names
the difference. Leases it already holds are left to finish: they renew and complete as
before, or expire. An inventory that matches the baseline again ends the wait by itself.

What else an accelerator reports (index, driver and CUDA versions, PCI bus id, MIG mode) is
taken as published, and so is the rest of the inventory (host, storage roots, worker).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import (
    HARDWARE_NOT_PENDING,
    HARDWARE_PENDING_CHANGED,
    INVENTORY_ACCELERATORS_ON_CPU,
    INVENTORY_GPU_DUPLICATE,
    NODE_DECOMMISSIONED,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound
from ..store import audit
from ..store.database import Store
from ..store.tables import Node

# What identifies an accelerator besides its UUID: a change in either is held.
IDENTIFYING = ("name", "memory_total_bytes")
# The most GPUs one message names; the lists in the node's ``hardware`` have them all.
DESCRIBED = 8


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _brief(gpu: dict[str, Any]) -> dict[str, Any]:
    return {"uuid": gpu.get("uuid"), "name": gpu.get("name"), **_memory(gpu)}


def _memory(gpu: dict[str, Any]) -> dict[str, Any]:
    return {"memory_total_bytes": gpu.get("memory_total_bytes")}


def _gib(value: Any) -> str:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, int | float) else "?"


@dataclass(frozen=True)
class Difference:
    """How published accelerators differ from the accepted ones, in their order."""

    appeared: list[dict[str, Any]] = field(default_factory=list)
    vanished: list[dict[str, Any]] = field(default_factory=list)
    # {uuid, field, accepted, published} for each identifying field that changed
    changed: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.appeared or self.vanished or self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {"appeared": self.appeared, "vanished": self.vanished, "changed": self.changed}

    def describe(self) -> str:
        """One line for a person, e.g. 'GPU-1 appeared (NVIDIA H100, 80.0 GiB); GPU-0
        vanished; GPU-2 memory 80.0 GiB → 40.0 GiB'."""
        parts = [
            *(
                f"{g['uuid']} appeared ({g['name']}, {_gib(g['memory_total_bytes'])})"
                for g in self.appeared
            ),
            *(f"{g['uuid']} vanished" for g in self.vanished),
            *(
                f"{c['uuid']} {c['field'].split('_')[0]} {_shown(c, 'accepted')} → "
                f"{_shown(c, 'published')}"
                for c in self.changed
            ),
        ]
        more = len(parts) - DESCRIBED
        return "; ".join(parts[:DESCRIBED]) + (f"; and {more} more" if more > 0 else "")


def _shown(change: dict[str, Any], side: str) -> str:
    value = change[side]
    return _gib(value) if change["field"] == "memory_total_bytes" else repr(value)


def difference(accepted: list[dict[str, Any]], published: list[dict[str, Any]]) -> Difference:
    """What changed from ``accepted`` to ``published``, matched by UUID."""
    before = {gpu.get("uuid"): gpu for gpu in accepted}
    after = {gpu.get("uuid"): gpu for gpu in published}
    changed = [
        {"uuid": uuid, "field": name, "accepted": before[uuid].get(name), "published": value}
        for uuid, gpu in after.items()
        if uuid in before
        for name in IDENTIFYING
        if (value := gpu.get(name)) != before[uuid].get(name)
    ]
    return Difference(
        appeared=[_brief(gpu) for uuid, gpu in after.items() if uuid not in before],
        vanished=[_brief(gpu) for uuid, gpu in before.items() if uuid not in after],
        changed=changed,
    )


def check_published(accelerator_mode: str, accelerators: list[dict[str, Any]]) -> None:
    """400 for accelerators no node may publish: any from a ``cpu`` node (it was enrolled
    to run without a GPU), or one UUID twice (a GPU counted twice)."""
    if accelerator_mode == "cpu" and accelerators:
        raise Invalid(
            f"accelerators: a cpu node publishes none; this inventory lists {len(accelerators)}",
            code=INVENTORY_ACCELERATORS_ON_CPU,
            next_step="Enroll the node in nvidia or auto mode (a fresh enrollment token with "
            "that accelerator mode) to use its GPUs.",
        )
    seen: set[str] = set()
    for position, gpu in enumerate(accelerators):
        if gpu["uuid"] in seen:
            raise Invalid(
                f"accelerators[{position}].uuid repeats a GPU listed before it",
                code=INVENTORY_GPU_DUPLICATE,
                next_step="List each GPU once.",
            )
        seen.add(gpu["uuid"])


def accepted_accelerators(node: Node) -> list[dict[str, Any]] | None:
    """The node's accepted accelerators; None before its first inventory."""
    if not node.inventory:
        return None
    return list(json.loads(node.inventory).get("accelerators") or [])


def pending_of(node: Node) -> list[dict[str, Any]] | None:
    """The published accelerators waiting for an administrator; None when none wait."""
    return json.loads(node.pending_accelerators) if node.pending_accelerators else None


def digest_of(pending_json: str) -> str:
    """A short name for what is pending, so an accept takes exactly what was shown."""
    return hashlib.sha256(pending_json.encode()).hexdigest()[:16]


def columns_for(node: Node, inventory: dict[str, Any], now: float) -> dict[str, Any]:
    """The node columns a published inventory writes: the whole inventory when its
    accelerators match the accepted ones (or are the first), otherwise the accepted
    accelerators kept beside the rest of it and the published ones pending."""
    accepted = accepted_accelerators(node)
    published = inventory.get("accelerators") or []
    if accepted is None or not difference(accepted, published):
        return {
            "inventory": _dump(inventory),
            "pending_accelerators": None,
            "hardware_changed_at": None,
        }
    since = node.hardware_changed_at if node.pending_accelerators else None
    return {
        "inventory": _dump({**inventory, "accelerators": accepted}),
        "pending_accelerators": _dump(published),
        "hardware_changed_at": now if since is None else since,
    }


def hardware_view(node: Node) -> dict[str, Any]:
    """The node's ``hardware``: whether published accelerators wait, since when, how they
    differ from the accepted ones and the digest an accept may name."""
    pending = pending_of(node)
    if pending is None:
        return {
            "pending": False,
            "since": None,
            "published": None,
            "difference": None,
            "digest": None,
        }
    return {
        "pending": True,
        "since": isoformat(node.hardware_changed_at),
        "published": pending,
        "difference": difference(accepted_accelerators(node) or [], pending).as_dict(),
        "digest": digest_of(node.pending_accelerators),
    }


def describe_pending(node: Node) -> str | None:
    pending = pending_of(node)
    return (
        None
        if pending is None
        else difference(accepted_accelerators(node) or [], pending).describe()
    )


def accept_hardware(
    store: Store, node_id: str, actor: str, digest: str | None = None
) -> Difference:
    """Make the node's pending accelerators its accepted baseline; return what changed.

    409 ``HARDWARE_NOT_PENDING`` when nothing waits, ``HARDWARE_PENDING_CHANGED`` when
    ``digest`` names other accelerators than those waiting now (the node published again
    since the administrator looked). Audited as ``node.hardware_accepted`` with the
    difference. A conditional update on the pending value: an inventory that lands at the
    same moment is either accepted whole or still pending afterwards, never half of each.
    """
    with store.write():
        query = Node.select().where(Node.node_id == node_id)
        node = (query if store.is_sqlite else query.for_update()).first()
        if node is None:
            raise NotFound(f"no node {node_id}")
        if node.decommissioned_at is not None:
            raise Conflict(
                f"node {node_id} is decommissioned",
                code=NODE_DECOMMISSIONED,
                next_step="Enroll the hardware as a new node to return it to service.",
            )
        if node.pending_accelerators is None:
            raise Conflict(
                f"node {node_id} has no hardware change waiting: its accelerators are "
                "those accepted",
                code=HARDWARE_NOT_PENDING,
                next_step="Nothing to accept; see modelforge nodes show for its GPUs.",
            )
        if digest is not None and digest != digest_of(node.pending_accelerators):
            raise Conflict(
                f"node {node_id} published other accelerators since digest {digest}",
                code=HARDWARE_PENDING_CHANGED,
                next_step="Look at the node's hardware change again and accept what it shows now.",
            )
        published = json.loads(node.pending_accelerators)
        changes = difference(accepted_accelerators(node) or [], published)
        inventory = {**json.loads(node.inventory), "accelerators": published}
        Node.update(
            inventory=_dump(inventory), pending_accelerators=None, hardware_changed_at=None
        ).where(
            (Node.node_id == node_id) & (Node.pending_accelerators == node.pending_accelerators)
        ).execute()
        audit.record(
            store,
            actor,
            "node.hardware_accepted",
            node_id=node_id,
            accelerators=len(published),
            **changes.as_dict(),
        )
    return changes
