"""HTTPS to the control plane: certificate checks on, a private CA, a pinned host address,
and calls that are bounded in time and size whatever the other end does.

``MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS`` makes the agent connect to that
address while the TLS handshake (SNI) and the certificate check still use the
URL's host name, and the Host header still names it, so the enrollment origin
lock on the control plane keeps working.

A socket timeout bounds each ``recv()``, not a call: a peer sending one byte every
few seconds would hold a call for ever. ``Deadline`` ends a call at a fixed time by
shutting the socket it is using (the adapter's connections tell it which one), and
answers are read with a cap (``read_answer``), never decompressed. One watchdog thread
keeps every deadline of the process: a thread started per call cost more than the call
when a node ran hundreds of work items a second.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import socket
import ssl
import threading
import time
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from modelforge_contract.tls import strict_x509_cause

from .settings import AgentSettings

log = logging.getLogger(__name__)

# (connect, read) seconds: bounded so one hung call delays only its own publication.
REQUEST_TIMEOUT = (5.0, 15.0)
# The whole call, from connecting to the last byte of the answer.
CALL_DEADLINE_SECONDS = 30.0
# Answers are a few hundred bytes; anything near this is not the control plane talking.
MAX_ANSWER_BYTES = 1024 * 1024
_READ_CHUNK = 64 * 1024

_in_flight = threading.local()  # .deadline: the Deadline of the call this thread is making


class AnswerTooLarge(Exception):
    """The answer is larger than MAX_ANSWER_BYTES (or not plain bytes at all)."""


class Deadline:
    """Ends the call made inside ``with Deadline(seconds):`` once it has run that long.

    The connection the call uses registers itself (``watch``); at the deadline its
    socket is shut down, so a ``recv()`` blocked in this thread returns at once and the
    call fails. Nothing is shut once the block has been left: the connection may by then
    belong to another call.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._active = False
        self._connection: HTTPConnection | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Deadline:
        self._active = True
        _in_flight.deadline = self
        _watchdog.keep(time.monotonic() + self.seconds, self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        with self._lock:
            self._active = False
            self._connection = None
        _in_flight.deadline = None

    @property
    def active(self) -> bool:
        return self._active

    def watch(self, connection: HTTPConnection) -> None:
        with self._lock:
            self._connection = connection
            if self.expired:
                _shut(connection)

    def _expire(self) -> None:
        with self._lock:
            if not self._active:
                return
            self.expired = True
            if self._connection is not None:
                _shut(self._connection)


# How often the watchdog looks whether any call is still in flight.
IDLE_CHECK_SECONDS = 1.0


class _Watchdog:
    """The one thread that expires every Deadline of the process at its time.

    Deadlines wait in a heap by time; one whose call has ended is dropped when it reaches
    the top, so the heap holds about as many entries as there are calls in flight. The
    thread ends once no call is in flight (it looks every IDLE_CHECK_SECONDS).
    """

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def keep(self, at: float, deadline: Deadline) -> None:
        with self._wake:
            self._drop_ended()
            heapq.heappush(self._heap, (at, next(self._order), deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="call-deadlines", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is deadline:
                self._wake.notify()  # earlier than what the thread sleeps towards

    def _drop_ended(self) -> None:
        while self._heap and not self._heap[0][2].active:
            heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            due: list[Deadline] = []
            with self._wake:
                self._drop_ended()
                if not self._heap:
                    # No call in flight: the thread ends (the next call starts another), so
                    # an idle agent holds no thread for it.
                    self._thread = None
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if not due:
                    self._wake.wait(min(self._heap[0][0] - now, IDLE_CHECK_SECONDS))
            for deadline in due:  # outside the heap's lock: expiring takes the call's lock
                deadline._expire()


_watchdog = _Watchdog()


def _shut(connection: HTTPConnection) -> None:
    sock = connection.sock
    if sock is not None:
        # The plain socket call, also for a TLS socket: no TLS state is touched while
        # another thread may be reading through it.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _watched(connection: HTTPConnection) -> None:
    deadline = getattr(_in_flight, "deadline", None)
    if deadline is not None:
        deadline.watch(connection)


class _WatchedHTTPConnection(HTTPConnection):
    def connect(self) -> None:
        _watched(self)
        super().connect()

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watched(self)
        super().request(*args, **kwargs)


class _WatchedHTTPSConnection(HTTPSConnection):
    def connect(self) -> None:
        _watched(self)
        super().connect()

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watched(self)
        super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class BoundedAdapter(HTTPAdapter):
    """requests' adapter whose connections report to the calling thread's Deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def read_answer(response: requests.Response, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """The body of a ``stream=True`` response, at most ``limit`` bytes, as sent.

    The agent asks for no content coding and decodes none: a compressed answer could
    expand without bound.
    """
    coding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise AnswerTooLarge(f"content coding {coding[:20]!r}")
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge("declared length")
    chunks, size = [], 0
    for chunk in response.raw.stream(_READ_CHUNK, decode_content=False):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge("body")
        chunks.append(chunk)
    return b"".join(chunks)


class HostAddressAdapter(BoundedAdapter):
    """Dial ``address`` instead of the URL's host; verify and name the URL's host."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self.address = address
        super().__init__(**kwargs)

    def build_connection_pool_key_attributes(
        self, request: requests.PreparedRequest, verify: Any, cert: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(
            request, verify, cert
        )
        url_host = host_params["host"]
        host_params["host"] = self.address
        if host_params["scheme"] == "https":
            pool_kwargs["server_hostname"] = url_host
            pool_kwargs["assert_hostname"] = url_host
        return host_params, pool_kwargs

    def add_headers(self, request: requests.PreparedRequest, **kwargs: Any) -> None:
        # urllib3 would otherwise derive Host from the address it dials.
        request.headers.setdefault("Host", urlsplit(request.url).netloc)


def make_session(settings: AgentSettings) -> requests.Session:
    """A session for the control plane with the operator's TLS settings applied."""
    session = requests.Session()
    # Only the agent's own settings decide where it connects and whom it trusts:
    # no proxy variables, no REQUESTS_CA_BUNDLE, no .netrc credentials.
    session.trust_env = False
    session.verify = settings.tls_verify_value
    session.headers["Accept-Encoding"] = "identity"
    if settings.control_plane_host_address:
        adapter: BoundedAdapter = HostAddressAdapter(settings.control_plane_host_address)
    else:
        adapter = BoundedAdapter()
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    if not settings.tls_verify:
        # One loud warning per start (main) instead of one per request.
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return session


def exception_name(exc: BaseException) -> str:
    """A short, stable name for a transport failure, for log lines operators grep."""
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLSError"
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "ConnectTimeout"
    if isinstance(exc, requests.exceptions.ReadTimeout):
        return "ReadTimeout"
    if isinstance(exc, requests.exceptions.ConnectionError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, urllib3.exceptions.NameResolutionError):
                return "DNSError"
            cause = cause.__context__ or (cause.args[0] if cause.args else None)
            if not isinstance(cause, BaseException):
                break
        return "ConnectError"
    return type(exc).__name__


def tls_cause(exc: BaseException) -> str | None:
    """For a certificate refused only by strict X.509 checks (Python 3.13+), what to fix."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            return strict_x509_cause(cause.verify_message)
        nested = cause.args[0] if cause.args and isinstance(cause.args[0], BaseException) else None
        cause = cause.__cause__ or cause.__context__ or nested
    return None
