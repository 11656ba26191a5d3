"""``modelforge audit``: the append-only audit trail, newest first."""

from __future__ import annotations

import json

import click

from ..store import audit
from .completion import complete_nodes
from .nodes import find_node
from .support import JSON_OPTION, Context, emit


@click.command("audit")
@click.option(
    "--node",
    metavar="NODE",
    shell_complete=complete_nodes,
    help="Only events about this node (id, unique id prefix, hostname or name).",
)
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@click.option(
    "--before",
    type=click.IntRange(min=1),
    help="Events older than this event id (the previous page's next_before).",
)
@JSON_OPTION
@click.pass_obj
def audit_command(
    obj: Context, node: str | None, limit: int, before: int | None, as_json: bool
) -> None:
    """Who did what to which node, and when; never a secret."""
    node_id = find_node(obj, node).node_id if node else None
    page = audit.list_events(obj.store(), limit=limit, before=before, node_id=node_id)
    lines = [f"{'ID':>6} {'AT':24} {'ACTOR':26} {'ACTION':28} NODE / DETAIL"]
    for event in page["events"]:
        detail = json.dumps(event["detail"], sort_keys=True, separators=(",", ":"))
        lines.append(
            f"{event['id']:>6} {event['at']:24} {event['actor'][:26]:26} {event['action']:28} "
            f"{event['node_id'] or '-'} {detail}"
        )
    if page["next_before"]:
        lines.append(f"(older: modelforge audit --before {page['next_before']})")
    emit(as_json, page, "\n".join(lines))
