"""The JSON API of the control plane, split by caller: ``admin`` and ``agent`` routes.

``make_app(settings, store)`` builds the one WSGI application; the console (when present)
mounts its own routes on the same app and calls the same service functions.
"""

from __future__ import annotations

import bottle

from ..audit import RefusalLog
from ..heartbeats import HeartbeatBuffer
from ..metrics import Metrics
from ..settings import Settings
from ..store import Store
from . import admin, agent
from .http import ApiContext, answering, framework_error


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
    refusals = app.refusals = RefusalLog(store)
    context = ApiContext(
        settings=settings, store=store, heartbeats=heartbeats, metrics=metrics, refusals=refusals
    )
    admin.add_routes(app, context)
    agent.add_routes(app, context)
    return app


__all__ = ["ApiContext", "make_app"]
