"""One database setup: SQLite (WAL, foreign keys, busy_timeout) or PostgreSQL.

Numbered, append-only migrations are applied at start; the schema version is
recorded, and a store written by a newer program is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

import peewee as pw

from ..core.clock import Clock
from ..core.errors import OperatorError
from ..core.settings import Settings
from . import tables
from .migrations import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger(__name__)

SQLITE_PRAGMAS = {
    "journal_mode": "wal",
    "foreign_keys": 1,
    "busy_timeout": 10000,
    # FULL: an acknowledged enrollment or credential change survives power loss too.
    # Heartbeats are batched (heartbeats.py), so this costs one fsync a second for them.
    "synchronous": "full",
}


T = TypeVar("T")


@dataclass
class _Job:
    """One change waiting for a group commit, and what became of it."""

    change: Callable[[], Any]
    order: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class StoreVersionError(OperatorError):
    """The store was written by a newer program (or is otherwise unusable)."""


class _SqliteDatabase(pw.SqliteDatabase):
    """peewee's SQLite database, knowing every connection it opened in any thread.

    peewee keeps one connection per thread; closing the store closes them all, so the last
    close checkpoints the WAL and SQLite removes it, whatever the interpreter does with the
    server's finished threads at exit (a WAL left beside a stopped store is read by the
    next start; ``modelforge backup`` refuses a path that could be taken for one).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: set[Any] = set()
        self._open_lock = threading.Lock()

    def _connect(self) -> Any:
        connection = super()._connect()
        with self._open_lock:
            self._open.add(connection)
        return connection

    def _close(self, conn: Any) -> None:
        with self._open_lock:
            self._open.discard(conn)
        super()._close(conn)

    def close_all(self) -> None:
        """Close this thread's connection, then every other thread's (all done by now)."""
        if not self.is_closed():
            self.close()
        with self._open_lock:
            left, self._open = self._open, set()
        for connection in left:
            connection.close()


def open_database(url: str) -> pw.Database:
    """Create (without connecting) the peewee database for a sqlite:/// or postgresql:// URL."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = unquote(parts.path)
        if url.startswith("sqlite:////"):
            path = "/" + path.lstrip("/")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return _SqliteDatabase(path, pragmas=SQLITE_PRAGMAS, timeout=10, check_same_thread=False)
    if parts.scheme in ("postgresql", "postgres"):
        return pw.PostgresqlDatabase(
            unquote(parts.path.lstrip("/")) or "postgres",
            user=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 5432,
            connect_timeout=5,
        )
    raise ValueError(f"unsupported database URL scheme {parts.scheme!r}")


def sqlite_url(path: Path) -> str:
    """The sqlite:/// URL of an absolute path, escaped so #, ? and % stay part of the name."""
    return "sqlite:///" + quote(str(path))


class Store:
    """The database, its migrations and its write transactions."""

    def __init__(self, url: str, clock: Clock) -> None:
        self.url = url
        self.clock = clock
        self.db = open_database(url)
        self.is_sqlite = isinstance(self.db, pw.SqliteDatabase)
        self._write_lock = threading.RLock()  # reentrant: a nested write is a savepoint
        self._group: list[_Job] = []
        self._group_lock = threading.Lock()
        tables.database.initialize(self.db)

    @property
    def sqlite_path(self) -> str | None:
        return self.db.database if self.is_sqlite else None

    def write(self, *, flushed: bool = True) -> contextlib.AbstractContextManager:
        """A write transaction; IMMEDIATE on SQLite so writers queue instead of deadlocking.

        ``flushed=False`` commits without waiting for the disk (SQLite ``synchronous=NORMAL``,
        PostgreSQL ``synchronous_commit=off``): a crash of the process keeps it, a power loss
        may undo it. Only for changes that are safe to lose that way (a work claim, renewal
        or expiry: the item runs again); the next flushed commit makes it durable too.
        """
        self.revalidate()
        self.db.connect(reuse_if_open=True)
        if self.is_sqlite:
            return self._sqlite_write(flushed)
        return self._postgres_write(flushed)

    @contextlib.contextmanager
    def _sqlite_write(self, flushed: bool) -> Iterator[None]:
        # SQLite has one writer at a time. Threads of this process take turns on a lock
        # that hands over at once, instead of meeting in SQLite's busy handler, which
        # sleeps up to 100 ms per try (other processes, such as the CLI, still do).
        with self._write_lock:
            relaxed = not flushed and not self.db.in_transaction()
            if relaxed:
                self.db.execute_sql("PRAGMA synchronous = NORMAL")
            try:
                with self._discarding_on_failure(), self.db.atomic("IMMEDIATE"):
                    yield
            finally:
                if relaxed:
                    self.db.execute_sql(f"PRAGMA synchronous = {SQLITE_PRAGMAS['synchronous']}")

    @contextlib.contextmanager
    def _postgres_write(self, flushed: bool) -> Iterator[None]:
        with self._discarding_on_failure(), self.db.atomic():
            if not flushed:
                self.db.execute_sql("SET LOCAL synchronous_commit TO OFF")
            yield

    def revalidate(self) -> None:
        """Drop this thread's connection if the server broke it (a restart,
        ``pg_terminate_backend``, a network cut), so the next query opens a new one.

        Cheap: psycopg2 marks a connection broken when a call on it fails, and this reads
        that mark; no round trip. Run before every request and every write, it means a
        thread sees at most one failed call per outage, and nothing waits for ``/healthz``
        to heal it. Inside a transaction nothing changes.
        """
        db = self.db
        if not db.is_closed() and not db.in_transaction() and not db.is_connection_usable():
            log.warning("the store connection of this thread was lost; reconnecting")
            self.discard_connection()

    def discard_connection(self) -> None:
        """Forget this thread's connection (unless a transaction is open on it), so the
        next call opens a new one."""
        db = self.db
        if db.is_closed() or db.in_transaction():
            return
        # peewee forgets the connection even when closing a dead one fails.
        with contextlib.suppress(Exception):
            db.close()

    @contextlib.contextmanager
    def _discarding_on_failure(self) -> Iterator[None]:
        try:
            yield
        except (pw.OperationalError, pw.InterfaceError):
            # The outermost failure on this thread: drop the connection if the server
            # broke it, so the next call starts afresh instead of failing again.
            if not self.db.in_transaction() and not self.db.is_connection_usable():
                self.discard_connection()
            raise

    def grouped(self, change: Callable[[], T], order: str = "") -> T:
        """Run ``change`` in a flushed write transaction shared with the changes other threads
        are waiting to commit: one disk flush answers them all (group commit).

        Each change runs in its own savepoint on the committing thread's connection, so one
        that raises leaves the others standing; the caller gets its own result or exception,
        and nothing before the whole transaction is on disk. Changes run sorted by ``order``
        (the key of the row they change), so two groups never take rows in opposite orders.
        """
        job = _Job(change, order)
        with self._group_lock:
            self._group.append(job)
        while not job.done.is_set():
            with self._write_lock:  # whoever holds it commits for everyone waiting
                if job.done.is_set():
                    break
                with self._group_lock:
                    batch, self._group = self._group, []
                if batch:
                    self._commit_group(batch)
        if job.error is not None:
            raise job.error
        return job.result

    def _commit_group(self, batch: list[_Job]) -> None:
        try:
            with self.write():
                for job in sorted(batch, key=lambda job: job.order):
                    try:
                        with self.db.atomic():
                            job.result = job.change()
                    except (pw.OperationalError, pw.InterfaceError):
                        raise  # the store itself failed: the whole group does
                    except Exception as exc:  # this change only; its savepoint is undone
                        job.error = exc
        except Exception as exc:
            for job in batch:
                job.result, job.error = None, exc
        finally:
            for job in batch:
                job.done.set()

    @contextlib.contextmanager
    def connection(self) -> Iterator[None]:
        self.revalidate()
        with self._discarding_on_failure():
            self.db.connect(reuse_if_open=True)
            yield

    def close(self) -> None:
        """Done with the store: close its connections, those of finished threads too."""
        if isinstance(self.db, _SqliteDatabase):
            self.db.close_all()
        elif not self.db.is_closed():
            self.db.close()

    def current_version(self) -> int:
        self.db.connect(reuse_if_open=True)
        if not self.db.table_exists("schema_version"):
            return 0
        row = tables.SchemaVersion.select(pw.fn.MAX(tables.SchemaVersion.version)).scalar()
        return int(row or 0)

    def migrate(self) -> list[int]:
        """Apply pending migrations in order; refuse a store newer than this program."""
        self.db.connect(reuse_if_open=True)
        with self.write():
            self.db.create_tables([tables.SchemaVersion])
            current = self.current_version()
            if current > SCHEMA_VERSION:
                raise StoreVersionError(
                    f"the store at {redact_url(self.url)} has schema version {current}, newer than "
                    f"this program's {SCHEMA_VERSION}; run the release that wrote it or newer"
                )
            applied = []
            for migration in MIGRATIONS:
                if migration.version <= current:
                    continue
                migration.apply(self.db)
                tables.SchemaVersion.create(
                    version=migration.version, name=migration.name, applied_at=self.clock.now()
                )
                applied.append(migration.version)
        if applied:
            log.info("store migrated to schema version %d", SCHEMA_VERSION)
        if self.is_sqlite:
            os.chmod(self.db.database, 0o600)
        return applied

    def ping(self) -> bool:
        try:
            with self.connection():
                self.db.execute_sql("SELECT 1").fetchone()
        except pw.PeeweeException:
            log.warning("store ping failed", exc_info=False)
            self.discard_connection()
            return False
        return True


def redact_url(url: str) -> str:
    """The database URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


def open_store(settings: Settings, clock: Clock | None = None) -> Store:
    """The store for these settings, migrated to this program's schema (the state directory
    made first, for the user alone)."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = Store(settings.database_url, clock or Clock())
    store.migrate()
    return store
