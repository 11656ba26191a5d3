"""Relayed requests on the agent's event loop: no thread per stream (docs/tunnel-protocol.md).

Each OPEN the tunnel brings becomes an ``AgentStream`` task on one asyncio loop, a thread of
the agent (``StreamLoop``): it waits for the request's body, sends it to the server's
runtime on 127.0.0.1 over a kept connection (h11 speaks HTTP/1.1 both ways; no hand-written
parser), and hands the answer to the tunnel as credit allows, an SSE event at a time or the
whole JSON body, with every filesystem path of this node replaced by the deployment's name.
What went out, what the credit allows and what a resume must send again is the tunnel
core's (``modelforge_contract.streams.Outgoing``).

The tunnel's reader thread feeds each stream (``on_data``, ``on_end``, ``on_window``,
``on_resume``, ``abort``) and wakes its task; an abort cancels it, which closes its runtime
connection: the runtime sees its client gone and stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h11

from modelforge_contract import relay as rel
from modelforge_contract import tunnel as wire
from modelforge_contract.scrub import SseScrubber, scrub_body
from modelforge_contract.streams import Outgoing
from modelforge_contract.waking import Waker

if TYPE_CHECKING:
    from .tunnel import TunnelClient

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
CONNECT_RETRY_SECONDS = 0.2  # a loopback connect not done by then lost its SYN: again
RUNTIME_TIMEOUT = 600.0  # a runtime may think this long before its first byte (or between)
BODY_MAX_BYTES = 64 * 1024 * 1024  # a JSON answer scrubbed whole
READ_CHUNK = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024  # a runtime's status line and headers


class StreamLoop:
    """The asyncio loop the agent's relayed requests run on (a thread, started on first
    use). ``spawn`` and ``call`` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="streams", daemon=True)
                thread.start()
                self.loop, self._thread = loop, thread
            return self.loop

    def call(self, function: Callable[[], Any]) -> None:
        """Run ``function`` on the loop (soon); nothing before it started or once it has
        stopped (the agent stops: no loop is started again for it)."""
        loop = self.loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(function)

    def stop(self) -> None:
        with self._lock:
            loop, thread, self.loop, self._thread = self.loop, self._thread, None, None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


class RuntimeConnection:
    """One HTTP/1.1 connection to a runtime on 127.0.0.1 (a non-blocking socket and h11's
    client side of it), used by one request at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.given_up = False

    def give_up(self) -> None:
        """Waited too long for the runtime: shut down (a read waiting on it ends), never
        closed under the loop's reader."""
        self.given_up = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def quiet(self) -> bool:
        """Open, and the runtime sent nothing on it since (neither bytes nor its close)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def reusable(self) -> bool:
        """The last exchange ended cleanly both ways: ready for the next request."""
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            return True
        return False

    def close(self) -> None:
        """Closed at once: a runtime still writing sees its client gone."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class RuntimeConnections:
    """Keep-alive connections to the runtimes on 127.0.0.1, by port: a relayed request
    takes one the last request left (so a small request costs no TCP handshake, nor a
    runtime's accept), or opens one. A connection waits at most IDLE_SECONDS (under every
    runtime's own keep-alive timeout: llama-server's and uvicorn's are 5 s), and one the
    runtime closed or wrote to meanwhile is dropped, never used. Used on the loop only."""

    IDLE_SECONDS = 2.0
    PER_PORT = 16

    def __init__(self) -> None:
        self._idle: dict[int, list[tuple[RuntimeConnection, float]]] = {}

    async def take(self, port: int) -> tuple[RuntimeConnection, bool]:
        """A connection to ``port``, and whether it was kept from an earlier request."""
        horizon = time.monotonic() - self.IDLE_SECONDS
        kept = self._idle.get(port) or []
        while kept:
            connection, since = kept.pop()
            if since > horizon and connection.quiet():
                return connection, True
            connection.close()
        return RuntimeConnection(await _connect(port)), False

    def put(self, port: int, connection: RuntimeConnection) -> None:
        kept = self._idle.setdefault(port, [])
        if len(kept) < self.PER_PORT:
            kept.append((connection, time.monotonic()))
        else:
            connection.close()

    def close(self) -> None:
        kept, self._idle = self._idle, {}
        for connection, _ in (pair for pairs in kept.values() for pair in pairs):
            connection.close()


async def _connect(port: int) -> socket.socket:
    """A new connection to the runtime on ``port``. A connect on loopback takes microseconds
    unless the runtime's accept queue was full (llama-server's holds 5) and the kernel
    dropped the SYN, which it sends again only after a second: so one that has not
    completed within CONNECT_RETRY_SECONDS is given up and made again, up to
    CONNECT_TIMEOUT in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_TIMEOUT
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wait = min(CONNECT_RETRY_SECONDS, deadline - loop.time())
        try:
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), wait)
        except asyncio.TimeoutError:
            sock.close()
            if loop.time() >= deadline:
                raise
            continue
        except BaseException:
            sock.close()
            raise
        return sock


class _Aborted(Exception):
    pass


class _KeptConnectionClosed(Exception):
    """A kept connection the runtime closed before answering: sent again on a new one."""


class AgentStream:
    """One relayed request, as the agent carries it: fed by the tunnel's reader thread,
    run as a task on the stream loop."""

    def __init__(self, relay: TunnelClient, stream_id: int, opened: dict[str, Any]) -> None:
        self.relay, self.stream_id, self.opened = relay, stream_id, opened
        self.lock = threading.Lock()
        self.body = bytearray()
        self.body_done = False
        # The answer as the runtime produces it (the tunnel core: what went out within the
        # credit, what a resume may send again); touched only inside ``lock``.
        self.answer = Outgoing()
        self.done = False  # its task has ended
        self._loop = relay.streams.start()
        self._waker = Waker(self._loop)  # woken whenever the stream may move on
        self._task: asyncio.Task[None] | None = None
        self._connection: RuntimeConnection | None = None

    # -- from the tunnel's reader thread --------------------------------------------------

    @property
    def aborted(self) -> bool:
        """Reset (its client left) or ended by a stopping agent: nothing more is sent."""
        return self.answer.reset

    def wake(self) -> None:
        """Something changed: the task looks again."""
        self._waker.wake()

    def on_data(self, payload: bytes) -> None:
        with self.lock:
            if len(self.body) + len(payload) > BODY_MAX_BYTES:
                raise wire.FrameError("request body beyond its bound")
            self.body += payload

    def on_end(self) -> None:
        with self.lock:
            self.body_done = True
        self.wake()

    def on_window(self, count: int) -> None:
        with self.lock:
            self.answer.on_window(count)
        self.wake()

    def on_resume(self, received: int, delivered: int, head: bool) -> None:
        """A new tunnel: its client took ``delivered`` bytes, ``received`` arrived, and
        whether the head did."""
        with self.lock:
            self.answer.on_resume(received, delivered, head)
            done = self.done
        if done:  # its task has ended: send what is left from here
            self.relay.streams.call(lambda: self._loop.create_task(self._redrain()))
        else:
            self.wake()

    def abort(self) -> None:
        """The stream is over (its client left, or the agent stops): its task is cancelled
        and its runtime connection closed, so the runtime stops generating."""
        with self.lock:
            self.answer.on_reset()
        self.relay.streams.call(self._cancel)

    def start(self) -> None:
        self.relay.streams.call(self._begin)

    # -- on the loop ------------------------------------------------------------------------

    def _begin(self) -> None:
        self._task = self._loop.create_task(self.run())

    def _cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def run(self) -> None:
        try:
            await self._run()
        except (_Aborted, asyncio.CancelledError):
            pass
        except Exception as exc:  # logged by type only: its text may quote a body
            if not self.aborted:
                log.warning("stream %d: %s", self.stream_id, type(exc).__name__)
                self.relay.send(
                    wire.reset_frame(self.stream_id, rel.RUNTIME_UNREACHABLE, type(exc).__name__)
                )
        finally:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
            with self.lock:
                self.done = True
            self.relay.finished(self)

    async def _run(self) -> None:
        while True:
            with self.lock:
                self._check()
                if self.body_done:
                    break
            await self._waker.wait(1.0)
        server_id = str(self.opened.get("server_id"))
        target = self.relay.server_of(server_id)
        path = str(self.opened.get("path") or "")
        if target is None or not rel.is_relayed(str(self.opened.get("method")), path):
            code = rel.SERVER_NOT_ON_NODE if target is None else rel.ROUTE_NOT_RELAYED
            self.relay.send(wire.reset_frame(self.stream_id, code, "not served by this node"))
            return
        port, name, model_dir = target
        given = [tuple(h) for h in self.opened.get("headers") or [] if len(h) == 2]
        headers = [
            (name_, value)
            for name_, value in rel.relayable_headers(
                given, rel.REQUEST_HEADERS_NOT_RELAYED | {"content-length"}
            )
            if name_.lower() not in ("accept-encoding", "host")
        ]
        headers.append(("Accept-Encoding", rel.ACCEPT_ENCODING_TO_RUNTIME))  # scrubbed as it comes
        status, answer_headers = await self._request(port, path, headers)
        encoding = _header(answer_headers, "content-encoding")
        if not rel.is_identity_encoding(encoding):
            # Compressed anyway: its paths could not be scrubbed, so nothing of it is passed.
            message = f"the runtime answered {str(encoding)[:40]}-encoded, which cannot be scrubbed"
            self.relay.send(wire.reset_frame(self.stream_id, rel.BODY_ENCODED, message))
            return
        paths = self.relay.paths(model_dir)
        kept = rel.relayable_headers(answer_headers, rel.RESPONSE_HEADERS_NOT_RELAYED)
        sse = (_header(answer_headers, "content-type") or "").startswith("text/event-stream")
        if sse:
            self._head(status, kept)
            await self._drain()
            scrubber = SseScrubber(paths, name)
            async for chunk in self._body():
                self._emit(scrubber.feed(chunk))
                await self._drain()
            self._emit(scrubber.flush())
        else:
            raw = bytearray()
            async for chunk in self._body():
                raw += chunk
                if len(raw) > BODY_MAX_BYTES:
                    raise ValueError("answer beyond its bound")
            body = scrub_body(bytes(raw), paths, name)
            self._head(status, [*kept, ("Content-Length", str(len(body)))])
            self._emit(body)
        with self.lock:
            self.answer.finish()
        connection, self._connection = self._connection, None
        if connection is not None:
            if connection.reusable() and not self.aborted:
                self.relay.runtime_connections.put(port, connection)  # read to its end
            else:
                connection.close()
        await self._drain()

    async def _request(
        self, port: int, path: str, headers: list[tuple[str, str]]
    ) -> tuple[int, list[tuple[str, str]]]:
        """Send the request on a kept connection to the runtime, or a new one, and read the
        answer's head. A kept one the runtime closed meanwhile fails before it answers: sent
        again on a new one."""
        pool = self.relay.runtime_connections
        with self.lock:
            body = bytes(self.body)
        request = h11.Request(
            method=rel.RELAYED_METHOD,
            target=path,
            headers=[
                ("Host", f"127.0.0.1:{port}"),
                *headers,
                ("Content-Length", str(len(body))),
            ],
        )
        while True:
            connection, reused = await pool.take(port)
            self._connection = connection
            self._check()
            http = connection.http
            out = (
                http.send(request) + http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage())
            )
            try:
                await self._loop.sock_sendall(connection.sock, out)
                return await self._response_head(connection, reused)
            except (_KeptConnectionClosed, BrokenPipeError, ConnectionResetError):
                connection.close()
                self._connection = None
                if not reused:
                    raise

    async def _response_head(
        self, connection: RuntimeConnection, reused: bool
    ) -> tuple[int, list[tuple[str, str]]]:
        received = False
        while True:
            event = connection.http.next_event()
            if event is h11.NEED_DATA:
                data = await self._recv(connection)
                if not data and not received and reused:
                    raise _KeptConnectionClosed()
                received = received or bool(data)
                connection.http.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                pairs = [
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers.raw_items()
                ]
                return event.status_code, pairs
            raise ConnectionError("the runtime closed its connection before answering")

    async def _body(self):
        """The answer's body as it comes, a read at a time."""
        assert self._connection is not None
        http = self._connection.http
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await self._recv(self._connection))
                continue
            if isinstance(event, h11.Data):
                if event.data:
                    yield bytes(event.data)
                continue
            if isinstance(event, h11.EndOfMessage):
                return
            raise ConnectionError("the runtime's answer ended early")

    async def _recv(self, connection: RuntimeConnection) -> bytes:
        """The runtime's next bytes (b"" at its end). Read at once when they are there;
        otherwise waited for, at most RUNTIME_TIMEOUT (a timer, not a task per read: a
        token stream reads once per event)."""
        sock = connection.sock
        try:
            return sock.recv(READ_CHUNK)
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return b""
        silent = self._loop.call_later(RUNTIME_TIMEOUT, connection.give_up)
        try:
            data = await self._loop.sock_recv(sock, READ_CHUNK)
        except ConnectionResetError:
            data = b""
        finally:
            silent.cancel()
        if connection.given_up:  # the runtime sent nothing for that long
            raise TimeoutError("the runtime sent nothing for RUNTIME_TIMEOUT seconds")
        return data

    async def _redrain(self) -> None:
        with contextlib.suppress(_Aborted, asyncio.CancelledError):
            await self._drain()

    def _check(self) -> None:
        if self.aborted:
            raise _Aborted()

    def _head(self, status: int, headers: list[tuple[str, str]]) -> None:
        # A header the contract refuses is dropped, not relayed.
        frame = wire.head_frame(self.stream_id, status, wire.carried_headers(headers))
        with self.lock:
            self.answer.set_head(frame.payload)

    def _emit(self, data: bytes) -> None:
        if data:
            with self.lock:
                self.answer.produce(data)

    async def _drain(self) -> None:
        """Send what credit allows; wait (bounded) for credit or a tunnel while more is
        waiting; returns once everything produced so far is sent."""
        while True:
            with self.lock:
                self._check()
                frames = self.answer.frames(self.stream_id) if self.relay.up() else None
            if frames is None:  # no tunnel: the next one's RESUME says where to go on
                lost = self.relay.lost_since()
                if lost is not None and time.monotonic() - lost > self.relay.grace:
                    raise _Aborted()
                await self._waker.wait(0.5)
                continue
            if not all(self.relay.send(frame) for frame in frames):
                continue  # the tunnel broke: its successor's RESUME says where to go on
            with self.lock:
                if self.answer.all_sent:
                    return  # everything produced so far is sent
            if not frames:
                await self._waker.wait(0.5)  # no credit: a WINDOW (or a resume) wakes it


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
