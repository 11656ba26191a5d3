"""``modelforge backup``, ``restore``, ``save-finality`` and ``restore-finality``.

The SQLite store is backed up online and restored by the runbook's restore; a PostgreSQL
store is dumped and restored with PostgreSQL's tools, and its finality record is carried
across with save-finality before and restore-finality after (docs/runbooks/backup-restore.md).
"""

from __future__ import annotations

from pathlib import Path

import click

from ..core import sealing
from ..core.clock import Clock
from ..store import backup
from .locate import require_store_file
from .ownership import require_state_owner
from .support import JSON_OPTION, Context, confirm_or_refuse, emit

_KEPT_NAMES = {
    "credentials": "credentials",
    "admin_tokens": "admin tokens",
    "enrollment_tokens": "enrollment tokens",
    "decommissioned_nodes": "decommissioned nodes",
    "decommission_confirmations": "decommission confirmations",
    "api_keys": "API keys",
}


def _counts(made_final: dict[str, int]) -> str:
    return ", ".join(f"{count} {_KEPT_NAMES.get(name, name)}" for name, count in made_final.items())


def _items(count: int, of: int | None = None) -> str:
    """``1 queued or leased item holds`` / ``2 of 3 queued or leased items hold``."""
    whole = count if of is None else of
    prefix = f"{count}" if of is None else f"{count} of {of}"
    return f"{prefix} queued or leased item{' holds' if whole == 1 else 's hold'}"


def _work_secrets(found: dict, key_file: str) -> str:
    """What a restored store's sealed work secrets need, and whether the key file opens them."""
    total, unreadable = found["unfinished_items_with_secrets"], found["unfinished_items_unreadable"]
    if not total:
        return "Work secrets: no queued or leased item holds one."
    if not unreadable:
        return f"Work secrets: {_items(total)} sealed env values; {key_file} opens them all."
    return (
        f"Work secrets: {_items(unreadable, total)} env values sealed with work key "
        f"{', '.join(found['key_ids_missing'])}, which {key_file} does not hold: each fails with "
        "WORK_SECRET_UNREADABLE when a node claims it, and reaches no node. Put that key file "
        "back before starting the control plane (docs/runbooks/backup-restore.md), or submit "
        "those items again."
    )


def _backup_work_key(done: dict, state_dir: Path) -> str:
    key, total = done["work_key"], done["work_secrets"]["unfinished_items_with_secrets"]
    holding = (
        f"{_items(total)} sealed env values" if total else "no queued or leased item holds one"
    )
    if key["included"]:
        return (
            f"Work secrets: {holding}; the work key is in {key['path']} (mode 0600). Whoever "
            "has both files can read them: keep the key apart from the backup."
        )
    return (
        f"Work secrets: {holding}; the backup holds their ciphertext only, not the work key "
        f"({sealing.work_key_path(state_dir)}). Restored with this state directory they open; "
        "anywhere else they fail when leased unless the key comes along (--include-work-key)."
    )


@click.command("backup")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--force", is_flag=True, help="Replace PATH even if it exists and is not a ModelForge backup."
)
@click.option(
    "--include-work-key",
    is_flag=True,
    help="Also write the work key, which opens the work items' sealed secrets, to PATH.work-key.",
)
@JSON_OPTION
@click.pass_obj
def backup_command(
    obj: Context, path: Path, force: bool, include_work_key: bool, as_json: bool
) -> None:
    """Copy the SQLite store to PATH (consistent while serving; mode 0600).

    PATH is a plain file name in an existing directory. An earlier backup at PATH is
    replaced; any other existing file only with --force. The store's own files are refused.
    Work items' secrets are in it sealed; the key that opens them stays in the state
    directory unless --include-work-key writes it to PATH.work-key (mode 0600) too.
    """
    require_state_owner(obj.settings)
    require_store_file(obj.settings, obj.env_file)  # never creates a store to back up
    obj.announce_store()
    done = backup.backup(obj.settings, path, force, include_work_key)
    emit(
        as_json,
        done,
        f"Backed up the store to {done['backup']} ({done['bytes']} bytes).\n"
        + _backup_work_key(done, obj.settings.state_dir),
    )


@click.command("restore")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--yes", is_flag=True, help="Replace the current store without asking.")
@click.option(
    "--accept-lost-revocations",
    is_flag=True,
    help="Restore even when the current store cannot be read, losing the revocations it holds.",
)
@JSON_OPTION
@click.pass_obj
def restore_command(
    obj: Context, path: Path, yes: bool, accept_lost_revocations: bool, as_json: bool
) -> None:
    """Replace the store with a backup (the control plane must be stopped).

    Everything the replaced store made final stays final: its finality record is carried
    into the restored store, also for secrets the backup has no row for. A work key file
    beside the backup (PATH.work-key) joins the state directory's; the restore says whether
    the restored items' sealed secrets can be opened. Asks on the terminal first; with
    --json, --yes is required.
    """
    require_state_owner(obj.settings)
    obj.announce_store()
    confirm_or_refuse(f"Replace the store in {obj.settings.state_dir} with {path}?", yes, as_json)
    done = backup.restore(obj.settings, path, Clock(), accept_lost_revocations)
    record = done["finality_record"]
    emit(
        as_json,
        done,
        f"Restored the store from {done['restored_from']}.\n"
        f"Made final again from the replaced store: {_counts(done['kept_from_current_store'])}.\n"
        f"Finality record: {record['entries']} entries, "
        f"{record['carried_from_current_store']} of them carried over from the replaced store; "
        "they stay final through any later restore.\n"
        "Inventory is treated as stale until each agent publishes again.\n"
        + _restored_work_key(done["work_key"])
        + _work_secrets(done["work_secrets"], done["work_key"]["path"]),
    )


def _restored_work_key(key: dict) -> str:
    if not key["from_backup"]:
        return ""
    added = ", ".join(key["key_ids_added"]) or "none new"
    return f"Work key from {key['from_backup']}: added to {key['path']} ({added}).\n"


@click.command("save-finality")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@JSON_OPTION
@click.pass_obj
def save_finality_command(obj: Context, path: Path, as_json: bool) -> None:
    """Save the store's finality record to PATH (before a pg_restore).

    The record lists every credential, admin token, enrollment token, decommissioned node
    and identity, and decommission confirmation that was ever revoked or spent: ids and
    times only, never a secret. Feed it to restore-finality after restoring the database.
    """
    done = backup.save_finality(obj.store(), path)
    emit(
        as_json,
        done,
        f"Saved the finality record ({done['entries']} entries) to {done['saved']}.\n"
        f"After the database restore, run: modelforge restore-finality {done['saved']}",
    )


@click.command("restore-finality")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@JSON_OPTION
@click.pass_obj
def restore_finality_command(obj: Context, path: Path, as_json: bool) -> None:
    """Carry a saved finality record into the restored store (the control plane stopped).

    Run after pg_restore (or any restore made outside `modelforge restore`): every secret
    the record names stays revoked or spent, and every node's inventory counts as
    unmeasured until its agent publishes again.
    """
    require_state_owner(obj.settings)
    obj.announce_store()
    done = backup.restore_finality(obj.settings, path, Clock())  # never into a new store
    record = done["finality_record"]
    emit(
        as_json,
        done,
        f"Carried the finality record from {done['restored_from']} into the store.\n"
        f"Made final again: {_counts(done['made_final'])}.\n"
        f"Finality record: {record['entries']} entries, {record['carried']} of them added now.\n"
        "Inventory is treated as stale until each agent publishes again.\n"
        + _work_secrets(done["work_secrets"], str(sealing.work_key_path(obj.settings.state_dir))),
    )
