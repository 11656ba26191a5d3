"""What a heartbeat answer's generation tells a loop: fetch its desired set again.

Each set the control plane keeps for a node (its models, its servers) carries a generation,
bumped in the transaction that changes the set; every heartbeat answer names it. The loop
that holds the set fetches again when the value moves from the one it last fetched.
"""

from __future__ import annotations

import threading


class Generation:
    """The last generation seen and fetched of one desired set; ``wanted`` is set when a
    fetch is due (the loop may set it too, to wake itself)."""

    def __init__(self) -> None:
        self.wanted = threading.Event()
        self._lock = threading.Lock()
        self._seen: object = None
        self._fetched: object = None

    def seen(self, value: object) -> None:
        """A heartbeat answer's value: a fetch is wanted when it moved."""
        if value is None:
            return
        with self._lock:
            self._seen = value
            changed = value != self._fetched
        if changed:
            self.wanted.set()

    def asking(self) -> object:
        """The value seen as a fetch leaves (what it answers when it names none)."""
        with self._lock:
            return self._seen

    def fetched(self, answered: object) -> None:
        """A fetch answered ``answered``. A heartbeat that came while it was out and saw
        what it answered wants no other."""
        with self._lock:
            self._fetched = answered
            if self._seen in (None, answered):
                self.wanted.clear()
