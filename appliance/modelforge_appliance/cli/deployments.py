"""``modelforge deploy``, ``modelforge deployments [show|restart]``, ``modelforge undeploy``
(docs/deployments.md)."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from modelforge_contract import EXIT_CHECK_FAILED, EXIT_USAGE
from modelforge_contract.deployments import (
    RUNTIMES,
    SERVER_FAILED,
    SERVER_RUNNING,
    SERVER_STOPPED,
)

from ..core.errors import ApiError, NotFound
from ..deployments import leases, servers
from ..store import audit
from .completion import complete_nodes
from .errors import CliError, refused
from .nodes import find_node
from .support import JSON_OPTION, Context, emit

_NEXT_STEPS = {
    "RUNTIME_EXITED": "read the node's runtime worker log, fix the cause, then "
    "`modelforge deployments restart NAME`",
    "RUNTIME_NOT_READY": "check the node's runtime worker log (a large model may need a longer "
    "MODELFORGE_AGENT_SERVE_READY_SECONDS), then restart",
    "RUNTIME_LAUNCH_FAILED": "check the runtime on the node (docs/deployments.md, 'Runtimes'), "
    "then restart",
    "SERVER_LEASE_LOST": "bring the node's agent back, then `modelforge deployments restart NAME`",
    "NODE_OFFLINE": "bring the node back online, then restart",
    "MODEL_NOT_ON_NODE": "replicate the model to the node again, then restart",
    "GPUS_ON_CPU_NODE": "deploy with --gpus 0 to a CPU node",
}


def _server_line(s: dict[str, Any]) -> str:
    gpus = f" gpus {','.join(g[-8:] for g in s['gpus'])}" if s["gpus"] else ""
    line = f"  {s['display_name']} ({s['node_id']}): {s['state']} since {s['state_since']}{gpus}"
    if s["restarts"]:
        line += f", {s['restarts']} restart(s)"
    if s["error"]:
        line += f"\n    {s['error']['code']}: {s['error']['message']}"
    return line


def _lines(view: dict[str, Any]) -> list[str]:
    return [
        f"deployment {view['name']}: {view['state']} — {view['model']} revision "
        f"{view['revision']} on {view['runtime']}",
        *[_server_line(s) for s in view["servers"]],
    ]


@click.command("deploy")
@click.argument("name")
@click.option("--model", "model", required=True, help="The imported model to serve.")
@click.option(
    "--nodes",
    required=True,
    shell_complete=complete_nodes,
    help="Comma-separated node ids, id prefixes or hostnames: one server on each.",
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
@click.option("--replicate", is_flag=True, help="Replicate the model where missing, then start.")
@click.option("--wait", is_flag=True, help="Follow until every server runs or fails.")
@click.option("--timeout", type=click.FloatRange(1), default=1800.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def deploy_command(
    obj: Context,
    name: str,
    model: str,
    nodes: str,
    runtime: str,
    revision: str | None,
    gpu_count: int | None,
    share_gpus: bool,
    context_length: int | None,
    model_file: str | None,
    image_id: str | None,
    args: tuple[str, ...],
    replicate: bool,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Serve MODEL as NAME on NODES: one server per node, each started by its agent."""
    store = obj.store()
    wanted = [n.strip() for n in nodes.split(",") if n.strip()]
    if not wanted:
        raise CliError("--nodes names no node", "Pass --nodes A,B.", EXIT_USAGE)
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
            },
            "replicate": replicate,
        }
        view = servers.deploy(store, obj.settings, fields, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    if not wait:
        emit(
            as_json,
            view,
            "\n".join(["Deployed; each node's agent starts its server.", *_lines(view)]),
        )
        return
    view = _follow(obj, name, timeout, as_json, until=(SERVER_RUNNING, SERVER_FAILED))
    _finish(view, as_json)


def _follow(
    obj: Context, name: str, timeout: float, quiet: bool, until: tuple[str, ...]
) -> dict[str, Any] | None:
    """Poll the deployment until every server is in ``until`` (None: it went)."""
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
            drawn = len(rows)
        elif not quiet:
            for s in rows:
                if seen.get(s["server_id"]) != s["state"]:
                    seen[s["server_id"]] = s["state"]
                    click.echo(f"{s['display_name']} ({s['node_id']}): {s['state']}")
        if rows and all(s["state"] in until for s in rows):
            return view
        if time.monotonic() >= deadline:
            click.echo(f"modelforge: gave up waiting after {timeout:.0f} s", err=True)
            return view
        time.sleep(0.5)


def _finish(view: dict[str, Any] | None, as_json: bool) -> None:
    if view is None:
        raise CliError("the deployment went while waiting", "See `modelforge deployments`.", 1)
    if as_json:
        emit(True, view, "")
    failed = [s for s in view["servers"] if s["state"] == SERVER_FAILED]
    for s in failed:
        code = (s["error"] or {}).get("code", "")
        click.echo(
            f"modelforge: {s['display_name']} ({s['node_id']}): {code}: "
            f"{(s['error'] or {}).get('message', '')}; next step: "
            f"{_NEXT_STEPS.get(code, 'check the node, then restart the deployment')}",
            err=True,
        )
    if failed or any(s["state"] != SERVER_RUNNING for s in view["servers"]):
        raise SystemExit(EXIT_CHECK_FAILED)
    if not as_json:
        click.echo(f"{view['name']}: every server runs.")


@click.group("deployments", invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def deployments_group(ctx: click.Context, as_json: bool) -> None:
    """List deployments and their servers; `show NAME`, `restart NAME` (docs/deployments.md)."""
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
    lines = _lines(view)
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
    if not wait:
        emit(as_json, view, "\n".join(["Restarting:", *_lines(view)]))
        return
    _finish(_follow(obj, name, timeout, as_json, until=(SERVER_RUNNING, SERVER_FAILED)), as_json)


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
        left = _follow(obj, name, timeout, as_json, until=(SERVER_STOPPED,))
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
