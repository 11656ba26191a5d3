"""Token buckets per key, in memory: how often one caller may do something.

Each key (a node id) has a bucket of ``burst`` tokens refilled at ``rate`` a second; a call
takes one token or is told how long until there is one. A bucket costs one small list, and
only keys that spent tokens recently hold one: once the table passes ``tracked`` keys, the
buckets that have filled up again (the same as no bucket) are dropped. With 5,000 nodes the
table is a few hundred kilobytes and every call is one dictionary lookup under a lock.

Time is the store's injectable clock, so tests move it instead of sleeping; a clock that
steps backwards refills nothing (and never takes tokens away).
"""

from __future__ import annotations

import threading

from .clock import Clock

TRACKED_KEYS = 20_000


class TokenBuckets:
    def __init__(
        self, rate: float, burst: float, clock: Clock, tracked: int = TRACKED_KEYS
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and room for one token")
        self.rate, self.burst, self.clock, self.tracked = rate, burst, clock, tracked
        self._buckets: dict[str, list[float]] = {}  # key -> [tokens, as of]
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0.0 when a token was taken; otherwise the seconds until one will be there (and
        nothing is taken, so a caller that keeps asking too fast stays refused)."""
        now = self.clock.now()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= self.tracked:
                    self._drop_full(now)
                bucket = self._buckets[key] = [self.burst, now]
            tokens, then = bucket
            tokens = min(self.burst, tokens + max(0.0, now - then) * self.rate)
            bucket[1] = max(then, now)
            if tokens >= 1:
                bucket[0] = tokens - 1
                return 0.0
            bucket[0] = tokens
            return (1 - tokens) / self.rate

    def _drop_full(self, now: float) -> None:
        """Forget the buckets that have refilled (inside the lock)."""
        full = [
            key
            for key, (tokens, then) in self._buckets.items()
            if tokens + max(0.0, now - then) * self.rate >= self.burst
        ]
        for key in full:
            del self._buckets[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)
