"""The HTTP face of the control plane. Handlers parse, call one service function, shape the answer."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import bottle
import peewee as pw

from modelforge_contract import (
    API_PREFIX,
    COMPATIBILITY_NEXT_STEPS,
    COMPATIBLE,
    HEADER_ADMIN_TOKEN,
    HEADER_AGENT_PROTOCOL,
    HOST_INVALID,
    INTERNAL_ERROR,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    PATH_ADMIN_ALERTS,
    PATH_ADMIN_AUDIT,
    PATH_ADMIN_ENROLLMENT,
    PATH_ADMIN_ENROLLMENTS,
    PATH_ADMIN_NODE,
    PATH_ADMIN_NODE_CORDON,
    PATH_ADMIN_NODE_CREDENTIAL,
    PATH_ADMIN_NODE_CREDENTIALS,
    PATH_ADMIN_NODE_DECOMMISSION_EXECUTE,
    PATH_ADMIN_NODE_DECOMMISSION_PREVIEW,
    PATH_ADMIN_NODE_READINESS,
    PATH_ADMIN_NODE_UNCORDON,
    PATH_ADMIN_NODES,
    PATH_AGENT_ENROLL,
    PATH_AGENT_HEARTBEAT,
    PATH_AGENT_INVENTORY,
    PATH_AGENT_TELEMETRY,
    PATH_HEALTHZ,
    PATH_METRICS,
    QUERY_INVALID,
    compatibility_of,
)

from . import admin_tokens, alerts, audit, credentials, decommission, enrollment, nodes, readiness
from .clock import isoformat
from .errors import ApiError, Invalid, StoreUnavailable, UpgradeRequired
from .heartbeats import HeartbeatBuffer
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .settings import Settings, normalize_origin
from .store import Store
from .validation import (
    ENROLL_FIELDS,
    EXECUTE_FIELDS,
    HEARTBEAT_FIELDS,
    INVENTORY_FIELDS,
    MINT_FIELDS,
    TELEMETRY_FIELDS,
    Field,
    parse_body,
)

log = logging.getLogger(__name__)

AGENT_PREFIX = f"{API_PREFIX}/agent/"
JSON_HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store"}


def json_response(body: dict[str, Any], status: int = 200) -> bottle.HTTPResponse:
    return bottle.HTTPResponse(json.dumps(body), status=status, headers=JSON_HEADERS)


def error_response(error: ApiError) -> bottle.HTTPResponse:
    return json_response(error.body(), error.status)


def _answering(metrics: Metrics) -> Callable:
    """A bottle plugin: time every route, and render its errors in the one error shape."""

    def plugin(callback: Callable) -> Callable:
        @functools.wraps(callback)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            response = _api_errors(callback, args, kwargs)
            request = bottle.request
            metrics.latency.labels(
                request.method, request.route.rule, str(response.status_code)
            ).observe(time.perf_counter() - began)
            return response

        return wrapper

    return plugin


def _api_errors(callback: Callable, args: tuple, kwargs: dict) -> bottle.HTTPResponse:
    """Render domain errors, and a store that stopped answering, in the one error shape."""
    try:
        return callback(*args, **kwargs)
    except ApiError as error:
        request = bottle.request
        log.info("%s %s -> %d %s", request.method, request.path, error.status, error.code)
        return error_response(_with_compatibility(error))
    except (pw.OperationalError, pw.InterfaceError) as exc:
        log.error(
            "store error on %s %s: %s",
            bottle.request.method,
            bottle.request.path,
            type(exc).__name__,
        )
        return error_response(StoreUnavailable("the store did not answer"))


def _with_compatibility(error: ApiError) -> ApiError:
    """Every agent response carries ``compatibility``, refusals included (DESIGN §3)."""
    if bottle.request.path.startswith(AGENT_PREFIX) and "compatibility" not in error.extra:
        error.extra["compatibility"] = compatibility_of(
            bottle.request.get_header(HEADER_AGENT_PROTOCOL)
        )
    return error


def _framework_error(error: bottle.HTTPError) -> str:
    """404, 405 and uncaught exceptions from bottle itself, in the one error shape."""
    bottle.response.content_type = "application/json"
    bottle.response.set_header("Cache-Control", "no-store")
    if error.status_code == 404:
        body = ApiError(
            "no such endpoint",
            code=NOT_FOUND,
            status=404,
            next_step="See docs/api.md for the endpoints.",
        )
    elif error.status_code == 405:
        body = ApiError(
            f"{bottle.request.method} is not allowed here",
            code=METHOD_NOT_ALLOWED,
            status=405,
            next_step=f"Use one of: {error.headers.get('Allow', '')}.",
        )
    else:
        if error.exception is not None:
            log.error(
                "unhandled %s on %s %s",
                type(error.exception).__name__,
                bottle.request.method,
                bottle.request.path,
            )
        body = ApiError(
            "the control plane failed to answer",
            code=INTERNAL_ERROR,
            status=500,
            next_step="Retry; if it persists, check the control plane's log.",
        )
    return json.dumps(body.body())


def request_origin(environ: dict[str, Any]) -> str:
    """The origin the client addressed. Behind MODELFORGE_TRUSTED_PROXY, waitress has already
    put the proxy's X-Forwarded-Proto and X-Forwarded-Host into these two keys."""
    scheme = environ.get("wsgi.url_scheme", "http")
    host = environ.get("HTTP_HOST") or ""
    try:
        origin = normalize_origin(f"{scheme}://{host}")
    except ValueError:
        return "unknown"
    return origin if len(origin) <= ORIGIN_MAX_LENGTH else "unknown"


ORIGIN_MAX_LENGTH = 300  # the column that keeps a token's origin


def _query_int(name: str, default: int | None, low: int, high: int) -> int | None:
    raw = bottle.request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise Invalid(
            f"query parameter {name} must be an integer in {low}..{high}", code=QUERY_INVALID
        )
    return int(raw)


def make_app(settings: Settings, store: Store) -> bottle.Bottle:
    """Build the WSGI application for these settings and this store.

    ``app.heartbeats`` is the heartbeat buffer; whoever serves the app starts and stops it
    (``server.run_until``).
    """
    app = bottle.Bottle(catchall=True)
    heartbeats = app.heartbeats = HeartbeatBuffer(store)
    app.default_error_handler = _framework_error
    metrics = app.metrics = Metrics(store, settings)
    app.install(_answering(metrics))
    clock = store.clock

    def body(fields: dict[str, Field]) -> dict[str, Any]:
        return parse_body(bottle.request.environ, settings.max_body_bytes, fields)

    def admin() -> str:
        """Authenticate the admin; flush heartbeats so every answer sees the acknowledged ones."""
        heartbeats.flush()
        token = admin_tokens.authenticate_admin(
            store, bottle.request.get_header(HEADER_ADMIN_TOKEN)
        )
        return audit.admin_actor(token.token_id)

    def agent_protocol() -> int:
        """Invariant 8: every agent call names its protocol; anything else gets 426."""
        header = bottle.request.get_header(HEADER_AGENT_PROTOCOL)
        answer = compatibility_of(header)
        if answer != COMPATIBLE:
            raise UpgradeRequired(
                f"agent protocol {header!r} is not accepted ({answer})",
                next_step=COMPATIBILITY_NEXT_STEPS[answer],
                extra={"compatibility": answer},
            )
        return int(header)

    def agent_credential(node_id: str):
        return credentials.authenticate_node(
            store, bottle.request.get_header("Authorization"), node_id
        )

    def claim(store: Store, request: enrollment.EnrollRequest) -> enrollment.Enrolled:
        try:
            enrolled = enrollment.claim_token(store, request)
        except ApiError as refusal:
            metrics.enrollments.labels(refusal.code).inc()
            raise
        metrics.enrollments.labels("REENROLLED" if enrolled.reenrolled else "ENROLLED").inc()
        return enrolled

    @app.get(PATH_METRICS)
    def prometheus_metrics():
        # Prometheus sends `authorization: {credentials: mfa_…}` as a Bearer header.
        bearer = bottle.request.get_header("Authorization", "")
        header = bottle.request.get_header(HEADER_ADMIN_TOKEN) or bearer.removeprefix("Bearer ")
        admin_tokens.authenticate_admin(store, header or None)
        heartbeats.flush()
        return bottle.HTTPResponse(
            metrics.exposition(),
            headers={"Content-Type": METRICS_CONTENT_TYPE, "Cache-Control": "no-store"},
        )

    @app.get(PATH_HEALTHZ)
    def healthz():
        if not store.ping():
            raise StoreUnavailable("the store did not answer")
        return json_response({"status": "ok"})

    # -- admin: enrollment tokens ------------------------------------------------

    @app.post(PATH_ADMIN_ENROLLMENTS)
    def mint():
        actor = admin()
        fields = body(MINT_FIELDS)
        origin = settings.public_api_origin or request_origin(bottle.request.environ)
        if origin == "unknown":
            raise Invalid(
                "the Host header of this request is not an origin a token can be locked to",
                code=HOST_INVALID,
                next_step="Set MODELFORGE_PUBLIC_API_ORIGIN, or mint through the address the "
                "agents use.",
            )
        minted = enrollment.mint_enrollment_token(
            store,
            display_name=fields["display_name"],
            expires_in_seconds=fields["expires_in_seconds"],
            api_origin=origin,
            actor=actor,
        )
        return json_response(minted.response(clock.now()), 201)

    @app.get(PATH_ADMIN_ENROLLMENTS)
    def list_enrollments():
        admin()
        return json_response({"enrollments": enrollment.list_enrollments(store)})

    @app.delete(PATH_ADMIN_ENROLLMENT)
    def revoke_enrollment(enrollment_id: str):
        actor = admin()
        return json_response(enrollment.revoke_enrollment(store, enrollment_id, actor))

    # -- admin: fleet and audit ------------------------------------------------

    @app.get(PATH_ADMIN_NODES)
    def fleet():
        admin()
        return json_response({"nodes": nodes.list_nodes(store, settings)})

    @app.get(PATH_ADMIN_NODE)
    def one_node(node_id: str):
        admin()
        node = nodes.get_node(store, node_id)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.get(PATH_ADMIN_NODE_READINESS)
    def node_readiness(node_id: str):
        admin()
        return json_response(readiness.readiness_of(store, settings, node_id))

    @app.get(PATH_ADMIN_NODE_CREDENTIALS)
    def node_credentials(node_id: str):
        admin()
        return json_response(credentials.credentials_of(store, nodes.get_node(store, node_id)))

    @app.delete(PATH_ADMIN_NODE_CREDENTIAL)
    def revoke_node_credential(node_id: str):
        actor = admin()
        node = nodes.get_node(store, node_id)
        revoked = credentials.revoke_node_credential(store, node, actor)
        return json_response({"node_id": node_id, "revoked": revoked})

    @app.post(PATH_ADMIN_NODE_DECOMMISSION_PREVIEW)
    def decommission_preview(node_id: str):
        actor = admin()
        return json_response(decommission.preview(store, node_id, actor))

    @app.post(PATH_ADMIN_NODE_DECOMMISSION_EXECUTE)
    def decommission_execute(node_id: str):
        actor = admin()
        confirmation = body(EXECUTE_FIELDS)["confirmation"]
        return json_response(decommission.execute(store, node_id, confirmation, actor))

    @app.post(PATH_ADMIN_NODE_CORDON)
    def cordon(node_id: str):
        actor = admin()
        node = nodes.set_cordoned(store, node_id, True, actor)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.post(PATH_ADMIN_NODE_UNCORDON)
    def uncordon(node_id: str):
        actor = admin()
        node = nodes.set_cordoned(store, node_id, False, actor)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.get(PATH_ADMIN_ALERTS)
    def list_alerts():
        admin()
        return json_response({"alerts": alerts.active_alerts(store, settings)})

    @app.get(PATH_ADMIN_AUDIT)
    def audit_events():
        admin()
        limit = _query_int("limit", 50, 1, 500)
        before = _query_int("before", None, 1, 2**62)
        node_id = bottle.request.query.get("node_id") or None
        return json_response(audit.list_events(store, limit=limit, before=before, node_id=node_id))

    # -- agent -------------------------------------------------------------------

    @app.post(PATH_AGENT_ENROLL)
    def enroll():
        protocol = agent_protocol()
        fields = body(ENROLL_FIELDS)
        identity = fields.get("identity") or {}
        enrolled = claim(
            store,
            enrollment.EnrollRequest(
                token=fields["token"],
                hostname=fields["hostname"],
                agent_version=fields["agent_version"],
                accelerator_mode=fields["accelerator_mode"],
                protocol_version=protocol,
                request_origin=request_origin(bottle.request.environ),
                identity_id=identity.get("identity_id"),
                identity_secret=identity.get("identity_secret"),
            ),
        )
        return json_response(
            {
                "node_id": enrolled.node.node_id,
                "credential": enrolled.credential,
                "reenrolled": enrolled.reenrolled,
                "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                "compatibility": COMPATIBLE,
            },
            201,
        )

    @app.post(PATH_AGENT_HEARTBEAT)
    def heartbeat():
        protocol = agent_protocol()
        fields = body(HEARTBEAT_FIELDS)
        caller = agent_credential(fields["node_id"])
        metrics.heartbeats.inc()
        at = heartbeats.record(
            caller,
            agent_version=fields["agent_version"],
            protocol=protocol,
            health=fields["health"],
        )
        return json_response(
            {
                "server_time": isoformat(at),
                "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                "compatibility": COMPATIBLE,
            }
        )

    @app.put(PATH_AGENT_INVENTORY)
    def inventory():
        agent_protocol()
        fields = body(INVENTORY_FIELDS)
        caller = agent_credential(fields["node_id"])
        at = nodes.record_inventory(store, caller, fields)
        return json_response({"server_time": isoformat(at), "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_TELEMETRY)
    def telemetry():
        agent_protocol()
        fields = body(TELEMETRY_FIELDS)
        caller = agent_credential(fields["node_id"])
        at = nodes.record_telemetry(store, caller, fields["samples"])
        return json_response({"server_time": isoformat(at), "compatibility": COMPATIBLE})

    return app
