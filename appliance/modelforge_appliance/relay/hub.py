"""The hub: every agent's tunnel, and the client streams they carry.

Each agent keeps one outbound tunnel (the control plane never dials a node). A client
request becomes a *stream* on the tunnel of the node that runs the chosen server: OPEN with
the request head, DATA with its body, END; the agent answers HEAD, DATA as the runtime sends
it, END (or RESET). Memory is bounded by credit: an agent sends at most WINDOW_BYTES of a
stream beyond what its client has taken; each chunk the client's connection takes is
granted back (WINDOW). A client that stops reading costs about one window.

A stream outlives its tunnel: when a tunnel drops while the agent lives, the stream waits up
to RESUME_GRACE_SECONDS for the node's next tunnel, which is told (RESUME) how many bytes of
each stream arrived; the agent sends on from there, so the client sees no gap and no
duplicate. A stream whose tunnel does not come back ends with NODE_LINK_LOST.

An agent that stops says so first (RESET of stream 0, TUNNEL_CLOSING): it resumes nothing,
so its node's streams end at once instead of waiting out the grace, and its tunnel takes no
new stream. A stream that ends before its head for a reason of the node's, not the
request's (``may_fail_over``), is one the client route may send to another server.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from modelforge_contract import relay as rel
from modelforge_contract import tunnel as wire
from modelforge_contract.streams import Credit, Incoming, Phase
from modelforge_contract.waking import Waker, running_loop

log = logging.getLogger(__name__)

RESUME_GRACE_SECONDS = 30.0
HEAD_TIMEOUT_SECONDS = 600.0  # a runtime may queue a request this long before answering
KEEPALIVE_SECONDS = 15.0
GRANT_BYTES = 64 * 1024  # credit goes back to the agent in steps of at least this
ENDED_KEPT = 4096  # per node: the streams that ended lately, whose late frames are dropped


class Link(Protocol):
    """One tunnel's connection: a WebSocket on the relay's event loop
    (``runtime/tunnel_websocket.WebSocketLink``) or an HTTP-fallback session
    (``http_link.HttpLink``). It pushes: each whole frame the agent sends goes to
    ``receive`` as it comes, in order, and the end to ``ended``, once. ``send`` and
    ``close`` never wait, from any thread; ``send`` is False once the link is closed.
    ``pause`` and ``resume`` stop and restart reading the agent's frames."""

    def start(self, receive: Callable[[bytes], None], ended: Callable[[str], None]) -> None: ...

    def send(self, data: bytes) -> bool: ...

    def close(self, code: int = 1000, reason: str = "") -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class LinkLost(Exception):
    """The stream's node link is gone: it did not come back in time, or the agent said it
    is going."""


class NoAnswer(LinkLost):
    """The node took the request but gave no head in time. Not sent again: the runtime may
    still be at it."""


class HeadTimeout(NoAnswer):
    """The runtime gave no head within the head deadline (MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS)."""


class BodyIdle(Exception):
    """A body that is not an event stream sent no byte within the idle deadline."""


class StreamLimit(Exception):
    """The node's tunnel carries as many relayed streams as it may."""


class StreamReset(Exception):
    """The agent reset the stream: ``code`` and ``message`` say why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def may_fail_over(failure: Exception) -> bool:
    """Whether a stream that failed before its head may be sent to another server: its
    node's link went for good, or the agent reset it for a reason of the node's
    (``relay.FAILOVER_CODES``), not the request's."""
    if isinstance(failure, StreamReset):
        return failure.code in rel.FAILOVER_CODES
    return isinstance(failure, LinkLost) and not isinstance(failure, NoAnswer)


@dataclass(frozen=True)
class Head:
    status: int
    headers: list[tuple[str, str]]


class Stream:
    """One client request on a node's tunnel, as the control plane sees it."""

    def __init__(self, hub: Hub, stream_id: int, node_id: str, server_id: str) -> None:
        self.hub, self.stream_id, self.node_id, self.server_id = hub, stream_id, node_id, server_id
        self.lock = threading.Lock()
        # The answer as it arrives (the tunnel core: phases, credit, the RESUME's counts);
        # touched only inside the lock.
        self.answer = Incoming()
        self.tunnel: Tunnel | None = None
        self.lost_at: float | None = None
        self.gone = False  # its agent said it is going: no resume will come
        self.closed = False
        # The client's side waits on the relay's event loop: each change wakes it once.
        self._waker: Waker | None = None
        self._woken = False

    def _wake(self) -> None:
        """Inside the lock: tell the waiting client side that something changed (once
        until it looks again, so a burst of frames costs one wake-up)."""
        if self._waker is not None and not self._woken:
            self._woken = True
            self._waker.wake()

    # -- from the tunnel's reader -------------------------------------------------------

    # Each raises FrameError for a frame the stream's phase does not allow, or DATA beyond
    # its credit: the tunnel that sent it is closed.

    def on_head(self, head: Head) -> None:
        with self.lock:
            self.answer.on_head(head)
            self._wake()

    def on_data(self, payload: bytes) -> None:
        with self.lock:
            self.answer.on_data(payload)
            self._wake()

    def on_end(self) -> None:
        with self.lock:
            self.answer.on_end()
            self._wake()

    def on_reset(self, code: str, message: str) -> None:
        with self.lock:
            self.answer.on_reset(code, message)
            self._wake()

    def on_link_lost(self, tunnel: Tunnel) -> None:
        with self.lock:
            if self.tunnel is tunnel:
                self.tunnel, self.lost_at = None, time.monotonic()
                self._wake()

    def on_gone(self) -> None:
        """The node's agent is going (or never got the OPEN): the stream ends now, with
        what already arrived still delivered, and is never resumed."""
        with self.lock:
            self.gone, self.tunnel = True, None
            self._wake()

    def on_link(self, tunnel: Tunnel) -> None:
        with self.lock:
            self.tunnel, self.lost_at = tunnel, None
            self._wake()

    # -- for the client's request -------------------------------------------------------

    def _gone(self) -> bool:
        """Inside the lock: the agent is going, or the link is lost beyond the grace."""
        if self.gone:
            return True
        return self.lost_at is not None and time.monotonic() - self.lost_at > self.hub.grace

    def watch(self) -> None:
        """From now on, wake the calling event loop on each change (call it on that loop,
        before the first ``head_of``)."""
        self._waker = Waker()

    async def _changed(self, timeout: float) -> None:
        """Until something changes, or ``timeout`` seconds."""
        assert self._waker is not None, "watch() first"
        await self._waker.wait(timeout)

    def _waiting_at_most(self, left: float) -> float:
        """Inside the lock: how long to wait for a change, given ``left`` seconds to a
        deadline; a lost link is looked at again once its grace is over."""
        if self.lost_at is not None:
            return min(left, self.lost_at + self.hub.grace - time.monotonic() + 0.01)
        return left

    async def head_of(self, timeout: float) -> Head:
        """The runtime's head. StreamReset, LinkLost (the link went for good), HeadTimeout
        (none within ``timeout`` seconds). (A stream cannot end without one: END before
        HEAD breaks the contract and closes the tunnel.)"""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                self._woken = False
                answer = self.answer
                if answer.head is not None:
                    return answer.head
                if answer.reset is not None:
                    raise StreamReset(*answer.reset)
                if self._gone():
                    raise LinkLost()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HeadTimeout()
                wait = self._waiting_at_most(left)
            await self._changed(wait)

    async def body_of(
        self, keepalive: bytes | None = None, idle: float | None = None
    ) -> AsyncIterator[bytes]:
        """The body as it arrives, what has arrived at each turn in one piece. What the
        client took is granted back to the agent once the next piece is asked for (by then
        the client's socket has taken it), GRANT_BYTES or more at a time. ``keepalive`` is
        yielded after KEEPALIVE_SECONDS without a byte; without it, ``idle`` seconds without
        a byte end the body (BodyIdle)."""
        quiet_since = time.monotonic()
        while True:
            self._grant()
            with self.lock:
                self._woken = False
                data = self.answer.take()
                if not data:
                    if self.answer.reset is not None:
                        raise StreamReset(*self.answer.reset)
                    if self.answer.ended:
                        return
                    if self._gone():
                        raise LinkLost()
                    quiet = time.monotonic() - quiet_since
                    if keepalive is not None:
                        if quiet >= self.hub.keepalive:
                            data = keepalive
                        left = self.hub.keepalive - quiet
                    elif idle is not None:
                        if quiet >= idle:
                            raise BodyIdle()
                        left = idle - quiet
                    else:
                        left = self.hub.keepalive
                    wait = self._waiting_at_most(left)
            if data:
                quiet_since = time.monotonic()
                yield data
            else:
                await self._changed(wait)

    def _grant(self) -> None:
        """Give the agent back the credit of what the client took, once that is at least
        GRANT_BYTES: a WINDOW per 64 KiB, not per SSE event. The agent is never held by
        it: while it waits for credit, buffered + ungranted is a whole window, so the
        client takes what is buffered and the grant follows. Nothing once all arrived."""
        with self.lock:
            if self.tunnel is None:
                return
            count = self.answer.grant(GRANT_BYTES)
            tunnel = self.tunnel
        if count:
            tunnel.send(wire.window_frame(self.stream_id, count))

    def close(self) -> None:
        """The client is done (or went away): a stream still running is reset on the node,
        so its runtime stops generating."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            running = self.answer.phase in (Phase.AWAITING_HEAD, Phase.BODY)
            tunnel = self.tunnel
        if running and tunnel is not None:
            tunnel.send(
                wire.reset_frame(self.stream_id, rel.STREAM_CANCELLED, "the client went away")
            )
        self.hub.forget(self)


class LinkRefused(Exception):
    """A LINK the control plane will not splice; the message says why (no secret)."""


class LinkEnd:
    """One side of a spliced link (a model split across nodes): the stream on one node's
    tunnel, the credit that node still has toward the other (the other side's grants,
    passed on as they come: the hub keeps no bytes), and the other side."""

    __slots__ = ("credit", "ended", "peer", "stream_id", "tunnel")

    def __init__(self, tunnel: Tunnel, stream_id: int) -> None:
        self.tunnel, self.stream_id = tunnel, stream_id
        self.credit = Credit()  # what this side may still send toward the other
        self.ended = False  # this side sent END: it sends no more DATA
        self.peer: LinkEnd | None = None


# authorize(node_id, server_id, peer_server_id) -> the peer's node id, or LinkRefused
LinkAuthority = Callable[[str, str, str], str]


@dataclass(frozen=True)
class LinkRequest:
    """An agent's LINK, as checked: its node, the stream id it chose, its own server and
    the helper's server it dials."""

    node_id: str
    stream_id: int
    server_id: str
    peer_server_id: str


def _no_links(node_id: str, server_id: str, peer_server_id: str) -> str:
    raise LinkRefused("this control plane splices no links")


class Tunnel:
    """One agent's tunnel: its link, the streams it carries. No thread is the tunnel's: its
    link hands each frame over as it comes (on the relay's event loop for a WebSocket, on
    an upload's thread for the HTTP fallback) and takes frames to send without waiting."""

    def __init__(self, hub: Hub, node_id: str, link: Link, credential_id: str | None) -> None:
        self.hub, self.node_id, self.link = hub, node_id, link
        self.credential_id = credential_id  # what opened it: its revocation closes it
        self.send_lock = threading.Lock()
        self.open = True
        # Frames that came while a LINK is authorized (a store call, off the loop): read
        # again, in order, once it is decided. None: none held.
        self._held: collections.deque[bytes] | None = None
        self._failed = False

    def send(self, frame: wire.Frame) -> bool:
        """Send ``frame`` (never waits). False when the tunnel is closed, or closes now:
        the agent stopped reading it."""
        data = wire.encode(frame)
        with self.send_lock:
            if not self.open:
                return False
        if not self.link.send(data):
            self.shut()
            return False
        return True

    def shut(self, code: int = 1011, reason: str = "") -> None:
        """Stop sending and close the link (its end then unregisters the tunnel). Never
        waits: the agent has the link's close timeout to answer."""
        with self.send_lock:
            was_open, self.open = self.open, False
        if was_open:
            self.link.close(code, reason)

    def start(self, then: Callable[[], None] | None = None) -> None:
        """A pushing link: take its frames from now on; once it ends, the tunnel is
        unregistered, then ``then`` runs."""

        def ended(reason: str) -> None:
            self.hub.unregister(self, reason)
            if then is not None:
                then()

        self.link.start(self._pushed, ended)

    def _pushed(self, data: bytes) -> None:
        """A pushing link's next frame: on the loop (a WebSocket), or on an upload's thread
        (the HTTP fallback, one upload at a time)."""
        if self._failed:
            return
        if self._held is not None:
            self._held.append(data)
            return
        self.receive(data)

    def receive(self, data: bytes) -> None:
        """One frame from the agent. One that breaks the contract closes the tunnel (1002),
        and the frames after it are dropped."""
        try:
            frame = wire.decode(data)
            if frame.type == wire.LINK and running_loop() is not None:
                self._authorize(frame)
            else:
                self._dispatch(frame)
        except wire.FrameError as bad:
            log.warning("tunnel of node %s closed: %s", self.node_id, bad)
            self._failed = True
            self.hub.metrics_protocol_error()
            self.shut(1002, "protocol error")

    def _authorize(self, frame: wire.Frame) -> None:
        """A LINK on the loop: the store is asked on a store thread, and this tunnel's
        frames after it wait (reading paused) until it is decided, so none overtakes it.
        (Off a loop, an upload's thread asks the store itself.)"""
        request = self.hub.link_request(self, frame)
        self._held = collections.deque()
        self.link.pause()
        loop = asyncio.get_running_loop()
        decided = loop.run_in_executor(None, self.hub.authorized, request)
        decided.add_done_callback(lambda outcome: self._decided(request, outcome))

    def _decided(self, request: LinkRequest, outcome: asyncio.Future[str | LinkRefused]) -> None:
        try:
            answer: str | LinkRefused = outcome.result()
        except Exception as exc:  # the store is away: refused, the agent dials again
            log.warning("could not authorize a link of node %s: %s", self.node_id,
                        type(exc).__name__)  # fmt: skip
            answer = LinkRefused("the control plane could not look it up")
        self.hub.splice(self, request, answer)
        held, self._held = self._held, None
        while held and self._held is None and not self._failed:
            self.receive(held.popleft())
        if held and self._held is not None:  # another LINK: the rest wait behind it again
            self._held.extendleft(reversed(held))
        elif not self._failed:
            self.link.resume()

    def _dispatch(self, frame: wire.Frame) -> None:
        kind = frame.type
        if kind == wire.PING:
            self.send(wire.Frame(wire.PONG, 0, frame.payload))
            return
        if kind in (wire.PONG,):
            return
        if kind == wire.RESET and frame.stream_id == 0:
            value = wire.json_of(frame)
            self.hub.going(self, str(value.get("code") or "RESET")[:64])
            return
        if kind == wire.LINK:
            request = self.hub.link_request(self, frame)
            self.hub.splice(self, request, self.hub.authorized(request))
            return
        if self.hub.on_link_frame(self, frame):
            return
        stream = self.hub.stream(frame.stream_id)
        if stream is None or stream.node_id != self.node_id:
            if stream is None and self.hub.ended_here(self.node_id, frame.stream_id):
                # This node's stream that ended here meanwhile (its client went away): the
                # agent's frames in flight for it are dropped, and a RESET tells it.
                if kind != wire.RESET:
                    self.send(
                        wire.reset_frame(frame.stream_id, rel.STREAM_CANCELLED, "the stream ended")
                    )
                return
            raise wire.FrameError(f"{kind.name} for stream {frame.stream_id}, not this node's")
        if kind == wire.HEAD:
            value = wire.json_of(frame)
            status = value.get("status")
            headers = value.get("headers")
            if not isinstance(status, int) or not isinstance(headers, list):
                raise wire.FrameError("HEAD needs status and headers")
            pairs = [
                (str(h[0]), str(h[1]))
                for h in headers
                if isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)
            ]
            stream.on_head(Head(status, pairs))
            if frame.end_stream:  # no body follows
                stream.on_end()
        elif kind == wire.DATA:
            stream.on_data(frame.payload)
            if frame.end_stream:
                stream.on_end()
        elif kind == wire.END:
            stream.on_end()
        elif kind == wire.RESET:
            value = wire.json_of(frame)
            stream.on_reset(
                str(value.get("code") or "RESET")[:64], str(value.get("message") or "")[:500]
            )
        else:
            raise wire.FrameError(f"frame type {kind} is not one an agent sends")


class Hub:
    """Every tunnel of this control-plane process and the streams on them."""

    def __init__(
        self,
        grace: float = RESUME_GRACE_SECONDS,
        keepalive: float = KEEPALIVE_SECONDS,
        max_streams: int = wire.MAX_STREAMS_PER_TUNNEL,
        on_protocol_error: Callable[[], None] | None = None,
        authorize_link: LinkAuthority = _no_links,
    ) -> None:
        # The relay's own bounds (in all, per key, per deployment) are shares.Shares'; the
        # hub keeps only the tunnel's, which no agent may be asked past.
        self.grace, self.keepalive, self.max_streams = grace, keepalive, max_streams
        self._lock = threading.Lock()
        self._tunnels: dict[str, Tunnel] = {}
        # Each node's tunnels until their reader ends: the live one and those closing.
        self._held: collections.Counter[str] = collections.Counter()
        self._streams: dict[int, Stream] = {}
        self._carried: collections.Counter[str] = collections.Counter()  # streams by node
        self._ids = itertools.count(1)
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._turns = itertools.count()  # routing takes turns among equally loaded servers
        # The streams that ended lately, by node (bounded): frames still in flight for one
        # are dropped; a frame for a stream the node never had closes its tunnel.
        self._ended: dict[str, collections.deque[int]] = {}
        self._on_protocol_error = on_protocol_error or (lambda: None)
        # Spliced links (a model split across nodes), by (node id, stream id) of each side.
        self._links: dict[tuple[str, int], LinkEnd] = {}
        self.authorize_link = authorize_link
        # Bytes the links carried, from the main nodes to their helpers and back.
        self.link_bytes = {"to_helpers": 0, "from_helpers": 0}
        self.link_frames = {"to_helpers": 0, "from_helpers": 0}  # DATA frames, likewise

    def metrics_protocol_error(self) -> None:
        self._on_protocol_error()

    # -- tunnels ------------------------------------------------------------------------

    def register(self, node_id: str, link: Link, credential_id: str | None = None) -> Tunnel:
        """The node's new tunnel, opened with ``credential_id`` (its old one, if any, is
        closed); the streams waiting for the node are resumed on it."""
        tunnel = Tunnel(self, node_id, link, credential_id)
        with self._lock:
            old = self._tunnels.get(node_id)
            self._tunnels[node_id] = tunnel
            self._held[node_id] += 1
            waiting = [s for s in self._streams.values() if s.node_id == node_id]
        if old is not None:
            old.shut(1000, "replaced by a newer tunnel")
        entries = []
        for stream in list(waiting):
            with stream.lock:
                if stream.gone:  # ended when its agent went: nothing to resume
                    waiting.remove(stream)
                    continue
                # The RESUME says what the client took: credit starts again from there
                # (taken after this, it is granted on the new tunnel, after the RESUME).
                entries.append(stream.answer.resume_entry(stream.stream_id))
        tunnel.send(wire.Frame(wire.RESUME, 0, json.dumps({"streams": entries}).encode()))
        for stream in waiting:
            stream.on_link(tunnel)
        log.info("node %s: tunnel up (%d stream(s) resumed)", node_id, len(waiting))
        return tunnel

    def unregister(self, tunnel: Tunnel, reason: str) -> None:
        with self._lock:
            if self._tunnels.get(tunnel.node_id) is tunnel:
                del self._tunnels[tunnel.node_id]
            self._held[tunnel.node_id] -= 1
            if self._held[tunnel.node_id] <= 0:
                del self._held[tunnel.node_id]
            streams = [s for s in self._streams.values() if s.tunnel is tunnel]
        tunnel.shut(1000, reason[:100])
        self._drop_links(tunnel, rel.NODE_LINK_LOST, "the other node's tunnel went away")
        for stream in streams:
            stream.on_link_lost(tunnel)
        log.info("node %s: tunnel down (%s; %d stream(s) waiting)", tunnel.node_id, reason,
                 len(streams))  # fmt: skip

    def going(self, tunnel: Tunnel, code: str, why: str = "its agent is going") -> None:
        """The agent on ``tunnel`` said it is going (RESET of stream 0), or its credential
        stopped being valid: it takes no new stream, and every stream of its node ends now,
        not after the resume grace."""
        node_id = tunnel.node_id
        with self._lock:
            # The node's tunnel: each stream of the node rides it or waits for it. One a
            # newer tunnel replaced speaks only for what it still carries.
            current = self._tunnels.get(node_id) is tunnel
            if current:
                del self._tunnels[node_id]
            streams = [
                s
                for s in self._streams.values()
                if s.tunnel is tunnel or (current and s.node_id == node_id)
            ]
        for stream in streams:
            stream.on_gone()
        self._drop_links(tunnel, rel.NODE_LINK_LOST, "the other node's agent is going")
        tunnel.shut(1000, why[:100])  # it closes next; nothing more to carry
        log.info("node %s: %s (%s); %d stream(s) ended", node_id, why, code,
                 len(streams))  # fmt: skip

    def tunnels_by_credential(self) -> dict[str, Tunnel]:
        """The live tunnels, by the credential that opened each."""
        with self._lock:
            return {t.credential_id: t for t in self._tunnels.values() if t.credential_id}

    def tunnels_held(self, node_id: str) -> int:
        """The node's tunnels whose reader still runs: its live one and those closing."""
        with self._lock:
            return self._held[node_id]

    def connected(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._tunnels

    # -- streams ------------------------------------------------------------------------

    def stream(self, stream_id: int) -> Stream | None:
        with self._lock:
            return self._streams.get(stream_id)

    def in_flight(self, server_id: str) -> int:
        with self._lock:
            return self._in_flight[server_id]

    def next_turn(self) -> int:
        """A number that grows with each call: whose turn it is among equals."""
        with self._lock:
            return next(self._turns)

    def open(
        self,
        node_id: str,
        server_id: str,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Stream | None:
        """A new stream to the server on the node's tunnel; None when the node has no
        tunnel here. StreamLimit when the node's tunnel carries its cap."""
        with self._lock:
            tunnel = self._tunnels.get(node_id)
            if tunnel is None:
                return None
            if self._carried[node_id] >= self.max_streams:
                raise StreamLimit()
            stream = Stream(self, next(self._ids), node_id, server_id)
            stream.tunnel = tunnel
            self._streams[stream.stream_id] = stream
            self._carried[node_id] += 1
            self._in_flight[server_id] += 1
        # The request's end rides on its last frame (OPEN when there is no body). A client
        # header the frame cannot carry is left out: the agent would close the tunnel.
        carried = wire.carried_headers(headers)
        sent = tunnel.send(
            wire.open_frame(stream.stream_id, server_id, method, path, carried, end_stream=not body)
        )
        if not sent:  # the tunnel is closing: the agent never gets it, no resume could help
            stream.on_gone()
            return stream
        if body:
            for frame in wire.data_frames(stream.stream_id, body, end_stream=True):
                tunnel.send(frame)
        return stream

    def _remember_ended(self, node_id: str, stream_id: int) -> None:
        """Inside the lock: a stream (or link side) of the node ended here; frames the agent
        still sends for it are dropped, not a protocol error."""
        ended = self._ended.setdefault(node_id, collections.deque(maxlen=ENDED_KEPT))
        ended.append(stream_id)

    def ended_here(self, node_id: str, stream_id: int) -> bool:
        with self._lock:
            return stream_id in self._ended.get(node_id, ())

    def forget(self, stream: Stream) -> None:
        with self._lock:
            self._remember_ended(stream.node_id, stream.stream_id)
            if self._streams.pop(stream.stream_id, None) is stream:
                self._carried[stream.node_id] -= 1
                if self._carried[stream.node_id] <= 0:
                    del self._carried[stream.node_id]
                self._in_flight[stream.server_id] -= 1
                if self._in_flight[stream.server_id] <= 0:
                    del self._in_flight[stream.server_id]

    # -- links (a model split across nodes) -------------------------------------------------

    def link_request(self, tunnel: Tunnel, frame: wire.Frame) -> LinkRequest:
        """An agent's LINK (its main server dials a helper), checked against the contract;
        FrameError when it breaks it."""
        value = wire.json_of(frame)
        stream_id = frame.stream_id
        if not wire.is_link_id(stream_id):
            raise wire.FrameError(f"LINK on stream {stream_id}, an id the agent may not choose")
        peer_server = value.get("peer_server_id")
        if peer_server is None:
            raise wire.FrameError("LINK from an agent names no peer_server_id")
        with self._lock:
            if (tunnel.node_id, stream_id) in self._links:
                raise wire.FrameError(f"LINK for stream {stream_id}, a link that exists")
        return LinkRequest(tunnel.node_id, stream_id, str(value.get("server_id")), str(peer_server))

    def authorized(self, request: LinkRequest) -> str | LinkRefused:
        """``authorize_link``'s answer (a store call: off the loop): the helper's node id,
        or why not."""
        try:
            return self.authorize_link(request.node_id, request.server_id, request.peer_server_id)
        except LinkRefused as refused:
            return refused

    def splice(self, tunnel: Tunnel, request: LinkRequest, answer: str | LinkRefused) -> None:
        """The LINK spliced to a new stream on the helper node's tunnel when ``answer`` is a
        node id; else RESET LINK_REFUSED."""
        stream_id, peer_server = request.stream_id, request.peer_server_id
        if isinstance(answer, LinkRefused):
            log.warning("node %s: link to server %s refused: %s", tunnel.node_id, peer_server,
                        answer)  # fmt: skip
            tunnel.send(wire.reset_frame(stream_id, rel.LINK_REFUSED, str(answer)))
            return
        peer_node = answer
        here: LinkEnd | None = None
        with self._lock:
            peer_tunnel = self._tunnels.get(peer_node)
            if peer_tunnel is not None and peer_tunnel.open and tunnel.open:
                here, there = LinkEnd(tunnel, stream_id), LinkEnd(peer_tunnel, next(self._ids))
                here.peer, there.peer = there, here
                self._links[(tunnel.node_id, stream_id)] = here
                self._links[(peer_node, there.stream_id)] = there
        if peer_tunnel is None or here is None:
            tunnel.send(wire.reset_frame(stream_id, rel.LINK_REFUSED, "the helper's node is away"))
            return
        if not peer_tunnel.send(wire.link_frame(there.stream_id, peer_server)):
            self._end_link(here, rel.NODE_LINK_LOST, "the helper's node is away")
            return
        log.info("node %s: link %d to server %s on node %s", tunnel.node_id, stream_id,
                 peer_server, peer_node)  # fmt: skip

    def on_link_frame(self, tunnel: Tunnel, frame: wire.Frame) -> bool:
        """A frame of a spliced link, passed on to the other side; False when the frame is
        not a link's. DATA beyond the sender's credit is a protocol error."""
        with self._lock:
            end = self._links.get((tunnel.node_id, frame.stream_id))
        if end is None or end.tunnel is not tunnel:
            if not wire.is_link_id(frame.stream_id):
                return False
            if frame.type != wire.RESET:  # a link that ended here meanwhile
                tunnel.send(wire.reset_frame(frame.stream_id, "STREAM_UNKNOWN", "no such link"))
            return True
        peer = end.peer
        assert peer is not None
        kind = frame.type
        if kind == wire.DATA:
            with self._lock:
                end.credit.spend(len(frame.payload))  # FrameError beyond it
                # The main node's side is the one whose id it chose (LINK_STREAM_BIT).
                way = "to_helpers" if wire.is_link_id(end.stream_id) else "from_helpers"
                self.link_bytes[way] += len(frame.payload)
                self.link_frames[way] += 1
            peer.tunnel.send(
                wire.data_frame(peer.stream_id, frame.payload, end_stream=frame.end_stream)
            )
            if frame.end_stream:
                self._link_ended(end)
        elif kind == wire.WINDOW:
            increment = wire.window_of(frame)
            with self._lock:
                peer.credit.give(increment)  # this side took it: the other may send again
            peer.tunnel.send(wire.window_frame(peer.stream_id, increment))
        elif kind == wire.END:
            peer.tunnel.send(wire.end_frame(peer.stream_id))
            self._link_ended(end)
        elif kind == wire.RESET:
            value = wire.json_of(frame)
            self._end_link(
                end, str(value.get("code") or "RESET")[:64], str(value.get("message") or "")[:500]
            )
        else:
            raise wire.FrameError(f"{kind.name} on a link")
        return True

    def _link_ended(self, end: LinkEnd) -> None:
        """One side sent END; once both have, the link is over and forgotten."""
        with self._lock:
            end.ended = True
            over = end.peer is not None and end.peer.ended
        if over:
            self._forget_link(end)

    def _forget_link(self, end: LinkEnd) -> None:
        with self._lock:
            # Frames either agent still sends for it are late, not a protocol error.
            for side in (end, end.peer):
                if side is None:
                    continue
                if self._links.pop((side.tunnel.node_id, side.stream_id), None) is not None:
                    self._remember_ended(side.tunnel.node_id, side.stream_id)

    def _end_link(self, end: LinkEnd, code: str, message: str) -> None:
        """Forget both sides; the other side is told with RESET (this side said it, or its
        tunnel is gone)."""
        peer = end.peer
        self._forget_link(end)
        if peer is not None:
            peer.tunnel.send(wire.reset_frame(peer.stream_id, code, message))

    def _drop_links(self, tunnel: Tunnel, code: str, message: str) -> None:
        with self._lock:
            ends = [end for end in self._links.values() if end.tunnel is tunnel]
        for end in ends:
            self._end_link(end, code, message)

    def links(self) -> int:
        """Links spliced now (each counted once)."""
        with self._lock:
            return len(self._links) // 2

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tunnels": len(self._tunnels),
                "streams": len(self._streams),
                "buffered_bytes": sum(s.answer.buffered for s in self._streams.values()),
            }
