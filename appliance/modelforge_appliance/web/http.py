"""What every JSON route shares: the answer shapes, the error plugin, request parsing."""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import bottle
import peewee as pw

from modelforge_contract import (
    API_PREFIX,
    HEADER_AGENT_PROTOCOL,
    INTERNAL_ERROR,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    QUERY_INVALID,
    REQUEST_MALFORMED,
    compatibility_of,
)

from ..core.errors import ApiError, Invalid, StoreUnavailable
from ..core.settings import Settings, is_unspecified, normalize_origin
from ..core.validation import Field, parse_body
from ..fleet.heartbeats import HeartbeatBuffer
from ..fleet.telemetry import TelemetryHistory
from ..store.audit import RefusalLog
from ..store.database import Store
from .metrics import Metrics

log = logging.getLogger(__name__)

AGENT_PREFIX = f"{API_PREFIX}/agent/"
JSON_HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store"}
# The environ key of a request the relay's event loop answers itself (runtime/client_loop.py):
# the route appends what the loop is to send (a relayed request, a tunnel download) to the
# list there, and returns its status and headers without a body.
DEFERRED = "modelforge.relay.deferred"
ORIGIN_MAX_LENGTH = 300  # the column that keeps a token's origin


@dataclass(frozen=True)
class ApiContext:
    """What the route modules share: settings, store, heartbeat buffer, metrics, and the
    rate-limited audit of repeated refusals."""

    settings: Settings
    store: Store
    heartbeats: HeartbeatBuffer
    metrics: Metrics
    refusals: RefusalLog
    telemetry: TelemetryHistory

    def body(self, fields: dict[str, Field]) -> dict[str, Any]:
        return parse_body(bottle.request.environ, self.settings.max_body_bytes, fields)


def client_address() -> str:
    """The client's address as waitress saw it (the proxy's client behind a trusted proxy).

    Not bottle's ``remote_addr``: that believes any X-Forwarded-For a client sends.
    """
    return (bottle.request.environ.get("REMOTE_ADDR") or "unknown")[:64]


def request_header(name: str) -> str | None:
    """A request header as text. HTTP carries bytes; a value that is not UTF-8 comes back
    with U+FFFD in place of the bad bytes, so it fails every check like any other wrong
    value (401, 426 UNKNOWN) instead of raising (bottle's own ``get_header`` would)."""
    raw = bottle.request.environ.get("HTTP_" + name.upper().replace("-", "_"))
    if raw is None:
        return None
    return raw.encode("latin-1", "replace").decode("utf-8", "replace")


# Every answer, page or JSON: scripts and styles only from this origin, no inline code, no
# framing, no referrer, no guessing of content types.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def security_headers() -> None:
    """An ``after_request`` hook: runs for routes, error pages and 404s alike."""
    for name, value in SECURITY_HEADERS.items():
        bottle.response.set_header(name, value)


def json_response(body: dict[str, Any], status: int = 200) -> bottle.HTTPResponse:
    return bottle.HTTPResponse(json.dumps(body), status=status, headers=JSON_HEADERS)


def redirect(location: str) -> bottle.HTTPResponse:
    """A 303 to ``location``, never cached (the console's pages and its sign-in)."""
    return bottle.HTTPResponse(
        status=303, headers={"Location": location, "Cache-Control": "no-store"}
    )


def error_parts(error: ApiError) -> tuple[int, list[tuple[str, str]], bytes]:
    """An error's whole answer: status, headers (the security headers too) and body."""
    raw = json.dumps(error.body()).encode()
    headers = [*JSON_HEADERS.items(), ("Content-Length", str(len(raw)))]
    if "retry_after_seconds" in error.extra:  # a 429 says when to come back (RFC 9110)
        headers.append(("Retry-After", str(error.extra["retry_after_seconds"])))
    return error.status, [*headers, *SECURITY_HEADERS.items()], raw


def error_response(error: ApiError) -> bottle.HTTPResponse:
    status, headers, raw = error_parts(error)
    return bottle.HTTPResponse(raw, status=status, headers=headers)


def answering(metrics: Metrics) -> Callable:
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
        if error.logged:
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
    """Every agent response carries ``compatibility``, refusals included
    (docs/architecture.md §3)."""
    if bottle.request.path.startswith(AGENT_PREFIX) and "compatibility" not in error.extra:
        error.extra["compatibility"] = compatibility_of(request_header(HEADER_AGENT_PROTOCOL))
    return error


def framework_error(error: bottle.HTTPError) -> str:
    """404, 405, other refusals and uncaught exceptions from bottle itself, in the one error
    shape; agent routes add ``compatibility`` as everywhere else."""
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
    elif 400 <= error.status_code < 500:
        body = ApiError(
            "the request is not well-formed",
            code=REQUEST_MALFORMED,
            status=error.status_code,
            next_step="Send a well-formed request; see docs/api.md.",
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
    return json.dumps(_with_compatibility(body).body())


def request_origin(environ: dict[str, Any]) -> str:
    """The origin the client addressed. Behind MODELFORGE_TRUSTED_PROXY, waitress has already
    put the proxy's X-Forwarded-Proto and X-Forwarded-Host into these two keys."""
    scheme = environ.get("wsgi.url_scheme", "http")
    host = environ.get("HTTP_HOST") or ""
    try:
        origin = normalize_origin(f"{scheme}://{host}")
    except ValueError:
        return "unknown"
    if is_unspecified(urlsplit(origin).hostname or ""):
        return "unknown"  # 0.0.0.0 or [::]: no agent elsewhere can dial it
    return origin if len(origin) <= ORIGIN_MAX_LENGTH else "unknown"


_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() also takes "²"


def query_int(name: str, default: int | None, low: int, high: int) -> int | None:
    raw = bottle.request.query.get(name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not low <= int(raw) <= high:
        raise Invalid(
            f"query parameter {name} must be an integer in {low}..{high}", code=QUERY_INVALID
        )
    return int(raw)
