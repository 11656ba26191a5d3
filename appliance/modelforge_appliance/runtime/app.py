"""The one WSGI application: the JSON API (admin and agent routes) and the console, both
standing on the web layer (answer shapes, the error and auth plugins)."""

from __future__ import annotations

import bottle

from ..api import (
    admin,
    admin_api_keys,
    admin_deployments,
    admin_models,
    admin_users,
    admin_work,
    agent,
    agent_models,
    agent_servers,
    agent_tunnel_http,
    agent_work,
    client,
)
from ..console import routes as console_routes
from ..core.settings import Settings
from ..deployments.idle import Unloader, Usage
from ..fleet.heartbeats import HeartbeatBuffer
from ..fleet.telemetry import TelemetryHistory
from ..relay import links
from ..relay.answer import Relay
from ..relay.hub import Hub
from ..relay.limits import Limits, UsageBook
from ..relay.shares import Shares
from ..store.audit import RefusalLog
from ..store.database import Store
from ..web.auth import Authentication, refuse_undeclared
from ..web.http import ApiContext, answering, framework_error, security_headers
from ..web.metrics import Metrics


def make_app(settings: Settings, store: Store) -> bottle.Bottle:
    """Build the WSGI application for these settings and this store.

    ``app.heartbeats`` is the heartbeat buffer; whoever serves the app starts and stops it
    (``server.run_until``), and writes ``app.refusals``' pending counts when it stops.
    ``app.unloader`` unloads idle deployments (idle.py), started and stopped with it.
    ``app.hub`` holds the agents' tunnels the client API relays over (the server's front
    hands them to it, ``server.create_server``); ``app.relay`` is the loop the relayed
    streams wait on (started on first use, stopped by whoever serves the app).
    """
    app = bottle.Bottle(catchall=True)
    heartbeats = app.heartbeats = HeartbeatBuffer(
        store, heartbeat_interval=settings.heartbeat_interval_seconds
    )
    metrics = app.metrics = Metrics(store, settings)
    # Load on demand: when each deployment was last called, and the thread that unloads
    # the idle ones (started and stopped with the heartbeat buffer, server.run_until).
    usage = app.usage = Usage(store)
    app.unloader = Unloader(store, usage)
    app.default_error_handler = framework_error
    app.add_hook("after_request", security_headers)
    # A connection the database dropped (a restart, a terminated backend) is replaced before
    # the request uses it: each serving thread fails at most one call per outage.
    app.add_hook("before_request", lambda: store.revalidate())
    refusals = app.refusals = RefusalLog(store)
    context = ApiContext(
        settings=settings,
        store=store,
        heartbeats=heartbeats,
        metrics=metrics,
        telemetry=TelemetryHistory(store, settings),
        refusals=refusals,
    )
    # The error plugin wraps the auth plugin, so a refusal is answered in the one shape.
    app.install(answering(metrics))
    app.install(Authentication(context))
    admin.add_routes(app, context)
    admin_work.add_routes(app, context)
    agent.add_routes(app, context)
    agent_work.add_routes(app, context)
    admin_models.add_routes(app, context)
    agent_models.add_routes(app, context)
    admin_deployments.add_routes(app, context)
    agent_servers.add_routes(app, context)
    # The relay's streams wait on its own event loop, within its fair shares.
    # A split model's main node reaches its helpers over the hub (relay/links.py).
    hub = app.hub = Hub(
        on_protocol_error=metrics.relay_tunnel_errors.inc, authorize_link=links.authorizer(store)
    )
    shares = Shares(
        settings.relay_streams,
        settings.relay_streams_per_key,
        settings.relay_streams_per_deployment,
    )
    # API keys' limits and what each used, counted in memory and written in batches.
    book = app.usage_book = UsageBook(store)
    relay = app.relay = Relay(
        store,
        hub,
        metrics,
        shares,
        settings.relay_head_timeout_seconds,
        settings.relay_idle_timeout_seconds,
        book,
    )
    client.add_routes(app, context, relay, Limits(store, book))
    admin_api_keys.add_routes(app, context, book)
    admin_users.add_routes(app, context)
    agent_tunnel_http.add_routes(app, context, hub)
    console_routes.add_routes(app, context)
    refuse_undeclared(app)  # a route that names no caller stops the app here
    return app
