"""The one-port front: agents' tunnels and waitress on the control plane's one port.

Every agent keeps one tunnel to the control plane (docs/architecture.md §12): a WebSocket
upgrade of ``GET /api/v1/agent/tunnel``. waitress cannot hand a connection over, so the
front looks at each new connection first (``connections.Channel`` does the reading, on the
event loop, before waitress's parser sees a byte):

- bytes that cannot begin ``GET /api/v1/agent/tunnel`` go to waitress untouched, the very
  bytes the client sent (usually nothing has been read yet: the first look is a
  ``MSG_PEEK``);
- a tunnel request is read up to the end of its head and no further, then handed, socket
  and head, to the registered handler on the relay's event loop (no thread of its own),
  and leaves waitress's loop.

The control plane speaks plain HTTP (TLS ends at the reverse proxy in front of it,
docs/reverse-proxy.md), so what the front looks at is the request itself. A client that
connects and says nothing, or trickles a head, costs the loop nothing: it is a waitress
connection like any other, under the same request deadline, idle timeout and connection
limits.

``tunnel_websocket.websocket_tunnel(accept, serve)`` makes the handler the relay
registers: the WebSocket on the handed-over connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from modelforge_contract import (
    HEADER_AGENT_PROTOCOL,
    NOT_FOUND,
    TOO_MANY_TUNNELS,
    compatibility_of,
)
from modelforge_contract.tunnel import PATH_AGENT_TUNNEL, PATH_AGENT_TUNNEL_DOWN

from ..web.http import JSON_HEADERS, SECURITY_HEADERS

log = logging.getLogger(__name__)

# What a tunnel request begins with; the byte after it ends the path (a space, or "?"),
# so the HTTP fallback's GET …/tunnel/down is waitress's like any other route.
TUNNEL_REQUEST_LINE = f"GET {PATH_AGENT_TUNNEL}".encode()
_END_OF_PATH = (b" ", b"?")
END_OF_HEAD = b"\r\n\r\n"

# Tunnels held at once (each a connection on the relay's event loop, no thread). An agent
# holds one; past this a new one is answered 503 with Retry-After.
MAX_TUNNELS = 1024
RETRY_AFTER_SECONDS = 5

# handler(sock, head, peer), a coroutine run on the relay's event loop: the connection's
# socket, its request head (the bytes read, up to and including the blank line that ends
# it), the client's address. The socket is closed once it returns.
TunnelHandler = Callable[[socket.socket, bytes, tuple], Awaitable[None]]

# What the front makes of a new connection's first bytes.
MORE = "more"  # cannot tell yet
WAITRESS = "waitress"  # not a tunnel request: waitress takes it
TUNNEL = "tunnel"  # a whole tunnel request head
CLIENT = "client"  # a client call (/v1/*): the relay's event loop takes it

# What the relay's event loop serves (client_loop.py): client calls, and the HTTP
# fallback's tunnel downloads (which live as long as their tunnel).
CLIENT_REQUEST_LINES = (b"POST /v1/", b"GET /v1/", f"GET {PATH_AGENT_TUNNEL_DOWN}".encode())


def classify_client(head: bytes) -> str:
    """CLIENT when ``head`` begins a client call, MORE when it may still, else WAITRESS."""
    for line in CLIENT_REQUEST_LINES:
        if head.startswith(line):
            return CLIENT
    if any(line.startswith(head) for line in CLIENT_REQUEST_LINES):
        return MORE
    return WAITRESS


def classify_both(
    head: bytes, max_head_bytes: int, tunnels: bool, clients: bool
) -> tuple[str, int]:
    """``classify`` for a server that takes tunnels, client calls, or both: for a client
    call, ``(CLIENT, len(head))`` (the loop reads the rest itself)."""
    kind, take = classify(head, max_head_bytes) if tunnels else (WAITRESS, 0)
    if clients:
        client = classify_client(head)
        if client == CLIENT:
            return CLIENT, len(head)
        if client == MORE and kind == WAITRESS:
            return MORE, len(head)
    return kind, take


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

    The relay registers its handler once, with the event loop it runs on; until then (and
    after ``register(None)``) the front takes nothing and every connection is waitress's,
    exactly as without it.
    """

    def __init__(self, max_tunnels: int = MAX_TUNNELS) -> None:
        self.max_tunnels = max_tunnels
        self._handler: TunnelHandler | None = None
        self._loop_of: Callable[[], asyncio.AbstractEventLoop] | None = None
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()

    def register(
        self,
        handler: TunnelHandler | None,
        loop_of: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:
        """Hand tunnel connections to ``handler`` from now on (None: to nobody), run on the
        loop ``loop_of()`` answers (the relay's, started on first use)."""
        self._handler, self._loop_of = handler, loop_of

    @property
    def taking(self) -> bool:
        """A handler is registered: new connections are looked at."""
        return self._handler is not None and self._loop_of is not None

    @property
    def live(self) -> int:
        """Tunnel connections being handled now."""
        return len(self._live)

    def take(self, sock: socket.socket, head: bytes, peer: tuple, done: Callable[[], None]) -> bool:
        """Run the handler on ``sock`` on the loop; ``done`` runs once it has returned and
        the socket is closed. False, with nothing started, when the front holds
        ``max_tunnels`` already or no handler is registered."""
        handler, loop_of = self._handler, self._loop_of
        with self._lock:
            if handler is None or loop_of is None or len(self._live) >= self.max_tunnels:
                return False
            self._live.add(sock)
        run = self._run(handler, sock, head, peer, done)
        try:
            loop_of().call_soon_threadsafe(asyncio.ensure_future, run)
        except RuntimeError:  # the loop is closed: the control plane is stopping
            run.close()
            with self._lock:
                self._live.discard(sock)
            return False
        return True

    async def _run(
        self,
        handler: TunnelHandler,
        sock: socket.socket,
        head: bytes,
        peer: tuple,
        done: Callable[[], None],
    ) -> None:
        try:
            await handler(sock, head, peer)
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
