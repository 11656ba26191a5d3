"""One injectable clock: liveness and expiry tests move time instead of sleeping."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone


class Clock:
    """Wall-clock seconds since the epoch, from the control plane's own clock."""

    def now(self) -> float:
        return time.time()


class ManualClock(Clock):
    """A clock that only moves when told to (tests, benchmarks)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def isoformat(epoch: float | None) -> str | None:
    """RFC 3339 UTC with milliseconds, or None."""
    if epoch is None:
        return None
    stamp = datetime.fromtimestamp(epoch, tz=timezone.utc)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
