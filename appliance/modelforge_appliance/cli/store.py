"""``modelforge backup`` and ``restore``: the store's online backup and its runbook restore."""

from __future__ import annotations

from pathlib import Path

import click

from .. import backup
from ..clock import Clock
from .support import JSON_OPTION, Context, confirmed, emit, fail


@click.command("backup")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@JSON_OPTION
@click.pass_obj
def backup_command(obj: Context, path: Path, as_json: bool) -> None:
    """Copy the SQLite store to PATH (consistent while serving; mode 0600)."""
    done = backup.backup(obj.settings, path)
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
    """Replace the store with a backup (the control plane must be stopped)."""
    if not yes and not confirmed(f"Replace the store in {obj.settings.state_dir} with {path}?"):
        fail("nothing was changed", code=1)
    done = backup.restore(obj.settings, path, Clock(), accept_lost_revocations)
    kept = done["kept_from_current_store"]
    emit(
        as_json,
        done,
        f"Restored the store from {done['restored_from']}. Kept from the replaced store: "
        + ", ".join(f"{count} {name.replace('_', ' ')}" for name, count in kept.items())
        + ". Inventory is treated as stale until each agent publishes again.",
    )
