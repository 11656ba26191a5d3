"""One process of a kind per directory: an ``flock`` on a file there, holding the pid.

``modelforge serve`` holds one on its state directory and the node agent one on its state
volume, for as long as they run. The kernel drops the lock when its holder exits, even by
SIGKILL, so a crash never leaves it held; a second process finds it held and is told the
first one's pid. Standard library only.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class AlreadyRunning(Exception):
    """Another process holds the lock; ``pid`` is the one it wrote (None if unreadable)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(f"{path} is held by pid {pid}")
        self.path, self.pid = path, pid


def hold(path: Path) -> int:
    """Take the lock without waiting and write this pid into it; answer the descriptor,
    which the caller keeps open for as long as it runs. Raise AlreadyRunning."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(path, flags, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
        finally:
            os.close(descriptor)
        raise AlreadyRunning(path, int(text) if text.isdigit() else None) from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor
