"""Authentication by declaration: every route says who may call it, one plugin enforces it.

A route declares its caller with ``auth=`` (``app.post(PATH, auth=ADMIN)``); the plugin
authenticates before the handler runs and hands it what it proved, as a keyword argument the
handler names (``actor``, ``agent``, ``protocol``, ``session``). A route that declares
nothing, or a caller this module does not know, refuses to install: ``runtime.app.make_app``
prepares every route when it builds the app, so such an app never starts.

The callers:

- ``PUBLIC``: anyone (``/healthz``, the sign-in page, static files).
- ``ENROLLING``: an agent without a credential yet: its protocol header is checked (426), and
  the single-use token in the body is what the enrollment service authenticates.
- ``AGENT``: a node credential (``Authorization: Bearer mfc_…``) and the protocol header. In
  this order: protocol (426), credential (401, or 403 for a decommissioned node), body (400,
  413), then the node the body names (403 when it is another node's; invariant 4).
- ``ADMIN``: an admin token (``X-ModelForge-Admin-Token``) or a console session, whose CSRF
  token must come with every state-changing call (403, nothing changed). Each belongs to a
  user, whose role must be at least what the route's declared ``action=`` needs
  (identity/roles.py; 403 ROLE_FORBIDDEN); a disabled user's are refused (401
  USER_DISABLED). The handler gets ``actor`` (the audit's words) and ``principal``.
- ``SCRAPER``: an admin token as ``X-ModelForge-Admin-Token`` or ``Authorization: Bearer``
  (Prometheus sends its credentials that way), of an enabled user.
- ``SESSION``: a console session. A page without one redirects to the sign-in page; a
  state-changing call without one is refused (401), without its CSRF token 403.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import bottle

from modelforge_contract import (
    API_KEY_INVALID,
    COMPATIBILITY_NEXT_STEPS,
    COMPATIBLE,
    HEADER_ADMIN_TOKEN,
    HEADER_AGENT_PROTOCOL,
    HEADER_CSRF_TOKEN,
    SESSION_COOKIE,
    compatibility_of,
)

from ..core.errors import ApiError, UpgradeRequired
from ..core.validation import Field
from ..identity import admin_tokens, api_keys, credentials, key_guesses, roles, sessions, users
from ..store import audit
from .http import ApiContext, client_address, redirect, request_header

PUBLIC = "public"
ENROLLING = "enrolling"
AGENT = "agent"
ADMIN = "admin"
SCRAPER = "scraper"
SESSION = "session"
CLIENT = "client"  # an API key (mfk_…): the client API on /v1 (issue 26)
CALLERS = frozenset({PUBLIC, ENROLLING, AGENT, ADMIN, SCRAPER, SESSION, CLIENT})

STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SIGN_IN_PATH = "/console/sign-in"


class UndeclaredRoute(Exception):
    """A route that does not say who may call it: the app refuses to install it."""


@dataclass(frozen=True)
class Body:
    """An ``AGENT`` route's body fields, declared as ``body=Body(FIELDS)`` (bottle's route
    config would flatten a bare dict into one key per field)."""

    fields: dict[str, Field]
    raw: bool = False  # the handler reads the body itself (RAW_BODY): no JSON is parsed


@dataclass(frozen=True)
class AgentCall:
    """What an ``AGENT`` route's plugin proved: the protocol, the parsed body, the caller."""

    protocol: int
    fields: dict[str, Any]
    caller: credentials.Caller


def agent_protocol() -> int:
    """Invariant 8: every agent call names its protocol; anything else gets 426."""
    header = request_header(HEADER_AGENT_PROTOCOL)
    answer = compatibility_of(header)
    if answer != COMPATIBLE:
        shown = header if header is None else header[:32]
        raise UpgradeRequired(
            f"agent protocol {shown!r} is not accepted ({answer})",
            next_step=COMPATIBILITY_NEXT_STEPS[answer],
            extra={"compatibility": answer},
        )
    return int(header)


def token_principal(context: ApiContext, header: str | None) -> users.Principal:
    """The user behind an admin token, with its role (401 for a bad token or a disabled
    user)."""
    token = admin_tokens.authenticate_admin(context.store, header)
    role = users.role_of(context.store, token.user_name)
    return users.Principal(
        token.user_name, role, f"{audit.admin_actor(token.token_id)} ({token.user_name})"
    )


def admin_principal(context: ApiContext) -> users.Principal:
    """Authenticate the admin, then flush heartbeats so the answer sees the acknowledged ones.

    In that order: a request without a valid credential causes no write at all. An admin
    token (automation) wins; otherwise a console session cookie, which must carry its CSRF
    token in ``X-CSRF-Token`` on every state-changing call (403, nothing changed).
    """
    request = bottle.request
    header = request_header(HEADER_ADMIN_TOKEN)
    cookie = request.get_cookie(SESSION_COOKIE)
    if header or not cookie:
        principal = token_principal(context, header)
    else:
        session = sessions.session_for(context.store, context.settings, cookie)
        if request.method in STATE_CHANGING_METHODS:
            sessions.check_csrf(session, request_header(HEADER_CSRF_TOKEN))
        role = users.role_of(context.store, session.user)
        principal = users.Principal(session.user, role, session.actor)
    context.heartbeats.flush()
    return principal


def scraper(context: ApiContext) -> None:
    """An admin token in either header; heartbeats flushed, as for an admin."""
    scheme, _, value = (request_header("Authorization") or "").strip().partition(" ")
    bearer = value.strip() if scheme.lower() == "bearer" else ""  # RFC 9110: any case
    header = request_header(HEADER_ADMIN_TOKEN) or bearer
    roles.check(token_principal(context, header or None), "metrics.read")
    context.heartbeats.flush()


# A GET agent route (``body=NO_BODY``): no body is read; the caller is the credential's node.
NO_BODY = Body({})
# A binary agent route (``body=RAW_BODY``, the tunnel's uploads): the plugin reads no body,
# the caller is the credential's node, and the handler reads and bounds the bytes itself.
RAW_BODY = Body({}, raw=True)


def agent_call(context: ApiContext, body: dict[str, Field]) -> AgentCall:
    protocol = agent_protocol()
    credential = credentials.authenticate_credential(context.store, request_header("Authorization"))
    if not body:  # NO_BODY and RAW_BODY: the body (if any) is the handler's
        return AgentCall(protocol, {}, credential.for_node(credential.owner))
    fields = context.body(body)
    return AgentCall(protocol, fields, credential.for_node(fields["node_id"]))


def signed_in_session(context: ApiContext) -> sessions.Session | None:
    """The console session this request's cookie names, or None when there is none."""
    try:
        return sessions.session_for(
            context.store, context.settings, bottle.request.get_cookie(SESSION_COOKIE)
        )
    except ApiError:
        return None


def console_session(context: ApiContext) -> sessions.Session | bottle.HTTPResponse:
    """The signed-in session of an enabled user; a page without one is sent to sign in."""
    if bottle.request.method not in STATE_CHANGING_METHODS:
        session = signed_in_session(context)
        if session is not None:
            try:
                users.role_of(context.store, session.user)
            except ApiError:
                session = None
        return session if session is not None else redirect(SIGN_IN_PATH)
    cookie = bottle.request.get_cookie(SESSION_COOKIE)
    session = sessions.session_for(context.store, context.settings, cookie)
    sessions.check_csrf(session, request_header(HEADER_CSRF_TOKEN))
    return session


def client_key(context: ApiContext, guesses: key_guesses.WrongKeyThrottle) -> Any:
    """The API key of a client call. An address that sent a burst of wrong keys is refused
    (429) before any key is looked up; each wrong key counts and is not logged by itself."""
    header = request_header("Authorization")
    address = client_address()
    if header:  # no key at all is not a guess
        guesses.check(address)
    try:
        key = api_keys.authenticate_api_key(context.store, header)
    except ApiError as refused:
        if refused.code == API_KEY_INVALID:
            guesses.wrong(address)
            refused.logged = False
        raise
    guesses.right(address)
    return key


class Authentication:
    """The bottle plugin that enforces each route's ``auth`` declaration."""

    name = "modelforge-auth"
    api = 2

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.key_guesses = key_guesses.WrongKeyThrottle()

    def apply(self, callback: Callable, route: bottle.Route) -> Callable:
        caller = route.config.get("auth")
        if caller not in CALLERS:
            raise UndeclaredRoute(
                f"{route.method} {route.rule} declares no caller: give it auth= one of "
                f"{', '.join(sorted(CALLERS))} (web/auth.py)"
            )
        wanted = inspect.signature(route.callback).parameters
        context, guesses = self.context, self.key_guesses
        if caller == AGENT:
            body = route.config.get("body")
            if not isinstance(body, Body):
                raise UndeclaredRoute(
                    f"{route.method} {route.rule}: an agent route needs body=Body(FIELDS)"
                )
        action = route.config.get("action")
        if caller == ADMIN and action not in roles.MIN_ROLE:
            raise UndeclaredRoute(
                f"{route.method} {route.rule} declares no action: give it action= one of "
                f"{', '.join(sorted(roles.MIN_ROLE))} (identity/roles.py)"
            )

        @functools.wraps(callback)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if caller == ADMIN:
                principal = admin_principal(context)
                roles.check(principal, action)
                if "actor" in wanted:
                    kwargs["actor"] = principal.actor
                if "principal" in wanted:
                    kwargs["principal"] = principal
            elif caller == SCRAPER:
                scraper(context)
            elif caller == CLIENT:
                key = client_key(context, guesses)
                if "client" in wanted:
                    kwargs["client"] = key
            elif caller == AGENT:
                kwargs["agent"] = agent_call(context, body.fields)
            elif caller == ENROLLING:
                protocol = agent_protocol()
                if "protocol" in wanted:
                    kwargs["protocol"] = protocol
            elif caller == SESSION:
                session = console_session(context)
                if isinstance(session, bottle.HTTPResponse):
                    return session
                kwargs["session"] = session
            return callback(*args, **kwargs)

        return wrapper


def refuse_undeclared(app: bottle.Bottle) -> None:
    """Apply the plugins to every route now, so an undeclared one stops the app being built
    instead of failing on its first request."""
    for route in app.routes:
        route.prepare()
