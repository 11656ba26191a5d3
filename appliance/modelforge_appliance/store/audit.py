"""The append-only audit trail: who did what to which node, and when. Never a secret."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from ..core.clock import isoformat
from .database import Store
from .tables import AuditEvent

CLI_ACTOR = "cli"


def admin_actor(token_id: str) -> str:
    return f"admin:{token_id}"


# One prepared statement: the work plane appends an event per claim and completion.
_INSERT_SQL = "INSERT INTO audit_event (at, actor, action, node_id, detail) VALUES (?, ?, ?, ?, ?)"


def record(
    store: Store, actor: str, action: str, *, node_id: str | None = None, **detail: Any
) -> None:
    """Append one event. Call inside the transaction whose change it describes."""
    store.db.execute_sql(
        _INSERT_SQL.replace("?", store.db.param),
        (
            store.clock.now(),
            actor,
            action,
            node_id,
            json.dumps(detail, sort_keys=True, separators=(",", ":")),
        ),
    )


def record_alone(store: Store, actor: str, action: str, **kwargs: Any) -> None:
    """Append an event in its own transaction (refusals, whose own change rolled back)."""
    with store.write():
        record(store, actor, action, **kwargs)


# A refusal of one kind for one subject is written at most once per window; the ones in
# between are counted and written with the next row (or at shutdown).
REFUSAL_WINDOW_SECONDS = 60.0
REFUSAL_SUBJECTS_TRACKED = 10_000


@dataclass
class _Refusals:
    written_at: float
    actor: str
    action: str
    detail: dict[str, Any]
    unrecorded: int = 0


class RefusalLog:
    """Audited refusals without one fsync'd row per attempt.

    Someone replaying a consumed enrollment token can send hundreds of requests a second;
    each used to append (and fsync) its own row. Here the first refusal of a kind
    (``key``, e.g. token and error code) is written at once; repeats within the window
    are only counted, and the next row written for that key carries the count as
    ``unrecorded_repeats``. Every refusal is still counted in the metrics.
    """

    def __init__(
        self,
        store: Store,
        window: float = REFUSAL_WINDOW_SECONDS,
        capacity: int = REFUSAL_SUBJECTS_TRACKED,
    ) -> None:
        self.store, self.window, self.capacity = store, window, capacity
        self._seen: dict[tuple[str, ...], _Refusals] = {}
        self._lock = threading.Lock()

    def record(self, key: tuple[str, ...], actor: str, action: str, **detail: Any) -> bool:
        """Write this refusal, or count it; True when a row was written."""
        now = self.store.clock.now()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen.written_at < self.window:
                seen.unrecorded += 1
                return False
            unrecorded = seen.unrecorded if seen is not None else 0
            if seen is not None or self._make_room(now):
                self._seen[key] = _Refusals(now, actor, action, detail)
        if unrecorded:
            detail = {**detail, "unrecorded_repeats": unrecorded}
        record_alone(self.store, actor, action, **detail)
        return True

    def _make_room(self, now: float) -> bool:
        """Room to track one more key; past capacity, forget the quiet expired ones."""
        if len(self._seen) < self.capacity:
            return True
        for key in [k for k, v in self._seen.items() if not v.unrecorded]:
            if now - self._seen[key].written_at >= self.window:
                del self._seen[key]
        return len(self._seen) < self.capacity  # if not, write every refusal of new keys

    def flush(self) -> int:
        """Write the counts not yet written (at shutdown); return how many rows."""
        rows = []
        with self._lock:
            for seen in self._seen.values():
                if seen.unrecorded:
                    detail = {**seen.detail, "unrecorded_repeats": seen.unrecorded}
                    rows.append((seen.actor, seen.action, detail))
                    seen.unrecorded = 0
        if rows:
            with self.store.write():
                for actor, action, detail in rows:
                    record(self.store, actor, action, **detail)
        return len(rows)


def event_view(event: AuditEvent) -> dict[str, Any]:
    return {
        "id": event.id,
        "at": isoformat(event.at),
        "actor": event.actor,
        "action": event.action,
        "node_id": event.node_id,
        "detail": json.loads(event.detail),
    }


def list_events(
    store: Store, *, limit: int = 50, before: int | None = None, node_id: str | None = None
) -> dict[str, Any]:
    """Newest first; ``next_before`` pages further back."""
    query = AuditEvent.select().order_by(AuditEvent.id.desc()).limit(limit)
    if before is not None:
        query = query.where(AuditEvent.id < before)
    if node_id is not None:
        query = query.where(AuditEvent.node_id == node_id)
    with store.connection():
        events = [event_view(event) for event in query]
    next_before = events[-1]["id"] if len(events) == limit else None
    return {"events": events, "next_before": next_before}
