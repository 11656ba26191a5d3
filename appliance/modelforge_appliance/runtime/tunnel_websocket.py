"""The WebSocket on a tunnel connection the front handed over (front.py), on the relay's
event loop: no thread per tunnel.

``websocket_tunnel(accept, serve)`` is the handler the relay registers on the front: the
opening handshake with the ``websockets`` library's sans-I/O server (compression never
agreed, the subprotocol ``modelforge.tunnel.v1`` chosen when offered, messages bounded to
one tunnel frame), ``accept(headers)`` on a store thread to refuse before the upgrade
completes, then ``serve(link, admission)`` on the loop with a ``WebSocketLink``: whole
binary messages pushed to the hub as they arrive, and sent from any thread without waiting.
Every refusal is a plain HTTP answer in the one error shape, with ``compatibility`` as on
every agent answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from websockets.datastructures import Headers, MultipleValuesError
from websockets.exceptions import SecurityError
from websockets.frames import OP_BINARY, OP_CONT, OP_TEXT
from websockets.http11 import Request
from websockets.protocol import OPEN
from websockets.server import ServerProtocol

from modelforge_contract import (
    HEADER_AGENT_PROTOCOL,
    HEADERS_TOO_LARGE,
    INTERNAL_ERROR,
    REQUEST_MALFORMED,
    TUNNEL_UPGRADE_REQUIRED,
)
from modelforge_contract.tunnel import MAX_FRAME, TUNNEL_SUBPROTOCOL

from ..core.errors import ApiError
from .front import error_body, json_answer

log = logging.getLogger(__name__)
# The websockets library's own lines, held at WARNING: at DEBUG it logs every handshake
# header, the agent's credential among them, and at INFO a line per tunnel opened.
_WEBSOCKETS_LOG = logging.getLogger(f"{__name__}.websockets")
_WEBSOCKETS_LOG.setLevel(logging.WARNING)

# One WebSocket message carries one tunnel frame (modelforge_contract.tunnel): its 12-byte
# header and at most 256 KiB of payload. A longer message closes the tunnel (1009).
MAX_MESSAGE_BYTES = MAX_FRAME
# What the loop holds unsent for one agent before it looks at how long the agent takes to
# read: above UNSENT_HIGH_BYTES for SEND_TIMEOUT_SECONDS, or above UNSENT_MAX_BYTES at
# all, the agent stopped reading and its tunnel is closed.
UNSENT_HIGH_BYTES = 4 * 1024 * 1024
UNSENT_MAX_BYTES = 64 * 1024 * 1024
SEND_TIMEOUT_SECONDS = 10.0
# A refusal, its answer sent and what the client still sends read and dropped (so that a
# reset does not destroy the answer), takes at most this long in all, however the client
# trickles, and reads at most LINGER_BYTES.
REFUSAL_SECONDS = 2.0
LINGER_BYTES = 64 * 1024

# accept(headers), on a store thread: what serve needs to know of the tunnel (the node it
# is, for the relay), or an ApiError raised, which refuses it with that status and body
# (``retry_after_seconds`` in the body becomes Retry-After).
Accept = Callable[[Headers], Any]


class WebSocketLink(asyncio.Protocol):
    """One agent's tunnel after the upgrade, on the loop: a hub link that pushes.

    ``start(receive, ended)`` once, on the loop: from then on ``receive(message)`` gets each
    whole binary message in order (what arrived before is given first), and
    ``ended(reason)`` once when the connection is gone. ``send`` and ``close`` may be called
    from any thread and never wait: off the loop they are handed to it. ``pause`` and
    ``resume`` stop and restart reading (TCP then pushes back on the agent).
    """

    pushes = True

    def __init__(
        self,
        protocol: ServerProtocol,
        headers: Headers,
        peer: tuple,
        loop: asyncio.AbstractEventLoop,
        close_timeout: float,
    ) -> None:
        self.protocol, self.headers, self.peer, self.loop = protocol, headers, peer, loop
        self.close_timeout = close_timeout
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        self.close_code: int | None = None  # the close frame's code, once one came or went
        self.open = True
        self._thread = threading.get_ident()  # the loop's
        self._receive: Callable[[bytes], None] | None = None
        self._ended: Callable[[str], None] | None = None
        self._early: list[bytes] = []
        self._parts: list[bytes] = []  # a fragmented message so far
        self._stall: asyncio.TimerHandle | None = None
        self._closing: asyncio.TimerHandle | None = None

    # -- asyncio's side -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=UNSENT_HIGH_BYTES)
        self._flush()  # the handshake's answer

    def data_received(self, data: bytes) -> None:
        self.protocol.receive_data(data)
        for frame in self.protocol.events_received():
            if frame.opcode == OP_TEXT:
                self._fail(1003, "binary messages only")
                return
            if frame.opcode == OP_BINARY or frame.opcode == OP_CONT:
                self._parts.append(frame.data)
                if frame.fin:
                    message = b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
                    self._parts = []
                    self._deliver(message)
        self._flush()

    def eof_received(self) -> bool:
        self.protocol.receive_eof()
        self._flush()
        return False  # asyncio closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        for timer in (self._stall, self._closing):
            if timer is not None:
                timer.cancel()
        close = self.protocol.close_rcvd or self.protocol.close_sent
        if close is not None:
            self.close_code = close.code
        elif self.close_code is None:
            self.close_code = 1006  # the connection just broke
        ended, self._ended = self._ended, None
        if ended is not None:
            ended(f"closed ({self.close_code})")
        if not self.done.done():
            self.done.set_result(None)

    def pause_writing(self) -> None:
        """More than UNSENT_HIGH_BYTES wait for the agent: it has SEND_TIMEOUT_SECONDS to
        take them."""
        if self._stall is None:
            self._stall = self.loop.call_later(SEND_TIMEOUT_SECONDS, self._stalled)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    # -- the hub's side -------------------------------------------------------------------

    def start(self, receive: Callable[[bytes], None], ended: Callable[[str], None]) -> None:
        """On the loop: push messages to ``receive`` from now on, and the end to ``ended``."""
        self._receive, self._ended = receive, ended
        early, self._early = self._early, []
        for message in early:
            self._deliver(message)
        if not self.open:
            self._ended = None
            ended(f"closed ({self.close_code})")

    def send(self, data: bytes) -> bool:
        """Send one message (never waits); False once the link is closed."""
        if not self.open:
            return False
        if threading.get_ident() != self._thread:
            self.loop.call_soon_threadsafe(self._send, data)
            return True
        return self._send(data)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close with ``code`` and ``reason``: the agent has ``close_timeout`` seconds to
        answer before the connection is dropped. Never waits."""
        if threading.get_ident() != self._thread:
            if self.open:
                self.loop.call_soon_threadsafe(self.close, code, reason)
            return
        if not self.open or self.protocol.state is not OPEN:
            return
        self.protocol.send_close(code, reason)
        self._flush()
        if self.transport is not None and self._closing is None:
            self._closing = self.loop.call_later(self.close_timeout, self.transport.abort)

    def pause(self) -> None:
        if self.transport is not None and self.open:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.open:
            self.transport.resume_reading()

    # -- inside ---------------------------------------------------------------------------

    def _deliver(self, message: bytes) -> None:
        if self._receive is None:
            self._early.append(message)
        elif self.open:
            self._receive(message)

    def _send(self, data: bytes) -> bool:
        if not self.open or self.protocol.state is not OPEN:
            return False
        self.protocol.send_binary(data)
        self._flush()
        return self.open

    def _flush(self) -> None:
        transport = self.transport
        if transport is None:
            return
        for chunk in self.protocol.data_to_send():
            if chunk:
                transport.write(chunk)
            else:  # the end: a server closes the TCP connection once its buffer is out
                transport.close()
                return
        if transport.get_write_buffer_size() > UNSENT_MAX_BYTES:
            self._stalled()

    def _fail(self, code: int, reason: str) -> None:
        self.protocol.fail(code, reason)
        self._flush()

    def _stalled(self) -> None:
        log.warning("the tunnel from %s closed: the agent stopped reading it",
                    self.peer[0] if self.peer else "?")  # fmt: skip
        self.close_code = 1011
        if self.transport is not None:
            self.transport.abort()


def websocket_tunnel(
    accept: Accept,
    serve: Callable[[WebSocketLink, Any], None],
    *,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    close_timeout: float = 10.0,
) -> Callable[[socket.socket, bytes, tuple], Awaitable[None]]:
    """The handler (a coroutine, run on the relay's loop) that upgrades a tunnel request to
    a WebSocket and serves it.

    ``accept(headers)`` runs on the loop's store threads before the upgrade completes, so a
    refusal is a plain HTTP answer; ``serve(link, admission)`` runs on the loop with what
    accept returned, must not wait, and starts the link; the handler returns once the
    connection is closed. A request that is no valid WebSocket upgrade is answered 426 or
    400 in the one error shape. No compression (permessage-deflate costs memory and CPU per
    connection, and most of what a tunnel carries is already compact); the subprotocol
    ``modelforge.tunnel.v1`` is chosen when offered; liveness is the agent's pings and the
    tunnel's own PING frames.
    """

    async def handler(sock: socket.socket, head: bytes, peer: tuple) -> None:
        loop = asyncio.get_running_loop()
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
            await refuse(sock, _unparsed(protocol.handshake_exc))
            return
        protocols = request.headers.get_all(HEADER_AGENT_PROTOCOL)
        agent_protocol = protocols[0] if len(protocols) == 1 else None
        response = protocol.accept(request)
        if response.status_code != 101:
            await refuse(sock, _not_an_upgrade(response.status_code, agent_protocol))
            return
        refusal: bytes | None = None
        try:
            admission = await loop.run_in_executor(None, accept, request.headers)
        except ApiError as error:
            body = error.body()
            retry = body.get("retry_after_seconds")
            extra = [("Retry-After", str(retry))] if retry is not None else []
            refusal = json_answer(error.status, body, extra)
        except MultipleValuesError:  # Headers.get of a header sent twice (Authorization…)
            refusal = json_answer(400, _duplicate_header_body(agent_protocol))
        except Exception as exc:
            log.error("the tunnel's accept failed: %s", type(exc).__name__, exc_info=True)
            refusal = _not_an_upgrade(500, agent_protocol)
        if refusal is not None:
            await refuse(sock, refusal)
            return
        protocol.send_response(response)
        link = WebSocketLink(protocol, request.headers, peer, loop, close_timeout)
        sock.setblocking(False)
        await loop.connect_accepted_socket(lambda: link, sock)
        try:
            serve(link, admission)
        except Exception:
            link.close(1011, "internal error")
            raise
        finally:
            await link.done

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


class _Refusal(asyncio.Protocol):
    """Sends one answer, then reads and drops what the client still sends (so that a reset
    does not destroy the answer before the client reads it), REFUSAL_SECONDS in all."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.drained = 0
        self.done = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_SECONDS, transport.abort)
        transport.write(self.answer)
        transport.write_eof()

    def data_received(self, data: bytes) -> None:
        self.drained += len(data)
        if self.drained >= LINGER_BYTES and self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.done.done():
            self.done.set_result(None)


async def refuse(sock: socket.socket, answer: bytes) -> None:
    """Answer ``answer`` on ``sock`` and close it, REFUSAL_SECONDS at most in all, however
    the client reads or trickles."""
    sock.setblocking(False)
    refusal = _Refusal(answer)
    await asyncio.get_running_loop().connect_accepted_socket(lambda: refusal, sock)
    await refusal.done
