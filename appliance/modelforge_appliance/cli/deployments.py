"""``modelforge deploy``, ``modelforge deployments [show|restart|set|add-nodes|remove-nodes]``,
``modelforge undeploy`` (docs/deployments.md)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from modelforge_contract import EXIT_CHECK_FAILED, EXIT_USAGE
from modelforge_contract.deployments import (
    GOAL_REMOVE,
    IDLE_UNLOAD_MAX,
    RUNTIMES,
    SERVER_BACKOFF,
    SERVER_FAILED,
    SERVER_IDLE,
    SERVER_RUNNING,
    SERVER_STOPPED,
)

from ..core.errors import ApiError, NotFound
from ..deployments import leases, members, servers
from ..store import audit
from .completion import complete_nodes
from .errors import CliError, refused
from .nodes import ago, find_node
from .support import JSON_OPTION, Context, duration_seconds, emit

# What to do about a server's error code. Waiting and backing off end by themselves; only
# a failed server needs a person (docs/deployments.md).
_NEXT_STEPS = {
    "SERVER_LEASE_LOST": "nothing to do: it starts again by itself when the node's agent is back "
    "(`modelforge nodes show NODE` says why it is away)",
    "NODE_OFFLINE": "nothing to do: it starts again by itself when the node is back online",
    "NODE_STOPPING": "nothing to do: it starts again by itself when the node's agent is back",
    "RUNTIME_EXITED": "nothing to do: the agent starts it again by itself (5 s, 10 s, 20 s … up to "
    "5 min apart); if it keeps exiting, read the node's runtime worker log and fix the cause "
    "(its own arguments: `modelforge deployments set NAME --arg …` or `--no-args`)",
    "RUNTIME_NOT_READY": "nothing to do: the agent starts it again by itself; if it is never ready, "
    "check the node's runtime worker log (a large model may need a longer "
    "MODELFORGE_AGENT_SERVE_READY_SECONDS)",
    "RUNTIME_LAUNCH_FAILED": "check the runtime on the node (docs/deployments.md, 'Runtimes'), "
    "then `modelforge deployments restart NAME`",
    "RUNTIME_UNSUPPORTED": "install the runtime on the node (docs/deployments.md, 'Runtimes'), "
    "then restart, or move the server: `modelforge deployments remove-nodes NAME NODE`",
    "MODEL_MISSING": "replicate the model to the node again, then restart",
    "MODEL_NOT_ON_NODE": "replicate the model to the node again, then restart",
    "NODE_DECOMMISSIONED": "take the node out (`modelforge deployments remove-nodes NAME "
    "NODE`) and add another (`modelforge deployments add-nodes NAME NODE`)",
    "GPUS_ON_CPU_NODE": "deploy with --gpus 0 to a CPU node",
}


def next_step(code: str, name: str) -> str:
    step = _NEXT_STEPS.get(code, "check the node, then restart the deployment")
    return step.replace(" NAME", f" {name}")


def parse_duration(text: str) -> int:
    """``--idle-unload``: 90s, 10m, 1h, 2d or plain seconds, 1 s to 30 days."""
    return duration_seconds(text, "--idle-unload", 1, IDLE_UNLOAD_MAX, "90s, 10m or 1h")


def _state_words(s: dict[str, Any]) -> str:
    if s.get("goal") == GOAL_REMOVE:
        return f"{s['state']} (leaving the deployment)"
    if s["state"] == SERVER_IDLE:
        return f"{s['state']} (unloaded; the next request starts it)"
    return s["state"]


def _ago(stamp: str | None, now: float | None) -> str:
    if stamp is None or now is None:
        return ""
    return f" ({ago(now, datetime.fromisoformat(stamp).timestamp())})"


def _server_line(s: dict[str, Any], now: float | None = None, name: str = "") -> str:
    """One server: its state and since when (with ``now``, how long ago too), GPUs,
    restarts, when a backing-off one starts again, and why it is not running (with
    ``name``, the next step)."""
    gpus = f" gpus {','.join(g[-8:] for g in s['gpus'])}" if s["gpus"] else ""
    role = f" [{s['role']}]" if s.get("role") else ""
    line = (
        f"  {s['display_name']} ({s['node_id']}){role}: {_state_words(s)} since "
        f"{s['state_since']}{_ago(s['state_since'], now)}{gpus}"
    )
    if s["restarts"] or now is not None:
        line += f", {s['restarts']} restart{'' if s['restarts'] == 1 else 's'}"
    if s["state"] == SERVER_BACKOFF and s.get("next_attempt_at"):
        line += f", next attempt {s['next_attempt_at']}"
    if s["error"]:
        line += f"\n    {s['error']['code']}: {s['error']['message']}"
        if name and s["state"] != SERVER_RUNNING:
            line += f"\n    next step: {next_step(s['error']['code'], name)}"
    return line


def _lines(view: dict[str, Any], now: float | None = None) -> list[str]:
    name = view["name"] if now is not None else ""
    split = view["settings"].get("split")
    group = ""
    if split:
        shares = view["settings"].get("shares") or []
        names = {s["node_id"]: s["display_name"] for s in view["servers"]}
        parts = [
            f"{names.get(n, n)} {round(100 * shares[i])}%" if i < len(shares) else names.get(n, n)
            for i, n in enumerate(split)
        ]
        group = f", split across {len(split)} nodes ({', '.join(parts)} of the layers)"
    return [
        f"deployment {view['name']}: {view['state']} — {view['model']} revision "
        f"{view['revision']} on {view['runtime']}{group}",
        *[_server_line(s, now, name) for s in view["servers"]],
    ]


@click.command("deploy")
@click.argument("name")
@click.option("--model", "model", required=True, help="The imported model to serve.")
@click.option(
    "--nodes",
    shell_complete=complete_nodes,
    help="Comma-separated node ids, id prefixes or hostnames: one server on each.",
)
@click.option(
    "--split",
    "split",
    shell_complete=complete_nodes,
    help="llama.cpp: one model across these nodes instead (MAIN,HELPER[,HELPER…]): the main "
    "node holds the model and serves, each helper holds layers, over the agents' tunnels.",
)
@click.option("--runtime", type=click.Choice(RUNTIMES), default="llama.cpp", show_default=True)
@click.option("--revision", help="That revision of the model instead of the latest.")
@click.option(
    "--gpus",
    "gpu_count",
    type=click.IntRange(0, 64),
    help="GPUs per server (default: 1 on a node with GPUs, 0 without).",
)
@click.option("--share-gpus", is_flag=True, help="Let servers share GPUs another server holds.")
@click.option("--context-length", type=click.IntRange(1), help="The runtime's context size.")
@click.option("--model-file", help="The file the runtime loads (default: the model's GGUF).")
@click.option("--image-id", help="vllm: the loaded image's id (sha256:…), never pulled.")
@click.option("--arg", "args", multiple=True, help="An extra runtime argument (repeatable).")
@click.option(
    "--idle-unload",
    "idle_unload",
    metavar="DURATION",
    help="Unload the servers after this long without a request (90s, 10m, 1h; at least 1 s); "
    "the next request starts them.",
)
@click.option("--replicate", is_flag=True, help="Replicate the model where missing, then start.")
@click.option("--wait", is_flag=True, help="Follow until every server runs or fails.")
@click.option("--timeout", type=click.FloatRange(1), default=1800.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def deploy_command(
    obj: Context,
    name: str,
    model: str,
    nodes: str | None,
    split: str | None,
    runtime: str,
    revision: str | None,
    gpu_count: int | None,
    share_gpus: bool,
    context_length: int | None,
    model_file: str | None,
    image_id: str | None,
    args: tuple[str, ...],
    idle_unload: str | None,
    replicate: bool,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Serve MODEL as NAME on NODES: one server per node, each started by its agent."""
    if (nodes is None) == (split is None):
        raise CliError(
            "name the nodes with one of --nodes or --split",
            "Pass --nodes A,B (a server on each), or --split MAIN,HELPER (one model across them).",
            EXIT_USAGE,
        )
    wanted = [n.strip() for n in (nodes or split or "").split(",") if n.strip()]
    if not wanted or (split is not None and len(wanted) < 2):
        raise CliError(
            "--split names fewer than two nodes" if split is not None else "--nodes names no node",
            "Pass --split MAIN,HELPER[,HELPER…]." if split is not None else "Pass --nodes A,B.",
            EXIT_USAGE,
        )
    idle_unload_seconds = parse_duration(idle_unload) if idle_unload is not None else None
    store = obj.store()
    try:
        fields = {
            "name": name,
            "model": model,
            "revision": revision,
            "runtime": runtime,
            "node_ids": [find_node(obj, n).node_id for n in wanted],
            "gpu_count": gpu_count,
            "share_gpus": share_gpus,
            "settings": {
                "context_length": context_length,
                "args": list(args),
                "image_id": image_id,
                "model_file": model_file,
                "idle_unload_seconds": idle_unload_seconds,
            },
            "replicate": replicate,
        }
        if split is not None:
            fields["settings"]["split"] = fields["node_ids"]
            fields["node_ids"] = fields["node_ids"][:1]
        view = servers.deploy(store, obj.settings, fields, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    said = "Deployed; each node's agent starts its server."
    _said_or_followed(obj, name, view, said, wait, timeout, as_json)


Rows = list[dict[str, Any]]


def _settled(node_ids: frozenset[str] | None = None) -> Callable[[Rows], bool]:
    """Done when every server (of ``node_ids``) runs or failed; for a deployment that
    unloads when idle, an unloaded one is done too."""

    def done(rows: Rows) -> bool:
        watched = [s for s in rows if node_ids is None or s["node_id"] in node_ids]
        finished = (SERVER_RUNNING, SERVER_FAILED, SERVER_IDLE)
        return bool(watched) and all(s["state"] in finished for s in watched)

    return done


def _gone(node_ids: frozenset[str]) -> Callable[[Rows], bool]:
    return lambda rows: not any(s["node_id"] in node_ids for s in rows)


def _follow(
    obj: Context, name: str, timeout: float, quiet: bool, done: Callable[[Rows], bool]
) -> dict[str, Any] | None:
    """Poll the deployment until ``done(servers)`` (None: the deployment went), with a
    progress line per server: redrawn on a terminal, one per change otherwise."""
    store = obj.store()
    tty = sys.stdout.isatty() and not quiet
    seen: dict[str, str] = {}
    drawn = 0
    deadline = time.monotonic() + timeout
    while True:
        leases.expire_servers(store, obj.settings)
        try:
            view = servers.get_deployment(store, name)
        except NotFound:
            return None
        rows = view["servers"]
        if tty:
            if drawn:
                click.echo(f"\x1b[{drawn}F", nl=False)
            for s in rows:
                error = f" {s['error']['code']}" if s["error"] else ""
                click.echo(f"\x1b[2K{s['display_name']:24} {s['state']:10} {s['restarts']}{error}")
            for _ in range(drawn - len(rows)):  # a server that left: blank its line
                click.echo("\x1b[2K")
            drawn = max(drawn, len(rows))
        elif not quiet:
            for s in rows:
                shown = s["state"] + (f" {s['error']['code']}" if s["error"] else "")
                if seen.get(s["server_id"]) != shown:
                    seen[s["server_id"]] = shown
                    click.echo(f"{s['display_name']} ({s['node_id']}): {shown}")
        if done(rows):
            return view
        if time.monotonic() >= deadline:
            click.echo(f"modelforge: gave up waiting after {timeout:.0f} s", err=True)
            return view
        time.sleep(0.5)


def _said_or_followed(
    obj: Context,
    name: str,
    view: dict[str, Any],
    said: str,
    wait: bool,
    timeout: float,
    as_json: bool,
    node_ids: frozenset[str] | None = None,
) -> None:
    """What a change answers: ``said`` and the servers; with --wait, follow the servers (of
    ``node_ids``) until they settle, and exit as _finish says."""
    if not wait:
        emit(as_json, view, "\n".join([said, *_lines(view)]))
        return
    _finish(_follow(obj, name, timeout, as_json, _settled(node_ids)), as_json, node_ids)


def _finish(
    view: dict[str, Any] | None, as_json: bool, node_ids: frozenset[str] | None = None
) -> None:
    """Exit 0 when every server (of ``node_ids``) runs, or is unloaded; 1 naming each that
    does not, with its code and next step."""
    if view is None:
        raise CliError("the deployment went while waiting", "See `modelforge deployments`.", 1)
    if as_json:
        emit(True, view, "")
    watched = [s for s in view["servers"] if node_ids is None or s["node_id"] in node_ids]
    behind = [s for s in watched if s["state"] not in (SERVER_RUNNING, SERVER_IDLE)]
    for s in behind:
        code = (s["error"] or {}).get("code", "")
        why = f"{code}: {(s['error'] or {}).get('message', '')}; " if code else ""
        click.echo(
            f"modelforge: {s['display_name']} ({s['node_id']}): {s['state']}: {why}next step: "
            f"{next_step(code, view['name']) if code else 'wait, or check the node'}",
            err=True,
        )
    if behind or not watched:
        raise SystemExit(EXIT_CHECK_FAILED)
    if not as_json:
        some = "every added server" if node_ids is not None else "every server"
        click.echo(f"{view['name']}: {some} runs.")


@click.group("deployments", invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def deployments_group(ctx: click.Context, as_json: bool) -> None:
    """List deployments and their servers; `show`, `restart`, `set`, `add-nodes`,
    `remove-nodes`."""
    if ctx.invoked_subcommand is not None:
        return
    obj: Context = ctx.obj
    store = obj.store()
    leases.expire_servers(store, obj.settings)
    listed = servers.list_deployments(store)
    lines = [line for view in listed for line in _lines(view)]
    if not listed:
        lines = ["No deployments: modelforge deploy NAME --model M --nodes A,B --runtime llama.cpp"]
    emit(as_json, {"deployments": listed}, "\n".join(lines))


@deployments_group.command("show")
@click.argument("name")
@JSON_OPTION
@click.pass_obj
def show_command(obj: Context, name: str, as_json: bool) -> None:
    """One deployment: its model, runtime, settings and every server."""
    store = obj.store()
    leases.expire_servers(store, obj.settings)
    try:
        view = servers.get_deployment(store, name)
    except ApiError as exc:
        raise refused(exc) from None
    settings = view["settings"]
    extra = [
        f"  digest:   {view['digest']}",
        f"  file:     {settings['model_file'] or '(the directory)'}",
        f"  gpus:     {view['gpu_count'] if view['gpu_count'] is not None else 'default'} per server"
        + (" (shared)" if view["share_gpus"] else ""),
        f"  created:  {view['created_at']} by {view['created_by']}",
    ]
    if settings["context_length"]:
        extra.append(f"  context:  {settings['context_length']}")
    if settings["args"]:
        extra.append(f"  args:     {' '.join(settings['args'])}")
    if settings["image_id"]:
        extra.append(f"  image:    {settings['image_id']}")
    if settings.get("idle_unload_seconds"):
        extra.append(f"  unload:   after {settings['idle_unload_seconds']} s without a request")
    lines = _lines(view, store.clock.now())
    emit(as_json, view, "\n".join([lines[0], *extra, *lines[1:]]))


@deployments_group.command("restart")
@click.argument("name")
@click.option("--wait", is_flag=True, help="Follow until every server runs or fails.")
@click.option("--timeout", type=click.FloatRange(1), default=1800.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def restart_command(obj: Context, name: str, wait: bool, timeout: float, as_json: bool) -> None:
    """Start every server of NAME afresh (a failed one gets its restarts back)."""
    try:
        view = servers.restart(obj.store(), name, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    _said_or_followed(obj, name, view, "Restarting:", wait, timeout, as_json)


@deployments_group.command("set")
@click.argument("name")
@click.option(
    "--arg", "args", multiple=True, help="The runtime's extra arguments, replacing the current."
)
@click.option("--no-args", is_flag=True, help="Clear the runtime's extra arguments.")
@click.option("--context-length", type=click.IntRange(1), help="The runtime's context size.")
@click.option("--wait", is_flag=True, help="Follow until every server runs or fails.")
@click.option("--timeout", type=click.FloatRange(1), default=1800.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def set_command(
    obj: Context,
    name: str,
    args: tuple[str, ...],
    no_args: bool,
    context_length: int | None,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Change NAME's runtime arguments or context size, and restart its servers with them.

    The options given replace what the deployment has; the rest is kept. Settings equal to
    the current ones restart nothing. The model, runtime, image, GPUs and idle unload are
    changed by undeploying and deploying again."""
    if args and no_args:
        raise CliError("--arg and --no-args contradict each other", "Pass one.", EXIT_USAGE)
    given: dict[str, Any] = {}
    if args or no_args:
        given["args"] = list(args)
    if context_length is not None:
        given["context_length"] = context_length
    if not given:
        raise CliError(
            "nothing to change",
            "Pass --arg X (repeatable), --no-args or --context-length N.",
            EXIT_USAGE,
        )
    try:
        view = servers.change_settings(obj.store(), name, given, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    said = "Changed; restarting with the new settings:"
    _said_or_followed(obj, name, view, said, wait, timeout, as_json)


def _node_ids(obj: Context, references: tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(find_node(obj, n).node_id for n in references))


@deployments_group.command("add-nodes")
@click.argument("name")
@click.argument("nodes", nargs=-1, required=True, shell_complete=complete_nodes)
@click.option("--replicate", is_flag=True, help="Replicate the model where missing, then start.")
@click.option("--wait", is_flag=True, help="Follow until every added server runs or fails.")
@click.option("--timeout", type=click.FloatRange(1), default=1800.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def add_nodes_command(
    obj: Context,
    name: str,
    nodes: tuple[str, ...],
    replicate: bool,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Add NODES (ids, id prefixes or names) to deployment NAME: a server on each, with the
    checks of a deploy; clients keep calling NAME."""
    store = obj.store()
    try:
        node_ids = _node_ids(obj, nodes)
        fields = {"node_ids": node_ids, "replicate": replicate}
        view = members.add_members(store, obj.settings, name, fields, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    said = "Added; each node's agent starts its server."
    _said_or_followed(obj, name, view, said, wait, timeout, as_json, frozenset(node_ids))


@deployments_group.command("remove-nodes")
@click.argument("name")
@click.argument("nodes", nargs=-1, required=True, shell_complete=complete_nodes)
@click.option("--wait", is_flag=True, help="Follow until every removed server has gone.")
@click.option("--timeout", type=click.FloatRange(1), default=300.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def remove_nodes_command(
    obj: Context, name: str, nodes: tuple[str, ...], wait: bool, timeout: float, as_json: bool
) -> None:
    """Take NODES out of deployment NAME: each server stops, then goes; the others serve on."""
    store = obj.store()
    try:
        node_ids = _node_ids(obj, nodes)
        for node_id in node_ids:  # one at a time: a refusal names the node it refuses
            view = members.remove_member(store, name, node_id, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    removed = frozenset(node_ids)
    if wait and not _gone(removed)(view["servers"]):
        left = _follow(obj, name, timeout, as_json, _gone(removed))
        if left is None:
            raise CliError("the deployment went while waiting", "See `modelforge deployments`.", 1)
        view = left
        if not _gone(removed)(view["servers"]):
            if as_json:
                emit(True, view, "")
            raise CliError(
                f"{name} has removed servers still stopping",
                "Their agents stop them at their next renewal; a node that is gone stops "
                "when its serve lease runs out.",
                EXIT_CHECK_FAILED,
            )
    still = [s for s in view["servers"] if s["node_id"] in removed]
    headline = (
        f"{name}: {', '.join(nodes)} left the deployment."
        if not still
        else "Removing; each leaving server stops at its agent's next renewal, then goes."
    )
    emit(as_json, view, "\n".join([headline, *_lines(view)]))


@click.command("undeploy")
@click.argument("name")
@click.option("--wait", is_flag=True, help="Follow until every server has stopped.")
@click.option("--timeout", type=click.FloatRange(1), default=300.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def undeploy_command(obj: Context, name: str, wait: bool, timeout: float, as_json: bool) -> None:
    """Stop every server of NAME; the deployment goes once they all have stopped."""
    try:
        view = servers.undeploy(obj.store(), name, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    if wait and view["state"] != SERVER_STOPPED:
        left = _follow(
            obj,
            name,
            timeout,
            as_json,
            lambda rows: bool(rows) and all(s["state"] == SERVER_STOPPED for s in rows),
        )
        if left is not None:
            if as_json:
                emit(True, left, "")
            raise CliError(
                f"{name} has servers still stopping",
                "Their agents stop them at their next renewal; a node that is gone stops "
                "when its serve lease runs out.",
                EXIT_CHECK_FAILED,
            )
        view = {**view, "state": SERVER_STOPPED}
    if view["state"] == SERVER_STOPPED:
        emit(as_json, view, f"{name}: every server stopped; the deployment is gone.")
    else:
        emit(as_json, view, "\n".join(["Stopping:", *_lines(view)]))
