"""``modelforge models import|pull|list|show|replicate|replicas|remove|verify``
(docs/models.md); ``pull`` is in models_pull.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from modelforge_contract import EXIT_CHECK_FAILED
from modelforge_contract.models import (
    MODEL_CACHE_INVALID,
    REPLICA_FAILED,
    REPLICA_PRESENT,
)

from ..core.errors import ApiError
from ..models import cache, catalog, replicas
from ..store import audit
from .completion import complete_nodes
from .errors import CliError, refused
from .models_pull import pull_command
from .nodes import find_node
from .support import JSON_OPTION, Context, emit, files_text, size_text

_NEXT_STEPS = {
    "INSUFFICIENT_SPACE": "free space on the node's artifact root (or point "
    "MODELFORGE_AGENT_ARTIFACT_ROOT at a larger disk), then replicate again",
    "DISK_FULL": "free space on the node's artifact root, then replicate again (it resumes)",
    "DIGEST_MISMATCH": "run `modelforge models verify NAME`; the bad file is in the node's "
    "quarantine root",
    "DOWNLOAD_STALLED": "check the network between the node and the control plane, then "
    "replicate again",
    "DOWNLOAD_FAILED": "check the node's agent log, then replicate again",
    "MANIFEST_INVALID": "upgrade the node's agent, then replicate again",
    "STORAGE_FAILED": "check the node's artifact and quarantine roots, then replicate again",
}


@click.group("models")
def models_group() -> None:
    """Import models into the seed cache and replicate them to nodes (docs/models.md)."""


models_group.add_command(pull_command)


@models_group.command("import")
@click.argument("name")
@click.argument("path", type=click.Path())
@click.option("--revision", help="The revision to record (default: r1, r2, … or the HF commit).")
@JSON_OPTION
@click.pass_obj
def import_command(obj: Context, name: str, path: str, revision: str | None, as_json: bool):
    """Hash the file or directory PATH on this host into the seed cache as model NAME."""
    store = obj.store()
    try:
        found = cache.scan_source(Path(path))
        total = sum(entry.size for entry in found)
        show = sys.stderr.isatty() and not as_json
        if show:
            with click.progressbar(
                length=total, label=f"Hashing {name}", file=sys.stderr, show_pos=False
            ) as bar:
                imported = catalog.import_model(
                    store, obj.settings.state_dir, name, path, audit.CLI_ACTOR, revision, bar.update
                )
        else:
            imported = catalog.import_model(
                store, obj.settings.state_dir, name, path, audit.CLI_ACTOR, revision
            )
    except ApiError as exc:
        raise refused(exc) from None
    view = catalog.model_view(imported.model)
    note = "Imported" if imported.created else "Already imported as"
    lines = [
        f"{note} {view['name']} revision {view['revision']}: {files_text(view['file_count'])}, "
        f"{size_text(view['size_bytes'])}, {view['digest']}"
    ]
    if imported.created and cache.shares_file_system(Path(path), obj.settings.state_dir):
        lines.append(
            f"The seed cache keeps its own copy on the same file system as {path}: remove "
            "the source if you no longer need it (the cache never links to a source, which "
            "could be changed in place)."
        )
    emit(as_json, view, "\n".join(lines))


@models_group.command("list")
@JSON_OPTION
@click.pass_obj
def list_command(obj: Context, as_json: bool) -> None:
    """Each model's latest revision."""
    models = catalog.list_models(obj.store())
    lines = [f"{'NAME':30} {'REVISION':16} {'REVS':>4} {'SIZE':>10} {'FILES':>5} DIGEST"]
    for m in models:
        lines.append(
            f"{m['name']:30} {m['revision']:16} {m['revision_count']:>4} "
            f"{size_text(m['size_bytes']):>10} {m['file_count']:>5} {m['digest'][:19]}"
        )
    if not models:
        lines = [
            "No models yet: modelforge models import NAME PATH, or modelforge models pull "
            "NAME hf://ORG/REPO"
        ]
    emit(as_json, {"models": models}, "\n".join(lines))


def _replica_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        line = (
            f"  {r['display_name']} ({r['node_id']}) {r['revision']}: {r['state']} "
            f"{size_text(r['bytes_done'])}/{size_text(r['bytes_total'])}"
        )
        if r["error"]:
            line += f" {r['error']['code']}: {r['error']['message']}"
        lines.append(line)
    return lines


@models_group.command("show")
@click.argument("name")
@click.option("--revision", help="That revision instead of the latest.")
@JSON_OPTION
@click.pass_obj
def show_command(obj: Context, name: str, revision: str | None, as_json: bool) -> None:
    """One model revision: its files, revisions and replicas."""
    store = obj.store()
    try:
        model = catalog.get_revision(store, name, revision)
        revisions = catalog.revisions_of(store, name)
    except ApiError as exc:
        raise refused(exc) from None
    view = catalog.model_view(model)
    view["revisions"] = [catalog.revision_summary(m) for m in revisions]
    view["replicas"] = replicas.list_replicas(store, [model])
    lines = [
        f"model {view['name']} revision {view['revision']}: {view['digest']}",
        f"  size:      {size_text(view['size_bytes'])} in {files_text(view['file_count'])}",
        f"  source:    {view['source']}",
        f"  imported:  {view['created_at']} by {view['created_by']}",
        "  revisions: " + ", ".join(r["revision"] for r in view["revisions"]),
        "  files:",
        *[
            f"    {f['path']}  {size_text(f['size'])}  sha256:{f['sha256'][:12]}"
            for f in view["files"]
        ],
        "  replicas:" + ("" if view["replicas"] else " none"),
        *["  " + line for line in _replica_lines(view["replicas"])],
    ]
    emit(as_json, view, "\n".join(lines))


@models_group.command("replicate")
@click.argument("name")
@click.argument("nodes", nargs=-1, required=True, shell_complete=complete_nodes)
@click.option("--revision", help="That revision instead of the latest.")
@click.option("--wait", is_flag=True, help="Follow until each replica is present or failed.")
@click.option("--timeout", type=click.FloatRange(1), default=3600.0, show_default=True)
@JSON_OPTION
@click.pass_obj
def replicate_command(
    obj: Context,
    name: str,
    nodes: tuple[str, ...],
    revision: str | None,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Ask NODES (ids, id prefixes or hostnames) to hold model NAME."""
    store = obj.store()
    try:
        node_ids = [find_node(obj, node).node_id for node in nodes]
        made = replicas.replicate(store, obj.settings, name, node_ids, audit.CLI_ACTOR, revision)
    except ApiError as exc:
        raise refused(exc) from None
    if not wait:
        emit(
            as_json,
            {"replicas": made},
            "\n".join([f"Asked {len(made)} node(s) for {name}:", *_replica_lines(made)]),
        )
        return
    rows = _follow(obj, name, made, timeout, quiet=as_json)
    failed = [r for r in rows if r["state"] == REPLICA_FAILED]
    if as_json:
        emit(True, {"replicas": rows}, "")
    for r in failed:
        code = (r["error"] or {}).get("code", "")
        click.echo(
            f"modelforge: {r['display_name']} ({r['node_id']}): {code}: "
            f"{(r['error'] or {}).get('message', '')}; next step: "
            f"{_NEXT_STEPS.get(code, 'check the node, then replicate again')}",
            err=True,
        )
    if failed or any(r["state"] != REPLICA_PRESENT for r in rows):
        raise SystemExit(EXIT_CHECK_FAILED)


def _follow(
    obj: Context, name: str, made: list[dict[str, Any]], timeout: float, quiet: bool
) -> list[dict[str, Any]]:
    """Poll the replicas until each is present or failed (or the timeout)."""
    store = obj.store()
    wanted = {(r["node_id"], r["digest"]) for r in made}
    tty = sys.stdout.isatty() and not quiet
    seen: dict[tuple[str, str], str] = {}
    rates: dict[tuple[str, str], tuple[float, int]] = {}
    drawn = 0
    deadline = time.monotonic() + timeout
    models = catalog.revisions_of(store, name)
    while True:
        rows = [
            r
            for r in replicas.list_replicas(store, models)
            if (r["node_id"], r["digest"]) in wanted
        ]
        now = time.monotonic()
        if tty:
            if drawn:
                click.echo(f"\x1b[{drawn}F", nl=False)
            for r in rows:
                key = (r["node_id"], r["digest"])
                then, done = rates.get(key, (now, r["bytes_done"]))
                speed = (r["bytes_done"] - done) / (now - then) / 1e6 if now > then else 0.0
                rates[key] = (now, r["bytes_done"])
                click.echo(
                    f"\x1b[2K{r['display_name']:24} {r['state']:12} "
                    f"{size_text(r['bytes_done'])}/{size_text(r['bytes_total'])} {max(speed, 0):.1f} MB/s"
                )
            drawn = len(rows)
        elif not quiet:
            for r in rows:
                key = (r["node_id"], r["digest"])
                if seen.get(key) != r["state"]:
                    seen[key] = r["state"]
                    click.echo(f"{r['display_name']} ({r['node_id']}): {r['state']}")
        if all(r["state"] in (REPLICA_PRESENT, REPLICA_FAILED) for r in rows) and rows:
            return rows
        if now >= deadline:
            click.echo(f"modelforge: gave up waiting after {timeout:.0f} s", err=True)
            return rows
        time.sleep(0.5)


@models_group.command("replicas")
@click.argument("name")
@click.option("--revision", help="Only that revision.")
@JSON_OPTION
@click.pass_obj
def replicas_command(obj: Context, name: str, revision: str | None, as_json: bool) -> None:
    """Where model NAME is held, and how far each replica has come."""
    store = obj.store()
    try:
        models = (
            [catalog.get_revision(store, name, revision)]
            if revision
            else catalog.revisions_of(store, name)
        )
    except ApiError as exc:
        raise refused(exc) from None
    rows = replicas.list_replicas(store, models)
    emit(as_json, {"replicas": rows}, "\n".join(_replica_lines(rows)) or f"{name}: no replicas")


@models_group.command("remove")
@click.argument("name")
@click.option("--node", "node", help="Remove only the replica on this node.")
@click.option("--revision", help="Only that revision.")
@JSON_OPTION
@click.pass_obj
def remove_command(
    obj: Context, name: str, node: str | None, revision: str | None, as_json: bool
) -> None:
    """Remove model NAME from the seed cache, or with --node its replica on that node.

    NAME goes only once no deployment uses it and no node holds a replica: remove each
    replica first (--node), and the refusal names the commands that do.
    """
    store = obj.store()
    try:
        if node is not None:
            node_id = find_node(obj, node).node_id
            rows = replicas.remove_replica(store, name, node_id, audit.CLI_ACTOR, revision)
            emit(
                as_json,
                {"replicas": rows},
                f"Asked {node_id} to remove {name}; its row goes once the node stops reporting it.",
            )
            return
        deleted = catalog.delete_model(
            store, obj.settings.state_dir, name, audit.CLI_ACTOR, revision
        )
    except ApiError as exc:
        raise refused(exc) from None
    emit(
        as_json,
        {"name": name, "deleted": deleted},
        f"Removed {name} revision(s) {', '.join(d['revision'] for d in deleted)}.",
    )


@models_group.command("verify")
@click.argument("name")
@click.option("--revision", help="That revision instead of the latest.")
@JSON_OPTION
@click.pass_obj
def verify_command(obj: Context, name: str, revision: str | None, as_json: bool) -> None:
    """Hash model NAME's seed-cache blobs again; exit 1 when one is missing or altered."""
    store = obj.store()
    try:
        problems = catalog.verify_model(store, obj.settings.state_dir, name, revision)
    except ApiError as exc:
        raise refused(exc) from None
    if problems:
        for problem in problems:
            click.echo(f"modelforge: {MODEL_CACHE_INVALID}: {problem}", err=True)
        if as_json:
            emit(True, {"name": name, "ok": False, "problems": problems}, "")
        raise CliError(
            f"{len(problems)} cache blob(s) of {name} are missing or do not hash "
            f"({MODEL_CACHE_INVALID})",
            f"import the model again: modelforge models import {name} PATH",
            EXIT_CHECK_FAILED,
        )
    emit(as_json, {"name": name, "ok": True, "problems": []}, f"{name}: every cache blob hashes.")
