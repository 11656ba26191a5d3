"""The HTTP fallback's tunnel link (docs/architecture.md §12): a hub Link over plain HTTP.

Where WebSocket is blocked, an agent holds its tunnel open as two halves on waitress: the
streamed answer of ``GET …/tunnel/down`` carries the control plane's frames back to back
(``body``), and each ``POST …/tunnel/up`` carries a batch of the agent's (``feed``). The hub
sees one Link like any other: ``send`` one whole frame, ``recv`` one whole frame, ``close``.

Both directions are bounded queues. A full outgoing queue (the agent stopped reading) holds
the sender at most SEND_BLOCK_SECONDS, then closes the link; a full incoming queue (the hub's
reader is behind) holds the uploading POST the same way. A quiet download carries a PING
every PING_SECONDS, so no proxy times it out, and a client gone away is noticed at the next
write at the latest: waitress then closes the answer's iterator, which closes the link.
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator

from modelforge_contract import tunnel as wire

from .waking import Waker

QUEUE_FRAMES = 256  # each way; a frame is at most wire.MAX_FRAME bytes
SEND_BLOCK_SECONDS = 5.0
PING_SECONDS = 15.0
BATCH_BYTES = 1024 * 1024  # the most bytes one write of the download carries
SESSIONS_KEPT = 1024  # closed sessions remembered, so a late upload gets 409, not 404


class LinkClosed(ConnectionError):
    """The link is closed; nothing more goes either way."""


class HttpLink:
    """One HTTP tunnel session of one node: a hub Link (``send``/``recv``/``close``)."""

    def __init__(
        self,
        node_id: str,
        *,
        queue_frames: int = QUEUE_FRAMES,
        send_block: float = SEND_BLOCK_SECONDS,
        ping_seconds: float = PING_SECONDS,
    ) -> None:
        self.node_id = node_id
        self.session_id = secrets.token_urlsafe(24)
        self.queue_frames, self.send_block, self.ping_seconds = (
            queue_frames,
            send_block,
            ping_seconds,
        )
        self._cond = threading.Condition()
        self._out: collections.deque[bytes] = collections.deque()
        self._in: collections.deque[bytes] = collections.deque()
        self.closed = False
        self.reason = ""
        # The download streamed on the relay's event loop: each change wakes it.
        self._waker: Waker | None = None

    def _changed(self) -> None:
        """Inside the lock: wake the threads, and the loop streaming the download."""
        self._cond.notify_all()
        if self._waker is not None:
            self._waker.wake()

    # -- the hub's side -----------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue one encoded frame for the download; a queue full for ``send_block``
        seconds closes the link."""
        self._put(self._out, data)

    def recv(self) -> bytes:
        """The agent's next frame (uploads feed them); LinkClosed once the link is closed."""
        with self._cond:
            while not self._in:
                if self.closed:
                    raise LinkClosed(self.reason or "closed")
                self._cond.wait()
            data = self._in.popleft()
            self._changed()
            return data

    def close(self, code: int = 1000, reason: str = "") -> None:
        with self._cond:
            if not self.closed:
                self.closed, self.reason = True, reason or f"closed ({code})"
            self._changed()

    # -- the HTTP side --------------------------------------------------------------------

    def feed(self, frames: list[wire.Frame]) -> None:
        """An upload's frames, in order, for ``recv``; LinkClosed when the link closes."""
        for frame in frames:
            self._put(self._in, wire.encode(frame))

    def _batch(self) -> list[bytes]:
        """Inside the lock: queued frames, up to BATCH_BYTES."""
        batch, size = [], 0
        while self._out and size < BATCH_BYTES:
            size += len(self._out[0])
            batch.append(self._out.popleft())
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

    def _put(self, queue: collections.deque[bytes], data: bytes) -> None:
        with self._cond:
            deadline = time.monotonic() + self.send_block
            while len(queue) >= self.queue_frames and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.closed, self.reason = True, "a queue stayed full"
                    self._changed()
                    break
                self._cond.wait(left)
            if self.closed:
                raise LinkClosed(self.reason)
            queue.append(data)
            self._changed()


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
