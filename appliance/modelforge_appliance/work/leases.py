"""Leases on work items: claims, renewals, completions, expiry and returns (placement.py
says who may claim what).

Every transition is a conditional ``UPDATE`` whose row count decides, on SQLite and
PostgreSQL alike (the same rule as invariant 2's token claim): two nodes racing for one
item, a completion racing an expiry or a cancel — exactly one of them changes the row,
and only that one writes its lease row and audit event.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import (
    FIELD_RANGE,
    LEASE_EXPIRED,
    LEASE_LOST,
    WORK_FAILED,
    WORK_LEASED,
    WORK_LOG_TAIL_MAX_CHARS,
    WORK_QUEUED,
    WORK_RESULT_MAX_BYTES,
    WORK_SECRET_UNREADABLE,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid
from ..core.sealing import SealingError, WorkKeys
from ..core.settings import Settings
from ..identity.credentials import Caller
from ..store import audit
from ..store.database import Store
from ..store.tables import Node, WorkItem, WorkLease
from .items import dump
from .placement import (
    Candidate,
    fits,
    gpus_in_use_by_work,
    ineligibility,
    node_gpus,
    pick_gpus,
    reported_by,
    scan_candidates,
    work_slots,
)
from .sealed_input import SealedInputUnreadable, open_input

log = logging.getLogger(__name__)


def node_actor(node_id: str) -> str:
    return f"node:{node_id}"


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
    gpus: tuple[str, ...] = field(default=())  # the UUIDs this lease holds, picked at claim

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
            "gpus": list(self.gpus),
        }


def claim_work(
    store: Store,
    settings: Settings,
    caller: Caller,
    capabilities: list[str],
    pending: tuple[float, str] | None = None,
    reported_slots: int = 1,
    held_elsewhere: Callable[[str], Collection[str]] | None = None,
) -> Lease | str:
    """Lease the oldest queued item this node fits, or say (as a claim reason) why none.

    ``pending`` is the node's newest heartbeat (time, health JSON) not yet in the store.
    ``reported_slots`` is the work slots the agent says it runs (1 when it does not say);
    the node never holds more leases than that or its administrator's maximum.
    ``held_elsewhere(node_id)`` names GPU UUIDs of the node held by something other than
    work items (a deployment's servers); it is called inside the claim's connection and
    again inside its write transaction. An item asking N GPUs is leased exactly N of the
    node's measured GPUs that neither another leased item nor ``held_elsewhere`` holds.
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
    slots = work_slots(node, reported_slots, settings)

    def held_now() -> set[str]:
        held = gpus_in_use_by_work(store, node.node_id)
        if held_elsewhere is not None:
            held.update(held_elsewhere(node.node_id))
        return held

    # Look before locking: most claims of an idle fleet find nothing, and must not queue
    # behind (or hold up) the writers. What is found is only a hint; the conditional
    # update inside the write transaction decides.
    with store.connection():
        if held_leases(store, node.node_id) >= slots:
            return "slots_full"
        held = held_now()
        hint = next(
            (
                c
                for c in scan_candidates(store, node.node_id, wanted, gpus, held)
                if fits(c, node.node_id, gpus, held)
            ),
            None,
        )
    if hint is None:
        return "no_fitting_item"
    # Not flushed: a claim lost to a power cut only makes the item run again.
    with store.write(flushed=False):
        # The lease's own time is read where it is granted: an expiry that freed the item
        # after the look above committed before this transaction, so the lease never
        # starts (and runs out) before the time that freed it.
        now = store.clock.now()
        # Counted again where it decides: this node's other claims commit one at a time
        # (SQLite's write lock; on PostgreSQL the node's row, locked first).
        if not store.is_sqlite:
            _execute(store, _LOCK_NODE_SQL_PG, (node.node_id,))
        if held_leases(store, node.node_id) >= slots:
            return "slots_full"
        # Read again where it decides: the GPUs are this node's, and its claims (and a
        # deployment placing servers on it) commit one at a time.
        held = held_now()
        uuids = pick_gpus(hint, node.node_id, gpus, held)
        if uuids is not None:
            lease = _lease(store, settings, caller, hint, now, uuids)
            if lease is not None:
                return lease
        # Another node took the hint, or its GPUs were taken in between.
        for item in scan_candidates(store, node.node_id, wanted, gpus, held):
            uuids = pick_gpus(item, node.node_id, gpus, held)
            if uuids is not None:
                lease = _lease(store, settings, caller, item, now, uuids)
                if lease is not None:
                    return lease
    return "no_fitting_item"


_HELD_SQL = "SELECT COUNT(*) FROM work_item WHERE node_id = ? AND state = 'leased'"
# Only this node's claims wait for it (and its heartbeat writes, briefly); not a key lock,
# so rows referring to the node (leases, audit events) are never held up.
_LOCK_NODE_SQL_PG = "SELECT node_id FROM node WHERE node_id = ? FOR NO KEY UPDATE"


def held_leases(store: Store, node_id: str) -> int:
    """How many items the node holds leased now (inside the caller's connection)."""
    (count,) = _execute(store, _HELD_SQL, (node_id,)).fetchone()
    return count


_LEASE_SQL = (
    "UPDATE work_item SET state = 'leased', node_id = ?, lease_credential_id = ?, "
    "lease_id = ?, lease_expires_at = ?, gpu_uuids = ?, attempts = attempts + 1, "
    "started_at = COALESCE(started_at, ?) WHERE work_id = ? AND state = 'queued'"
)
# PostgreSQL: a claim never waits for a row another transaction holds (it tries the next
# item instead), so it can never be part of a lock cycle with a completion group or an
# expiry, which take their rows in work_id order. The row count still decides.
_LEASE_SQL_PG = _LEASE_SQL.replace(
    "WHERE work_id = ? AND state = 'queued'",
    "WHERE work_id = (SELECT work_id FROM work_item WHERE work_id = ? AND state = 'queued' "
    "FOR UPDATE SKIP LOCKED)",
)
_LEASED_SQL = "SELECT capability, input, timeout_seconds, attempts FROM work_item WHERE work_id = ?"
_NEW_LEASE_SQL = (
    "INSERT INTO work_lease (lease_id, work_id, node_id, credential_id, attempt, granted_at, "
    "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _execute(store: Store, sql: str, params: tuple) -> Any:
    """A prepared statement of the hot paths, with the store's placeholder."""
    return store.db.execute_sql(sql.replace("?", store.db.param), params)


def _lease(
    store: Store,
    settings: Settings,
    caller: Caller,
    item: Candidate,
    now: float,
    gpus: list[str],
) -> Lease | None:
    node_id, credential_id = caller.node_id, caller.credential_id
    lease_id = uuid.uuid4().hex
    expires_at = now + settings.work_lease_seconds
    # The conditional update whose row count picks the one winner.
    sql = _LEASE_SQL if store.is_sqlite else _LEASE_SQL_PG
    uuids = dump(gpus) if gpus else None
    held = (node_id, credential_id, lease_id, expires_at, uuids, now, item.work_id)
    if _execute(store, sql, held).rowcount != 1:
        return None
    capability, given, timeout_seconds, attempt = _execute(
        store, _LEASED_SQL, (item.work_id,)
    ).fetchone()
    try:
        # The only place a secret is opened: for the answer to the node that won the item.
        opened = open_input(
            capability, json.loads(given), item.work_id, WorkKeys.of(settings.state_dir)
        )
    except (SealedInputUnreadable, SealingError) as exc:
        _fail_unreadable(store, node_id, item.work_id, lease_id, now, exc)
        return None
    _execute(
        store,
        _NEW_LEASE_SQL,
        (lease_id, item.work_id, node_id, credential_id, attempt, now, expires_at),
    )
    audit.record(
        store,
        node_actor(node_id),
        "work.leased",
        node_id=node_id,
        credential_id=credential_id,
        work_id=item.work_id,
        lease_id=lease_id,
        attempt=attempt,
        expires_at=isoformat(expires_at),
        gpus=gpus,
    )
    return Lease(
        work_id=item.work_id,
        lease_id=lease_id,
        expires_at=expires_at,
        lease_seconds=settings.work_lease_seconds,
        attempt=attempt,
        capability=capability,
        input=opened,
        timeout_seconds=timeout_seconds,
        gpus=tuple(gpus),
    )


_UNREADABLE_SQL = (
    "UPDATE work_item SET state = 'failed', finished_at = ?, error = ?, node_id = NULL, "
    "lease_credential_id = NULL, lease_expires_at = NULL, attempts = attempts - 1 "
    "WHERE work_id = ? AND lease_id = ?"
)


def _fail_unreadable(
    store: Store,
    node_id: str,
    work_id: str,
    lease_id: str,
    now: float,
    exc: SealedInputUnreadable | SealingError,
) -> None:
    """Fail, in the claim's transaction, an item whose sealed input does not open here: it
    fails closed and says why, instead of reaching a node without its secrets (or staying
    queued for every claim to trip on). No node got it, so no attempt is counted."""
    what = str(exc) if isinstance(exc, SealedInputUnreadable) else f"sealed input: {exc}"
    message = (
        f"the item's {what}; it was not handed to any node. Put back the work key file it "
        "was sealed with (docs/work.md, 'Secrets'), or submit the item again."
    )
    error = {"code": WORK_SECRET_UNREADABLE, "message": message}
    _execute(store, _UNREADABLE_SQL, (now, dump(error), work_id, lease_id))
    audit.record(
        store,
        "control-plane",
        "work.secret_unreadable",
        node_id=node_id,
        work_id=work_id,
        field=getattr(exc, "field", None),
        key_id=getattr(exc, "key_id", None),
    )
    log.warning(
        "work %s failed without reaching a node (%s): %s", work_id, WORK_SECRET_UNREADABLE, exc
    )


# Both only while the item is still leased to this node under this lease, and it is alive.
_RENEW_SQL = (
    "UPDATE work_item SET lease_expires_at = ? WHERE work_id = ? AND lease_id = ? "
    "AND node_id = ? AND state = 'leased' AND lease_expires_at > ?"
)
_RENEW_LEASE_SQL = "UPDATE work_lease SET expires_at = ? WHERE lease_id = ?"
_COMPLETE_SQL = (
    "UPDATE work_item SET state = ?, finished_at = ?, result = ?, log_tail = ?, error = ?, "
    "completed_by_node_id = ?, completed_by_credential_id = ?, lease_expires_at = NULL "
    "WHERE work_id = ? AND lease_id = ? AND node_id = ? AND state = 'leased' "
    "AND lease_expires_at > ?"
)
_END_LEASE_SQL = (
    "UPDATE work_lease SET ended_at = ?, end_reason = ? WHERE lease_id = ? AND ended_at IS NULL"
)


def _lease_lost(work_id: str, ended: str | None = None) -> Conflict:
    """409 LEASE_LOST; ``lease_end`` says how this node's lease ended, when it has ended
    ("cancelled" tells the agent to stop the item's run at once)."""
    return Conflict(
        f"the lease on work item {work_id} is no longer held by this node: it expired, was "
        "cancelled, returned or completed, or the item was leased again",
        code=LEASE_LOST,
        next_step="Stop working on this item and claim new work; nothing was changed.",
        extra={"lease_end": ended} if ended else None,
    )


_LEASE_END_SQL = (
    "SELECT end_reason FROM work_lease WHERE lease_id = ? AND work_id = ? AND node_id = ?"
)


def _lease_end(store: Store, work_id: str, lease_id: str, node_id: str) -> str | None:
    """How this node's own lease ended (None: it has not, or it is not this node's)."""
    row = _execute(store, _LEASE_END_SQL, (lease_id, work_id, node_id)).fetchone()
    return row[0] if row else None


def renew_lease(
    store: Store, settings: Settings, caller: Caller, work_id: str, lease_id: str
) -> float:
    """Extend a live lease by the lease period; 409 LEASE_LOST otherwise."""
    now = store.clock.now()
    expires_at = now + settings.work_lease_seconds
    with store.write(flushed=False):
        held = (work_id, lease_id, caller.node_id, now)
        if _execute(store, _RENEW_SQL, (expires_at, *held)).rowcount != 1:
            raise _lease_lost(work_id, _lease_end(store, work_id, lease_id, caller.node_id))
        _execute(store, _RENEW_LEASE_SQL, (expires_at, lease_id))
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
) -> Completed:
    """Record the outcome under a live lease; a lost lease changes nothing (409 LEASE_LOST).

    The outcome is the node's own claim: it is recorded as that node's and credential's,
    not checked (docs/work.md).
    """
    result_json = dump(result) if result is not None else None
    if result_json is not None and len(result_json.encode()) > WORK_RESULT_MAX_BYTES:
        raise Invalid(
            f"result: at most {WORK_RESULT_MAX_BYTES} bytes of JSON",
            code=FIELD_RANGE,
            next_step="Put large output in the log tail or in storage, not in the result.",
        )
    now = store.clock.now()
    values = (
        outcome,
        now,
        result_json,
        trimmed_log(log_tail),
        dump(error) if error else None,
        caller.node_id,
        caller.credential_id,
    )

    def complete() -> Completed:
        held = (work_id, lease_id, caller.node_id, now)
        if _execute(store, _COMPLETE_SQL, (*values, *held)).rowcount != 1:
            raise _lease_lost(work_id)
        _execute(store, _END_LEASE_SQL, (now, "completed", lease_id))
        audit.record(
            store,
            node_actor(caller.node_id),
            "work.completed",
            node_id=caller.node_id,
            credential_id=caller.credential_id,
            work_id=work_id,
            lease_id=lease_id,
            outcome=outcome,
            error_code=(error or {}).get("code"),
        )
        (created_at,) = _execute(
            store, "SELECT created_at FROM work_item WHERE work_id = ?", (work_id,)
        ).fetchone()
        return Completed(work_id, outcome, created_at, now)

    # Flushed before the agent hears 200, and one flush serves every completion waiting.
    return store.grouped(complete, order=work_id)


@dataclass(frozen=True)
class Completed:
    work_id: str
    state: str
    created_at: float
    finished_at: float


# -- expiry and returns ---------------------------------------------------------------


_EXPIRED_SQL = (
    "SELECT work_id, lease_id, node_id, attempts, max_attempts FROM work_item "
    "WHERE state = 'leased' AND lease_expires_at <= ?"
)


@dataclass(frozen=True)
class Expired:
    work_id: str
    lease_id: str
    node_id: str
    attempts: int
    max_attempts: int


def expire_leases(store: Store) -> list[dict[str, Any]]:
    """Return every item whose lease ran out to the queue, or fail it after max_attempts.

    Called before claims and admin reads, so the answer is the same whichever
    control-plane process (or CLI) looks first; the conditional update decides who records it.
    """
    now = store.clock.now()
    with store.connection():
        expired = sorted(  # rows are taken in work_id order (see _LEASE_SQL_PG)
            (Expired(*row) for row in _execute(store, _EXPIRED_SQL, (now,)).fetchall()),
            key=lambda row: row.work_id,
        )
    if not expired:
        return []
    done = []
    with store.write(flushed=False):  # recomputed from the lease times if lost
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
                values = {
                    "state": WORK_QUEUED,
                    "node": None,
                    "lease_credential_id": None,
                    "gpu_uuids": None,
                }
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
        WorkItem.select(WorkItem.work_id, WorkItem.lease_id)
        .where((WorkItem.node == node.node_id) & (WorkItem.state == WORK_LEASED))
        .order_by(WorkItem.work_id)  # rows are taken in work_id order (see _LEASE_SQL_PG)
    )
    for row in rows:
        changed = (
            WorkItem.update(
                state=WORK_QUEUED,
                node=None,
                lease_credential_id=None,
                lease_expires_at=None,
                gpu_uuids=None,
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
