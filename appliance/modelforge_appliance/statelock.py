"""The state directory's lock: a restore alone, or any number of other commands together.

Every ``modelforge`` command that opens the store holds the lock shared for its whole run,
``serve`` included and before it migrates; ``backup`` holds it while it copies. ``restore``
and ``restore-finality`` need it exclusively. So a command that finds a restore running is
refused before it reads or writes anything (its change would land in a store about to be
replaced, and be lost), and a restore that finds anything else running is refused too. The
lock is an ``flock`` on a file in the state directory: the kernel drops it when its
holder exits, even by SIGKILL, so a crash never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from .settings import Settings

LOCK_NAME = "modelforge.lock"


class StateBusy(Exception):
    """Another process holds the state lock in a way that excludes this command."""


class StateLock:
    """A held lock; released by ``release`` or when the process ends."""

    def __init__(self, descriptor: int) -> None:
        self._descriptor: int | None = descriptor

    def release(self) -> None:
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
    return StateLock(descriptor)


@contextlib.contextmanager
def held(settings: Settings, exclusive: bool) -> Iterator[None]:
    lock = acquire(settings, exclusive)
    try:
        yield
    finally:
        lock.release()
