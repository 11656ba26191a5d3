"""The agent's tunnel (issue 26): one outbound WebSocket to the control plane that carries
every client request for this node's servers. The control plane never dials a node.

The control plane opens a stream per request (OPEN, the body in DATA, END); the agent sends
it to the server's runtime on 127.0.0.1, and answers HEAD and the body as it comes, with
every filesystem path of this node replaced by the deployment's name (an SSE event at a
time, or the whole JSON body with Content-Length fixed). It sends at most WINDOW_BYTES of a
stream beyond what the control plane granted back, and keeps exactly those bytes: when the
tunnel drops, the runtime's connection is kept for RESUME_GRACE_SECONDS, and the next
tunnel's RESUME says where each stream's client is, so it goes on with no gap and no
duplicate. A RESET (the client went away) closes the runtime's connection: it stops
generating. Only servers this agent runs are reached, and only the relayed routes. Each
stream is a task on one event loop (relayed.py), not a thread of its own.

An agent that stops says so on the tunnel before it closes it (RESET of stream 0,
TUNNEL_CLOSING): the control plane ends this node's streams at once, sending those not yet
answered to another server, instead of holding them for a resume that will not come. From
then on it starts no stream, and its own streams' runtime connections are closed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from modelforge_contract import HEADER_AGENT_PROTOCOL, HEADER_AUTHORIZATION, PROTOCOL_VERSION
from modelforge_contract import relay as rel
from modelforge_contract import tunnel as wire

from . import __version__, transport
from .backoff import BACKOFF_STEPS, Backoff, seconds
from .links import LinkPump
from .relayed import READ_CHUNK, AgentStream, RuntimeConnections, StreamLoop
from .settings import AgentSettings

log = logging.getLogger(__name__)

RESUME_GRACE_SECONDS = 30.0
CONNECT_TIMEOUT = 10.0
# The HTTP fallback: the download carries a PING every 15 s, so one silent for this long is
# dead; uploads go in batches of at most UPLOAD_BATCH_BYTES (under MODELFORGE_MAX_BODY_BYTES).
DOWNLOAD_READ_TIMEOUT = 60.0
UPLOAD_BATCH_BYTES = 512 * 1024
UPLOAD_QUEUE_FRAMES = 256
UPLOAD_BLOCK_SECONDS = 5.0
# Stopping: how long the last frames (the RESET of stream 0) may take to go out.
GOING_AWAY_SECONDS = 3.0
# A refusal of the upgrade that says WebSocket is blocked (a proxy's, not the control
# plane's own error): auto then uses the HTTP fallback.
WEBSOCKET_BLOCKED_STATUSES = frozenset({400, 403, 404, 405, 426, 501})


def tunnel_url(control_plane_url: str) -> str:
    parts = urlsplit(control_plane_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return f"{scheme}://{parts.netloc}{wire.PATH_AGENT_TUNNEL}"


def tls_context(settings: AgentSettings) -> ssl.SSLContext | None:
    """The agent's TLS settings, exactly as its other calls use them."""
    if not (settings.control_plane_url or "").startswith("https://"):
        return None
    verify = settings.tls_verify_value
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # MODELFORGE_AGENT_TLS_VERIFY=false, warned at start
        return context
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return ssl.create_default_context()


class TunnelRefused(Exception):
    """The control plane refused the HTTP tunnel's download (``response.status_code``)."""

    def __init__(self, response: Any) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


class HttpLink:
    """The HTTP fallback's link, with a WebSocket's ``send``/``recv``/``close``.

    ``recv`` reads the control plane's frames from the streamed ``GET …/tunnel/down``;
    ``send`` queues a frame (bounded: a queue full for UPLOAD_BLOCK_SECONDS closes the link)
    that a sender thread POSTs to ``…/tunnel/up`` with whatever else is queued, a POST per
    batch. Both go through ``transport.make_session``, so the agent's TLS settings and its
    pinned host address apply exactly as to its other calls. A failed upload closes the
    link: the next tunnel's RESUME says where each stream goes on.
    """

    def __init__(self, settings: AgentSettings, credential: str | None) -> None:
        self.base = settings.require_control_plane().rstrip("/")
        self.headers = {
            HEADER_AUTHORIZATION: f"Bearer {credential}",
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "User-Agent": f"modelforge-node-agent/{__version__}",
        }
        self.session = transport.make_session(settings)
        self.uploads = transport.make_session(settings)  # its own connection
        response = self.session.get(
            self.base + wire.PATH_AGENT_TUNNEL_DOWN,
            headers=self.headers,
            stream=True,
            timeout=(CONNECT_TIMEOUT, DOWNLOAD_READ_TIMEOUT),
        )
        session_id = response.headers.get(wire.HEADER_TUNNEL_SESSION)
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        if response.status_code != 200 or not session_id or media_type != wire.TUNNEL_MEDIA_TYPE:
            response.close()
            raise TunnelRefused(response)
        self.response, self.session_id = response, session_id
        # The download's socket, so that close (from any thread) can wake a blocked recv.
        self._sock = getattr(getattr(response.raw, "connection", None), "sock", None)
        self._chunks = response.raw.stream(READ_CHUNK, decode_content=False)
        self._reader = wire.FrameReader()
        self._frames: list[wire.Frame] = []
        self._cond = threading.Condition()
        self._queue: list[bytes] = []
        self._uploading = False  # a batch taken from the queue is being POSTed
        self.closed = False
        threading.Thread(target=self._upload, name="tunnel-upload", daemon=True).start()

    def recv(self) -> bytes:
        try:
            while not self._frames:
                if self.closed:
                    raise ConnectionError("the HTTP tunnel is closed")
                try:
                    chunk = next(self._chunks)
                except StopIteration:
                    raise ConnectionError("the HTTP tunnel's download ended") from None
                self._frames = self._reader.feed(chunk)
        except BaseException:
            self.close()
            with contextlib.suppress(Exception):  # the reading thread's own: no lock held
                self.response.close()
            raise
        return wire.encode(self._frames.pop(0))

    def send(self, data: bytes) -> None:
        with self._cond:
            deadline = time.monotonic() + UPLOAD_BLOCK_SECONDS
            while len(self._queue) >= UPLOAD_QUEUE_FRAMES and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.closed or len(self._queue) >= UPLOAD_QUEUE_FRAMES:
                self._close_locked()
                raise ConnectionError("the HTTP tunnel is closed")
            self._queue.append(data)
            self._cond.notify_all()

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every queued frame is uploaded: a
        WebSocket's send has written its frame when it returns; this link's only queued it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._uploading) and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self, code: int = 1000, reason: str = "") -> None:
        with self._cond:
            self._close_locked()

    def _close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._cond.notify_all()
        with contextlib.suppress(OSError):  # wakes a recv blocked on the download
            if self._sock is not None:
                self._sock.shutdown(socket.SHUT_RDWR)

    def _upload(self) -> None:
        url = self.base + wire.PATH_AGENT_TUNNEL_UP
        headers = {
            **self.headers,
            wire.HEADER_TUNNEL_SESSION: self.session_id,
            "Content-Type": wire.TUNNEL_MEDIA_TYPE,
        }
        try:
            while True:
                with self._cond:
                    while not self._queue and not self.closed:
                        self._cond.wait()
                    if self.closed:
                        return
                    batch, size = [], 0
                    while self._queue and size + len(self._queue[0]) <= UPLOAD_BATCH_BYTES:
                        size += len(self._queue[0])
                        batch.append(self._queue.pop(0))
                    if not batch:  # one frame is never over the batch bound; be safe
                        batch.append(self._queue.pop(0))
                    self._uploading = True
                    self._cond.notify_all()
                answer = self.uploads.post(
                    url, data=b"".join(batch), headers=headers, timeout=(CONNECT_TIMEOUT, 60)
                )
                answer.close()
                with self._cond:
                    self._uploading = False
                    self._cond.notify_all()
                if answer.status_code != 204:
                    log.warning("tunnel: an upload was refused (HTTP %d)", answer.status_code)
                    return
        except Exception as exc:
            log.warning("tunnel: an upload failed (%s)", transport.exception_name(exc))
        finally:
            self.close()
            self.uploads.close()


def websocket_blocked(exc: BaseException) -> bool:
    """Whether a failed upgrade says WebSocket is blocked on the way: a proxy's refusal
    (WEBSOCKET_BLOCKED_STATUSES, not in the control plane's own error shape) or the
    connection reset or ended during the handshake."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        if status not in WEBSOCKET_BLOCKED_STATUSES:
            return False
        try:
            error = json.loads(getattr(response, "body", b"") or b"").get("error")
        except (ValueError, AttributeError):
            return True
        return not (isinstance(error, dict) and "code" in error)
    from websockets.exceptions import InvalidMessage

    return isinstance(exc, (InvalidMessage, ConnectionResetError, EOFError))


class TunnelClient:
    """Keeps the node's tunnel up and carries its streams."""

    def __init__(
        self,
        settings: AgentSettings,
        credential: Callable[[], str | None],
        servers: Callable[[str], tuple[int, str, str | None] | None],
        stop: threading.Event,
        *,
        steps: tuple[float, ...] = BACKOFF_STEPS,
        grace: float = RESUME_GRACE_SECONDS,
    ) -> None:
        self.settings, self.credential, self.server_of = settings, credential, servers
        self.stop, self.steps, self.grace = stop, steps, grace
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._link: Any = None
        self._lost_at: float | None = time.monotonic()
        self._streams: dict[int, AgentStream] = {}  # running
        self._finished: dict[int, tuple[AgentStream, float]] = {}  # ended, kept for a resume
        # For the heartbeat's health: None until the first attempt has ended (so a node is
        # not held unready while its tunnel is still connecting), then "up" or "down".
        self.state: str | None = None
        self.transport = settings.tunnel_transport  # auto becomes http once WebSocket fails
        # Relayed requests run as tasks on one loop (relayed.py), not a thread each.
        self.streams = StreamLoop()
        self.runtime_connections = RuntimeConnections()  # used on that loop only
        self.going = False  # said on the tunnel that this agent stops: no new stream
        # Links of a split model (links.py), by stream id: those this agent opened (ids
        # with LINK_STREAM_BIT) and those the control plane opened to a helper here.
        self._links: dict[int, LinkPump] = {}
        self._link_ids = itertools.count(1)

    # -- what the streams use ---------------------------------------------------------

    def up(self) -> bool:
        with self._lock:
            return self._link is not None

    def lost_since(self) -> float | None:
        with self._lock:
            return self._lost_at

    def paths(self, model_dir: str | None = None) -> list[str]:
        """Every filesystem path of this node a runtime could print: the server's model
        directory, the artifact, quarantine and state roots, the worker's directory."""
        roots = [
            *([Path(model_dir)] if model_dir else []),
            self.settings.artifacts_dir,
            self.settings.quarantine_dir,
            self.settings.state_volume,
            self.settings.worker_socket.parent,
        ]
        found = {str(p) for p in roots} | {str(p.resolve()) for p in roots if p.exists()}
        usable = (
            p for p in found if p.startswith("/") and len(p) > 1 and p.isprintable()
        )  # what the scrubber takes: absolute, not "/", no control character
        return sorted(usable, key=len, reverse=True)

    def send(self, frame: wire.Frame) -> bool:
        data = wire.encode(frame)
        with self._send_lock:
            link = self._link
            if link is None:
                return False
            try:
                link.send(data)
            except Exception:
                return False
        return True

    # -- links (a model split across nodes) -----------------------------------------------

    def open_link(self, server_id: str, peer_server_id: str, sock: socket.socket) -> None:
        """A connection the main server made to a helper's listener: a LINK on the tunnel;
        closed at once when there is no tunnel (llama-server then fails and is restarted)."""
        with self._lock:
            up = self._link is not None and not self.going
            stream_id = wire.LINK_STREAM_BIT | (next(self._link_ids) % wire.LINK_STREAM_BIT)
            pump = LinkPump(
                stream_id,
                sock,
                self.send,
                self._link_finished,
                self.settings.rpc_stall_seconds,
                busy=lambda: self._serving(server_id),
                lost=lambda: self._group_lost(server_id),
            )
            if up:
                self._links[stream_id] = pump
        if not up or not self.send(wire.link_frame(stream_id, server_id, peer_server_id)):
            log.warning("link to server %s: no tunnel; closing it", peer_server_id)
            with self._lock:
                self._links.pop(stream_id, None)
            sock.close()
            return
        pump.start()

    def _accept_link(self, frame: wire.Frame) -> None:
        """The control plane's LINK to a helper this node runs: connect to its
        ggml-rpc-server on 127.0.0.1."""
        value = wire.json_of(frame)
        target = self.server_of(str(value.get("server_id")))
        if target is None:
            self.send(wire.reset_frame(frame.stream_id, rel.SERVER_NOT_ON_NODE, "no such helper"))
            return
        try:
            sock = socket.create_connection(("127.0.0.1", target[0]), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            self.send(
                wire.reset_frame(frame.stream_id, rel.RUNTIME_UNREACHABLE, type(exc).__name__)
            )
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pump = LinkPump(frame.stream_id, sock, self.send, self._link_finished)
        with self._lock:
            if frame.stream_id in self._links:
                sock.close()
                raise wire.FrameError("LINK for a link that exists")
            self._links[frame.stream_id] = pump
        pump.start()

    def _in_flight(self, server_id: str) -> list[AgentStream]:
        """The server's client requests in flight here."""
        with self._lock:
            return [
                s
                for s in self._streams.values()
                if s.opened.get("server_id") == server_id and not s.done
            ]

    def _serving(self, server_id: str) -> bool:
        return bool(self._in_flight(server_id))

    def _group_lost(self, server_id: str) -> None:
        """A link of the server's split ended under it (a helper went or stalled): its
        llama-server cannot answer, so its clients' requests end now, NODE_LINK_LOST."""
        streams = self._in_flight(server_id)
        for stream in streams:
            self.send(wire.reset_frame(stream.stream_id, rel.NODE_LINK_LOST, "a helper went"))
            stream.abort()
        if streams:
            log.warning("server %s: a helper's link ended; %d request(s) ended", server_id,
                        len(streams))  # fmt: skip

    def _link_finished(self, pump: LinkPump) -> None:
        with self._lock:
            if self._links.get(pump.stream_id) is pump:
                del self._links[pump.stream_id]

    def _link_frame(self, frame: wire.Frame) -> bool:
        """A frame of one of this agent's links; False when it is not a link's."""
        with self._lock:
            pump = self._links.get(frame.stream_id)
        if pump is None:
            # One of this agent's links that ended meanwhile: nothing to do.
            return wire.is_link_id(frame.stream_id)
        kind = frame.type
        if kind == wire.DATA:
            pump.on_data(frame.payload)
            if frame.end_stream:
                pump.on_end()
        elif kind == wire.WINDOW:
            pump.on_window(wire.window_of(frame))
        elif kind == wire.END:
            pump.on_end()
        elif kind == wire.RESET:
            pump.on_reset()
        else:
            raise wire.FrameError(f"{kind.name} on a link")
        return True

    def _end_links(self) -> None:
        """The tunnel is gone: a link is never resumed."""
        with self._lock:
            pumps = list(self._links.values())
            self._links.clear()
        for pump in pumps:
            pump.close(tell=False)

    def finished(self, stream: AgentStream) -> None:
        """A stream's thread ended: it no longer counts against the cap, and is kept for a
        resume until the grace passes (pruned as new streams open)."""
        with self._lock:
            if self._streams.get(stream.stream_id) is stream:
                del self._streams[stream.stream_id]
            if not stream.aborted:
                self._finished[stream.stream_id] = (stream, time.monotonic())

    def _prune(self) -> None:
        """Inside the lock: forget finished streams older than the grace."""
        horizon = time.monotonic() - self.grace
        for stream_id in [i for i, (_, at) in self._finished.items() if at < horizon]:
            del self._finished[stream_id]

    def _held(self, stream_id: int) -> AgentStream | None:
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is None and stream_id in self._finished:
                stream = self._finished[stream_id][0]
        return stream

    # -- the connection ---------------------------------------------------------------

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="tunnel", daemon=True)
        thread.start()
        return thread

    def _connect(self) -> Any:
        """The tunnel's link: a WebSocket, or the HTTP fallback (the setting; auto falls
        back for good once the upgrade is refused in a way that says WebSocket is blocked)."""
        if self.transport == "http":
            return HttpLink(self.settings, self.credential())
        try:
            return self._connect_websocket()
        except Exception as exc:
            if self.transport != "auto" or not websocket_blocked(exc):
                raise
            self.transport = "http"
            log.warning("tunnel: the WebSocket upgrade was refused (%s); using the HTTP "
                        "tunnel from now on", _describe(exc))  # fmt: skip
            return HttpLink(self.settings, self.credential())

    def _connect_websocket(self) -> Any:
        from websockets.sync.client import connect

        url = tunnel_url(self.settings.require_control_plane())
        parts = urlsplit(url)
        credential = self.credential()
        headers = [
            (HEADER_AUTHORIZATION, f"Bearer {credential}"),
            (HEADER_AGENT_PROTOCOL, str(PROTOCOL_VERSION)),
        ]
        context = tls_context(self.settings)
        sock = None
        if self.settings.control_plane_host_address:  # pinned: dial it, verify the name
            port = parts.port or (443 if parts.scheme == "wss" else 80)
            sock = socket.create_connection(
                (self.settings.control_plane_host_address, port), timeout=CONNECT_TIMEOUT
            )
            # The timeout was the connect's: websockets reads a socket it is given as it is,
            # and a quiet tunnel would otherwise break at its first silent CONNECT_TIMEOUT.
            sock.settimeout(None)
        # websockets turns Nagle's delay off itself (a split model's links are small
        # requests and answers, each of which would otherwise wait for the last's ACK).
        return connect(
            url,
            sock=sock,
            ssl=context,
            server_hostname=parts.hostname if context is not None else None,
            additional_headers=headers,
            user_agent_header=f"modelforge-node-agent/{__version__}",
            compression=None,
            max_size=wire.MAX_PAYLOAD + wire.HEADER_SIZE + 1024,
            open_timeout=CONNECT_TIMEOUT,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=5,
        )

    def run(self) -> None:
        backoff = Backoff(self.steps)
        while not self.stop.is_set():
            try:
                link = self._connect()
            except Exception as exc:
                self.state = "down"
                step, delay = backoff.next_step()
                log.warning("tunnel: %s; again in %s", _describe(exc), seconds(step))
                self.stop.wait(delay)
                continue
            backoff.reset()
            with self._lock:
                self._link, self._lost_at = link, None
            self.state = "up"
            log.info("tunnel up")
            watcher = threading.Thread(target=self._close_on_stop, args=(link,), daemon=True)
            watcher.start()
            try:
                self._serve(link)
            finally:
                with self._lock:
                    self._link, self._lost_at = None, time.monotonic()
                    streams = list(self._streams.values())
                self._end_links()
                self.state = "down"
                for stream in streams:
                    stream.wake()
                if self.going:
                    log.info("tunnel closed: the agent stops")
                else:
                    log.warning("tunnel down; %d stream(s) wait %s for it", len(streams),
                                seconds(self.grace))  # fmt: skip
            if not self.stop.is_set():
                step, delay = backoff.next_step()
                self.stop.wait(min(delay, 1.0))
        # Stopping: the kept runtime connections go too, then the streams' loop.
        self.streams.call(self.runtime_connections.close)
        self.streams.stop()

    def _close_on_stop(self, link: Any) -> None:
        while not self.stop.wait(1.0):
            with self._lock:
                if self._link is not link:
                    return
        self._go_away(link)

    def _go_away(self, link: Any) -> None:
        """Stopping: end this node's streams (their runtimes stop generating), then say so
        on the tunnel (RESET of stream 0), so that the control plane ends them now rather
        than after its resume grace, and close the tunnel."""
        with self._lock:
            self.going = True  # from here on an OPEN is refused
            current = self._link is link
            streams = [*self._streams.values(), *(held for held, _ in self._finished.values())]
            self._finished.clear()
        for stream in streams:  # an aborted stream sends nothing more
            stream.abort()
        if current:
            self.send(wire.going_away_frame())
            if isinstance(link, HttpLink):
                link.flush(GOING_AWAY_SECONDS)
        with contextlib.suppress(Exception):  # it is going anyway
            link.close(1001, "the node agent is stopping")

    def _serve(self, link: Any) -> None:
        while not self.stop.is_set():
            try:
                data = link.recv()
            except Exception:
                return
            if isinstance(data, str):
                log.warning("tunnel: a text message; closing it")
                link.close(1003, "binary frames only")
                return
            try:
                self._dispatch(wire.decode(data))
            except wire.FrameError as bad:
                log.warning("tunnel: protocol error (%s); closing it", bad)
                link.close(1002, "protocol error")
                return

    def _dispatch(self, frame: wire.Frame) -> None:
        kind = frame.type
        if kind == wire.PING:
            self.send(wire.Frame(wire.PONG, 0, frame.payload))
            return
        if kind == wire.PONG:
            return
        if kind == wire.RESUME:
            self._resume(wire.json_of(frame))
            return
        if kind == wire.LINK:
            self._accept_link(frame)
            return
        if self._link_frame(frame):
            return
        stream = self._held(frame.stream_id)
        if kind == wire.OPEN:
            if stream is not None and not stream.done:
                raise wire.FrameError("OPEN for a stream that exists")
            with self._lock:  # a finished one of that id (a restarted control plane counts anew)
                self._finished.pop(frame.stream_id, None)
            stream = AgentStream(self, frame.stream_id, wire.json_of(frame))
            with self._lock:
                going = self.going
            if going:  # said it stops: this one goes to another server instead
                self.send(wire.reset_frame(frame.stream_id, rel.TUNNEL_CLOSING, "stopping"))
                return
            with self._lock:
                self._prune()
                if len(self._streams) >= wire.MAX_STREAMS_PER_TUNNEL * 2:
                    self.send(wire.reset_frame(frame.stream_id, "STREAM_LIMIT", "too many"))
                    return
                self._streams[frame.stream_id] = stream
            if frame.end_stream:  # no request body follows
                stream.on_end()
            stream.start()  # a task on the streams' loop: no thread of its own
            return
        if stream is None:
            if kind != wire.RESET:
                self.send(wire.reset_frame(frame.stream_id, "STREAM_UNKNOWN", "no such stream"))
            return
        if kind == wire.DATA:
            stream.on_data(frame.payload)
            if frame.end_stream:
                stream.on_end()
        elif kind == wire.END:
            stream.on_end()
        elif kind == wire.WINDOW:
            stream.on_window(wire.window_of(frame))
        elif kind == wire.RESET:
            stream.abort()
        else:
            raise wire.FrameError(f"frame type {kind} is not one the control plane sends")

    def _resume(self, value: dict[str, Any]) -> None:
        entries = value.get("streams")
        listed: dict[int, tuple[int, int, bool]] = {}
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("stream_id"), int):
                listed[entry["stream_id"]] = (
                    int(entry.get("received") or 0),
                    int(entry.get("delivered") or 0),
                    bool(entry.get("head")),
                )
        with self._lock:
            self._prune()
            streams = [*self._streams.values(), *(f[0] for f in self._finished.values())]
        held = {stream.stream_id for stream in streams}
        for stream in streams:
            if stream.stream_id in listed:
                stream.on_resume(*listed[stream.stream_id])
            else:
                stream.abort()  # its client is gone
        for stream_id in sorted(set(listed) - held):
            # Opened on a tunnel that died before its OPEN got here: its client is told now.
            self.send(wire.reset_frame(stream_id, rel.RESUME_FAILED, "the node never got it"))
        if listed:
            log.info("tunnel: %d stream(s) resumed", len(listed))


def _describe(exc: BaseException) -> str:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status is not None:
        return f"{type(exc).__name__} (HTTP {status})"
    return type(exc).__name__
