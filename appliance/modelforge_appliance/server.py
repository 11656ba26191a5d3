"""Run the control plane on waitress."""

from __future__ import annotations

import logging
import threading

import waitress
from waitress.server import BaseWSGIServer

from .api import make_app
from .clock import Clock
from .settings import Settings
from .store import Store

log = logging.getLogger(__name__)


def open_store(settings: Settings, clock: Clock | None = None) -> Store:
    """The store for these settings, migrated to this program's schema."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = Store(settings.database_url, clock or Clock())
    store.migrate()
    return store


def waitress_options(settings: Settings) -> dict:
    proxy = {}
    if settings.trusted_proxy:
        # waitress rewrites wsgi.url_scheme, HTTP_HOST and REMOTE_ADDR from these headers,
        # and only for requests from this address; it strips them from everyone else. The
        # client address is what console sign-in throttling counts failures by.
        proxy = {
            "trusted_proxy": settings.trusted_proxy,
            "trusted_proxy_count": 1,
            "trusted_proxy_headers": {"x-forwarded-proto", "x-forwarded-host", "x-forwarded-for"},
        }
    return {
        **proxy,
        "threads": settings.threads,
        "ident": "modelforge",
        # Our own limit answers 413 in the JSON error shape; waitress only stops abuse far beyond it.
        "max_request_body_size": max(settings.max_body_bytes * 4, 16 * 1024 * 1024),
        "channel_timeout": 60,
    }


def create_server(settings: Settings, store: Store, host: str, port: int) -> BaseWSGIServer:
    """A waitress server bound to host:port (port 0 picks a free one); call ``.run()``."""
    app = make_app(settings, store)
    server = waitress.create_server(app, host=host, port=port, **waitress_options(settings))
    server.heartbeats = app.heartbeats  # started and stopped by run_until
    return server


def run_until(server: BaseWSGIServer, stop: threading.Event) -> None:
    """Serve until ``stop`` is set, then close the server from the serving thread itself.

    Closing from another thread while waitress sits in select() races on the file
    descriptors; polling a stop flag between short loop turns does not.
    """
    heartbeats = server.heartbeats
    heartbeats.start()
    try:
        while not stop.is_set():
            server.asyncore.loop(timeout=0.1, map=server._map, use_poll=True, count=1)
    finally:
        server.close()
        for channel in list(server._map.values()):  # open keep-alive connections go too
            channel.close()
        server.task_dispatcher.shutdown(timeout=5)
        heartbeats.stop()  # acknowledged heartbeats reach the store before we exit
