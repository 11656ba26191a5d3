"""Client connections on the relay's event loop: ``/v1/*`` without a thread per stream.

The one-port front (``connections.Channel``) hands a connection whose next request begins
``POST /v1/`` or ``GET /v1/`` to ``ClientLoop.take``, with the bytes it read of it. On the
loop (``relay.answer.Relay``), h11 parses each request (no hand-written parser); the
client routes (``api/client.py``: the key, the body, the server) run on one of a few
threads, and the answer is relayed on the loop itself, so a stream waiting for its head or
carrying tokens holds no thread. The loop watches the client's socket meanwhile: a client
that leaves ends its stream at once (reset on the node), while it waits for the head too.

A later request on the same connection that is not a client call (an admin call through a
reverse proxy's kept connection) goes back to waitress with the bytes read of it, and its
connection with it; waitress hands it over again at its next client call.

The deadlines are waitress's: a request's head and body within
MODELFORGE_REQUEST_TIMEOUT_SECONDS of its first byte, a kept connection closed after
MODELFORGE_IDLE_TIMEOUT_SECONDS without a request. Refusals are in the one error shape and
never echo what the client sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import h11

from ..core.errors import ApiError
from ..relay.answer import Relay
from ..relay.http_link import HttpLink
from ..web.http import DEFERRED, SECURITY_HEADERS, error_parts
from .connections import WAITRESS_REFUSALS
from .front import CLIENT, MORE, classify_client

log = logging.getLogger(__name__)

# The client routes (key, body, server) run here; the answers do not.
ROUTE_THREADS = 8
RECV_BYTES = 64 * 1024
_SECURITY = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]


class ClientGone(Exception):
    """The client closed its connection (or it broke) while its answer was on the way."""


class ClientLoop:
    """The loop's side of the front: takes client connections, serves them, and gives one
    back to waitress (``give_back(sock, peer, data)``) or closes it (``closed(peer)``)."""

    def __init__(
        self,
        relay: Relay,
        application: Callable,
        *,
        max_connections: int,
        max_header_bytes: int,
        max_body_bytes: int,
        request_timeout: float,
        idle_timeout: float,
        give_back: Callable[[socket.socket, tuple, bytes], None],
        closed: Callable[[tuple], None],
    ) -> None:
        self.relay, self.application = relay, application
        self.max_connections = max_connections
        self.max_header_bytes, self.max_body_bytes = max_header_bytes, max_body_bytes
        self.request_timeout, self.idle_timeout = request_timeout, idle_timeout
        self.give_back, self.closed = give_back, closed
        self.routes = concurrent.futures.ThreadPoolExecutor(
            ROUTE_THREADS, thread_name_prefix="relay-route"
        )
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()

    @property
    def live(self) -> int:
        return len(self._live)

    def take(self, sock: socket.socket, peer: tuple, data: bytes) -> bool:
        """Serve ``sock`` on the loop from now on (``data``: what was read of it). False,
        with nothing started, when the loop holds its most connections."""
        with self._lock:
            if len(self._live) >= self.max_connections:
                return False
            self._live.add(sock)
        loop = self.relay.start()
        loop.call_soon_threadsafe(self._begin, sock, peer, data)
        return True

    def _begin(self, sock: socket.socket, peer: tuple, data: bytes) -> None:
        asyncio.ensure_future(self._serve(sock, peer, data))

    async def _serve(self, sock: socket.socket, peer: tuple, data: bytes) -> None:
        back: bytes | None = None
        try:
            sock.setblocking(False)
            back = await Connection(self, sock, peer).run(data)
        except Exception as exc:
            log.error("a client connection failed: %s", type(exc).__name__, exc_info=True)
        finally:
            with self._lock:
                self._live.discard(sock)
            if back is not None:
                self.give_back(sock, peer, back)
            else:
                with contextlib.suppress(OSError):
                    sock.close()
                self.closed(peer)

    def close(self) -> None:
        """Shut every connection down (the control plane is stopping)."""
        with self._lock:
            live = list(self._live)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.routes.shutdown(wait=False, cancel_futures=True)


class Connection:
    """One client connection on the loop."""

    def __init__(self, owner: ClientLoop, sock: socket.socket, peer: tuple) -> None:
        self.owner, self.sock, self.peer = owner, sock, peer
        self.loop = asyncio.get_running_loop()
        self.gone = asyncio.Event()
        self.watching = False

    async def run(self, data: bytes) -> bytes | None:
        """Serve requests until the connection ends (None) or its next request is
        waitress's: then the bytes read of it."""
        buffer = data
        while True:
            buffer, kind = await self._next_request(buffer)
            if kind != CLIENT:
                return buffer if kind is not None else None
            parser = h11.Connection(
                h11.SERVER, max_incomplete_event_size=self.owner.max_header_bytes
            )
            parser.receive_data(buffer)
            request = await self._read_request(parser)
            if request is None:
                return None
            if not await self._respond(parser, *request):
                return None
            if parser.our_state is not h11.DONE or parser.their_state is not h11.DONE:
                return None
            buffer = parser.trailing_data[0]

    # -- reading ------------------------------------------------------------------------

    async def _recv(self, timeout: float) -> bytes | None:
        """Bytes from the client; b"" when it closed; None when ``timeout`` passed."""
        try:
            return await asyncio.wait_for(self.loop.sock_recv(self.sock, RECV_BYTES), timeout)
        except asyncio.TimeoutError:
            return None
        except OSError:
            return b""

    async def _next_request(self, buffer: bytes) -> tuple[bytes, str | None]:
        """Whose the next request is (CLIENT, or anything else: waitress's) once its first
        bytes tell; None when the connection closed or stayed idle past its deadline."""
        began = time.monotonic()
        while True:
            kind = classify_client(buffer)
            if kind != MORE:
                return buffer, kind
            if buffer:
                timeout = self.owner.request_timeout - (time.monotonic() - began)
            else:
                timeout = self.owner.idle_timeout - (time.monotonic() - began)
            data = await self._recv(max(timeout, 0.0))
            if not data:
                return buffer, None
            buffer += data

    async def _read_request(self, parser: h11.Connection) -> tuple[h11.Request, bytes] | None:
        """The whole request (its head and body), within the request deadline; a refusal
        (answered) or a closed connection is None."""
        deadline = time.monotonic() + self.owner.request_timeout
        request: h11.Request | None = None
        body = bytearray()
        try:
            while True:
                event = parser.next_event()
                if event is h11.NEED_DATA:
                    if parser.they_are_waiting_for_100_continue:
                        await self._send(parser.send(h11.InformationalResponse(status_code=100)))
                    data = await self._recv(deadline - time.monotonic())
                    if data is None:
                        return None  # past the request deadline: closed, as waitress does
                    parser.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                    length = _content_length(event)
                    if length is not None and length > self.owner.max_body_bytes:
                        await self._refuse(parser, 413)
                        return None
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self.owner.max_body_bytes:
                        await self._refuse(parser, 413)
                        return None
                elif isinstance(event, h11.EndOfMessage):
                    assert request is not None
                    return request, bytes(body)
                else:  # ConnectionClosed, PAUSED
                    return None
        except h11.RemoteProtocolError as bad:
            status = bad.error_status_hint
            if (
                status == 400
                and request is None
                and len(parser.trailing_data[0]) >= (self.owner.max_header_bytes)
            ):
                status = 431
            await self._refuse(parser, status)
            return None
        except OSError:
            return None

    # -- answering ----------------------------------------------------------------------

    async def _respond(self, parser: h11.Connection, request: h11.Request, body: bytes) -> bool:
        """Answer one request; False when the connection must end."""
        environ = self._environ(request, body)
        deferred: list[Any] = []
        environ[DEFERRED] = deferred
        status, headers, raw = await self.loop.run_in_executor(
            self.owner.routes, _call_app, self.owner.application, environ
        )
        if not deferred:
            return await self._whole(parser, status, headers, raw)
        [item] = deferred
        self._watch()
        try:
            if isinstance(item, HttpLink):  # a tunnel download: the route's head, the frames
                headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
                return await self._unless_gone(
                    self._stream(parser, status, headers, item.body_async())
                )
            try:
                answer = await self._unless_gone(self.owner.relay.answer(item))
            except ApiError as error:
                if error.logged:
                    log.info("%s %s -> %d %s", environ["REQUEST_METHOD"], environ["PATH_INFO"],
                             error.status, error.code)  # fmt: skip
                code, error_headers, error_body = error_parts(error)
                return await self._whole(parser, code, _bytes_headers(error_headers), error_body)
            headers = [*_bytes_headers(answer.headers), *_SECURITY]
            return await self._unless_gone(
                self._stream(parser, answer.status, headers, answer.chunks)
            )
        except ClientGone:
            return False
        finally:
            self._unwatch()

    async def _stream(
        self,
        parser: h11.Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: AsyncIterator[bytes],
    ) -> bool:
        """An answer whose body comes piece by piece; ``chunks`` is closed however it ends."""
        try:
            pending = parser.send(h11.Response(status_code=status, headers=headers))
            async for chunk in chunks:
                if not chunk:
                    continue
                await self._send(pending + parser.send(h11.Data(data=chunk)))
                pending = b""
            await self._send(pending + parser.send(h11.EndOfMessage()))
            return True
        except (h11.LocalProtocolError, OSError):
            # A sized body the node cut short or ran over: the connection ends, so the
            # client sees a short answer, never a second one in the same bytes.
            return False
        finally:
            await chunks.aclose()

    async def _whole(
        self, parser: h11.Connection, status: int, headers: list[tuple[bytes, bytes]], raw: bytes
    ) -> bool:
        try:
            data = parser.send(h11.Response(status_code=status, headers=headers))
            if raw:
                data += parser.send(h11.Data(data=raw))
            data += parser.send(h11.EndOfMessage())
            await self._send(data)
            return True
        except (h11.LocalProtocolError, OSError):
            return False

    async def _refuse(self, parser: h11.Connection, status: int) -> None:
        """waitress's refusal for ``status`` in the one error shape, then the end."""
        code, message, next_step = WAITRESS_REFUSALS.get(status, WAITRESS_REFUSALS[400])
        raw = json.dumps({"error": {"code": code, "message": message, "next_step": next_step}})
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Cache-Control", b"no-store"),
            (b"Connection", b"close"),
            (b"Content-Length", str(len(raw)).encode()),
            *_SECURITY,
        ]
        with contextlib.suppress(h11.LocalProtocolError, OSError):
            head = parser.send(h11.Response(status_code=status, headers=headers))
            await self._send(head + raw.encode())

    async def _send(self, data: bytes) -> None:
        if data:
            await self.loop.sock_sendall(self.sock, data)

    # -- the client's departure ---------------------------------------------------------

    def _watch(self) -> None:
        """Notice the client's departure while its answer is on the way: its socket turns
        readable with nothing to read. Bytes of a next request stay unread (and the watch
        ends): they are the next request's."""
        self.gone.clear()
        self.loop.add_reader(self.sock.fileno(), self._readable)
        self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            self.watching = False
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())

    def _readable(self) -> None:
        try:
            peeked = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            peeked = b""
        self._unwatch()
        if not peeked:
            self.gone.set()

    async def _unless_gone(self, work: Any) -> Any:
        """``work``'s result, or ClientGone (with ``work`` cancelled) once the client left."""
        task = asyncio.ensure_future(work)
        if self.gone.is_set():
            task.cancel()
        else:
            gone = asyncio.ensure_future(self.gone.wait())
            try:
                await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not task.done():
                task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if self.gone.is_set():
                raise ClientGone() from None
            raise

    # -- WSGI ---------------------------------------------------------------------------

    def _environ(self, request: h11.Request, body: bytes) -> dict[str, Any]:
        target = request.target
        path, _, query = target.partition(b"?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method.decode("latin-1"),
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
            "QUERY_STRING": query.decode("latin-1"),
            "SERVER_PROTOCOL": "HTTP/" + request.http_version.decode("latin-1"),
            "REMOTE_ADDR": str(self.peer[0]) if self.peer else "",
            "REMOTE_PORT": str(self.peer[1]) if len(self.peer) > 1 else "",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": io.StringIO(),
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        sockname = self.sock.getsockname()
        environ["SERVER_NAME"], environ["SERVER_PORT"] = str(sockname[0]), str(sockname[1])
        for raw_name, raw_value in request.headers:
            name = raw_name.decode("latin-1")
            if "_" in name:  # as waitress: a header with "_" could pose as another one
                continue
            value = raw_value.decode("latin-1")
            if name == "content-type":
                environ["CONTENT_TYPE"] = value
                continue
            if name == "content-length":
                continue
            key = "HTTP_" + name.upper().replace("-", "_")
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ


def _call_app(application: Callable, environ: dict[str, Any]) -> tuple[int, list, bytes]:
    """Run the WSGI application (on a route thread): its status, headers and whole body."""
    answered: dict[str, Any] = {}

    def start_response(status: str, headers: list, exc_info: Any = None) -> Callable:
        answered["status"], answered["headers"] = status, headers
        return lambda data: None

    result = application(environ, start_response)
    try:
        raw = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    status = int(str(answered["status"]).split(" ", 1)[0])
    return status, _bytes_headers(answered["headers"]), raw


def _bytes_headers(headers: list[tuple[Any, Any]]) -> list[tuple[bytes, bytes]]:
    return [
        (
            n if isinstance(n, bytes) else str(n).encode("latin-1"),
            v if isinstance(v, bytes) else str(v).encode("latin-1"),
        )
        for n, v in headers
    ]


def _content_length(request: h11.Request) -> int | None:
    for name, value in request.headers:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None
