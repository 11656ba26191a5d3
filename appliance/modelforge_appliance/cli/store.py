"""``modelforge backup``, ``restore``, ``save-finality`` and ``restore-finality``.

The SQLite store is backed up online and restored by the runbook's restore; a PostgreSQL
store is dumped and restored with PostgreSQL's tools, and its finality record is carried
across with save-finality before and restore-finality after (docs/runbooks/backup-restore.md).
"""

from __future__ import annotations

from pathlib import Path

import click

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
}


def _counts(made_final: dict[str, int]) -> str:
    return ", ".join(f"{count} {_KEPT_NAMES.get(name, name)}" for name, count in made_final.items())


@click.command("backup")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--force", is_flag=True, help="Replace PATH even if it exists and is not a ModelForge backup."
)
@JSON_OPTION
@click.pass_obj
def backup_command(obj: Context, path: Path, force: bool, as_json: bool) -> None:
    """Copy the SQLite store to PATH (consistent while serving; mode 0600).

    PATH is a plain file name in an existing directory. An earlier backup at PATH is
    replaced; any other existing file only with --force. The store's own files are refused.
    """
    require_state_owner(obj.settings)
    require_store_file(obj.settings, obj.env_file)  # never creates a store to back up
    obj.announce_store()
    done = backup.backup(obj.settings, path, force)
    emit(as_json, done, f"Backed up the store to {done['backup']} ({done['bytes']} bytes).")


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
    into the restored store, also for secrets the backup has no row for. Asks on the
    terminal first; with --json, --yes is required.
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
        "Inventory is treated as stale until each agent publishes again.",
    )


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
        "Inventory is treated as stale until each agent publishes again.",
    )
