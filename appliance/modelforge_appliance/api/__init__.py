"""The JSON API of the control plane, split by caller: ``admin`` and ``agent`` routes
(with the work plane's routes beside each, in ``admin_work`` and ``agent_work``).

``make_app(settings, store)`` builds the one WSGI application; the console (when present)
mounts its own routes on the same app and calls the same service functions.
"""

from __future__ import annotations

import bottle

from ..audit import RefusalLog
from ..console import routes as console_routes
from ..heartbeats import HeartbeatBuffer
from ..metrics import Metrics
from ..settings import Settings
from ..store import Store
from ..telemetry import TelemetryHistory
from . import admin, admin_work, agent, agent_work
from .http import ApiContext, answering, framework_error, security_headers


def make_app(settings: Settings, store: Store) -> bottle.Bottle:
    """Build the WSGI application for these settings and this store.

    ``app.heartbeats`` is the heartbeat buffer; whoever serves the app starts and stops it
    (``server.run_until``), and writes ``app.refusals``' pending counts when it stops.
    """
    app = bottle.Bottle(catchall=True)
    heartbeats = app.heartbeats = HeartbeatBuffer(store)
    metrics = app.metrics = Metrics(store, settings)
    app.default_error_handler = framework_error
    app.install(answering(metrics))
    app.add_hook("after_request", security_headers)
    refusals = app.refusals = RefusalLog(store)
    context = ApiContext(
        settings=settings,
        store=store,
        heartbeats=heartbeats,
        metrics=metrics,
        telemetry=TelemetryHistory(store, settings),
        refusals=refusals,
    )
    admin.add_routes(app, context)
    admin_work.add_routes(app, context)
    agent.add_routes(app, context)
    agent_work.add_routes(app, context)
    console_routes.add_routes(app, context)  # the console: a room of its own
    return app


__all__ = ["ApiContext", "make_app"]
