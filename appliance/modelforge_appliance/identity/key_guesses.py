"""Wrong API keys, throttled per client address (docs/clients.md, "Wrong keys").

A client that sends keys that are malformed, unknown or do not match is guessing, or is
misconfigured and retrying in a loop: either way each refusal used to cost a digest check,
a store read and a log line. Here each address has a window of ``WINDOW_SECONDS``; after
``BURST`` wrong keys in it, every request from that address with a key is answered
``429 API_KEY_THROTTLED`` (with ``Retry-After``) until the window ends, before any key is
looked up, as sign-ins are throttled (identity/sessions.py). A right key from an address
that is not throttled clears its count. The log says it once per burst: the refusal that
starts the throttle names the address and the count, and the refusals themselves are not
logged one by one.

The counts live in this process (at most ``MAX_ADDRESSES``, the oldest forgotten first): a
restart forgets them, which costs a guesser one more burst, not a store write per guess.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

from modelforge_contract import API_KEY_THROTTLED

from ..core.errors import ApiError

log = logging.getLogger(__name__)

BURST = 20
WINDOW_SECONDS = 60.0
MAX_ADDRESSES = 10_000


class WrongKeyThrottle:
    def __init__(
        self,
        burst: int = BURST,
        window: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = MAX_ADDRESSES,
    ) -> None:
        self.burst, self.window, self.clock = burst, window, clock
        self.max_addresses = max_addresses
        self._lock = threading.Lock()
        # address -> [wrong keys in this window, when the window began]
        self._counts: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def check(self, address: str) -> None:
        """429 API_KEY_THROTTLED while ``address`` has had its burst of wrong keys."""
        now = self.clock()
        with self._lock:
            entry = self._counts.get(address)
            if entry is None:
                return
            count, began = entry
            if now - began >= self.window:
                del self._counts[address]
                return
            if count < self.burst:
                return
            wait = max(1, math.ceil(began + self.window - now))
        raise ApiError(
            f"too many wrong API keys from this address; try again in {wait} s",
            code=API_KEY_THROTTLED,
            status=429,
            next_step="Check the key the client sends (modelforge api-keys list shows each "
            f"key's id, the part after mfk_), then wait {wait} seconds.",
            extra={"retry_after_seconds": wait},
        )

    def wrong(self, address: str) -> None:
        """Count one wrong key from ``address``; the one that fills its burst is logged."""
        now = self.clock()
        with self._lock:
            entry = self._counts.get(address)
            if entry is None or now - entry[1] >= self.window:
                entry = [0, now]
                self._counts[address] = entry
            self._counts.move_to_end(address)
            entry[0] += 1
            filled = entry[0] == self.burst
            while len(self._counts) > self.max_addresses:
                self._counts.popitem(last=False)
        if filled:
            log.warning("%d wrong API keys from %s within %g s: its keys wait until the "
                        "window ends", self.burst, address, self.window)  # fmt: skip

    def right(self, address: str) -> None:
        """A key that matched: the address's count starts again."""
        with self._lock:
            self._counts.pop(address, None)
