"""Links of a model split across nodes, carried over the tunnel (docs/deployments.md).

A split's main server runs ``llama-server --rpc``; its helpers run ``ggml-rpc-server`` on
their own nodes' loopback. Nothing listens on a network: the main node's agent listens on
127.0.0.1 for each helper (``Listener``), and each connection ``llama-server`` makes there
becomes a LINK on this agent's tunnel, which the control plane splices to a stream on the
helper's agent, which connects to its ``ggml-rpc-server``. Both directions are
credit-bounded: a side sends at most WINDOW_BYTES beyond what the other granted back, so a
link costs at most one window per direction anywhere on the way.

A link is never resumed: when the tunnel drops, or the other side RESETs, the local
connection is closed, and ``llama-server`` (which has no timeout of its own, and aborts
when a helper goes) exits; the serve loop starts it again after its backoff. The main
side also ends a link that stalls: while a client request of its server is in flight,
bytes sent and then no byte either way for ``stall_seconds`` (a helper whose node hangs
would otherwise hang ``llama-server`` forever, ``/health`` 200). A long upload of tensors
keeps sending, so it is no stall; a hang while loading is the readiness deadline's.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable

from modelforge_contract import relay as rel
from modelforge_contract import tunnel as wire
from modelforge_contract.streams import Credit, Grants

log = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024
# Credit goes back in steps of this much (a quarter of the window, so a sender never waits
# on it): a WINDOW per small RPC message would double the frames on each round trip.
GRANT_BYTES = wire.WINDOW_BYTES // 4
POLL_SECONDS = 0.5  # how often a reader looks for a stall or an end


class LinkPump:
    """One link: a local socket and the tunnel stream it rides."""

    def __init__(
        self,
        stream_id: int,
        sock: socket.socket,
        send: Callable[[wire.Frame], bool],
        finished: Callable[[LinkPump], None],
        stall_seconds: float | None = None,
        busy: Callable[[], bool] = lambda: True,
        lost: Callable[[], None] = lambda: None,
    ) -> None:
        """``lost`` (the main side's): called once the link ends under it, by a RESET, a
        stall, or the helper closing it first."""
        self.stream_id, self.sock, self._send = stream_id, sock, send
        self._finished, self.stall_seconds, self._busy = finished, stall_seconds, busy
        self._lost = lost  # the other side went or stalled: the group cannot answer now
        self._cond = threading.Condition()
        self.credit = Credit()  # what it may still send toward the other side
        self._incoming: queue.Queue[bytes | None] = queue.Queue()
        # Writes waiting for the writer thread, or being made: while there are any, what
        # comes next queues behind them; with none, the tunnel's thread writes at once.
        self._queued = 0
        self._grants = Grants(GRANT_BYTES)  # what the local socket took, to grant back
        self.closed = False
        self._halves_done = 0  # each direction that ended cleanly (END): both, and it is over
        self._local_ended = False  # the local side closed first (llama-server done with it)
        # A stall: bytes sent since the last byte came back, and when the last went.
        self._waiting_since: float | None = None

    def start(self) -> None:
        threading.Thread(target=self._read, name=f"link-{self.stream_id}", daemon=True).start()
        threading.Thread(target=self._write, name=f"link-w-{self.stream_id}", daemon=True).start()

    # -- from the tunnel ----------------------------------------------------------------

    def on_data(self, payload: bytes) -> None:
        """The other side's bytes: to the local socket now when it takes them without
        waiting (one thread handoff less on each round trip), else through the writer."""
        with self._cond:
            self._waiting_since = None  # the other side answers
            queued, self._queued = self._queued, self._queued + 1
        if queued or self.closed:
            self._incoming.put(payload)
            return
        try:
            sent = self.sock.send(payload, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close()
            return
        self._took(sent)
        if sent < len(payload):
            self._incoming.put(payload[sent:])  # the writer finishes it, still first in line
            return
        with self._cond:
            self._queued -= 1

    def _took(self, count: int) -> None:
        """The local socket took ``count`` bytes: credit back in GRANT_BYTES steps."""
        with self._cond:
            grant = self._grants.took(count)
        if grant:
            self._send(wire.window_frame(self.stream_id, grant))

    def on_window(self, count: int) -> None:
        with self._cond:
            self.credit.give(count)  # FrameError past what was sent
            self._cond.notify_all()

    def on_end(self) -> None:
        with self._cond:
            first = not self._local_ended
        self._incoming.put(None)
        if first:  # the other side closed before this one: its helper went (or restarted)
            self._lost()

    def on_reset(self) -> None:
        if not self.closed:
            self.close(tell=False)
            self._lost()

    # -- its threads --------------------------------------------------------------------

    def _read(self) -> None:
        """The local socket to the tunnel, within the credit. The socket stays blocking (the
        writer's sendall may wait on a busy runtime); reads wait in select, a stall check
        every POLL_SECONDS."""
        try:
            while not self.closed:
                with self._cond:
                    while self.credit.left <= 0 and not self.closed:
                        self._cond.wait(POLL_SECONDS)
                        self._check_stall()
                    room = min(self.credit.left, READ_CHUNK)
                if self.closed:
                    return
                if not select.select([self.sock], [], [], POLL_SECONDS)[0]:
                    with self._cond:
                        self._check_stall()
                    continue
                data = self.sock.recv(room)
                if self.closed:  # closed under it (its socket's end woke the select)
                    return
                if not data:  # the local side closed: this direction is over
                    with self._cond:
                        self._local_ended = True
                    self._send(wire.end_frame(self.stream_id))
                    self._half_done()
                    return
                with self._cond:
                    self.credit.spend(len(data))  # never past it: room was the credit
                    self._waiting_since = time.monotonic()
                if not self._send(wire.data_frame(self.stream_id, data)):
                    self.close(tell=False)  # the tunnel is gone: nothing to tell
                    return
        except _Stalled:
            log.warning("link %d: no answer for %g s; ending it", self.stream_id,
                        self.stall_seconds)  # fmt: skip
            self._send(wire.reset_frame(self.stream_id, rel.LINK_STALLED, "the helper stalled"))
            self.close(tell=False)
            self._lost()
        except (OSError, ValueError):  # ValueError: select on a socket closed meanwhile
            self.close()

    def _check_stall(self) -> None:
        """Inside the lock."""
        if self.stall_seconds is None or self._waiting_since is None:
            return
        if time.monotonic() - self._waiting_since > self.stall_seconds and self._busy():
            raise _Stalled()

    def _write(self) -> None:
        """What the tunnel brought, to the local socket; credit back once it took it."""
        while True:
            data = self._incoming.get()
            if data is None or self.closed:
                if data is None and not self.closed:
                    with contextlib.suppress(OSError):
                        self.sock.shutdown(socket.SHUT_WR)
                    self._half_done()
                return
            try:
                self.sock.sendall(data)  # a blocking socket: as long as its reader needs
            except OSError:
                self.close()
                return
            self._took(len(data))
            with self._cond:
                self._queued -= 1

    def _half_done(self) -> None:
        with self._cond:
            self._halves_done += 1
            over = self._halves_done == 2
        if over:  # both ways ended cleanly: nothing to tell
            self.close(tell=False)

    def close(self, tell: bool = True) -> None:
        """End the link: the local connection is closed, and (``tell``) the other side is
        told with RESET."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        self._incoming.put(None)
        if tell:
            self._send(wire.reset_frame(self.stream_id, rel.NODE_LINK_LOST, "the link ended"))
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._finished(self)


class _Stalled(Exception):
    pass


class Listener:
    """127.0.0.1:<port> for one helper of a main server: each connection becomes a link."""

    def __init__(
        self,
        server_id: str,
        peer_server_id: str,
        open_link: Callable[[str, str, socket.socket], None],
    ) -> None:
        self.server_id, self.peer_server_id, self._open = server_id, peer_server_id, open_link
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name=f"listen-{peer_server_id}", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open(self.server_id, self.peer_server_id, conn)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
