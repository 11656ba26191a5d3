"""One way to write a file that readers must see whole: ``write_atomically``.

Every writer of a secret or a record (the agent's identity and status, the control plane's
serving and finality records, SHA256SUMS, its signature, the Debian lock) goes through it,
so each gets all of it: a temporary file beside the target (created 0600, so a secret is
never readable by others, not even for a moment), the data flushed and fsynced, the mode
set, one rename, and the directory fsynced so the rename survives a power loss too.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data``: readers see the old file or the new one, never part of
    one, and after a crash or power loss the same holds. ``mode`` is the file's final mode
    (0600 unless said otherwise: the safe default for secrets)."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(directory)
