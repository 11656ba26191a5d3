"""Commands run as the state directory's owner, or not at all.

A restore run as root used to leave the store and its lock owned by root inside the
service's directory: the service could no longer open its own store, and systemd does not
repair that. Opening a SQLite store in WAL mode can create ``-wal``/``-shm`` files too, so
every command that touches the state directory checks first, and says which user to be.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from modelforge_contract import EXIT_USAGE

from ..core.settings import Settings
from .errors import CliError


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def foreign_files(state_dir: Path, owner: int) -> list[Path]:
    """Entries directly in the state directory that belong to someone else."""
    try:
        entries = list(state_dir.iterdir())
    except OSError:
        return []
    strays = []
    for entry in entries:
        try:
            if entry.lstat().st_uid != owner:
                strays.append(entry)
        except OSError:
            continue
    return sorted(strays)


def require_state_owner(settings: Settings, uid: int | None = None) -> None:
    """Refuse (exit 2) unless this process runs as the owner of the state directory.

    A directory that does not exist yet is fine: ``init`` creates it for the running user.
    """
    uid = os.geteuid() if uid is None else uid
    state_dir = settings.state_dir
    try:
        owner = state_dir.stat().st_uid
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CliError(
            f"cannot inspect the state directory {state_dir}: {exc.strerror}",
            f"run as the user the control plane runs as ({user_name(os.geteuid())} cannot "
            "reach it)",
        ) from None
    me, them = user_name(uid), user_name(owner)
    if owner != uid:
        raise CliError(
            f"the state directory {state_dir} belongs to {them}, but this command runs as {me}; "
            "files it created there would lock the service out of its own store",
            f"run it as {them}: sudo -u {them} -- modelforge … (under systemd, the mf() helper "
            "in docs/install-systemd.md does that)",
            EXIT_USAGE,
        )
    strays = foreign_files(state_dir, owner)
    if strays:
        shown = ", ".join(f"{path.name} ({user_name(path.lstat().st_uid)})" for path in strays)
        raise CliError(
            f"{state_dir} holds files its owner {them} does not own: {shown}; the control "
            "plane cannot use them (an earlier command ran as another user)",
            f"give them back: chown -R {them}: {state_dir}",
            EXIT_USAGE,
        )
