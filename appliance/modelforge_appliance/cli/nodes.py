"""``modelforge nodes …`` and ``alerts``: fleet operations from the host."""

from __future__ import annotations

import click

from .. import alerts, audit, credentials, decommission, nodes, readiness
from ..errors import ApiError
from .support import JSON_OPTION, Context, confirmed, emit, fail


def _node(obj: Context, node_id: str):
    try:
        return nodes.get_node(obj.store(), node_id)
    except ApiError as exc:
        fail(exc.message)


def _table(rows: list[dict]) -> str:
    lines = [f"{'NODE ID':38} {'NAME':20} {'HOSTNAME':20} {'LIVENESS':14} LAST HEARTBEAT"]
    for row in rows:
        cordoned = " (cordoned)" if row["cordoned"] and row["liveness"] != "decommissioned" else ""
        lines.append(
            f"{row['node_id']:38} {row['display_name'][:20]:20} {row['hostname'][:20]:20} "
            f"{row['liveness']:14} {row['last_heartbeat_at'] or '-'}{cordoned}"
        )
    return "\n".join(lines)


@click.group("nodes", invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def nodes_group(ctx: click.Context, as_json: bool) -> None:
    """List nodes with their liveness, or act on one (see the commands below)."""
    if ctx.invoked_subcommand is None:
        rows = nodes.list_nodes(ctx.obj.store(), ctx.obj.settings)
        emit(as_json, {"nodes": rows}, _table(rows))


@nodes_group.command("show")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def show(obj: Context, node_id: str, as_json: bool) -> None:
    """Show one node as the API does."""
    view = nodes.node_view(_node(obj, node_id), obj.store().clock.now(), obj.settings)
    emit(as_json, view, _table([view]))


@nodes_group.command("readiness")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def readiness_command(obj: Context, node_id: str, as_json: bool) -> None:
    """Check whether a node is ready for work; exit 1 when it is not."""
    _node(obj, node_id)
    answer = readiness.readiness_of(obj.store(), obj.settings, node_id)
    lines = [f"node {node_id}: {'READY' if answer['ready'] else 'NOT READY'}"]
    for check in answer["checks"]:
        lines.append(f"  {'ok  ' if check['ok'] else 'FAIL'} {check['name']:14} {check['detail']}")
        if not check["ok"] and check["next_step"]:
            lines.append(f"       next: {check['next_step']}")
    emit(as_json, answer, "\n".join(lines))
    if not answer["ready"]:
        raise SystemExit(1)


@nodes_group.command("credentials")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def credentials_command(obj: Context, node_id: str, as_json: bool) -> None:
    """Active and revoked credentials of a node (never a hash)."""
    answer = credentials.credentials_of(obj.store(), _node(obj, node_id))
    lines = [f"active {answer['active']}, revoked {answer['revoked']}"]
    for row in answer["credentials"]:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "ACTIVE"
        lines.append(
            f"  {row['credential_id']}  created {row['created_at']}  "
            f"last used {row['last_used_at'] or '-'}  {state}"
        )
    emit(as_json, answer, "\n".join(lines))


@nodes_group.command("revoke")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def revoke(obj: Context, node_id: str, as_json: bool) -> None:
    """Revoke a node's credential permanently (re-enroll the agent afterwards)."""
    revocation = credentials.revoke_node_credential(
        obj.store(), _node(obj, node_id), audit.CLI_ACTOR
    )
    emit(
        as_json,
        {"node_id": node_id, **revocation},
        f"Revoked {len(revocation['revoked'])} credential(s) of node {node_id}; returned "
        f"{len(revocation['leases_returned'])} leased work item(s) to the queue.",
    )


@nodes_group.command("cordon")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def cordon(obj: Context, node_id: str, as_json: bool) -> None:
    """Give the node no new work; it stays monitored."""
    _set_cordon(obj, node_id, True, as_json)


@nodes_group.command("uncordon")
@click.argument("node_id")
@JSON_OPTION
@click.pass_obj
def uncordon(obj: Context, node_id: str, as_json: bool) -> None:
    """Let the node take work again."""
    _set_cordon(obj, node_id, False, as_json)


def _set_cordon(obj: Context, node_id: str, cordoned: bool, as_json: bool) -> None:
    try:
        node = nodes.set_cordoned(obj.store(), node_id, cordoned, audit.CLI_ACTOR)
    except ApiError as exc:
        fail(exc.message)
    view = nodes.node_view(node, obj.store().clock.now(), obj.settings)
    emit(as_json, view, f"Node {node_id} is {'cordoned' if cordoned else 'uncordoned'}.")


@nodes_group.command("decommission")
@click.argument("node_id")
@click.option("--yes", is_flag=True, help="Execute the previewed plan without asking.")
@JSON_OPTION
@click.pass_obj
def decommission_command(obj: Context, node_id: str, yes: bool, as_json: bool) -> None:
    """Retire a node for good: preview the effects, then execute exactly them."""
    store = obj.store()
    try:
        plan = decommission.preview(store, node_id, audit.CLI_ACTOR)
        effects = plan["effects"]
        if not as_json:
            click.echo(
                f"Decommissioning node {node_id} will:\n"
                f"  revoke credentials: {', '.join(effects['credentials_revoked']) or 'none'}\n"
                f"  return leases:      {len(effects['leases_returned'])}\n"
                f"  retire identity:    {effects['identity_retired'] or 'none'}\n"
                f"  free hostname:      {effects['hostname_freed']}"
            )
        if not yes and not confirmed("Execute?"):
            fail("nothing was changed", code=1)
        done = decommission.execute(store, node_id, plan["confirmation"], audit.CLI_ACTOR)
    except ApiError as exc:
        fail(exc.message)
    emit(as_json, done, f"Node {node_id} decommissioned at {done['decommissioned_at']}.")


@click.command("alerts")
@JSON_OPTION
@click.pass_obj
def alerts_command(obj: Context, as_json: bool) -> None:
    """Active alerts: offline and stale nodes, hostname conflicts."""
    active = alerts.active_alerts(obj.store(), obj.settings)
    lines = [f"{a['severity']:8} {a['kind']:18} {a['node_id']}  {a['message']}" for a in active]
    emit(as_json, {"alerts": active}, "\n".join(lines) or "No active alerts.")
