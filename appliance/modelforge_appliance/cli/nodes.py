"""``modelforge nodes …`` and ``alerts``: fleet operations from the host.

A node is named by its id, a unique prefix of it, or its hostname (an enabled node's first),
as ``docker`` and ``headscale`` take them; an ambiguous name is refused with the candidates.
"""

from __future__ import annotations

from typing import Any

import click

from modelforge_contract import DECOMMISSIONED, EXIT_CHECK_FAILED, WORK_SLOTS_MAX

from .. import lifecycle
from ..fleet import alerts, hardware, nodes, readiness
from ..identity import credentials
from ..store import audit
from ..store.tables import Node
from .completion import complete_nodes
from .errors import only_match
from .support import JSON_OPTION, Context, confirm_or_refuse, emit, fail

NODE_ARGUMENT = click.argument("node", metavar="NODE", shell_complete=complete_nodes)


def find_node(obj: Context, reference: str) -> Node:
    """The node an id, unique id prefix, hostname or name (the NAME column, `enroll --name`)
    names; NotFound, or a usage error when it names several."""
    store = obj.store()
    reference = reference.strip()
    with store.connection():
        rows = list(
            Node.select(Node.node_id, Node.hostname, Node.display_name, Node.decommissioned_at)
        )
    if any(row.node_id == reference for row in rows):
        return nodes.get_node(store, reference)
    by_prefix = {
        row.node_id for row in rows if reference and row.node_id.startswith(reference.lower())
    }
    wanted = reference.casefold()
    named = [
        row
        for row in rows
        if wanted and wanted in (row.hostname.casefold(), (row.display_name or "").casefold())
    ]
    enabled = [row for row in named if row.decommissioned_at is None]
    by_name = {row.node_id for row in (enabled or named)}
    node_id = only_match(
        reference,
        sorted(by_prefix | by_name),
        kind="node",
        by="by id, id prefix, hostname or name",
        listing="modelforge nodes",
    )
    return nodes.get_node(store, node_id)


def ago(now: float, then: float | None) -> str:
    """'12s ago', '5m ago', '3h ago', '2d ago'; 'never' for no time."""
    if then is None:
        return "never"
    seconds = max(0.0, now - then)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def ready_column(row: dict) -> str:
    """READY, or NOT READY with the first failing check; '-' for a retired node (its
    liveness already says why it takes no work)."""
    if row["liveness"] == DECOMMISSIONED:
        return "-"
    readiness = row["readiness"]
    return "READY" if readiness["ready"] else f"NOT READY ({readiness['failing'][0]})"


def _table(rows: list[dict], now: float, seen: dict[str, float | None]) -> str:
    lines = [f"{'NODE ID':38} {'NAME':20} {'HOSTNAME':20} {'LIVENESS':14} {'READY':25} LAST SEEN"]
    for row in rows:
        cordoned = " (cordoned)" if row["cordoned"] and row["liveness"] != DECOMMISSIONED else ""
        lines.append(
            f"{row['node_id']:38} {row['display_name'][:20]:20} {row['hostname'][:20]:20} "
            f"{row['liveness']:14} {ready_column(row):25} "
            f"{ago(now, seen.get(row['node_id']))}{cordoned}"
        )
    return "\n".join(lines)


@click.group("nodes", invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def nodes_group(ctx: click.Context, as_json: bool) -> None:
    """List nodes with their liveness and readiness, or act on one (see the commands below).

    NODE is a node id, a unique prefix of one, or a hostname.
    """
    if ctx.invoked_subcommand is None:
        store = ctx.obj.store()
        rows = readiness.list_nodes(store, ctx.obj.settings)
        with store.connection():
            seen = {
                n.node_id: n.last_heartbeat_at
                for n in Node.select(Node.node_id, Node.last_heartbeat_at)
            }
        emit(as_json, {"nodes": rows}, _table(rows, store.clock.now(), seen))


def _gib(value: Any) -> str:
    return f"{value / 2**30:.1f} GiB" if isinstance(value, int | float) else "?"


def _detail(node: Node, view: dict[str, Any], now: float) -> str:
    """Everything an operator looks for on one node, as aligned lines."""
    health = view["health"] or {}
    host = view["host"] or {}
    lines = [
        ("node", f"{view['node_id']}  {view['display_name']} ({view['hostname']})"),
        (
            "liveness",
            f"{view['liveness']}, last heartbeat {ago(now, node.last_heartbeat_at)}"
            + (f" ({view['last_heartbeat_at']})" if view["last_heartbeat_at"] else ""),
        ),
        ("cordoned", "yes: no new work" if view["cordoned"] else "no"),
        (
            "work slots",
            f"at most {view['work_slots_max']} item(s) leased at once"
            + (
                " (MODELFORGE_WORK_SLOTS_PER_NODE)"
                if view["work_slots_max_source"] == "default"
                else " (set for this node)"
            ),
        ),
        (
            "mode",
            f"{view['accelerator_mode']}; agent {view['agent_version']}, protocol "
            f"{view['protocol_version']}, worker {view['worker_version'] or '-'}",
        ),
        (
            "health",
            (
                f"{health.get('status', '?')}, GPU probe {health.get('gpu_probe', '?')}"
                + (f": {health['message']}" if health.get("message") else "")
            )
            if health
            else "not reported yet",
        ),
        (
            "host",
            ", ".join(
                part
                for part in (
                    host.get("os"),
                    f"kernel {host['kernel']}" if host.get("kernel") else None,
                    f"{host['cpu_count']} CPUs" if host.get("cpu_count") else None,
                    _gib(host["memory_total_bytes"]) + " memory"
                    if host.get("memory_total_bytes")
                    else None,
                )
                if part
            )
            or "not reported yet",
        ),
        ("source", view["source_address"] or "not seen yet"),
        ("inventory", f"measured {ago(now, node.inventory_at)}"),
        ("telemetry", f"{ago(now, node.telemetry_at)}"),
        ("enrolled", f"{view['enrolled_at']} (created {view['created_at']})"),
    ]
    if view["decommissioned_at"]:
        lines.append(("retired", view["decommissioned_at"]))
    if view["hardware"]["pending"]:
        lines.append(
            (
                "hardware",
                f"CHANGED since {view['hardware']['since']}, no new work until accepted "
                f"(modelforge nodes accept-hardware): {hardware.describe_pending(node)}",
            )
        )
    text = [f"{label:12} {value}" for label, value in lines]
    text.append(f"{'accelerators':12} {len(view['accelerators']) or 'none'}")
    for gpu in view["accelerators"]:
        extra = " ".join(
            f"{key.split('_')[0]} {gpu[key]}"
            for key in ("driver_version", "cuda_version")
            if gpu.get(key)
        )
        text.append(
            f"  {gpu.get('index', '?'):>2}  {gpu.get('name', '?')}  "
            f"{_gib(gpu.get('memory_total_bytes'))}  {gpu.get('uuid', '')}  {extra}".rstrip()
        )
    for root in view["storage_roots"]:
        text.append(
            f"{'storage':12} {root.get('path')} ({root.get('role')}): "
            f"{_gib(root.get('free_bytes'))} free of {_gib(root.get('total_bytes'))}"
        )
    return "\n".join(text)


@nodes_group.command("show")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def show(obj: Context, node: str, as_json: bool) -> None:
    """Everything about one node: liveness, health, mode, versions, host, GPUs, storage."""
    row = find_node(obj, node)
    now = obj.store().clock.now()
    view = nodes.node_view(row, now, obj.settings)
    emit(as_json, view, _detail(row, view, now))


@nodes_group.command("readiness")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def readiness_command(obj: Context, node: str, as_json: bool) -> None:
    """Check whether a node is ready for work; exit 1 when it is not."""
    node_id = find_node(obj, node).node_id
    answer = readiness.readiness_of(obj.store(), obj.settings, node_id)
    lines = [f"node {node_id}: {'READY' if answer['ready'] else 'NOT READY'}"]
    for check in answer["checks"]:
        lines.append(f"  {'ok  ' if check['ok'] else 'FAIL'} {check['name']:14} {check['detail']}")
        if not check["ok"] and check["next_step"]:
            lines.append(f"       next: {check['next_step']}")
    emit(as_json, answer, "\n".join(lines))
    if not answer["ready"]:
        raise SystemExit(EXIT_CHECK_FAILED)


@nodes_group.command("credentials")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def credentials_command(obj: Context, node: str, as_json: bool) -> None:
    """Active and revoked credentials of a node (never a hash)."""
    answer = credentials.credentials_of(obj.store(), find_node(obj, node))
    lines = [f"active {answer['active']}, revoked {answer['revoked']}"]
    for row in answer["credentials"]:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "ACTIVE"
        lines.append(
            f"  {row['credential_id']}  created {row['created_at']}  "
            f"last used {row['last_used_at'] or '-'}  {state}"
        )
    emit(as_json, answer, "\n".join(lines))


@nodes_group.command("revoke")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def revoke(obj: Context, node: str, as_json: bool) -> None:
    """Revoke a node's credential permanently (re-enroll the agent afterwards)."""
    row = find_node(obj, node)
    revocation = lifecycle.revoke_node_credential(obj.store(), row, audit.CLI_ACTOR)
    emit(
        as_json,
        {"node_id": row.node_id, **revocation},
        f"Revoked {len(revocation['revoked'])} credential(s) of node {row.node_id}; returned "
        f"{len(revocation['leases_returned'])} leased work item(s) to the queue.",
    )


@nodes_group.command("rename")
@NODE_ARGUMENT
@click.argument("new_name")
@JSON_OPTION
@click.pass_obj
def rename(obj: Context, node: str, new_name: str, as_json: bool) -> None:
    """Give a node another display name (1-120 characters); its id and hostname stay."""
    row = nodes.rename_node(obj.store(), find_node(obj, node).node_id, new_name, audit.CLI_ACTOR)
    view = nodes.node_view(row, obj.store().clock.now(), obj.settings)
    emit(as_json, view, f"Node {row.node_id} is now {row.display_name!r}.")


@nodes_group.command("cordon")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def cordon(obj: Context, node: str, as_json: bool) -> None:
    """Give the node no new work; it stays monitored."""
    _set_cordon(obj, node, True, as_json)


@nodes_group.command("uncordon")
@NODE_ARGUMENT
@JSON_OPTION
@click.pass_obj
def uncordon(obj: Context, node: str, as_json: bool) -> None:
    """Let the node take work again."""
    _set_cordon(obj, node, False, as_json)


class _WorkSlots(click.ParamType):
    name = "SLOTS"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | None:
        text = str(value).strip().lower()
        if text == "default":
            return None
        if not text.isdigit() or not 1 <= int(text) <= WORK_SLOTS_MAX:
            self.fail(f"{value!r} is not a number from 1 to {WORK_SLOTS_MAX} or 'default'")
        return int(text)


@nodes_group.command("set-work-slots")
@NODE_ARGUMENT
@click.argument("slots", type=_WorkSlots())
@JSON_OPTION
@click.pass_obj
def set_work_slots(obj: Context, node: str, slots: int | None, as_json: bool) -> None:
    """Let the node hold at most SLOTS work items leased at once (1-64), or 'default' for
    MODELFORGE_WORK_SLOTS_PER_NODE; never more than its agent's own work slots."""
    node_id = find_node(obj, node).node_id
    row = nodes.set_work_slots(obj.store(), node_id, slots, audit.CLI_ACTOR)
    view = nodes.node_view(row, obj.store().clock.now(), obj.settings)
    source = "the default" if view["work_slots_max_source"] == "default" else "its own maximum"
    emit(
        as_json,
        view,
        f"Node {node_id} may hold at most {view['work_slots_max']} leased work item(s) ({source}).",
    )


@nodes_group.command("accept-hardware")
@NODE_ARGUMENT
@click.option("--yes", is_flag=True, help="Accept the change shown without asking.")
@JSON_OPTION
@click.pass_obj
def accept_hardware(obj: Context, node: str, yes: bool, as_json: bool) -> None:
    """Accept the node's changed accelerators as its new baseline, so it takes work again.

    Shows how they differ from the accepted ones and asks on the terminal; with --json,
    --yes is required. Exactly what was shown is accepted: if the node publishes other
    accelerators meanwhile, it is refused and nothing changes.
    """
    store = obj.store()
    row = find_node(obj, node)
    if as_json and not yes:  # refused before anything is looked at
        fail("--json does not ask questions: add --yes to go ahead")
    waiting = hardware.hardware_view(row)
    if not as_json and waiting["pending"]:
        click.echo(
            f"Node {row.node_id} published other accelerators on {waiting['since']}:\n"
            f"  {hardware.describe_pending(row)}"
        )
    if waiting["pending"]:
        confirm_or_refuse("Accept them as its hardware?", yes, as_json)
    accepted = hardware.accept_hardware(store, row.node_id, audit.CLI_ACTOR, waiting["digest"])
    view = nodes.node_view(nodes.get_node(store, row.node_id), store.clock.now(), obj.settings)
    emit(
        as_json,
        {**view, "accepted": accepted.as_dict()},
        f"Node {row.node_id}: {len(view['accelerators'])} accelerator(s) accepted; it may take "
        "work again.",
    )


def _set_cordon(obj: Context, node: str, cordoned: bool, as_json: bool) -> None:
    node_id = find_node(obj, node).node_id
    row = nodes.set_cordoned(obj.store(), node_id, cordoned, audit.CLI_ACTOR)
    view = nodes.node_view(row, obj.store().clock.now(), obj.settings)
    emit(as_json, view, f"Node {node_id} is {'cordoned' if cordoned else 'uncordoned'}.")


@nodes_group.command("decommission")
@NODE_ARGUMENT
@click.option("--yes", is_flag=True, help="Execute the previewed plan without asking.")
@JSON_OPTION
@click.pass_obj
def decommission_command(obj: Context, node: str, yes: bool, as_json: bool) -> None:
    """Retire a node for good: preview the effects, then execute exactly them.

    Asks on the terminal before executing; with --json, --yes is required.
    """
    store = obj.store()
    node_id = find_node(obj, node).node_id
    if as_json and not yes:  # refused before the preview records anything
        fail("--json does not ask questions: add --yes to go ahead")
    plan = lifecycle.preview_decommission(store, node_id, audit.CLI_ACTOR)
    effects = plan["effects"]
    if not as_json:
        click.echo(
            f"Decommissioning node {node_id} will:\n"
            f"  revoke credentials: {', '.join(effects['credentials_revoked']) or 'none'}\n"
            f"  return leases:      {len(effects['leases_returned'])}\n"
            f"  retire identity:    {effects['identity_retired'] or 'none'}\n"
            f"  free hostname:      {effects['hostname_freed']}"
        )
    confirm_or_refuse("Execute?", yes, as_json)
    done = lifecycle.execute_decommission(store, node_id, plan["confirmation"], audit.CLI_ACTOR)
    emit(as_json, done, f"Node {node_id} decommissioned at {done['decommissioned_at']}.")


SEVERITY_RANK = {"warning": 1, "critical": 2}


@click.command("alerts")
@click.option(
    "--fail-on",
    type=click.Choice(tuple(SEVERITY_RANK)),
    help="Exit 1 when an alert of this severity or worse is active (for scripts and cron).",
)
@JSON_OPTION
@click.pass_obj
def alerts_command(obj: Context, fail_on: str | None, as_json: bool) -> None:
    """Active alerts: offline and stale nodes, hostname conflicts."""
    active = alerts.active_alerts(obj.store(), obj.settings)
    lines = [f"{a['severity']:8} {a['kind']:18} {a['node_id']}  {a['message']}" for a in active]
    emit(as_json, {"alerts": active}, "\n".join(lines) or "No active alerts.")
    if fail_on and any(SEVERITY_RANK[a["severity"]] >= SEVERITY_RANK[fail_on] for a in active):
        raise SystemExit(EXIT_CHECK_FAILED)
