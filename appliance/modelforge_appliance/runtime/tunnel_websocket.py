"""The WebSocket on a tunnel connection the front handed over (front.py).

``websocket_tunnel(accept, serve)`` is the handler the relay registers on the front: the
opening handshake with the ``websockets`` library's sans-I/O server (compression never
agreed, the subprotocol ``modelforge.tunnel.v1`` chosen when offered, messages bounded to
one tunnel frame), ``accept(headers)`` to refuse before the upgrade completes, then
``serve(connection)`` with whole binary messages in and out. Every refusal is a plain HTTP
answer in the one error shape, with ``compatibility`` as on every agent answer.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from websockets.datastructures import Headers, MultipleValuesError
from websockets.exceptions import ConnectionClosed, SecurityError
from websockets.http11 import Request
from websockets.server import ServerProtocol
from websockets.sync.connection import Connection

from modelforge_contract import (
    HEADER_AGENT_PROTOCOL,
    HEADERS_TOO_LARGE,
    INTERNAL_ERROR,
    REQUEST_MALFORMED,
    TUNNEL_UPGRADE_REQUIRED,
)
from modelforge_contract.tunnel import MAX_FRAME, TUNNEL_SUBPROTOCOL

from ..core.errors import ApiError
from .front import TunnelHandler, error_body, json_answer

log = logging.getLogger(__name__)
# The websockets library's own lines, held at WARNING: at DEBUG it logs every handshake
# header, the agent's credential among them, and at INFO a line per tunnel opened.
_WEBSOCKETS_LOG = logging.getLogger(f"{__name__}.websockets")
_WEBSOCKETS_LOG.setLevel(logging.WARNING)

# One WebSocket message carries one tunnel frame (modelforge_contract.tunnel): its 12-byte
# header and at most 256 KiB of payload. A longer message closes the tunnel (1009).
MAX_MESSAGE_BYTES = MAX_FRAME
# Whole messages the reader thread queues before it stops reading the socket (TCP then
# pushes back on the agent): with MAX_MESSAGE_BYTES, about 4 MiB per tunnel at most.
MAX_QUEUED_MESSAGES = 16
# A handshake answer is a few hundred bytes; a client that will not take it is dropped.
HANDSHAKE_TIMEOUT_SECONDS = 10.0
# A refusal, its answer sent and what the client still sends read and dropped (so that a
# reset does not destroy the answer), takes at most this long in all, however the client
# trickles, and reads at most LINGER_BYTES.
REFUSAL_SECONDS = 2.0
LINGER_BYTES = 64 * 1024

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

    ``send`` may be called from several threads at once (websockets serialises writes,
    holding its connection lock while the socket takes the bytes: a send waiting on an
    agent that does not read holds the other senders, and websockets' reader, until it
    does); ``recv`` from one. Both raise TunnelClosed once the connection is closed.
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
        protocols = request.headers.get_all(HEADER_AGENT_PROTOCOL)
        agent_protocol = protocols[0] if len(protocols) == 1 else None
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
    # websockets gives up on a line past 8 KiB or past 128 headers (SecurityError).
    if isinstance(exc, SecurityError) or isinstance(getattr(exc, "__cause__", None), SecurityError):
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
    deadline = time.monotonic() + REFUSAL_SECONDS
    try:
        sock.settimeout(REFUSAL_SECONDS)  # sendall's timeout is its whole duration
        sock.sendall(answer)
        sock.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < LINGER_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            chunk = sock.recv(16384)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
