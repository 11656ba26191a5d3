"""Work items: submitted by admins, claimed by nodes (leases.py), followed to their end.

States (docs/architecture.md §5): ``queued`` → ``leased`` → ``succeeded`` | ``failed``;
``queued`` or ``leased`` → ``cancelled``; an expired lease goes back to ``queued`` (or
``failed`` once ``max_attempts`` leases were spent). Every transition is audited in the
transaction that makes it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import peewee as pw

from modelforge_contract import (
    FIELD_CHOICE,
    FIELD_FORMAT,
    FIELD_RANGE,
    WORK_CANCELLED,
    WORK_FINISHED,
    WORK_KEY_UNAVAILABLE,
    WORK_LEASED,
    WORK_QUEUED,
    WORK_STATES,
)
from modelforge_contract import containers as fence

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound, StoreUnavailable
from ..core.sealing import SealingError, WorkKeys
from ..core.settings import Settings
from ..core.validation import CAPABILITY_INPUT_FIELDS, check_object
from ..store import audit
from ..store.database import Store
from ..store.tables import WorkItem, WorkLease
from .sealed_input import masked_input, seal_input

DEFAULT_TIMEOUT_SECONDS = 600
DEFAULT_MAX_ATTEMPTS = 3
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")


def dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _load(value: str | None) -> Any:
    return json.loads(value) if value else None


@dataclass(frozen=True)
class Submission:
    capability: str
    input: dict[str, Any]
    constraints: dict[str, Any]
    timeout_seconds: int
    max_attempts: int
    idempotency_key: str | None


def submission_from(fields: dict[str, Any], settings: Settings) -> Submission:
    """Check a submit body (already shape-checked) for what the shape cannot say."""
    input_max_bytes = settings.work_input_max_bytes
    capability = fields["capability"]
    given = fields.get("input") or {}
    if len(dump(given).encode()) > input_max_bytes:
        raise Invalid(
            f"input: at most {input_max_bytes} bytes of JSON",
            code=FIELD_RANGE,
            next_step="Send a smaller input (MODELFORGE_WORK_INPUT_MAX_BYTES sets the limit).",
        )
    checked = check_object(given, CAPABILITY_INPUT_FIELDS[capability], "input")
    if capability == "container":
        checked = _check_container_input(checked, settings)
    constraints = normalise_constraints(fields.get("constraints") or {})
    asked = checked.get("gpus") if capability == "container" else None
    if isinstance(asked, int) and asked > constraints["gpu_count"]:
        # A container asking N GPUs is placed where N are free and leased N by UUID.
        constraints = {**constraints, "gpu_count": asked}
    return Submission(
        capability=capability,
        input=checked,
        constraints=constraints,
        timeout_seconds=fields.get("timeout_seconds") or DEFAULT_TIMEOUT_SECONDS,
        max_attempts=fields.get("max_attempts") or DEFAULT_MAX_ATTEMPTS,
        idempotency_key=fields.get("idempotency_key"),
    )


def _check_container_input(given: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Refuse here, naming the field, whatever the node's dockerd would refuse or the admin's
    maxima do not allow; the input comes back with the fence's defaults filled in, so the
    stored item says what it runs under (docs/work.md, "Limits")."""
    problem = fence.image_reference_problem(given["image"])
    if problem is not None:
        raise Invalid(
            f"input.image: {problem}",
            code=FIELD_FORMAT,
            next_step="Name the image as `docker image ls` shows it, e.g. trainer:1.4.",
        )
    if not _IMAGE_ID.fullmatch(given["image_id"]):
        raise Invalid(
            "input.image_id: must be sha256:<64 hex digits>, the id `docker image inspect` shows",
            code=FIELD_FORMAT,
            next_step="Pin the image by its id: docker image inspect --format '{{.Id}}' IMAGE",
        )
    for name, value in (given.get("env") or {}).items():
        shown = ascii(name)[1:-1][:130]  # the name only, never the value (it may be a secret)
        if not isinstance(value, str) or not fence.ENV_NAME.fullmatch(name):
            raise Invalid(
                f"input.env.{shown}: names must be shell-style (letters, digits, _; no =) and "
                "values strings",
                code=FIELD_FORMAT,
                next_step='Send env as {"NAME": "value", …}.',
            )
        problem = fence.env_value_problem(value)
        if problem is not None:
            raise Invalid(
                f"input.env.{shown}: the value {problem}",
                code=FIELD_FORMAT,
                next_step="Remove the NUL from the value; a process environment cannot hold one.",
            )
    return {**given, **_fenced(given, settings)}


def _fenced(given: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Each limit as asked (at most the admin's maximum) or its default."""
    limits: dict[str, Any] = {}
    for field, default, maximum, setting in (
        ("pids_limit", fence.PIDS_DEFAULT, settings.work_container_max_pids, "PIDS"),
        ("cpus", fence.CPUS_DEFAULT, settings.work_container_max_cpus, "CPUS"),
        (
            "memory_bytes",
            fence.MEMORY_DEFAULT_BYTES,
            settings.work_container_max_memory_bytes,
            "MEMORY_BYTES",
        ),
        (
            "swap_bytes",
            fence.SWAP_DEFAULT_BYTES,
            settings.work_container_max_swap_bytes,
            "SWAP_BYTES",
        ),
        ("tmp_bytes", fence.TMP_DEFAULT_BYTES, settings.work_container_max_tmp_bytes, "TMP_BYTES"),
        ("log_bytes", fence.LOG_DEFAULT_BYTES, settings.work_container_max_log_bytes, "LOG_BYTES"),
    ):
        asked = given.get(field)
        if asked is not None and asked > maximum:
            raise Invalid(
                f"input.{field}: at most {maximum:g} on this control plane",
                code=FIELD_RANGE,
                next_step=f"Ask for less, or raise MODELFORGE_WORK_CONTAINER_MAX_{setting}.",
            )
        limits[field] = asked if asked is not None else min(default, maximum)
    if given.get("run_as_root") and not settings.work_container_allow_root:
        raise Invalid(
            f"input.run_as_root: this control plane runs containers as {fence.NON_ROOT_USER} only",
            code=FIELD_CHOICE,
            next_step="Drop run_as_root, or set MODELFORGE_WORK_CONTAINER_ALLOW_ROOT=true.",
        )
    limits["run_as_root"] = given.get("run_as_root") is True
    allowed = settings.work_container_capabilities
    for i, name in enumerate(given.get("capabilities") or []):
        if name not in allowed:
            raise Invalid(
                f"input.capabilities[{i}]: {name} is not allowed here (allowed: "
                f"{', '.join(allowed) or 'none'})",
                code=FIELD_CHOICE,
                next_step="Ask only for allowed ones, or add it to "
                "MODELFORGE_WORK_CONTAINER_CAPABILITIES.",
            )
    limits["capabilities"] = sorted(set(given.get("capabilities") or []))
    return limits


def normalise_constraints(given: dict[str, Any]) -> dict[str, Any]:
    """The constraints with defaults filled in: naming a GPU memory or model implies one GPU."""
    min_memory = given.get("min_gpu_memory_bytes")
    gpu_name = given.get("gpu_name")
    implied = 1 if (min_memory is not None or gpu_name is not None) else 0
    node_ids = given.get("node_ids")
    return {
        "gpu_count": given.get("gpu_count", implied) or implied,
        "min_gpu_memory_bytes": min_memory,
        "gpu_name": gpu_name,
        "node_ids": sorted(set(node_ids)) if node_ids else None,
    }


def work_view(row: WorkItem) -> dict[str, Any]:
    return {
        "work_id": row.work_id,
        "capability": row.capability,
        "state": row.state,
        "attempts": row.attempts,
        "max_attempts": row.max_attempts,
        "node_id": row.node_id,
        "lease_credential_id": row.lease_credential_id,
        "completed_by_node_id": row.completed_by_node_id,
        "completed_by_credential_id": row.completed_by_credential_id,
        "lease_id": row.lease_id if row.state == WORK_LEASED else None,
        "lease_expires_at": isoformat(row.lease_expires_at) if row.state == WORK_LEASED else None,
        "gpus": _load(row.gpu_uuids) or [],  # the UUIDs its (last) lease held
        # Secret values (env) are never answered after submission, not even this once.
        "input": masked_input(row.capability, _load(row.input)),
        "constraints": _load(row.constraints),
        "timeout_seconds": row.timeout_seconds,
        "idempotency_key": row.idempotency_key,
        "created_by": row.created_by,
        "created_at": isoformat(row.created_at),
        "started_at": isoformat(row.started_at),
        "finished_at": isoformat(row.finished_at),
        "result": _load(row.result),
        "error": _load(row.error),
        "log_tail": row.log_tail,
    }


@dataclass(frozen=True)
class Submitted:
    item: WorkItem
    created: bool  # False: the idempotency key named an item that already existed


def submit_work(store: Store, submission: Submission, actor: str, work_keys: WorkKeys) -> Submitted:
    """Queue an item; the same idempotency key again returns the first item, never a second.

    Its secret input values are sealed for it with ``work_keys`` (sealed_input.py) before
    anything is written: the store never holds them in clear.
    """
    key = submission.idempotency_key
    if key is not None:
        existing = _by_key(store, key)
        if existing is not None:
            return Submitted(existing, created=False)
    constraints = submission.constraints
    now = store.clock.now()
    work_id = str(uuid.uuid4())
    try:
        stored_input = seal_input(submission.capability, submission.input, work_id, work_keys)
    except SealingError as exc:
        raise StoreUnavailable(
            f"the item's secrets cannot be sealed: {exc}",
            code=WORK_KEY_UNAVAILABLE,
            next_step="Fix the work key file as the message says, then submit again; "
            "nothing was queued.",
        ) from None
    try:
        with store.write():
            row = WorkItem.create(
                work_id=work_id,
                capability=submission.capability,
                input=dump(stored_input),
                constraints=dump(constraints),
                gpu_count=constraints["gpu_count"],
                min_gpu_memory_bytes=constraints["min_gpu_memory_bytes"],
                gpu_name=constraints["gpu_name"],
                node_ids=dump(constraints["node_ids"]) if constraints["node_ids"] else None,
                timeout_seconds=submission.timeout_seconds,
                max_attempts=submission.max_attempts,
                idempotency_key=key,
                state=WORK_QUEUED,
                attempts=0,
                created_by=actor,
                created_at=now,
            )
            audit.record(
                store,
                actor,
                "work.submitted",
                work_id=work_id,
                capability=submission.capability,
                constraints=constraints,
                idempotency_key=key,
            )
    except pw.IntegrityError:
        # Invariant: the unique index on the key decides; the loser answers with the winner.
        existing = _by_key(store, key) if key is not None else None
        if existing is None:
            raise
        return Submitted(existing, created=False)
    return Submitted(row, created=True)


def _by_key(store: Store, key: str) -> WorkItem | None:
    with store.connection():
        return WorkItem.get_or_none(WorkItem.idempotency_key == key)


def get_work(store: Store, work_id: str) -> WorkItem:
    with store.connection():
        row = WorkItem.get_or_none(WorkItem.work_id == work_id)
    if row is None:
        raise NotFound(
            f"no work item {work_id}", next_step="List work with GET /api/v1/admin/work."
        )
    return row


def list_work(
    store: Store, *, state: str | None = None, limit: int = 50, before: str | None = None
) -> dict[str, Any]:
    """Newest first; ``next_before`` (a work id) pages further back."""
    if state is not None and state not in WORK_STATES:
        raise Invalid(
            f"state must be one of {', '.join(WORK_STATES)}",
            code="QUERY_INVALID",
            next_step="Use ?state=queued|leased|succeeded|failed|cancelled.",
        )
    query = WorkItem.select().order_by(WorkItem.created_at.desc(), WorkItem.work_id.desc())
    with store.connection():
        if state is not None:
            query = query.where(WorkItem.state == state)
        if before is not None:
            anchor = WorkItem.get_or_none(WorkItem.work_id == before)
            if anchor is None:
                raise Invalid(f"before: no work item {before}", code="QUERY_INVALID")
            query = query.where(
                (WorkItem.created_at < anchor.created_at)
                | ((WorkItem.created_at == anchor.created_at) & (WorkItem.work_id < before))
            )
        rows = list(query.limit(limit))
    items = [work_view(row) for row in rows]
    return {"work": items, "next_before": items[-1]["work_id"] if len(items) == limit else None}


def counts_by_state(store: Store) -> dict[str, int]:
    with store.connection():
        rows = WorkItem.select(WorkItem.state, pw.fn.COUNT(WorkItem.work_id)).group_by(
            WorkItem.state
        )
        tally = {state: count for state, count in rows.tuples()}
    return {state: tally.get(state, 0) for state in WORK_STATES}


def cancel_work(store: Store, work_id: str, actor: str) -> WorkItem:
    """Cancel a queued or leased item; its node learns at its next renewal (409 LEASE_LOST
    with lease_end "cancelled") and stops the item's run."""
    now = store.clock.now()
    with store.write():
        row = WorkItem.get_or_none(WorkItem.work_id == work_id)
        if row is None:
            raise NotFound(f"no work item {work_id}")
        if row.state == WORK_CANCELLED:
            return row
        # Conditional, like every transition: a completion that commits first wins.
        unchanged = (WorkItem.work_id == work_id) & (WorkItem.state == row.state)
        if row.state == WORK_LEASED:
            unchanged &= WorkItem.lease_id == row.lease_id
        cancelled = 0
        if row.state in (WORK_QUEUED, WORK_LEASED):
            cancelled = (
                WorkItem.update(state=WORK_CANCELLED, finished_at=now, lease_expires_at=None)
                .where(unchanged)
                .execute()
            )
        if cancelled != 1:
            current = WorkItem.get_by_id(work_id)
            raise Conflict(
                f"work item {work_id} already finished ({current.state})",
                code=WORK_FINISHED,
                next_step="Nothing to cancel; submit a new item if it should run again.",
            )
        if row.state == WORK_LEASED:
            WorkLease.update(ended_at=now, end_reason="cancelled").where(
                (WorkLease.lease_id == row.lease_id) & WorkLease.ended_at.is_null()
            ).execute()
        audit.record(
            store,
            actor,
            "work.cancelled",
            node_id=row.node_id if row.state == WORK_LEASED else None,
            work_id=work_id,
            previous_state=row.state,
            lease_id=row.lease_id if row.state == WORK_LEASED else None,
        )
    return WorkItem.get_by_id(work_id)
