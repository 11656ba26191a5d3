"""``modelforge work submit|list|show|cancel``: the work queue from the control-plane host."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from modelforge_contract import (
    CAPABILITIES,
    EXIT_CHECK_FAILED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    WORK_QUEUED,
    WORK_STATES,
    WORK_SUCCEEDED,
)

from ..core.errors import ApiError, NotFound
from ..core.sealing import WorkKeys
from ..core.validation import SUBMIT_WORK_FIELDS, check_object
from ..store import audit
from ..store.tables import Node, WorkItem
from ..work import items, leases
from .completion import complete_nodes
from .errors import CliError, only_match
from .nodes import find_node
from .support import JSON_OPTION, Context, emit, fail

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TERMINAL = frozenset(WORK_STATES) - {WORK_QUEUED, "leased"}


def _bytes(value: str | None) -> int | None:
    """``24GiB``, ``512MiB`` or a plain number of bytes."""
    if value is None:
        return None
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if not number.isdigit() or unit not in _UNITS:
        fail(f"{value!r} is not a size such as 24GiB, 512MiB or 1073741824")
    return int(number) * _UNITS[unit]


def _input(value: str | None) -> dict[str, Any] | None:
    """Inline JSON, or @PATH to read it from a file."""
    if value is None:
        return None
    try:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as handle:
                value = handle.read()
        parsed = json.loads(value)
    except OSError as exc:
        fail(f"cannot read {value[1:]}: {exc.strerror}")
    except ValueError:
        fail("--input is not valid JSON")
    if not isinstance(parsed, dict):
        fail("--input must be a JSON object")
    return parsed


def _refused(exc: ApiError) -> CliError:
    """A refusal of the work service as the CLI's one line: exit 7 for an unknown item, 1 for
    a conflict (the item has finished: the answer is no), 2 for anything else."""
    if isinstance(exc, NotFound):
        code = EXIT_NOT_FOUND
    elif exc.status == 409:
        code = EXIT_CHECK_FAILED
    else:
        code = EXIT_USAGE
    return CliError(f"{exc.message} ({exc.code})", exc.next_step, code)


def _summary(item: dict[str, Any]) -> str:
    lines = [
        f"work {item['work_id']}: {item['state']} ({item['capability']}, attempt "
        f"{item['attempts']} of {item['max_attempts']})",
        f"  node:     {item['node_id'] or '-'}"
        + (f" (credential {item['lease_credential_id']})" if item["lease_credential_id"] else ""),
        f"  created:  {item['created_at']}  started: {item['started_at'] or '-'}  "
        f"finished: {item['finished_at'] or '-'}",
    ]
    if item["completed_by_node_id"]:
        # The outcome is what that node said; the control plane did not check it.
        lines.append(
            f"  reported: by node {item['completed_by_node_id']} with credential "
            f"{item['completed_by_credential_id']} (the node's own claim, not verified)"
        )
    if item["error"]:
        lines.append(f"  error:    {item['error']['code']}: {item['error']['message']}")
    if item["result"] is not None:
        lines.append(f"  result:   {json.dumps(item['result'], sort_keys=True)}")
    if item["log_tail"]:
        lines.append("  log tail:")
        lines += [f"    {line}" for line in item["log_tail"].splitlines()[-20:]]
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'WORK ID':38} {'CAPABILITY':10} {'STATE':10} {'ATTEMPTS':8} {'NODE':38} CREATED"]
    for item in rows:
        lines.append(
            f"{item['work_id']:38} {item['capability']:10} {item['state']:10} "
            f"{item['attempts']:>3}/{item['max_attempts']:<4} {item['node_id'] or '-':38} "
            f"{item['created_at']}"
        )
    return "\n".join(lines)


@click.group("work")
def work_group() -> None:
    """Submit work to the nodes and follow it (docs/work.md)."""


@work_group.command("submit")
@click.argument("capability", type=click.Choice(CAPABILITIES))
@click.option("--input", "input_json", help="The item's input: inline JSON, or @FILE.")
@click.option("--gpu-count", type=click.IntRange(0, 64), help="GPUs the node must have.")
@click.option("--min-gpu-memory", help="Each counted GPU has at least this much, e.g. 24GiB.")
@click.option("--gpu-name", help="Each counted GPU's model contains this, e.g. H100.")
@click.option(
    "--node",
    "node_ids",
    multiple=True,
    metavar="NODE",
    shell_complete=complete_nodes,
    help="Only this node: its id, a unique id prefix or its hostname (repeatable).",
)
@click.option("--timeout", type=click.IntRange(1, 86400), help="Seconds the run may take.")
@click.option("--max-attempts", type=click.IntRange(1, 20), help="Leases before it fails.")
@click.option("--idempotency-key", help="Submitting the same key again returns the first item.")
@click.option("--wait", is_flag=True, help="Wait for the end; exit 1 unless it succeeded.")
@JSON_OPTION
@click.pass_obj
def submit(
    obj: Context,
    capability: str,
    input_json: str | None,
    gpu_count: int | None,
    min_gpu_memory: str | None,
    gpu_name: str | None,
    node_ids: tuple[str, ...],
    timeout: int | None,
    max_attempts: int | None,
    idempotency_key: str | None,
    wait: bool,
    as_json: bool,
) -> None:
    """Queue a work item for CAPABILITY (smoke or container)."""
    constraints: dict[str, Any] = {
        "gpu_count": gpu_count,
        "min_gpu_memory_bytes": _bytes(min_gpu_memory),
        "gpu_name": gpu_name,
        "node_ids": [find_node(obj, node).node_id for node in node_ids] or None,
    }
    body = {
        "capability": capability,
        "input": _input(input_json),
        "constraints": {k: v for k, v in constraints.items() if v is not None},
        "timeout_seconds": timeout,
        "max_attempts": max_attempts,
        "idempotency_key": idempotency_key,
    }
    store = obj.store()
    try:
        fields = check_object({k: v for k, v in body.items() if v is not None}, SUBMIT_WORK_FIELDS)
        submission = items.submission_from(fields, obj.settings)
        submitted = items.submit_work(
            store, submission, audit.CLI_ACTOR, WorkKeys.of(obj.settings.state_dir)
        )
    except ApiError as exc:
        raise _refused(exc) from None
    item = items.work_view(submitted.item)
    offered = _nodes_offering(store, capability)
    if not offered:
        click.echo(
            f"modelforge: warning: no enrolled node's runtime worker offers {capability!r} now; "
            "the item waits until one does (`modelforge nodes readiness NODE` shows a node's "
            "worker and its capabilities)",
            err=True,
        )
    if not wait:
        note = "" if submitted.created else " (already submitted with this idempotency key)"
        emit(as_json, item, f"Queued work {item['work_id']}{note}.")
        return
    if not as_json:
        click.echo(f"Queued work {item['work_id']}; waiting for it to finish…", err=True)
    item = _wait(obj, item["work_id"])
    emit(as_json, item, _summary(item))
    if item["state"] != WORK_SUCCEEDED:
        raise SystemExit(EXIT_CHECK_FAILED)


def _nodes_offering(store: Any, capability: str) -> list[str]:
    """Nodes that may take work now whose worker last reported ``capability``."""
    with store.connection():
        rows = list(
            Node.select(Node.node_id, Node.health).where(
                Node.decommissioned_at.is_null(),
                Node.cordoned == False,  # noqa: E712
            )
        )
    offering = []
    for row in rows:
        try:
            worker = (json.loads(row.health) if row.health else {}).get("worker") or {}
        except ValueError:
            continue
        if capability in (worker.get("capabilities") or []):
            offering.append(row.node_id)
    return offering


def _wait(obj: Context, work_id: str) -> dict[str, Any]:
    store = obj.store()
    last = None
    while True:
        leases.expire_leases(store)
        item = items.work_view(items.get_work(store, work_id))
        if item["state"] != last:
            if last is not None:
                click.echo(f"  {item['state']} (node {item['node_id'] or '-'})", err=True)
            last = item["state"]
        if item["state"] in _TERMINAL:
            return item
        time.sleep(1)


@work_group.command("list")
@click.option("--state", type=click.Choice(WORK_STATES), help="Only items in this state.")
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@JSON_OPTION
@click.pass_obj
def list_command(obj: Context, state: str | None, limit: int, as_json: bool) -> None:
    """Work items, newest first."""
    store = obj.store()
    leases.expire_leases(store)
    answer = items.list_work(store, state=state, limit=limit)
    emit(as_json, answer, _table(answer["work"]) if answer["work"] else "No work items.")


def find_work(obj: Context, reference: str) -> str:
    """The work id a whole id or a unique id prefix names; NotFound or a usage error."""
    reference = reference.strip().lower()
    store = obj.store()
    with store.connection():
        if WorkItem.get_or_none(WorkItem.work_id == reference) is not None:
            return reference
        found = (
            [
                row.work_id
                for row in WorkItem.select(WorkItem.work_id)
                .where(WorkItem.work_id.startswith(reference))
                .order_by(WorkItem.work_id)
                .limit(7)
            ]
            if reference
            else []
        )
    return only_match(
        reference,
        found,
        kind="work item",
        by="by id or id prefix",
        listing="modelforge work list",
        id_of="work",
    )


@work_group.command("show")
@click.argument("work_id")
@JSON_OPTION
@click.pass_obj
def show(obj: Context, work_id: str, as_json: bool) -> None:
    """One work item (by id or unique id prefix) with its result, error and log tail."""
    store = obj.store()
    leases.expire_leases(store)
    try:
        item = items.work_view(items.get_work(store, find_work(obj, work_id)))
    except ApiError as exc:
        raise _refused(exc) from None
    emit(as_json, item, _summary(item))


@work_group.command("cancel")
@click.argument("work_id")
@JSON_OPTION
@click.pass_obj
def cancel(obj: Context, work_id: str, as_json: bool) -> None:
    """Cancel a queued or leased item (by id or unique id prefix); a running node stops at
    its next lease renewal."""
    store = obj.store()
    leases.expire_leases(store)
    try:
        item = items.work_view(items.cancel_work(store, find_work(obj, work_id), audit.CLI_ACTOR))
    except ApiError as exc:
        raise _refused(exc) from None
    emit(as_json, item, f"Work {item['work_id']} is {item['state']}.")
