"""SHA-256 of a file, streamed through one reused buffer so memory stays flat at any size."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)

# 1 MiB reads: large enough that the per-call overhead of Python is noise next to hashing,
# small enough to stay in L2/L3 between read and hash.
CHUNK_BYTES = 1 << 20
# Files above this size show progress (only on a terminal: logs and pipes stay clean).
PROGRESS_MIN_BYTES = 256 << 20
PROGRESS_EVERY_SECONDS = 0.5


class Progress:
    """A one-line, carriage-return progress meter for one file on a terminal stream."""

    def __init__(self, stream: TextIO, label: str, total: int) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self._next_at = 0.0
        self._width = 0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + PROGRESS_EVERY_SECONDS
        if self.total:
            line = (
                f"{self.label}: {done >> 20} / {self.total >> 20} MiB ({100 * done // self.total}%)"
            )
        else:  # a stream of unknown length
            line = f"{self.label}: {done >> 20} MiB"
        self._width = max(self._width, len(line))
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()

    def close(self) -> None:
        # Blank the meter so the OK/FAILED line that follows on stdout starts on a clean line.
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def wants_progress(stream: TextIO | None, size: int) -> bool:
    return stream is not None and size > PROGRESS_MIN_BYTES and stream.isatty()


def sha256_file(path: Path, label: str | None = None, progress: TextIO | None = None) -> str:
    """Hex SHA-256 of ``path``; raises OSError when it cannot be opened or read.

    ``progress`` is a stream (stderr) that gets a meter for large files when it is a TTY.
    """
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    started = time.monotonic()
    done = 0
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        # Tell the kernel we read once, front to back: it reads further ahead on a cold cache.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        meter = (
            Progress(progress, label or str(path), size) if wants_progress(progress, size) else None
        )
        try:
            while count := file.readinto(buffer):
                digest.update(view[:count])
                done += count
                if meter:
                    meter.update(done)
        finally:
            if meter:
                meter.close()
    seconds = time.monotonic() - started
    log.info("hashed %s: %d bytes in %.2f s", label or path, done, seconds)
    return digest.hexdigest()
