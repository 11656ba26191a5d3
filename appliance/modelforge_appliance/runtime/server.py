"""Run the control plane on waitress, sized for a fleet and bounded against slow clients.

Every agent keeps one keep-alive connection open between heartbeats, so the server
holds thousands of connections (``MODELFORGE_CONNECTION_LIMIT``) on an epoll loop
(``connections.EventLoop``); a connection that does not send a whole request within
``MODELFORGE_REQUEST_TIMEOUT_SECONDS``, or says nothing for
``MODELFORGE_IDLE_TIMEOUT_SECONDS``, is closed. Bodies are refused by waitress itself
beyond ``MODELFORGE_MAX_BODY_BYTES``, before a byte of them is buffered.

Agents' tunnels come in on the same port (or on ``MODELFORGE_TUNNEL_LISTEN``): the front
(``front.py``) takes them before waitress sees them, once the relay registers its handler
on ``server.tunnel_front``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import threading
from collections.abc import Callable, Iterable
from typing import Any

from waitress.adjustments import Adjustments
from waitress.proxy_headers import (
    PROXY_HEADERS,
    MalformedProxyHeader,
    clear_untrusted_headers,
    parse_proxy_headers,
)
from waitress.task import ThreadedTaskDispatcher

from modelforge_contract import REQUEST_MALFORMED

from ..core.errors import Invalid
from ..core.settings import ConfigError, Settings
from ..relay.endpoint import TunnelEndpoint
from ..store.database import Store
from ..web.http import JSON_HEADERS, SECURITY_HEADERS
from .app import make_app
from .client_loop import ClientLoop
from .connections import Bounds, EventLoop, Server
from .front import TunnelFront, tunnel_port_app
from .tunnel_websocket import websocket_tunnel

log = logging.getLogger(__name__)
wsgi_log = logging.getLogger("modelforge_appliance.wsgi")

# Headers (request line included) beyond this get 431; agents send well under 1 KiB.
MAX_HEADER_BYTES = 32 * 1024
# Descriptors beyond the client connections: listeners, triggers, the store, log files.
SPARE_DESCRIPTORS = 64
LISTEN_BACKLOG = 4096
# How often idle connections and request deadlines are checked.
MAINTENANCE_SECONDS = 1
# An answer's bytes waitress holds for a client before the thread writing it waits for the
# client to take them (its default is 16 MiB). A relayed stream is granted credit as its
# client's connection takes the bytes, so this is about one tunnel window (1 MiB): a client
# that stops reading costs about a window here and a window on the tunnel.
OUTBUF_HIGH_WATERMARK = 1 << 20


def waitress_options(settings: Settings) -> dict[str, Any]:
    return {
        "threads": settings.threads,
        "ident": "modelforge",
        # waitress itself refuses a larger body (413, JSON) from its Content-Length, or
        # as soon as a chunked one passes the limit; what it accepts stays in memory,
        # never in a temporary file.
        "max_request_body_size": settings.max_body_bytes + 1,
        "inbuf_overflow": settings.max_body_bytes + 1,
        "max_request_header_size": MAX_HEADER_BYTES,
        "outbuf_high_watermark": OUTBUF_HIGH_WATERMARK,
        # Each output buffer holds at most the watermark and one more write (a relayed
        # chunk is at most a frame's payload): kept in memory, never in a temporary file.
        "outbuf_overflow": 2 * OUTBUF_HIGH_WATERMARK,
        # Connections the kernel completes while the loop is busy wait here (Linux caps it
        # at net.core.somaxconn).
        "backlog": LISTEN_BACKLOG,
        "channel_timeout": settings.idle_timeout_seconds,
        "cleanup_interval": MAINTENANCE_SECONDS,
        "asyncore_use_poll": True,
        # Forwarded headers are handled by ``forwarded_headers`` (a list of proxies, and
        # refusals in the JSON shape), so waitress must leave them to it.
        "clear_untrusted_proxy_headers": False,
    }


def ensure_file_descriptors(connection_limit: int) -> int:
    """Raise this process's soft open-files limit to fit the connections; ConfigError if it
    cannot. Returns the limit now in force."""
    needed = connection_limit + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard == resource.RLIM_INFINITY or hard >= needed:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
            return needed
        except (ValueError, OSError):
            pass  # e.g. a seccomp filter that forbids setrlimit: report the limit as it is
    raise ConfigError(
        f"MODELFORGE_CONNECTION_LIMIT={connection_limit} needs {needed} open files, but this "
        f"process may open only {soft} (hard limit {hard}); lower MODELFORGE_CONNECTION_LIMIT "
        "or raise the limit (LimitNOFILE= in the systemd unit, --ulimit nofile= for docker, "
        "ulimit -n in a shell)"
    )


class _LogStream:
    """``wsgi.errors`` as a logger: bottle's catch-all writes tracebacks here, and they
    reach the log through the secret mask like every other line."""

    def write(self, text: str) -> int:
        if text.strip():
            wsgi_log.error("%s", text.rstrip())
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        self.write("".join(lines))

    def flush(self) -> None:
        pass


_LOG_STREAM = _LogStream()
# X-Forwarded-For too: console sign-in throttling counts failures by the real client.
_FORWARDED = frozenset({"x-forwarded-proto", "x-forwarded-host", "x-forwarded-for"})


def forwarded_headers(app: Callable, trusted: Iterable[str]) -> Callable:
    """Believe X-Forwarded-Proto/-Host/-For only from the trusted proxies; drop them from anyone
    else. waitress's own parser reads them; a malformed one is a JSON 400."""
    trusted = frozenset(trusted)

    def application(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        environ["wsgi.errors"] = _LOG_STREAM
        untrusted = PROXY_HEADERS
        if environ.get("REMOTE_ADDR") in trusted:
            try:
                untrusted = parse_proxy_headers(
                    environ, trusted_proxy_count=1, trusted_proxy_headers=_FORWARDED, logger=log
                )
            except MalformedProxyHeader as bad:
                log.warning("malformed %s header from the trusted proxy", bad.header)
                refusal = Invalid(
                    f"the proxy sent a malformed {bad.header} header",
                    code=REQUEST_MALFORMED,
                    next_step="Check the reverse proxy's configuration (docs/reverse-proxy.md).",
                )
                raw = json.dumps(refusal.body()).encode()
                start_response(
                    "400 Bad Request",
                    [
                        *JSON_HEADERS.items(),
                        *SECURITY_HEADERS.items(),
                        ("Content-Length", str(len(raw))),
                    ],
                )
                return [raw]
        clear_untrusted_headers(environ, untrusted)
        return app(environ, start_response)

    return application


def create_server(settings: Settings, store: Store, host: str, port: int) -> Server:
    """A waitress server bound to host:port (port 0 picks a free one), and to
    MODELFORGE_TUNNEL_LISTEN where it is set; serve with run_until.

    ``server.tunnel_front`` is where the relay registers the tunnel handler;
    ``server.tunnel_servers`` are the separate tunnel port's listeners (none when unset).
    """
    ensure_file_descriptors(settings.connection_limit)
    app = make_app(settings, store)
    adj = Adjustments(host=host, port=port, **waitress_options(settings))
    tunnel_listen = (
        Adjustments(
            host=settings.tunnel_listen[0],
            port=settings.tunnel_listen[1],
            **waitress_options(settings),
        ).listen
        if settings.tunnel_listen
        else []
    )
    # waitress counts its listening sockets and their wake-up pipes as connections too.
    adj.connection_limit = settings.connection_limit + 2 * (len(adj.listen) + len(tunnel_listen))
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    socket_map: dict[int, Any] = {}
    application = forwarded_headers(app, settings.trusted_proxies)
    servers = [
        Server(application, socket_map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo)
        for sockinfo in adj.listen
    ]
    front = TunnelFront()
    try:
        tunnel_servers = [
            Server(tunnel_port_app, socket_map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo)
            for sockinfo in tunnel_listen
        ]
    except OSError as exc:
        for each in servers:
            each.close()
        where = "{}:{}".format(*settings.tunnel_listen)
        raise ConfigError(
            f"cannot listen on MODELFORGE_TUNNEL_LISTEN={where}: {exc.strerror}; choose a free "
            "address for the tunnels, or leave it unset to share the one port"
        ) from None
    # The tunnels share the one port unless they have their own.
    for each in tunnel_servers or servers:
        each.front = front
    servers += tunnel_servers
    closed = app.metrics.connections_closed
    bounds = Bounds(
        settings.max_buffered_bytes,
        settings.connections_per_address,
        frozenset(settings.trusted_proxies),
    )
    for server in servers:
        server.request_timeout = settings.request_timeout_seconds
        server.bounds = bounds
        server.on_close = lambda reason: closed.labels(reason).inc()
    server = servers[0]
    app.metrics.buffered_bytes.set_function(lambda: bounds.buffered)
    app.metrics.connections_open.set_function(
        lambda: sum(len(each.active_channels) for each in servers)
    )
    app.metrics.requests_queued.set_function(lambda: len(dispatcher.queue))
    # waitress warns on every request that waits for a thread; with a fleet reconnecting
    # at once that is thousands of lines. The queue depth is a metric instead.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    server.app = app  # the bottle application (tests mount a failing route on it)
    server.heartbeats = app.heartbeats  # started and stopped by run_until
    server.unloader = app.unloader  # likewise
    server.refusals = app.refusals  # its pending counts are written when run_until stops
    server.tunnel_front = front  # the relay registers its handler here
    # Client calls (/v1/*) on the relay's event loop; the tunnel-only port takes none.
    clients = server.clients_loop = ClientLoop(
        app.relay,
        application,
        max_connections=settings.connection_limit,
        max_header_bytes=MAX_HEADER_BYTES,
        max_body_bytes=settings.max_body_bytes,
        request_timeout=settings.request_timeout_seconds,
        idle_timeout=settings.idle_timeout_seconds,
        give_back=lambda sock, peer, data: _on_loop(server, lambda: server.adopt(sock, peer, data)),
        closed=lambda peer: _on_loop(
            server, lambda: server.uncount_source(peer[0] if isinstance(peer, tuple) else str(peer))
        ),
    )
    for each in servers:
        if each not in tunnel_servers:
            each.clients = clients
    endpoint = TunnelEndpoint(store, app.hub)
    front.register(websocket_tunnel(endpoint.accept, endpoint.serve), app.relay.start)
    server.tunnel_servers = tunnel_servers
    return server


def _on_loop(server: Server, thunk: Callable[[], None]) -> None:
    """Run ``thunk`` on waitress's loop thread (nothing once it has stopped)."""
    with contextlib.suppress(OSError):
        server.trigger.pull_trigger(thunk)


def run_until(server: Server, stop: threading.Event) -> None:
    """Serve until ``stop`` is set, then close the server from the serving thread itself.

    Closing from another thread while the loop waits in epoll races on the file
    descriptors; polling a stop flag between short loop turns does not.
    """
    heartbeats = server.heartbeats
    heartbeats.start()
    unloader = getattr(server, "unloader", None)
    if unloader is not None:
        unloader.start()
    relay = getattr(getattr(server, "app", None), "relay", None)
    if relay is not None:
        relay.start()  # its sweep closes revoked nodes' tunnels from the first one on
    loop = EventLoop(server._map)
    try:
        while not stop.is_set():
            loop.turn(0.1)
    finally:
        # The relay's loop first: its connections hand back through this loop's trigger.
        clients = getattr(server, "clients_loop", None)
        if clients is not None:
            clients.close()
        if relay is not None:
            relay.stop()
        for dispatcher in list(server._map.values()):  # listeners, and open connections too
            dispatcher.close()
        front = getattr(server, "tunnel_front", None)
        if front is not None:  # the agents' tunnels, which left the loop's map
            front.close()
        loop.close()
        server.task_dispatcher.shutdown(timeout=5)
        if unloader is not None:
            unloader.stop()
        heartbeats.stop()  # acknowledged heartbeats reach the store before we exit
        try:
            server.refusals.flush()
        except Exception as exc:  # the store may be gone; the counts were in the metrics
            log.warning("could not write the counts of repeated refusals: %s", type(exc).__name__)
