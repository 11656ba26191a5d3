"""Backup and restore of the SQLite store.

``backup`` uses SQLite's online backup API, so it is consistent while the control
plane serves. ``restore`` refuses while any ``modelforge serve`` holds the state
directory, keeps every revocation, spent token and decommission the current store knows
(invariant 5), and marks
restored inventory and telemetry as unmeasured so nothing is placed on a snapshot.
PostgreSQL stores are backed up with ``pg_dump`` (docs/runbooks/backup-restore.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peewee as pw

from . import audit
from .clock import Clock
from .settings import ConfigError, Settings
from .store import SCHEMA_VERSION, Store, StoreVersionError, open_database

log = logging.getLogger(__name__)

LOCK_NAME = "modelforge.lock"


class RestoreRefused(Exception):
    """The restore cannot run now or from this file; nothing was changed."""


@contextlib.contextmanager
def state_lock(settings: Settings, exclusive: bool) -> Iterator[None]:
    """Serve holds the state directory shared; restore needs it alone."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(settings.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RestoreRefused(
                "the control plane is running on this state directory; stop it "
                "(systemctl stop modelforge) and run the restore again"
            ) from None
        yield
    finally:
        os.close(fd)


def sqlite_path(settings: Settings) -> Path:
    db = open_database(settings.database_url)
    if not isinstance(db, pw.SqliteDatabase):
        raise ConfigError(
            "backup and restore handle the SQLite store; back up PostgreSQL with pg_dump "
            "(docs/runbooks/backup-restore.md)"
        )
    return Path(db.database)


def _copy(source: Path, destination: Path) -> None:
    """Online-backup source into destination, written beside it and renamed into place."""
    temporary = destination.with_name(f".{destination.name}.partial")
    temporary.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(temporary)
    try:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=DELETE")  # a self-contained single file
    finally:
        dst.close()
        src.close()
    os.chmod(temporary, 0o600)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, destination)


def backup(settings: Settings, destination: Path) -> dict[str, Any]:
    source = sqlite_path(settings)
    if not source.exists():
        raise RestoreRefused(f"there is no store at {source}; run `modelforge init` first")
    destination = destination.absolute()
    if destination.is_dir():
        raise RestoreRefused(f"{destination} is a directory; name the backup file")
    _copy(source, destination)
    return {
        "backup": str(destination),
        "bytes": destination.stat().st_size,
        "schema_version": _schema_version_of(destination),
    }


def _schema_version_of(path: Path) -> int:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                raise RestoreRefused(f"{path} fails SQLite's integrity check")
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise RestoreRefused(f"{path} is not a ModelForge backup ({exc})") from None
    return int(row[0] or 0)


# What the current store has made final since any backup: it must stay final after the
# restore (invariant 5). Each entry: the SELECT on the current store, the UPDATE that
# reapplies a row of it to the restored one (only where the backup still has it open).
_FINAL = {
    "credentials": (
        "SELECT revoked_at, COALESCE(revoked_reason, 'revoked before restore'), credential_id "
        "FROM credential WHERE revoked_at IS NOT NULL",
        "UPDATE credential SET revoked_at = ?, revoked_reason = ? "
        "WHERE credential_id = ? AND revoked_at IS NULL",
    ),
    "admin_tokens": (
        "SELECT revoked_at, token_id FROM admin_token WHERE revoked_at IS NOT NULL",
        "UPDATE admin_token SET revoked_at = ? WHERE token_id = ? AND revoked_at IS NULL",
    ),
    # A token used or revoked after the backup can never be claimed again.
    "enrollment_tokens": (
        "SELECT COALESCE(consumed_at, revoked_at), enrollment_id FROM enrollment_token "
        "WHERE consumed_at IS NOT NULL OR revoked_at IS NOT NULL",
        "UPDATE enrollment_token SET revoked_at = ? WHERE enrollment_id = ? "
        "AND consumed_at IS NULL AND revoked_at IS NULL",
    ),
    "decommissioned_nodes": (
        "SELECT decommissioned_at, node_id FROM node WHERE decommissioned_at IS NOT NULL",
        "UPDATE node SET decommissioned_at = ?, cordoned = 1 WHERE node_id = ? "
        "AND decommissioned_at IS NULL",
    ),
}


def _current_finalities(path: Path, accept_loss: bool) -> dict[str, list[tuple]]:
    """Every revocation, spent token and decommission the store being replaced knows."""
    if not path.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return {name: conn.execute(select).fetchall() for name, (select, _) in _FINAL.items()}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if accept_loss:
            log.warning("the current store cannot be read (%s); its revocations are lost", exc)
            return {}
        raise RestoreRefused(
            f"the current store {path} cannot be read ({exc}), so the revocations made since "
            "the backup cannot be kept; if you accept that, run the restore again with "
            "--accept-lost-revocations and then revoke what must stay revoked"
        ) from None


def _current_password(path: Path) -> tuple | None:
    """The admin password hash the store being replaced holds, if it is readable and has one."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT password_hash, set_at FROM admin_password").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:  # an older schema, or an unreadable file
        return None


def _keep_console_security(store: Store, password: tuple | None, now: float) -> None:
    """A restore never revives a console session or an admin password replaced since.

    Sessions that were open at backup time may have been signed out since: every restored
    session ends. A password set after the backup (perhaps because the old one leaked)
    stays the password.
    """
    store.db.execute_sql("UPDATE console_session SET ended_at = ? WHERE ended_at IS NULL", (now,))
    if password is None:
        return
    password_hash, set_at = password
    store.db.execute_sql(
        "INSERT INTO admin_password (id, password_hash, set_at) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET password_hash = excluded.password_hash, "
        "set_at = excluded.set_at WHERE admin_password.set_at < excluded.set_at",
        (password_hash, set_at),
    )


def _reapply(store: Store, finalities: dict[str, list[tuple]]) -> dict[str, int]:
    kept = {}
    for name, rows in finalities.items():
        update = _FINAL[name][1]
        kept[name] = sum(store.db.execute_sql(update, row).rowcount for row in rows)
    return kept


def restore(
    settings: Settings, source: Path, clock: Clock, accept_lost_revocations: bool = False
) -> dict[str, Any]:
    target = sqlite_path(settings)
    source = source.absolute()
    if not source.is_file():
        raise RestoreRefused(f"{source} does not exist")
    version = _schema_version_of(source)
    if version > SCHEMA_VERSION:
        raise StoreVersionError(
            f"{source} has schema version {version}, newer than this "
            f"program's {SCHEMA_VERSION}; restore it with that release"
        )
    with state_lock(settings, exclusive=True):
        finalities = _current_finalities(target, accept_lost_revocations)
        password = _current_password(target)
        staged = target.with_name(f".{target.name}.restoring")
        _copy(source, staged)
        store = Store(f"sqlite:///{staged}", clock)
        try:
            store.migrate()
            with store.write():
                kept = _reapply(store, finalities)
                _keep_console_security(store, password, clock.now())
                # Placement and readiness wait for a fresh measurement, never a snapshot.
                store.db.execute_sql("UPDATE node SET inventory_at = NULL, telemetry_at = NULL")
                audit.record(
                    store,
                    audit.CLI_ACTOR,
                    "store.restored",
                    source=source.name,
                    backup_schema_version=version,
                    kept_from_current_store=kept,
                )
            store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            store.close()
        _checkpoint(target)
        for suffix in ("-wal", "-shm"):
            Path(f"{target}{suffix}").unlink(missing_ok=True)
        os.replace(staged, target)
    log.info("store restored from %s (schema version %d)", source.name, version)
    return {
        "restored_from": str(source),
        "backup_schema_version": version,
        "kept_from_current_store": kept,
    }


def _checkpoint(path: Path) -> None:
    """Fold the live store's WAL into it so no stale WAL outlives the replaced file."""
    if path.exists():
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError:
            pass  # an unreadable store (restore was told to accept that): nothing to fold
        finally:
            conn.close()
