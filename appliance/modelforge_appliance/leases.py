"""Leases on work items: who may claim what, renewals, completions, expiry and returns.

Every transition is a conditional ``UPDATE`` whose row count decides, on SQLite and
PostgreSQL alike (the same rule as invariant 2's token claim): two nodes racing for one
item, a completion racing an expiry or a cancel — exactly one of them changes the row,
and only that one writes its lease row and audit event.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import peewee as pw

from modelforge_contract import (
    ACCEPTED_PROTOCOL_VERSIONS,
    COMPATIBLE,
    FIELD_RANGE,
    LEASE_EXPIRED,
    LEASE_LOST,
    ONLINE,
    WORK_FAILED,
    WORK_LEASED,
    WORK_LOG_TAIL_MAX_CHARS,
    WORK_QUEUED,
    WORK_RESULT_MAX_BYTES,
    worker_compatibility_of,
)

from . import audit
from .clock import isoformat
from .credentials import Caller
from .errors import Conflict, Invalid
from .models import Node, WorkItem, WorkLease
from .nodes import liveness_of
from .settings import Settings
from .store import Store
from .work import dump

log = logging.getLogger(__name__)

CANDIDATE_BATCH = 100


def node_actor(node_id: str) -> str:
    return f"node:{node_id}"


# -- placement -------------------------------------------------------------------


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


def worker_answer(health: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """The compatibility of the worker the agent reported, and what it reported."""
    worker = (health or {}).get("worker")
    if not worker or not worker.get("reachable"):
        return "UNREACHABLE" if worker else "UNREPORTED", worker
    return worker_compatibility_of(worker.get("protocol")), worker


def ineligibility(node: Node, reported: Reported, now: float, settings: Settings) -> str | None:
    """Why this node may not claim now (one of CLAIM_REASONS), or None when it may."""
    seen = Node(**{**node.__data__, "last_heartbeat_at": reported.last_heartbeat_at})
    if liveness_of(seen, now, settings) != ONLINE:  # invariant 7
        return "not_online"
    if node.cordoned:
        return "cordoned"
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


def node_gpus(node: Node) -> list[dict[str, Any]]:
    inventory = json.loads(node.inventory) if node.inventory else {}
    return list(inventory.get("accelerators") or [])


def fits(item: WorkItem, node_id: str, gpus: list[dict[str, Any]]) -> bool:
    """Whether the node's measured GPUs meet every constraint of the item."""
    if item.node_ids and node_id not in json.loads(item.node_ids):
        return False
    if item.gpu_count == 0:
        return True
    fitting = [
        gpu
        for gpu in gpus
        if (
            item.min_gpu_memory_bytes is None
            or gpu.get("memory_total_bytes", 0) >= item.min_gpu_memory_bytes
        )
        and (item.gpu_name is None or item.gpu_name.lower() in str(gpu.get("name", "")).lower())
    ]
    return len(fitting) >= item.gpu_count


def _candidates(node: Node, capabilities: list[str], gpus: list[dict[str, Any]]) -> pw.Query:
    """Queued items the node might fit, oldest first; ``fits`` makes the exact decision."""
    largest = max((gpu.get("memory_total_bytes", 0) for gpu in gpus), default=0)
    return (
        WorkItem.select()
        .where(
            (WorkItem.state == WORK_QUEUED)
            & WorkItem.capability.in_(capabilities)
            & (WorkItem.gpu_count <= len(gpus))
            & (WorkItem.min_gpu_memory_bytes.is_null() | (WorkItem.min_gpu_memory_bytes <= largest))
            & (WorkItem.node_ids.is_null() | WorkItem.node_ids.contains(json.dumps(node.node_id)))
        )
        .order_by(WorkItem.created_at, WorkItem.work_id)
    )


# -- claim, renew, complete ------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    work_id: str
    lease_id: str
    expires_at: float
    lease_seconds: int
    attempt: int
    capability: str
    input: dict[str, Any]
    timeout_seconds: int

    def view(self) -> dict[str, Any]:
        return {
            "work_id": self.work_id,
            "lease_id": self.lease_id,
            "expires_at": isoformat(self.expires_at),
            "lease_seconds": self.lease_seconds,
            "attempt": self.attempt,
            "capability": self.capability,
            "input": self.input,
            "timeout_seconds": self.timeout_seconds,
        }


def claim_work(
    store: Store,
    settings: Settings,
    caller: Caller,
    capabilities: list[str],
    pending: tuple[float, str] | None = None,
) -> Lease | str:
    """Lease the oldest queued item this node fits, or say (as a claim reason) why none.

    ``pending`` is the node's newest heartbeat (time, health JSON) not yet in the store.
    """
    now = store.clock.now()
    with store.connection():
        node = Node.get_by_id(caller.node_id)
    pending_at, pending_health = pending or (None, None)
    reported = reported_by(node, pending_at, pending_health)
    reason = ineligibility(node, reported, now, settings)
    if reason is not None:
        return reason
    offered = set((reported.health or {}).get("worker", {}).get("capabilities") or capabilities)
    wanted = sorted(set(capabilities) & offered)
    if not wanted:
        return "no_fitting_item"
    gpus = node_gpus(node)
    with store.write():
        query = _candidates(node, wanted, gpus)
        offset = 0
        while True:
            batch = list(query.offset(offset).limit(CANDIDATE_BATCH))
            for item in batch:
                if fits(item, node.node_id, gpus):
                    lease = _lease(store, settings, node.node_id, item, now)
                    if lease is not None:
                        return lease
            if len(batch) < CANDIDATE_BATCH:
                return "no_fitting_item"
            offset += CANDIDATE_BATCH


def _lease(
    store: Store, settings: Settings, node_id: str, item: WorkItem, now: float
) -> Lease | None:
    lease_id = uuid.uuid4().hex
    expires_at = now + settings.work_lease_seconds
    # The conditional update whose row count picks the one winner.
    won = (
        WorkItem.update(
            state=WORK_LEASED,
            node=node_id,
            lease_id=lease_id,
            lease_expires_at=expires_at,
            attempts=WorkItem.attempts + 1,
            started_at=pw.fn.COALESCE(WorkItem.started_at, now),
        )
        .where((WorkItem.work_id == item.work_id) & (WorkItem.state == WORK_QUEUED))
        .execute()
    )
    if won != 1:
        return None
    attempt = item.attempts + 1
    WorkLease.create(
        lease_id=lease_id,
        work=item.work_id,
        node=node_id,
        attempt=attempt,
        granted_at=now,
        expires_at=expires_at,
    )
    audit.record(
        store,
        node_actor(node_id),
        "work.leased",
        node_id=node_id,
        work_id=item.work_id,
        lease_id=lease_id,
        attempt=attempt,
        expires_at=isoformat(expires_at),
    )
    return Lease(
        work_id=item.work_id,
        lease_id=lease_id,
        expires_at=expires_at,
        lease_seconds=settings.work_lease_seconds,
        attempt=attempt,
        capability=item.capability,
        input=json.loads(item.input),
        timeout_seconds=item.timeout_seconds,
    )


def _held(caller: Caller, work_id: str, lease_id: str, now: float) -> pw.Expression:
    """The item is still leased to this node under this lease, and the lease is alive."""
    return (
        (WorkItem.work_id == work_id)
        & (WorkItem.lease_id == lease_id)
        & (WorkItem.node == caller.node_id)
        & (WorkItem.state == WORK_LEASED)
        & (WorkItem.lease_expires_at > now)
    )


def _lease_lost(work_id: str) -> Conflict:
    return Conflict(
        f"the lease on work item {work_id} is no longer held by this node: it expired, was "
        "cancelled, returned or completed, or the item was leased again",
        code=LEASE_LOST,
        next_step="Stop working on this item and claim new work; nothing was changed.",
    )


def renew_lease(
    store: Store, settings: Settings, caller: Caller, work_id: str, lease_id: str
) -> float:
    """Extend a live lease by the lease period; 409 LEASE_LOST otherwise."""
    now = store.clock.now()
    expires_at = now + settings.work_lease_seconds
    with store.write():
        renewed = (
            WorkItem.update(lease_expires_at=expires_at)
            .where(_held(caller, work_id, lease_id, now))
            .execute()
        )
        if renewed != 1:
            raise _lease_lost(work_id)
        WorkLease.update(expires_at=expires_at).where(WorkLease.lease_id == lease_id).execute()
    return expires_at


def trimmed_log(log_tail: str | None) -> str | None:
    if log_tail is None:
        return None
    return log_tail[-WORK_LOG_TAIL_MAX_CHARS:]


def complete_work(
    store: Store,
    caller: Caller,
    work_id: str,
    lease_id: str,
    *,
    outcome: str,
    result: dict[str, Any] | None,
    log_tail: str | None,
    error: dict[str, Any] | None,
) -> WorkItem:
    """Record the outcome under a live lease; a lost lease changes nothing (409 LEASE_LOST)."""
    result_json = dump(result) if result is not None else None
    if result_json is not None and len(result_json.encode()) > WORK_RESULT_MAX_BYTES:
        raise Invalid(
            f"result: at most {WORK_RESULT_MAX_BYTES} bytes of JSON",
            code=FIELD_RANGE,
            next_step="Put large output in the log tail or in storage, not in the result.",
        )
    now = store.clock.now()
    with store.write():
        completed = (
            WorkItem.update(
                state=outcome,
                finished_at=now,
                result=result_json,
                log_tail=trimmed_log(log_tail),
                error=dump(error) if error else None,
                lease_expires_at=None,
            )
            .where(_held(caller, work_id, lease_id, now))
            .execute()
        )
        if completed != 1:
            raise _lease_lost(work_id)
        WorkLease.update(ended_at=now, end_reason="completed").where(
            WorkLease.lease_id == lease_id
        ).execute()
        audit.record(
            store,
            node_actor(caller.node_id),
            "work.completed",
            node_id=caller.node_id,
            work_id=work_id,
            lease_id=lease_id,
            outcome=outcome,
            error_code=(error or {}).get("code"),
        )
    return WorkItem.get_by_id(work_id)


# -- expiry and returns ---------------------------------------------------------------


def expire_leases(store: Store) -> list[dict[str, Any]]:
    """Return every item whose lease ran out to the queue, or fail it after max_attempts.

    Called before claims and admin reads, so the answer is the same whichever
    control-plane process (or CLI) looks first; the conditional update decides who records it.
    """
    now = store.clock.now()
    with store.connection():
        expired = list(
            WorkItem.select(
                WorkItem.work_id,
                WorkItem.lease_id,
                WorkItem.node,
                WorkItem.attempts,
                WorkItem.max_attempts,
            ).where((WorkItem.state == WORK_LEASED) & (WorkItem.lease_expires_at <= now))
        )
    if not expired:
        return []
    done = []
    with store.write():
        for row in expired:
            exhausted = row.attempts >= row.max_attempts
            if exhausted:
                message = f"the lease expired on attempt {row.attempts} of {row.max_attempts}"
                values = {
                    "state": WORK_FAILED,
                    "finished_at": now,
                    "error": dump({"code": LEASE_EXPIRED, "message": message}),
                }
            else:
                values = {"state": WORK_QUEUED, "node": None}
            changed = (
                WorkItem.update(lease_expires_at=None, **values)
                .where(
                    (WorkItem.work_id == row.work_id)
                    & (WorkItem.lease_id == row.lease_id)
                    & (WorkItem.state == WORK_LEASED)
                    & (WorkItem.lease_expires_at <= now)
                )
                .execute()
            )
            if changed != 1:
                continue
            WorkLease.update(ended_at=now, end_reason="expired").where(
                (WorkLease.lease_id == row.lease_id) & WorkLease.ended_at.is_null()
            ).execute()
            entry = {
                "work_id": row.work_id,
                "lease_id": row.lease_id,
                "state": values["state"],
            }
            audit.record(store, "control-plane", "work.lease_expired", node_id=row.node_id, **entry)
            done.append(entry)
    if done:
        log.info("%d lease(s) expired", len(done))
    return done


def leased_work_ids(node: Node) -> list[str]:
    """Items currently leased to node (inside the caller's connection)."""
    return [
        row.work_id
        for row in WorkItem.select(WorkItem.work_id)
        .where((WorkItem.node == node.node_id) & (WorkItem.state == WORK_LEASED))
        .order_by(WorkItem.work_id)
    ]


def return_node_leases(store: Store, node: Node, actor: str, reason: str) -> list[str]:
    """Put the node's leased items back in the queue (inside the caller's transaction).

    The node was taken away by an administrator, so the attempt does not count.
    """
    now = store.clock.now()
    returned = []
    rows = list(
        WorkItem.select(WorkItem.work_id, WorkItem.lease_id).where(
            (WorkItem.node == node.node_id) & (WorkItem.state == WORK_LEASED)
        )
    )
    for row in rows:
        changed = (
            WorkItem.update(
                state=WORK_QUEUED,
                node=None,
                lease_expires_at=None,
                attempts=WorkItem.attempts - 1,
            )
            .where(
                (WorkItem.work_id == row.work_id)
                & (WorkItem.lease_id == row.lease_id)
                & (WorkItem.state == WORK_LEASED)
            )
            .execute()
        )
        if changed != 1:
            continue
        WorkLease.update(ended_at=now, end_reason="returned").where(
            (WorkLease.lease_id == row.lease_id) & WorkLease.ended_at.is_null()
        ).execute()
        audit.record(
            store,
            actor,
            "work.lease_returned",
            node_id=node.node_id,
            work_id=row.work_id,
            lease_id=row.lease_id,
            reason=reason,
        )
        returned.append(row.work_id)
    return sorted(returned)
