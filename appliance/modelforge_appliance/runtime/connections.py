"""How the control plane holds thousands of connections on waitress.

What waitress does not do on its own:

- **A deadline for the whole request.** waitress closes a connection only after
  ``channel_timeout`` seconds *without any byte*, so a client that trickles its headers
  one byte at a time holds a connection for ever. ``Channel`` notes when the request
  it is receiving began (or when the connection opened, for its first request), and
  ``Server.maintenance`` closes it once that is older than the request timeout.
- **Its own refusals in the one error shape.** A request waitress refuses before the
  application sees it (malformed, headers or body over the limit, an unknown
  transfer coding) is answered by ``JsonErrorTask`` as
  ``{"error": {"code", "message", "next_step"}}``, never as waitress's plain text, and
  never echoing what the client sent.
- **Bounds one client cannot push the server past.** Bytes of unfinished requests are
  counted across all connections; past ``MODELFORGE_MAX_BUFFERED_BYTES`` a request still
  sending more than a small head is answered 503 with ``Retry-After`` and closed. One
  address may hold ``MODELFORGE_CONNECTIONS_PER_ADDRESS`` connections (a trusted proxy's
  are not counted); and near the connection limit the oldest idle keep-alive connections
  are closed to make room, so a flood of idle sockets never stops the others.
- **A look before waitress reads.** Where the tunnel front takes agents' tunnels
  (``front.py``), a new connection's first bytes are peeked at: a tunnel request's head
  is taken (and not a byte past it) and the connection handed over; anything else is
  waitress's, byte for byte.
- **An event loop whose cost does not grow with registrations.** waitress's poll loop
  builds a new ``poll`` set from every connection on every turn; ``EventLoop`` keeps
  one ``epoll`` set and only changes the entries whose interest changed. It still asks
  every connection what it is waiting for each turn, exactly as waitress does, so its
  behaviour is waitress's; bench/fleet.py measures the difference.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

from modelforge_contract import (
    API_PREFIX,
    BODY_TOO_LARGE,
    HEADERS_TOO_LARGE,
    INTERNAL_ERROR,
    REQUEST_MALFORMED,
    SERVER_BUSY,
    TOO_MANY_CONNECTIONS,
    TRANSFER_ENCODING_UNSUPPORTED,
    compatibility_of,
)

from ..web.http import SECURITY_HEADERS
from .front import CLIENT, TOO_MANY_TUNNELS_ANSWER, TUNNEL, WAITRESS, TunnelFront, classify_both

log = logging.getLogger(__name__)

AGENT_PREFIX = f"{API_PREFIX}/agent/"

# waitress's refusals by status: (code, message, next step). Its own text is never sent
# back: it can quote a header line the client sent, credential included.
WAITRESS_REFUSALS: dict[int, tuple[str, str, str]] = {
    400: (
        REQUEST_MALFORMED,
        "the request is not well-formed HTTP/1.1",
        "Send a well-formed request; see docs/api.md.",
    ),
    413: (
        BODY_TOO_LARGE,
        "the body is larger than the control plane accepts",
        "Send a smaller body (MODELFORGE_MAX_BODY_BYTES sets the limit).",
    ),
    431: (
        HEADERS_TOO_LARGE,
        "the request line and headers are larger than the control plane accepts",
        "Send shorter headers.",
    ),
    501: (
        TRANSFER_ENCODING_UNSUPPORTED,
        "the request uses a transfer coding other than chunked",
        "Send the body with Content-Length, or with Transfer-Encoding: chunked.",
    ),
    500: (
        INTERNAL_ERROR,
        "the control plane failed to answer",
        "Retry; if it persists, check the control plane's log.",
    ),
}


# The application's security headers on every answer, waitress's own included.
_SECURITY = list(SECURITY_HEADERS.items())


def busy_answer(code: str, message: str, next_step: str, retry_after: int) -> bytes:
    """A whole 503 answer, written straight to a connection the server is refusing."""
    body = json.dumps({"error": {"code": code, "message": message, "next_step": next_step}})
    headers = [
        ("Content-Type", "application/json"),
        ("Cache-Control", "no-store"),
        ("Retry-After", str(retry_after)),
        ("Connection", "close"),
        ("Content-Length", str(len(body))),
        *_SECURITY,
    ]
    head = "HTTP/1.1 503 Service Unavailable\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + "\r\n" + body).encode()


class JsonErrorTask(ErrorTask):
    """waitress's answer to a request it refused itself, in the one error shape."""

    def execute(self) -> None:
        error = self.request.error
        code, message, next_step = WAITRESS_REFUSALS.get(error.code, WAITRESS_REFUSALS[400])
        body: dict[str, Any] = {"error": {"code": code, "message": message, "next_step": next_step}}
        if (getattr(self.request, "path", "") or "").startswith(AGENT_PREFIX):
            # Every agent answer carries compatibility, refusals included
            # (docs/architecture.md §3).
            protocol = self.request.headers.get("X_MODELFORGE_AGENT_PROTOCOL")
            body["compatibility"] = compatibility_of(protocol)
        raw = json.dumps(body).encode()
        self.status = f"{error.code} {error.reason}"
        self.response_headers.extend(
            [("Content-Type", "application/json"), ("Cache-Control", "no-store")]
        )
        self.response_headers.extend(_SECURITY)
        self.set_close_on_finish()
        self.content_length = len(raw)
        self.write(raw)


# A request whose bytes so far stay under this is never refused for the global bound (a
# heartbeat, a read): the bound is for bodies, and this much per connection is already
# bounded by the per-address and total connection limits.
SMALL_REQUEST_BYTES = 16 * 1024
RETRY_AFTER_SECONDS = 5
# How long the loop waits for a task to finish appending to its output (a few µs with the
# GIL): far less than a loop turn that would otherwise spin on it.
OUTBUF_LOCK_WAIT_SECONDS = 0.002


class Channel(HTTPChannel):
    """One client connection, timed from the first byte of the request it is receiving,
    its unfinished request's bytes counted against the server's bound."""

    error_task_class = JsonErrorTask

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A new connection must send its first request within the deadline too: a socket
        # that connects and says nothing is a slow client, not an idle keep-alive one.
        self.request_began: float | None = self.creation_time
        self._timed_request: object | None = None
        self._fresh = True
        self.held = 0  # bytes of the unfinished request, counted in server.bounds
        self.draining = False  # refused mid-body: what arrives is dropped
        # Server.handle_accept counted this connection against its address (or refused it).
        self.source = self.addr[0] if isinstance(self.addr, tuple) else str(self.addr)
        self._counted = True
        # Looked at by the tunnel front before waitress reads a byte (front.py): what the
        # front has read of a tunnel request's head, never a byte past it.
        self.sniffing = self._looks()
        self.sniffed = b""

    def _looks(self) -> bool:
        """Whether the front looks at this connection's next request (its server takes
        tunnels, or hands client calls to the relay's loop)."""
        front = self.server.front
        return (front is not None and front.taking) or self.server.clients is not None

    def _flush_some_if_lockable(self, do_close: bool = True) -> bool | None:
        """waitress tries the output lock without waiting, and the loop goes round at once
        while a task holds it: holding the GIL, the loop then spins against the very
        thread it waits for (a profiled relayed bulk answer: 942k loop turns for 10k
        sends). Waiting a moment for the lock gives the GIL to the task instead."""
        if not self.outbuf_lock.acquire(timeout=OUTBUF_LOCK_WAIT_SECONDS):
            return None
        try:
            flushed = self._flush_some(do_close=do_close)
            if self.total_outbufs_len < self.adj.outbuf_high_watermark:
                self.outbuf_lock.notify()
            return flushed
        finally:
            self.outbuf_lock.release()

    def refuse(self, answer: bytes) -> None:
        """Answer ``answer`` to a client still sending a body, dropping what it sent.

        Closing with its bytes unread would reset the connection and lose the answer, so
        what it sends is read and dropped until it closes, or until the request deadline
        closes it.
        """
        self._release()
        self.request = None
        self.write_soon(answer)
        self.draining = True

    def _release(self) -> None:
        if self.held:
            self.server.bounds.buffered -= self.held
            self.held = 0

    def received(self, data: bytes) -> bool:
        if self.will_close or self.close_when_flushed or self.draining:
            return False
        server, bounds = self.server, self.server.bounds
        if (
            data
            and not self.requests
            and self.held + len(data) > SMALL_REQUEST_BYTES
            and bounds.buffered + len(data) > bounds.max_buffered
        ):
            server.on_close("buffer_full")
            self.refuse(
                busy_answer(
                    SERVER_BUSY,
                    "the control plane holds as much unfinished request data as it allows",
                    "Retry after the time Retry-After gives (MODELFORGE_MAX_BUFFERED_BYTES sets "
                    "the bound).",
                    RETRY_AFTER_SECONDS,
                )
            )
            return False
        result = super().received(data)
        if self.request is None:
            # Nothing half-received: the connection is idle, and the idle timeout applies.
            self._release()
            self.request_began, self._timed_request = None, None
        else:
            if self.request is not self._timed_request:
                # A request began in this chunk of bytes (the first one: when the connection
                # opened); what came before it was a whole request, no longer held.
                self._release()
                self._timed_request = self.request
                self.request_began = self.creation_time if self._fresh else time.time()
            self.held += len(data)
            bounds.buffered += len(data)
        self._fresh = False
        return result

    def handle_read(self) -> None:
        if not self.sniffing and self._between_requests() and self._looks():
            self.sniffing = True  # a client call after an admin call goes to the loop too
        if self.sniffing:
            self._sniff()
        else:
            super().handle_read()

    def _between_requests(self) -> bool:
        """Nothing half-received, nothing being answered or written: the next bytes begin
        a new request. (A request whose answer is still being finished is waitress's.)"""
        return (
            self.request is None
            and not self.requests
            and not self.total_outbufs_len
            and not (self.will_close or self.close_when_flushed or self.draining)
        )

    def _sniff(self) -> None:
        """The front's look at a new connection: waitress's, or an agent's tunnel.

        The look is a ``MSG_PEEK``; only bytes that may begin a tunnel request are taken
        (so the socket does not stay readable with nothing new), and a tunnel request's
        head is taken up to its blank line and no further. Anything else is waitress's:
        the bytes taken, then the socket, exactly as the client sent them.
        """
        try:
            peeked = self.socket.recv(self.adj.recv_bytes, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            self.handle_close()
            return
        if not peeked:  # the client closed before it said anything we kept
            self.handle_close()
            return
        front = self.server.front
        kind, take = classify_both(
            self.sniffed + peeked,
            self.adj.max_request_header_size,
            front is not None and front.taking,
            self.server.clients is not None,
        )
        if kind == WAITRESS:
            self.sniffing = False
            sniffed, self.sniffed = self.sniffed, b""
            if sniffed:
                self.last_activity = time.time()
                self.received(sniffed)
            super().handle_read()
            return
        try:
            self.sniffed += self.socket.recv(take - len(self.sniffed))
        except OSError:
            self.handle_close()
            return
        self.last_activity = time.time()
        if kind == TUNNEL and len(self.sniffed) == take:
            self._hand_over()
        elif kind == CLIENT:
            self._hand_to_clients()

    def _leave_loop(self) -> tuple[socket.socket, bytes, str]:
        """Take this connection out of waitress's loop (and its connection count), the
        socket left open; it stays counted against its address until whoever takes it
        closes it. Its socket, the bytes read of it, its address."""
        sock, head = self.socket, self.sniffed
        self.sniffing, self.sniffed, self._counted = False, b"", False
        self.del_channel()  # out of the loop's map, the socket left open
        with self.outbuf_lock:
            for outbuf in self.outbufs:
                outbuf.close()
            self.total_outbufs_len = 0
        self.connected = False
        return sock, head, self.source

    def _hand_over(self) -> None:
        """Give this connection to the tunnel front."""
        server = self.server
        sock, head, source = self._leave_loop()

        def done() -> None:  # on the tunnel's thread; the address count is the loop's
            with contextlib.suppress(Exception):
                server.trigger.pull_trigger(lambda: server.uncount_source(source))

        if server.front is None or not server.front.take(sock, head, self.addr, done):
            server.on_close("tunnels_full")
            with contextlib.suppress(OSError):
                sock.send(TOO_MANY_TUNNELS_ANSWER)
            sock.close()
            server.uncount_source(source)

    def _hand_to_clients(self) -> None:
        """Give this connection to the relay's event loop (client_loop.py), with the bytes
        read of its request; it comes back here at its next request that is not a client
        call."""
        server = self.server
        sock, head, source = self._leave_loop()
        if not server.clients.take(sock, self.addr, head):
            server.on_close("clients_full")
            with contextlib.suppress(OSError):
                sock.send(_CLIENTS_FULL_ANSWER)
            sock.close()
            server.uncount_source(source)

    def handle_close(self) -> None:
        self._release()
        if self._counted:
            self._counted = False
            self.server.uncount_source(self.source)
        super().handle_close()


# waitress accepts one connection per loop turn; a fleet reconnecting at once (after a
# restart of the control plane) would then wait on the loop, one turn per agent.
ACCEPTS_PER_TURN = 64


_PER_ADDRESS_ANSWER = busy_answer(
    TOO_MANY_CONNECTIONS,
    "this address holds as many connections as the control plane allows one address",
    "Close idle connections, or raise MODELFORGE_CONNECTIONS_PER_ADDRESS.",
    RETRY_AFTER_SECONDS,
)


_CLIENTS_FULL_ANSWER = busy_answer(
    SERVER_BUSY,
    "the relay holds as many client connections as it allows",
    "Retry after the time Retry-After gives (MODELFORGE_CONNECTION_LIMIT sets the bound).",
    RETRY_AFTER_SECONDS,
)


class Bounds:
    """What all the server's connections hold together, shared by its listening sockets:
    bytes of unfinished requests, and connections per client address. Touched only by the
    event loop's thread."""

    def __init__(
        self,
        max_buffered: int = 64 << 20,
        per_address: int = 1 << 30,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.max_buffered, self.per_address, self.trusted = max_buffered, per_address, trusted
        self.buffered = 0
        self.sources: dict[str, int] = {}

    def count_source(self, source: str) -> bool:
        if source in self.trusted:
            return True
        held = self.sources.get(source, 0)
        if held >= self.per_address:
            return False
        self.sources[source] = held + 1
        return True

    def uncount_source(self, source: str) -> None:
        if source in self.trusted:
            return
        left = self.sources.get(source, 0) - 1
        if left > 0:
            self.sources[source] = left
        else:
            self.sources.pop(source, None)


class Server(TcpWSGIServer):
    """waitress's TCP server with ``Channel`` connections, the request deadline, the
    per-address and buffered-bytes bounds, idle connections evicted near the limit, and
    accepting every waiting connection (up to ACCEPTS_PER_TURN) in one loop turn."""

    channel_class = Channel
    request_timeout: float = 30.0
    # Where agents' tunnel requests go (front.py); None: every connection is waitress's.
    front: TunnelFront | None = None
    # Where client calls (/v1/*) go: the relay's loop (client_loop.ClientLoop); None: here.
    clients: Any = None
    # Called with "idle", "request_timeout", "evicted", "buffer_full", "per_address" or
    # "tunnels_full" for every connection this server closes or refuses.
    on_close: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bounds = Bounds()  # create_server hands every listening socket one object

    def count_source(self, source: str) -> bool:
        """Count a new connection from ``source``; False when that address is at its cap."""
        if self.bounds.count_source(source):
            return True
        self.on_close("per_address")
        return False

    def uncount_source(self, source: str) -> None:
        self.bounds.uncount_source(source)

    def adopt(self, sock: socket.socket, addr: tuple, data: bytes) -> None:
        """Take back a connection the relay's loop served (on this loop's thread): its
        next request, of which ``data`` was read, is waitress's. It is still counted
        against its address."""
        sock.setblocking(False)
        channel = self.channel_class(self, sock, addr, self.adj, map=self._map)
        channel.sniffing = False
        channel.request_began = time.time()
        channel._fresh = False
        if data:
            channel.last_activity = time.time()
            channel.received(data)

    def readable(self) -> bool:
        if (
            self.accepting
            and len(self._map) >= self.adj.connection_limit
            and self._someone_waiting()
        ):
            self.evict_idle(ACCEPTS_PER_TURN)
        return super().readable()

    def _someone_waiting(self) -> bool:
        """A connection waits in the listen backlog (the listening socket is readable)."""
        try:
            ready, _, _ = select.select([self.socket], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(ready)

    def evict_idle(self, count: int) -> None:
        """Close the ``count`` oldest idle connections (no request half-received, none being
        answered) while the limit is reached and a new connection waits: room for a new
        client beats the oldest silent one. They close on this loop turn's writes."""
        idle = [
            channel
            for channel in self.active_channels.values()
            if not channel.requests
            and channel.request is None
            and not channel.total_outbufs_len
            and not (channel.will_close or channel.close_when_flushed)
            and not channel.sniffed  # a tunnel request's head is arriving
        ]
        for channel in sorted(idle, key=lambda channel: channel.last_activity)[:count]:
            self.on_close("evicted")
            log.debug("evicting an idle connection from %s at the limit", channel.addr)
            channel.will_close = True

    def handle_accept(self) -> None:
        """Accept every waiting connection (up to ACCEPTS_PER_TURN, never past the limit).
        One from an address at its cap is answered and closed at once, before a channel is
        made for it: a flood from one address costs the loop little."""
        for _ in range(ACCEPTS_PER_TURN):
            if len(self._map) >= self.adj.connection_limit:
                return
            try:
                accepted = self.accept()
                if accepted is None:
                    return  # nobody else is waiting
                conn, addr = accepted
                self.set_socket_options(conn)
            except OSError:
                if self.adj.log_socket_errors:
                    log.warning("accept() failed", exc_info=True)
                return
            addr = self.fix_addr(addr)
            source = addr[0] if isinstance(addr, tuple) else str(addr)
            if not self.count_source(source):
                with contextlib.suppress(OSError):
                    conn.setblocking(False)
                    conn.send(_PER_ADDRESS_ANSWER)
                conn.close()
                continue
            self.channel_class(self, conn, addr, self.adj, map=self._map)

    def maintenance(self, now: float) -> None:
        idle_cutoff = now - self.adj.channel_timeout
        request_cutoff = now - self.request_timeout
        for channel in self.active_channels.values():
            if channel.requests or channel.will_close:
                continue  # being answered (or already going): never cut off mid-answer
            began = getattr(channel, "request_began", None)
            if began is not None and began < request_cutoff:
                reason = "request_timeout"
            elif channel.last_activity < idle_cutoff:
                reason = "idle"
            else:
                continue
            channel.will_close = True
            self.on_close(reason)
            log.debug("closing a connection from %s: %s", channel.addr, reason)


_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT


class EventLoop:
    """wasyncore's poll loop over a socket map, with one persistent epoll set.

    Each turn asks every dispatcher, as ``wasyncore.poll2`` does, whether it wants to
    read or write; only a change of answer costs a system call. A dispatcher that wants
    neither is taken out of the set, again as in poll2, so a hang-up during an answer is
    noticed when the answer is done. Events are dispatched with wasyncore's own
    ``readwrite``.
    """

    def __init__(self, socket_map: dict[int, Any]) -> None:
        self.map = socket_map
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        # fd -> (dispatcher, registered events): a closed fd may come back as a new socket.
        self._registered: dict[int, tuple[Any, int]] = {}

    def turn(self, timeout: float) -> None:
        if self._epoll is None:  # not Linux: waitress's own loop
            wasyncore.poll2(timeout, self.map)
            return
        for fd in [fd for fd, (obj, _) in self._registered.items() if self.map.get(fd) is not obj]:
            self._forget(fd)
        for fd, obj in list(self.map.items()):
            events = 0
            if obj.readable():
                events |= _READ
            if obj.writable() and not obj.accepting:
                events |= _WRITE
            self._register(fd, obj, events)
        try:
            ready = self._epoll.poll(timeout)
        except InterruptedError:
            return
        for fd, events in ready:
            obj = self.map.get(fd)
            if obj is not None:
                wasyncore.readwrite(obj, events)

    def _register(self, fd: int, obj: Any, events: int) -> None:
        known = self._registered.get(fd)
        if known is not None and known[1] == events:
            return
        if not events:
            self._forget(fd)
            return
        try:
            if known is None:
                self._epoll.register(fd, events)
            else:
                self._epoll.modify(fd, events)
        except FileNotFoundError:  # the kernel dropped it along with a closed descriptor
            self._epoll.register(fd, events)
        except FileExistsError:
            self._epoll.modify(fd, events)
        self._registered[fd] = (obj, events)

    def _forget(self, fd: int) -> None:
        if self._registered.pop(fd, None) is not None:
            # A closed descriptor is already gone from the set.
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        self._registered.clear()
