"""The HTTP fallback's tunnel link (docs/architecture.md §12): a hub link over plain HTTP.

Where WebSocket is blocked, an agent holds its tunnel open as two halves: the streamed
answer of ``GET …/tunnel/down`` carries the control plane's frames back to back (``body``,
streamed on the relay's event loop), and each ``POST …/tunnel/up`` carries a batch of the
agent's (``feed``), handed to the hub on the upload's own thread, in order, before the POST
is answered. The link pushes, as a WebSocket tunnel does: no thread is the tunnel's.

What waits for the download is bounded: past UNSENT_HIGH_BYTES for SEND_BLOCK_SECONDS, or
past UNSENT_MAX_BYTES at all, the agent stopped reading and the link is closed. A quiet
download carries a PING every PING_SECONDS, so no proxy times it out, and a client gone away
is noticed at the next write at the latest: the download's end closes the link.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from modelforge_contract import tunnel as wire
from modelforge_contract.waking import Waker

UNSENT_HIGH_BYTES = 4 * 1024 * 1024
UNSENT_MAX_BYTES = 64 * 1024 * 1024
SEND_BLOCK_SECONDS = 5.0
PING_SECONDS = 15.0
BATCH_BYTES = 1024 * 1024  # the most bytes one write of the download carries
SESSIONS_KEPT = 1024  # closed sessions remembered, so a late upload gets 409, not 404


class LinkClosed(ConnectionError):
    """The link is closed; nothing more goes either way."""


class HttpLink:
    """One HTTP tunnel session of one node: a hub link that pushes (``start``, ``send``,
    ``close``)."""

    pushes = True

    def __init__(
        self,
        node_id: str,
        *,
        send_block: float = SEND_BLOCK_SECONDS,
        ping_seconds: float = PING_SECONDS,
    ) -> None:
        self.node_id = node_id
        self.session_id = secrets.token_urlsafe(24)
        self.send_block, self.ping_seconds = send_block, ping_seconds
        self._cond = threading.Condition()
        self._out: collections.deque[bytes] = collections.deque()
        self._unsent = 0  # bytes in _out
        self._high_since: float | None = None  # when _unsent last went past the high mark
        self.closed = False
        self.reason = ""
        # The download streamed on the relay's event loop: each change wakes it.
        self._waker: Waker | None = None
        # The hub's side: each uploaded frame, in order (one upload at a time), and the end.
        self._feeding = threading.Lock()
        self._receive: Callable[[bytes], None] | None = None
        self._ended: Callable[[str], None] | None = None

    def _changed(self) -> None:
        """Inside the lock: wake the threads, and the loop streaming the download."""
        self._cond.notify_all()
        if self._waker is not None:
            self._waker.wake()

    # -- the hub's side -----------------------------------------------------------------

    def start(self, receive: Callable[[bytes], None], ended: Callable[[str], None]) -> None:
        """Give uploaded frames to ``receive`` from now on, and the end to ``ended``."""
        with self._cond:
            self._receive, self._ended = receive, ended
            closed = self.closed
        if closed:
            self._end()

    def send(self, data: bytes) -> bool:
        """Queue one encoded frame for the download (never waits); False once the link is
        closed, or when this closes it: the agent stopped reading."""
        with self._cond:
            if self.closed:
                return False
            now = time.monotonic()
            if self._unsent <= UNSENT_HIGH_BYTES:
                self._high_since = None
            elif self._high_since is None:
                self._high_since = now
            stalled = self._unsent + len(data) > UNSENT_MAX_BYTES or (
                self._high_since is not None and now - self._high_since > self.send_block
            )
            if not stalled:
                self._out.append(data)
                self._unsent += len(data)
                self._changed()
                return True
        self.close(1011, "the agent stopped reading")
        return False

    def close(self, code: int = 1000, reason: str = "") -> None:
        with self._cond:
            if self.closed:
                return
            self.closed, self.reason = True, reason or f"closed ({code})"
            self._changed()
        self._end()

    def _end(self) -> None:
        with self._cond:
            ended, self._ended = self._ended, None
        if ended is not None:
            ended(self.reason)

    def pause(self) -> None:
        """Nothing to pause: an upload is handed over whole before its POST is answered, so
        the agent's next upload waits for the hub anyway."""

    def resume(self) -> None:
        """See ``pause``."""

    # -- the HTTP side --------------------------------------------------------------------

    def feed(self, frames: list[wire.Frame]) -> None:
        """An upload's frames, to the hub in order; LinkClosed when the link is closed."""
        with self._feeding:
            for frame in frames:
                receive = self._receive
                if self.closed or receive is None:
                    raise LinkClosed(self.reason or "closed")
                receive(wire.encode(frame))

    def _batch(self) -> list[bytes]:
        """Inside the lock: queued frames, up to BATCH_BYTES."""
        batch, size = [], 0
        while self._out and size < BATCH_BYTES:
            size += len(self._out[0])
            batch.append(self._out.popleft())
        self._unsent -= size
        self._changed()
        return batch

    async def body_async(self) -> AsyncIterator[bytes]:
        """``body`` on the relay's event loop (call it there): the same frames and PINGs,
        no thread held while the tunnel is quiet. Closing it closes the link."""
        waker = self._waker = Waker()
        try:
            while True:
                deadline = time.monotonic() + self.ping_seconds
                while True:
                    with self._cond:
                        if self.closed:
                            return
                        batch = self._batch() if self._out else []
                    left = deadline - time.monotonic()
                    if batch or left <= 0:
                        break
                    await waker.wait(left)
                if not batch:
                    batch = [wire.encode(wire.ping_frame(os.urandom(wire.PING_BYTES)))]
                yield b"".join(batch)
        finally:
            self.close(1001, "the download ended")

    def body(self) -> Iterator[bytes]:
        """The download's body: queued frames back to back, a PING when quiet. Closing the
        iterator (waitress does when the answer ends or its client went away) closes the
        link."""
        try:
            while True:
                with self._cond:
                    deadline = time.monotonic() + self.ping_seconds
                    while not self._out and not self.closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if self.closed:
                        return
                    batch = self._batch()
                if not batch:
                    batch = [wire.encode(wire.ping_frame(os.urandom(wire.PING_BYTES)))]
                yield b"".join(batch)
        finally:
            self.close(1001, "the download ended")


class HttpSessions:
    """The open HTTP tunnel sessions of this process, by session id, and those lately
    closed (a late upload to one is told it closed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, HttpLink] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()

    def add(self, link: HttpLink) -> None:
        with self._lock:
            self._open[link.session_id] = link

    def remove(self, link: HttpLink) -> None:
        with self._lock:
            if self._open.get(link.session_id) is link:
                del self._open[link.session_id]
            self._closed[link.session_id] = link.node_id
            while len(self._closed) > SESSIONS_KEPT:
                self._closed.popitem(last=False)

    def find(self, session_id: str) -> tuple[HttpLink | None, str | None]:
        """The open link, or None and the node of a lately closed one (None: unknown)."""
        with self._lock:
            link = self._open.get(session_id)
            if link is not None and link.closed:  # closed, not yet removed
                return None, link.node_id
            return link, None if link is not None else self._closed.get(session_id)

    def close_all(self, reason: str = "the control plane is stopping") -> None:
        """Close every open session (their downloads end at once, not at their next PING)."""
        with self._lock:
            links = list(self._open.values())
        for link in links:
            link.close(1001, reason)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
