"""Backup and restore of the SQLite store.

``backup`` uses SQLite's online backup API, so it is consistent while the control
plane serves. ``restore`` refuses while any ``modelforge serve`` holds the state
directory, keeps every revocation the current store knows (invariant 5), and marks
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


def _current_revocations(path: Path) -> list[tuple[str, float, str | None]]:
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT credential_id, revoked_at, revoked_reason FROM credential "
            "WHERE revoked_at IS NOT NULL"
        ).fetchall()
    except sqlite3.DatabaseError:
        return []
    finally:
        conn.close()


def restore(settings: Settings, source: Path, clock: Clock) -> dict[str, Any]:
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
        revocations = _current_revocations(target)
        staged = target.with_name(f".{target.name}.restoring")
        _copy(source, staged)
        store = Store(f"sqlite:///{staged}", clock)
        try:
            store.migrate()
            with store.write():
                carried = _carry_revocations(store, revocations)
                # Placement and readiness wait for a fresh measurement, never a snapshot.
                store.db.execute_sql("UPDATE node SET inventory_at = NULL, telemetry_at = NULL")
                audit.record(
                    store,
                    audit.CLI_ACTOR,
                    "store.restored",
                    source=source.name,
                    backup_schema_version=version,
                    revocations_kept=carried,
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
        "revocations_kept": carried,
    }


def _carry_revocations(store: Store, revocations: list[tuple[str, float, str | None]]) -> int:
    """Invariant 5: a credential revoked after the backup stays revoked after the restore."""
    carried = 0
    for credential_id, revoked_at, reason in revocations:
        cursor = store.db.execute_sql(
            "UPDATE credential SET revoked_at = ?, revoked_reason = ? "
            "WHERE credential_id = ? AND revoked_at IS NULL",
            (revoked_at, reason or "revoked before restore", credential_id),
        )
        carried += cursor.rowcount
    return carried


def _checkpoint(path: Path) -> None:
    """Fold the live store's WAL into it so no stale WAL outlives the replaced file."""
    if path.exists():
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
