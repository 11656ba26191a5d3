"""The one-port front: agents' tunnels and waitress on the control plane's one port.

Every agent keeps one tunnel to the control plane (docs/architecture.md §11): a WebSocket
upgrade of ``GET /api/v1/agent/tunnel``. waitress cannot hand a connection over, so the
front looks at each new connection first (``connections.Channel`` does the reading, on the
event loop, before waitress's parser sees a byte):

- bytes that cannot begin ``GET /api/v1/agent/tunnel`` go to waitress untouched, the very
  bytes the client sent (usually nothing has been read yet: the first look is a
  ``MSG_PEEK``);
- a tunnel request is read up to the end of its head and no further, then handed, socket
  and head, to the registered handler on a thread of its own, and leaves waitress's loop.

The control plane speaks plain HTTP (TLS ends at the reverse proxy in front of it,
docs/reverse-proxy.md), so what the front looks at is the request itself. A client that
connects and says nothing, or trickles a head, costs the loop nothing: it is a waitress
connection like any other, under the same request deadline, idle timeout and connection
limits.

``websocket_tunnel(accept, serve)`` makes the handler the relay registers: the WebSocket
handshake with the ``websockets`` library (sans-I/O, compression off, messages bounded to
one tunnel frame), ``accept(headers)`` to refuse before the upgrade completes, and
``serve(connection)`` with whole binary messages in and out.
"""

from __future__ import annotations

import contextlib
import http
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from websockets.datastructures import Headers, MultipleValuesError
from websockets.exceptions import ConnectionClosed, HeaderLineTooLong, TooManyHeaders
from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.sync.connection import Connection

from modelforge_contract import (
    HEADER_AGENT_PROTOCOL,
    HEADERS_TOO_LARGE,
    INTERNAL_ERROR,
    NOT_FOUND,
    REQUEST_MALFORMED,
    TOO_MANY_TUNNELS,
    TUNNEL_UPGRADE_REQUIRED,
    compatibility_of,
)
from modelforge_contract.tunnel import MAX_FRAME, PATH_AGENT_TUNNEL, TUNNEL_SUBPROTOCOL

from ..core.errors import ApiError
from ..web.http import JSON_HEADERS, SECURITY_HEADERS

log = logging.getLogger(__name__)
# The websockets library's own lines: never below INFO, since at DEBUG it logs every
# handshake header, the agent's credential among them.
_WEBSOCKETS_LOG = logging.getLogger(f"{__name__}.websockets")
_WEBSOCKETS_LOG.setLevel(logging.WARNING)

# What a tunnel request begins with; the byte after it ends the path (a space, or "?"),
# so the HTTP fallback's GET …/tunnel/down is waitress's like any other route.
TUNNEL_REQUEST_LINE = f"GET {PATH_AGENT_TUNNEL}".encode()
_END_OF_PATH = (b" ", b"?")
END_OF_HEAD = b"\r\n\r\n"

# One WebSocket message carries one tunnel frame (modelforge_contract.tunnel): its 12-byte
# header and at most 256 KiB of payload. A longer message closes the tunnel (1009).
MAX_MESSAGE_BYTES = MAX_FRAME
# Whole messages the reader thread queues before it stops reading the socket (TCP then
# pushes back on the agent): with MAX_MESSAGE_BYTES, about 4 MiB per tunnel at most.
MAX_QUEUED_MESSAGES = 16
# Tunnels held at once: each holds a thread (and websockets' reader thread). An agent
# holds one; past this a new one is answered 503 with Retry-After.
MAX_TUNNELS = 1024
RETRY_AFTER_SECONDS = 5
# A handshake answer is a few hundred bytes; a client that will not take it is dropped.
HANDSHAKE_TIMEOUT_SECONDS = 10.0
# After a refusal: how long, and how much, of what the client still sends is read and
# dropped before closing, so that the answer is not lost to a reset.
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024

# handler(sock, head, peer): the connection's socket (blocking), its request head (the
# bytes read, up to and including the blank line that ends it), the client's address.
TunnelHandler = Callable[[socket.socket, bytes, tuple], None]

# What the front makes of a new connection's first bytes.
MORE = "more"  # cannot tell yet
WAITRESS = "waitress"  # not a tunnel request: waitress takes it
TUNNEL = "tunnel"  # a whole tunnel request head


def classify(head: bytes, max_head_bytes: int) -> tuple[str, int]:
    """What a connection's first bytes are, and how many of them belong to the front.

    ``(WAITRESS, 0)`` when they cannot begin a tunnel request; ``(TUNNEL, n)`` when the
    first ``n`` bytes are a whole tunnel request head; ``(MORE, len(head))`` otherwise. A
    tunnel request whose head passes ``max_head_bytes`` goes to waitress, which refuses it
    (431) in the one error shape.
    """
    line = TUNNEL_REQUEST_LINE
    if len(head) <= len(line):
        return (MORE, len(head)) if line.startswith(head) else (WAITRESS, 0)
    if not head.startswith(line) or head[len(line) : len(line) + 1] not in _END_OF_PATH:
        return WAITRESS, 0
    end = head.find(END_OF_HEAD)
    if end < 0:
        return (WAITRESS, 0) if len(head) > max_head_bytes else (MORE, len(head))
    if end + len(END_OF_HEAD) > max_head_bytes:
        return WAITRESS, 0
    return TUNNEL, end + len(END_OF_HEAD)


def json_answer(
    status: int, body: dict[str, Any], headers: Iterable[tuple[str, str]] = ()
) -> bytes:
    """A whole HTTP/1.1 answer with a JSON body, closing the connection."""
    raw = json.dumps(body).encode()
    lines = [
        *JSON_HEADERS.items(),
        *headers,
        ("Connection", "close"),
        ("Content-Length", str(len(raw))),
        *SECURITY_HEADERS.items(),
    ]
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Refused"
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in lines)
    return head.encode("latin-1") + b"\r\n" + raw


def error_body(code: str, message: str, next_step: str, protocol: str | None) -> dict[str, Any]:
    """The one error shape, with ``compatibility`` as on every agent answer."""
    return {
        "error": {"code": code, "message": message, "next_step": next_step},
        "compatibility": compatibility_of(protocol),
    }


TOO_MANY_TUNNELS_ANSWER = json_answer(
    503,
    error_body(
        TOO_MANY_TUNNELS,
        "the control plane holds as many agent tunnels as it allows",
        "Retry after the time Retry-After gives.",
        None,
    ),
    [("Retry-After", str(RETRY_AFTER_SECONDS))],
)


_AGENT_PREFIX = PATH_AGENT_TUNNEL.rsplit("/", 1)[0] + "/"


def tunnel_port_app(environ: dict[str, Any], start_response: Callable) -> list[bytes]:
    """The WSGI application of the separate tunnel port (MODELFORGE_TUNNEL_LISTEN): the
    front takes the tunnel requests, and everything else is answered 404 here."""
    body: dict[str, Any] = {
        "error": {
            "code": NOT_FOUND,
            "message": "this port serves only the agents' tunnel",
            "next_step": "Send API requests to the control plane's port (MODELFORGE_LISTEN).",
        }
    }
    if (environ.get("PATH_INFO") or "").startswith(_AGENT_PREFIX):
        protocol = environ.get("HTTP_" + HEADER_AGENT_PROTOCOL.upper().replace("-", "_"))
        body["compatibility"] = compatibility_of(protocol)
    raw = json.dumps(body).encode()
    start_response(
        "404 Not Found",
        [
            *JSON_HEADERS.items(),
            ("Content-Length", str(len(raw))),
            *SECURITY_HEADERS.items(),
        ],
    )
    return [raw]


class TunnelFront:
    """Who takes the tunnel connections, and how many are held.

    The relay registers its handler once; until then (and after ``register(None)``) the
    front takes nothing and every connection is waitress's, exactly as without it.
    """

    def __init__(self, max_tunnels: int = MAX_TUNNELS) -> None:
        self.max_tunnels = max_tunnels
        self._handler: TunnelHandler | None = None
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()

    def register(self, handler: TunnelHandler | None) -> None:
        """Hand tunnel connections to ``handler`` from now on (None: to nobody)."""
        self._handler = handler

    @property
    def taking(self) -> bool:
        """A handler is registered: new connections are looked at."""
        return self._handler is not None

    @property
    def live(self) -> int:
        """Tunnel connections being handled now."""
        return len(self._live)

    def take(self, sock: socket.socket, head: bytes, peer: tuple, done: Callable[[], None]) -> bool:
        """Run the handler on ``sock`` on a thread of its own; ``done`` runs once it has
        returned and the socket is closed. False, with nothing started, when the front
        holds ``max_tunnels`` already or no handler is registered."""
        handler = self._handler
        with self._lock:
            if handler is None or len(self._live) >= self.max_tunnels:
                return False
            self._live.add(sock)
        thread = threading.Thread(
            target=self._run,
            args=(handler, sock, head, peer, done),
            name=f"tunnel-{peer[0] if peer else '?'}",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had
            with self._lock:
                self._live.discard(sock)
            return False
        return True

    def _run(
        self,
        handler: TunnelHandler,
        sock: socket.socket,
        head: bytes,
        peer: tuple,
        done: Callable[[], None],
    ) -> None:
        try:
            sock.settimeout(None)  # the loop's sockets are non-blocking; the handler's block
            handler(sock, head, peer)
        except Exception as exc:
            log.error("the tunnel handler failed: %s", type(exc).__name__, exc_info=True)
        finally:
            with self._lock:
                self._live.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()
            done()

    def close(self) -> None:
        """Shut every live tunnel's socket down: their handlers see the end and return."""
        with self._lock:
            live = list(self._live)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


# -- the WebSocket on a handed-over connection ------------------------------------------

# accept(headers): None to upgrade, or (status, body) to refuse with that answer (the one
# error shape; ``retry_after_seconds`` in the body becomes Retry-After). It may also raise
# an ApiError, which is answered as its status and body.
Refusal = tuple[int, dict[str, Any]]
Accept = Callable[[Headers], "Refusal | None"]


class TunnelClosed(Exception):
    """The tunnel's WebSocket is closed: ``code`` and ``reason`` as the close frame gave
    them (1006 and "" when the connection just broke)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"tunnel closed ({code}{': ' + reason if reason else ''})")
        self.code, self.reason = code, reason


class TunnelConnection:
    """One agent's tunnel after the upgrade: whole binary messages in and out.

    ``send`` may be called from several threads at once (websockets serialises writes);
    ``recv`` from one. Both raise TunnelClosed once the connection is closed.
    """

    def __init__(self, connection: Connection, headers: Headers, peer: tuple) -> None:
        self._connection = connection
        self.headers = headers  # the upgrade request's headers (case-insensitive)
        self.peer = peer  # the client's address (a trusted proxy's, behind one)

    def recv(self, timeout: float | None = None) -> bytes:
        """The next message; TimeoutError after ``timeout`` seconds without one. A text
        message is a protocol error: the tunnel is closed (1003)."""
        try:
            message = self._connection.recv(timeout, decode=None)
        except ConnectionClosed as closed:
            raise _closed(closed) from None
        if isinstance(message, str):
            self.close(1003, "binary messages only")
            raise TunnelClosed(1003, "binary messages only")
        return message

    def send(self, data: bytes) -> None:
        try:
            self._connection.send(data)
        except ConnectionClosed as closed:
            raise _closed(closed) from None

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close with ``code`` and ``reason`` (the closing handshake waits at most
        websockets' close timeout)."""
        self._connection.close(code, reason)


def _closed(closed: ConnectionClosed) -> TunnelClosed:
    frame = closed.rcvd or closed.sent
    return TunnelClosed(frame.code, frame.reason) if frame else TunnelClosed(1006, "")


def websocket_tunnel(
    accept: Accept,
    serve: Callable[[TunnelConnection], None],
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_queued_messages: int = MAX_QUEUED_MESSAGES,
    ping_interval: float | None = None,
    close_timeout: float = 10.0,
) -> TunnelHandler:
    """The handler that upgrades a tunnel request to a WebSocket and serves it.

    ``accept(headers)`` runs before the upgrade completes, so a refusal is a plain HTTP
    answer; ``serve(connection)`` runs on the same thread and the connection is closed
    when it returns. A request that is no valid WebSocket upgrade is answered 426 or 400 in
    the one error shape. No compression (permessage-deflate costs memory and CPU per
    connection, and most of what a tunnel carries is already compact); the subprotocol
    ``modelforge.tunnel.v1`` is chosen when offered; ``ping_interval`` None leaves
    liveness to the agent's pings and the tunnel's own PING frames.
    """

    def handler(sock: socket.socket, head: bytes, peer: tuple) -> None:
        protocol = ServerProtocol(
            extensions=None,
            subprotocols=[TUNNEL_SUBPROTOCOL],
            select_subprotocol=_tunnel_subprotocol,
            max_size=max_message_bytes,
            logger=_WEBSOCKETS_LOG,
        )
        protocol.receive_data(head)
        events = protocol.events_received()
        request = events[0] if events and isinstance(events[0], Request) else None
        if request is None:
            _refuse(sock, _unparsed(protocol.handshake_exc))
            return
        agent_protocol = request.headers.get(HEADER_AGENT_PROTOCOL)
        response = protocol.accept(request)
        if response.status_code != 101:
            _refuse(sock, _not_an_upgrade(response.status_code, agent_protocol))
            return
        try:
            refusal = accept(request.headers)
        except ApiError as error:
            refusal = (error.status, error.body())
        except MultipleValuesError:  # Headers.get of a header sent twice (Authorization…)
            refusal = (400, _duplicate_header_body(agent_protocol))
        except Exception as exc:
            log.error("the tunnel's accept failed: %s", type(exc).__name__, exc_info=True)
            _refuse(sock, _not_an_upgrade(500, agent_protocol))
            return
        if refusal is not None:
            status, body = refusal
            retry = body.get("retry_after_seconds")
            extra = [("Retry-After", str(retry))] if retry is not None else []
            _refuse(sock, json_answer(status, body, extra))
            return
        protocol.send_response(response)
        sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
        try:
            sock.sendall(b"".join(protocol.data_to_send()))
        except OSError:
            return  # the client went away (or would not read its answer)
        sock.settimeout(None)
        connection = Connection(
            sock,
            protocol,
            ping_interval=ping_interval,
            close_timeout=close_timeout,
            max_queue=max_queued_messages,
        )
        connection.request, connection.response = request, response
        try:
            serve(TunnelConnection(connection, request.headers, peer))
        finally:
            connection.close()

    return handler


def _tunnel_subprotocol(protocol: ServerProtocol, offered: Iterable[str]) -> str | None:
    """The tunnel's subprotocol when the client offers it; a client offering none is
    served all the same (the path says what the connection is)."""
    return TUNNEL_SUBPROTOCOL if TUNNEL_SUBPROTOCOL in offered else None


def _duplicate_header_body(agent_protocol: str | None) -> dict[str, Any]:
    return error_body(
        REQUEST_MALFORMED,
        "a header the tunnel reads once is sent more than once",
        "Send each of Authorization and the protocol header once.",
        agent_protocol,
    )


def _unparsed(exc: BaseException | None) -> bytes:
    if isinstance(exc, (HeaderLineTooLong, TooManyHeaders)):
        status, code, message = 431, HEADERS_TOO_LARGE, "the request's headers are too large"
    else:
        status, code, message = 400, REQUEST_MALFORMED, "the tunnel request is not well-formed"
    next_step = "Send a WebSocket upgrade request (the node agent does; see docs/api.md)."
    return json_answer(status, error_body(code, message, next_step, None))


def _not_an_upgrade(status: int, agent_protocol: str | None) -> bytes:
    next_step = "Send a WebSocket upgrade request (the node agent does; see docs/api.md)."
    if status == 426:
        body = error_body(
            TUNNEL_UPGRADE_REQUIRED,
            "the tunnel is a WebSocket: this request is no upgrade",
            next_step,
            agent_protocol,
        )
        return json_answer(426, body, [("Upgrade", "websocket")])
    if status >= 500:
        body = error_body(
            INTERNAL_ERROR,
            "the control plane failed to answer",
            "Retry; if it persists, check the control plane's log.",
            agent_protocol,
        )
        return json_answer(500, body)
    body = error_body(
        REQUEST_MALFORMED,
        "the WebSocket upgrade request is not valid",
        next_step,
        agent_protocol,
    )
    return json_answer(status, body)


def _refuse(sock: socket.socket, answer: bytes) -> None:
    """Send ``answer`` and close, reading (and dropping) for a moment what the client still
    sends, so that a reset does not destroy the answer before the client reads it."""
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
        sock.sendall(answer)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(LINGER_SECONDS)
        drained = 0
        while drained < LINGER_BYTES:
            chunk = sock.recv(16384)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
