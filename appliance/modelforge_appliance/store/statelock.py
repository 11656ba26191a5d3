"""The state directory's lock: a restore alone, or any number of other commands together.

Every ``modelforge`` command that opens the store holds the lock shared for its whole run,
``serve`` included and before it migrates; ``backup`` holds it while it copies. ``restore``
and ``restore-finality`` need it exclusively. So a command that finds a restore running is
refused before it reads or writes anything (its change would land in a store about to be
replaced, and be lost), and a restore that finds anything else running is refused too. The
lock is an ``flock`` on a file in the state directory: the kernel drops it when its
holder exits, even by SIGKILL, so a crash never leaves it held. On PostgreSQL, whose
control planes may run on several hosts, a session advisory lock on the database is taken
the same way beside it; PostgreSQL drops it when the holder's connection ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

import peewee as pw

from ..core.errors import OperatorError
from ..core.settings import Settings
from .database import open_database, redact_url

LOCK_NAME = "modelforge.lock"
# The advisory lock's key, the same in every ModelForge release ("MFST").
ADVISORY_KEY = 0x4D465354


class StateBusy(OperatorError):
    """Another process holds the state lock in a way that excludes this command."""


class StateLock:
    """A held lock; released by ``release`` or when the process ends."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor: int | None = descriptor
        self._database: pw.Database | None = None  # the advisory lock's own connection

    def release(self) -> None:
        if self._database is not None:
            self._database.close()
            self._database = None
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


def acquire(settings: Settings, exclusive: bool) -> StateLock:
    """Take the lock without waiting, or raise StateBusy with what to do."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(settings.state_dir / LOCK_NAME, flags, 0o600)
    try:
        fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        if exclusive:
            raise StateBusy(
                f"the control plane or another modelforge command is using {settings.state_dir}; "
                "stop it (systemctl stop modelforge), let running commands finish, and run the "
                "restore again"
            ) from None
        raise StateBusy(
            f"a restore is running on {settings.state_dir}; nothing was changed: run this "
            "command again once it has finished"
        ) from None
    lock = StateLock(descriptor)
    try:
        lock._database = _advisory_lock(settings.database_url, exclusive)
    except BaseException:
        lock.release()
        raise
    return lock


def _advisory_lock(url: str, exclusive: bool) -> pw.Database | None:
    database = open_database(url)
    if not isinstance(database, pw.PostgresqlDatabase):
        return None
    database.connect()
    function = "pg_try_advisory_lock" if exclusive else "pg_try_advisory_lock_shared"
    if database.execute_sql(f"SELECT {function}(%s)", (ADVISORY_KEY,)).fetchone()[0]:
        return database
    database.close()
    if exclusive:
        raise StateBusy(
            f"a control plane or another modelforge command is connected to {redact_url(url)}, "
            "possibly from another host; stop every `modelforge serve` using this database, "
            "let running commands finish, and run this again"
        )
    raise StateBusy(
        f"a restore is running on {redact_url(url)}; nothing was changed: run this command "
        "again once it has finished"
    )


@contextlib.contextmanager
def held(settings: Settings, exclusive: bool) -> Iterator[None]:
    lock = acquire(settings, exclusive)
    try:
        yield
    finally:
        lock.release()
