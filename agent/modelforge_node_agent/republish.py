"""Publish again when the control plane asks: its heartbeat answer's ``republish`` list.

After a restore the control plane holds no fresh inventory or telemetry, and an agent would
otherwise wait for its next periodic publication (the unchanged inventory only every
INVENTORY_REFRESH_SECONDS) before its node can be ready. The heartbeat answer names what it
lacks; the publication loops wake for it at once. An answer without the field asks nothing.
"""

from __future__ import annotations

import threading
import time

from modelforge_contract import REPUBLISH_INVENTORY, REPUBLISH_TELEMETRY

KINDS = (REPUBLISH_INVENTORY, REPUBLISH_TELEMETRY)
_SLICE = 0.5  # how often a wait also looks at the stop flag


class RepublishRequests:
    """What the control plane asked for, and when the heartbeat that carried it was sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, float] = {}
        self._events = {kind: threading.Event() for kind in KINDS}

    def ask(self, kinds: object, sent_at: float) -> None:
        """Record a heartbeat answer's list (anything but a list of known names is ignored)."""
        if not isinstance(kinds, list):
            return
        with self._lock:
            for kind in kinds:
                if kind in self._events:
                    self._asked[kind] = max(self._asked.get(kind, sent_at), sent_at)
                    self._events[kind].set()

    def due(self, kind: str, published_at: float) -> bool:
        """Asked for since the last publication (one published after the request went out
        already answers it); consumes the request."""
        with self._lock:
            asked = self._asked.pop(kind, None)
            self._events[kind].clear()
        return asked is not None and asked >= published_at

    def wait(self, kind: str, stop: threading.Event, timeout: float) -> bool:
        """Sleep up to ``timeout`` or until ``kind`` is asked for; True when stopping."""
        deadline = time.monotonic() + timeout
        event = self._events[kind]
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or event.wait(min(remaining, _SLICE)):
                return stop.is_set()
        return True


__all__ = ["KINDS", "RepublishRequests"]
