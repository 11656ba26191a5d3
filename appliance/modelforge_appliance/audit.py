"""The append-only audit trail: who did what to which node, and when. Never a secret."""

from __future__ import annotations

import json
from typing import Any

from .clock import isoformat
from .models import AuditEvent
from .store import Store

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
