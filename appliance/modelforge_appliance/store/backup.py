"""Backup and restore of the SQLite store; the finality record's way across a pg_restore.

``backup`` uses SQLite's online backup API, so it is consistent while the control plane
serves. ``restore`` needs the state lock alone (statelock.py): no ``serve`` and no other
command runs meanwhile. It copies the backup into a staging directory beside the store,
checks and migrates the copy there, carries the finality record of the store it replaces
into it (finality.py: every revocation, spent token and decommission stays final, also
those the backup has no row for), marks restored inventory and telemetry as unmeasured,
and only then renames it over the store. Killed at any point, it leaves the old store or
the new one, never a mix; the next command removes the staging directory.

File names are plain names: a read-only connection escapes the path into a ``file:`` URI
(so ``#``, ``?`` and ``%`` stay characters of the name), and any other connection opens an
absolute path with URI parsing off. Temporary files are made in a fresh private directory,
so no name planted beside the destination is ever followed or removed.

PostgreSQL stores are backed up with ``pg_dump``; ``save_finality`` and ``restore_finality``
carry the record across the ``pg_restore`` (docs/runbooks/backup-restore.md).

Work items' secrets are sealed with the state directory's work key (core/sealing.py), which
is not in the store: a backup holds only their ciphertext. ``backup(include_work_key=True)``
also writes the key file beside the backup (``PATH.work-key``, mode 0600); ``restore`` adds
the keys of such a file, when it lies beside the backup, to the state directory's. Both say
how many unfinished items hold sealed values and whether the keys they need are there; an
item whose key is missing fails when it is leased (work/leases.py), never silently.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import shutil
import sqlite3
import stat
import tempfile
from pathlib import Path
from typing import Any

import peewee as pw

from modelforge_contract.files import fsync_directory, write_atomically

from ..core import sealing
from ..core.clock import Clock
from ..core.errors import OperatorError
from ..core.settings import ConfigError, Settings
from . import audit, finality, statelock
from .database import (
    SCHEMA_VERSION,
    Store,
    StoreVersionError,
    open_database,
    redact_url,
    sqlite_url,
)
from .migrations import MIGRATIONS

log = logging.getLogger(__name__)


class RestoreRefused(OperatorError):
    """The backup or restore cannot run now, or from or to this file; nothing was changed."""


def reached_stage(stage: str) -> None:
    """Called as a restore passes each named stage; tests replace it to pause or SIGKILL there.

    Stages in order: locked, record-read, copied, prepared, folded, replaced.
    """


def sqlite_path(settings: Settings) -> Path:
    db = open_database(settings.database_url)
    if not isinstance(db, pw.SqliteDatabase):
        raise ConfigError(
            "backup and restore handle the SQLite store; back up PostgreSQL with pg_dump and "
            "carry the finality record with save-finality and restore-finality "
            "(docs/runbooks/backup-restore.md)"
        )
    return Path(os.path.abspath(db.database))


def _staging(target: Path) -> Path:
    return target.with_name(f".{target.name}.restoring")


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree at path, without following a link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_interrupted_restore(settings: Settings) -> None:
    """Remove what a restore killed midway left beside the store; call holding the lock."""
    if not isinstance(open_database(settings.database_url), pw.SqliteDatabase):
        return
    staging = _staging(sqlite_path(settings))
    for leftover in (staging, *(Path(f"{staging}{s}") for s in ("-wal", "-shm", "-journal"))):
        _remove(leftover)


def _open_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection; Path.as_uri escapes #, ? and % so the name stays the name."""
    return sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)


def _copy(source: Path, destination: Path) -> None:
    """Online-backup source into destination: made in a private directory, renamed into place."""
    private = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        temporary = private / "copy.sqlite3"
        src = _open_read_only(source)
        dst = sqlite3.connect(str(temporary))  # absolute path, URI parsing off
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
        fsync_directory(destination.parent)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _is_store_file(store: Path, path: Path) -> bool:
    """Whether path is the store, its WAL, SHM or journal: by name or as the same file."""
    resolved = os.path.realpath(path)
    for own in (store, *(Path(f"{store}{s}") for s in ("-wal", "-shm", "-journal"))):
        if resolved == os.path.realpath(own):
            return True
        try:
            if os.path.samefile(path, own):
                return True
        except OSError:
            pass  # one of them does not exist
    return False


@functools.cache
def _tables_at(version: int) -> dict[str, frozenset[str]]:
    """The tables and columns a store of this schema version has, from its migrations."""
    db = pw.SqliteDatabase(":memory:")
    db.connect()
    try:
        for migration in MIGRATIONS:
            if migration.version <= version:
                migration.apply(db)
        return {
            table: frozenset(c.name for c in db.get_columns(table)) for table in db.get_tables()
        }
    finally:
        db.close()


def _check_backup(path: Path, shown: Path) -> int:
    """The schema version of the backup at path, or RestoreRefused naming shown."""
    try:
        conn = _open_read_only(path)
        try:
            if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                raise RestoreRefused(f"{shown} fails SQLite's integrity check")
            tables = {
                name: {row[1] for row in conn.execute(f'PRAGMA table_info("{name}")')}
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            if "schema_version" not in tables:
                raise RestoreRefused(f"{shown} is not a ModelForge backup (no schema_version)")
            version = int(
                conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0
            )
        finally:
            conn.close()
    except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
        raise RestoreRefused(f"{shown} is not a ModelForge backup ({exc})") from None
    if version < 1:
        raise RestoreRefused(
            f"{shown} records schema version {version}: it holds no ModelForge store"
        )
    if version > SCHEMA_VERSION:
        raise RestoreRefused(
            f"{shown} has schema version {version}, newer than this program's "
            f"{SCHEMA_VERSION}; restore it with that release"
        )
    for table, columns in sorted(_tables_at(version).items()):
        if table not in tables:
            raise RestoreRefused(
                f"{shown} claims schema version {version} but lacks its table {table}"
            )
        if missing := sorted(columns - tables[table]):
            raise RestoreRefused(
                f"{shown} claims schema version {version} but its table {table} lacks "
                + ", ".join(missing)
            )
    return version


def _looks_like_backup(path: Path) -> bool:
    try:
        conn = _open_read_only(path)
        try:
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return False
    return bool(row and row[0] and int(row[0]) >= 1)


def _writable_destination(destination: Path, what: str) -> Path:
    destination = Path(os.path.abspath(destination))
    if not destination.parent.is_dir():
        raise RestoreRefused(
            f"the directory {destination.parent} does not exist; create it first or name "
            f"another place for the {what}"
        )
    if destination.is_dir():
        raise RestoreRefused(f"{destination} is a directory; name the {what} file")
    return destination


WORK_KEY_SUFFIX = ".work-key"
# Only items that can still be leased need their secrets opened again.
_UNFINISHED_INPUTS_SQL = "SELECT input FROM work_item WHERE state IN ('queued', 'leased')"


def work_key_beside(backup_file: Path) -> Path:
    """Where ``backup --include-work-key`` puts the key file, and where restore looks."""
    return backup_file.with_name(backup_file.name + WORK_KEY_SUFFIX)


def work_secrets(inputs: list[str], held: list[str]) -> dict[str, Any]:
    """What the unfinished items' stored inputs need: which work keys, and whether ``held``
    (the key ids there are) opens them; counts and key ids only, never a value."""
    needing: dict[str, int] = {}
    items = unreadable = 0
    for text in inputs:
        ids = sealing.key_ids_in(text or "")
        items += bool(ids)
        unreadable += bool(ids - set(held))
        for key_id in ids:
            needing[key_id] = needing.get(key_id, 0) + 1
    return {
        "unfinished_items_with_secrets": items,
        "unfinished_items_unreadable": unreadable,
        "key_ids_needed": sorted(needing),
        "key_ids_missing": sorted(set(needing) - set(held)),
    }


def held_key_ids(settings: Settings) -> list[str]:
    """The ids of the keys the state directory's work key file holds (none if unreadable:
    the reason is logged, and every sealed item then counts as unreadable)."""
    try:
        return sealing.WorkKeys.of(settings.state_dir).key_ids()
    except sealing.SealingError as exc:
        log.warning("%s", exc)
        return []


def _unfinished_inputs(path: Path) -> list[str]:
    conn = _open_read_only(path)
    try:
        return [text for (text,) in conn.execute(_UNFINISHED_INPUTS_SQL)]
    finally:
        conn.close()


def _copy_work_key(settings: Settings, destination: Path) -> dict[str, Any]:
    """The state directory's work key file, written beside the backup (0600, atomically)."""
    beside = work_key_beside(destination)
    try:
        keys = sealing.WorkKeys.of(settings.state_dir).keys()
    except sealing.SealingError as exc:
        raise RestoreRefused(f"the work key cannot be included: {exc}") from None
    if not keys:
        beside.unlink(missing_ok=True)  # no secret was ever sealed: nothing to include
        return {"included": False, "path": None, "key_ids": []}
    try:
        write_atomically(beside, sealing.render_keys(keys), mode=0o600)
    except OSError as exc:
        raise RestoreRefused(f"cannot write the work key to {beside}: {exc.strerror}") from None
    return {"included": True, "path": str(beside), "key_ids": [k.key_id for k in keys]}


def backup(
    settings: Settings, destination: Path, force: bool = False, include_work_key: bool = False
) -> dict[str, Any]:
    source = sqlite_path(settings)
    destination = _writable_destination(destination, "backup")
    if _is_store_file(source, destination):
        raise RestoreRefused(
            f"{destination} is the store itself (or its WAL or SHM file); name a backup "
            "file outside the store"
        )
    if destination.exists() and not force and not _looks_like_backup(destination):
        raise RestoreRefused(
            f"{destination} exists and is not a ModelForge backup; name another file, or "
            "pass --force to replace it"
        )
    with statelock.held(settings, exclusive=False):  # never copy a store being replaced
        if not source.exists():
            raise RestoreRefused(f"there is no store at {source}; run `modelforge init` first")
        try:
            _copy(source, destination)
        except OSError as exc:
            user = pwd.getpwuid(os.geteuid()).pw_name
            raise RestoreRefused(
                f"cannot write the backup into {destination.parent}: "
                f"{exc.strerror or type(exc).__name__}; name a directory {user} can write "
                f"(make one with: install -d -o {user} -m 0700 DIR)"
            ) from None
        except sqlite3.Error as exc:
            raise RestoreRefused(f"the backup to {destination} failed: {exc}") from None
        if include_work_key:
            work_key = _copy_work_key(settings, destination)
        else:
            # A key left beside an earlier backup of this name must not pass for this one's.
            work_key_beside(destination).unlink(missing_ok=True)
            work_key = {"included": False, "path": None, "key_ids": []}
    held = held_key_ids(settings)
    return {
        "backup": str(destination),
        "bytes": destination.stat().st_size,
        "schema_version": _check_backup(destination, destination),
        "work_key": work_key,
        "work_secrets": work_secrets(_unfinished_inputs(destination), held),
    }


def _record_of_current_store(path: Path, accept_loss: bool) -> list[finality.Entry]:
    """Every revocation, spent token and decommission the store being replaced knows."""
    if not path.exists():
        return []
    try:
        conn = _open_read_only(path)
        try:
            tables = [
                name
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            return finality.read(lambda sql: conn.execute(sql).fetchall(), tables)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if accept_loss:
            log.warning("the current store cannot be read (%s); its revocations are lost", exc)
            return []
        raise RestoreRefused(
            f"the current store {path} cannot be read ({exc}), so what it made final cannot "
            "be kept; if you accept that, run the restore again with "
            "--accept-lost-revocations and then revoke what must stay revoked"
        ) from None


def _prepare(
    staged: Path,
    source: Path,
    version: int,
    record: list[finality.Entry],
    password: tuple | None,
    clock: Clock,
) -> finality.Carried:
    """Migrate the staged copy and carry the record into it; it becomes one plain file."""
    store = Store(sqlite_url(staged), clock)
    try:
        store.migrate()
        with store.write():
            carried = finality.carry_into(store, record)
            _keep_console_security(store, password, clock.now())
            # Placement and readiness wait for a fresh measurement, never a snapshot.
            store.db.execute_sql("UPDATE node SET inventory_at = NULL, telemetry_at = NULL")
            # Presence of models is measured again too (docs/models.md).
            store.db.execute_sql("UPDATE model_replica SET reported_at = NULL")
            audit.record(
                store,
                audit.CLI_ACTOR,
                "store.restored",
                source=source.name,
                backup_schema_version=version,
                kept_from_current_store=carried.made_final,
                finality_record_entries=carried.record_entries,
                finality_carried=carried.carried,
            )
        store.db.execute_sql("PRAGMA journal_mode=DELETE")
    except (pw.PeeweeException, sqlite3.Error, StoreVersionError) as exc:
        raise RestoreRefused(
            f"{source} could not be migrated to schema version {SCHEMA_VERSION} ({exc}); "
            "the store was not replaced"
        ) from None
    finally:
        store.close()
    return carried


def _fold_wal(target: Path) -> None:
    """Fold the live store's WAL into it, so no stale WAL outlives the replaced file."""
    if not target.exists():
        return
    busy = 0
    try:
        conn = sqlite3.connect(str(target))  # absolute path, URI parsing off
        try:
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        pass  # an unreadable store (restore was told to accept that): nothing to fold
    if busy:
        raise RestoreRefused(
            f"another program has {target} open (sqlite3?); close it and run the restore again"
        )
    for suffix in ("-wal", "-shm"):
        Path(f"{target}{suffix}").unlink(missing_ok=True)


def _current_password(path: Path) -> tuple | None:
    """The admin password hash the store being replaced holds, if it is readable and has one."""
    if not path.exists():
        return None
    try:
        conn = _open_read_only(path)
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
    # The user admin signs in with the newer of the two (identity/users.py keeps both).
    store.db.execute_sql(
        "UPDATE app_user SET password_hash = (SELECT password_hash FROM admin_password "
        "WHERE id = 1) WHERE name = 'admin'"
    )


def restore(
    settings: Settings, source: Path, clock: Clock, accept_lost_revocations: bool = False
) -> dict[str, Any]:
    target = sqlite_path(settings)
    source = Path(os.path.abspath(source))
    if not source.is_file():
        raise RestoreRefused(f"{source} does not exist or is not a file")
    if _is_store_file(target, source):
        raise RestoreRefused(f"{source} is the store itself; name a backup file")
    _check_backup(source, source)  # refuse a wrong file before asking anyone to stop
    key_file = work_key_beside(source)
    backup_keys: list[sealing.Key] = []
    if key_file.is_file():
        try:
            backup_keys = sealing.read_key_file(key_file)
        except sealing.SealingError as exc:
            raise RestoreRefused(f"{exc}; or move it away to restore without it") from None
    work_keys = sealing.WorkKeys.of(settings.state_dir)
    with statelock.held(settings, exclusive=True):
        reached_stage("locked")
        clear_interrupted_restore(settings)
        record = _record_of_current_store(target, accept_lost_revocations)
        password = _current_password(target)
        reached_stage("record-read")
        staging = _staging(target)
        staging.mkdir(mode=0o700)
        try:
            staged = staging / target.name
            try:
                _copy(source, staged)
            except (OSError, sqlite3.Error) as exc:
                raise RestoreRefused(f"copying {source} failed: {exc}") from None
            reached_stage("copied")
            # What is checked is what is restored: the copy, not the name it came from.
            version = _check_backup(staged, source)
            carried = _prepare(staged, source, version, record, password, clock)
            inputs = _unfinished_inputs(staged)
            reached_stage("prepared")
            # Keys only ever join the file: an extra key, should the restore stop here, opens
            # nothing that was not sealed with it.
            try:
                added = work_keys.add(backup_keys)
            except sealing.SealingError as exc:
                raise RestoreRefused(f"{exc}; the store was not replaced") from None
            _fold_wal(target)
            reached_stage("folded")
            os.replace(staged, target)
            fsync_directory(target.parent)
            reached_stage("replaced")
        finally:
            _remove(staging)
    log.info("store restored from %s (schema version %d)", source.name, version)
    return {
        "restored_from": str(source),
        "backup_schema_version": version,
        "kept_from_current_store": carried.made_final,
        "finality_record": {
            "entries": carried.record_entries,
            "carried_from_current_store": carried.carried,
        },
        "work_key": {
            "path": str(work_keys.path),
            "from_backup": str(key_file) if backup_keys else None,
            "key_ids_added": added,
        },
        "work_secrets": work_secrets(inputs, held_key_ids(settings)),
    }


def save_finality(store: Store, destination: Path) -> dict[str, Any]:
    """Write the store's finality record to a file, for restore_finality after a pg_restore."""
    destination = _writable_destination(destination, "finality record")
    if destination.exists():
        try:
            finality.load(destination)
        except finality.RecordFileError:
            raise RestoreRefused(
                f"{destination} exists and is not a finality record; name another file"
            ) from None
    entries = finality.read_store(store)
    try:
        finality.save(entries, destination, store.clock.now(), redact_url(store.url))
    except OSError as exc:
        raise RestoreRefused(f"writing {destination} failed: {exc}") from None
    return {"saved": str(destination), "entries": len(entries)}


def restore_finality(settings: Settings, path: Path, clock: Clock) -> dict[str, Any]:
    """Carry a saved record into the store (after a pg_restore, or any outside restore)."""
    path = Path(os.path.abspath(path))
    try:
        entries = finality.load(path)
    except finality.RecordFileError as exc:
        raise RestoreRefused(str(exc)) from None
    if isinstance(open_database(settings.database_url), pw.SqliteDatabase):
        store_file = sqlite_path(settings)
        if not store_file.is_file():  # checked before the lock, which makes the directory
            raise RestoreRefused(
                f"there is no store at {store_file}; restore-finality carries a record into a "
                "restored store (docs/runbooks/backup-restore.md)"
            )
    with statelock.held(settings, exclusive=True):
        reached_stage("locked")
        store = Store(settings.database_url, clock)
        try:
            if store.current_version() == 0:  # never a new store: the restored one
                raise RestoreRefused(
                    f"{redact_url(store.url)} holds no ModelForge store; restore the database "
                    "first (docs/runbooks/backup-restore.md), then run this again"
                )
            store.migrate()
            with store.write():
                carried = finality.carry_into(store, entries)
                store.db.execute_sql("UPDATE node SET inventory_at = NULL, telemetry_at = NULL")
                # Presence of models is measured again too (docs/models.md).
                store.db.execute_sql("UPDATE model_replica SET reported_at = NULL")
                audit.record(
                    store,
                    audit.CLI_ACTOR,
                    "store.finality_restored",
                    source=path.name,
                    made_final=carried.made_final,
                    finality_record_entries=carried.record_entries,
                    finality_carried=carried.carried,
                )
            with store.connection():
                inputs = [text for (text,) in store.db.execute_sql(_UNFINISHED_INPUTS_SQL)]
        except pw.PeeweeException as exc:
            raise RestoreRefused(
                f"the finality record could not be carried into {redact_url(store.url)} ({exc})"
            ) from None
        finally:
            store.close()
    return {
        "restored_from": str(path),
        "made_final": carried.made_final,
        "finality_record": {"entries": carried.record_entries, "carried": carried.carried},
        "work_secrets": work_secrets(inputs, held_key_ids(settings)),
    }
