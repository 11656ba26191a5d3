"""Every route declares who may call it (web/auth.py), and every route that is not public
refuses a caller without credentials: the walk covers ``app.routes``, not a hand list. A
refused request writes nothing, not even a heartbeat flush."""

from __future__ import annotations

import contextlib
import re
import threading

import bottle
import pytest
import requests

from modelforge_appliance.api import admin
from modelforge_appliance.core.clock import Clock, ManualClock
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.runtime.app import make_app
from modelforge_appliance.runtime.connections import EventLoop
from modelforge_appliance.runtime.server import create_server
from modelforge_appliance.store import audit
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import AdminToken, Node
from modelforge_appliance.web import auth
from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION
from tests.harness.control_plane import ControlPlane, error_code, make_settings

from .test_agent_auth import enroll_node

# A request with these headers still carries no credential of any kind.
FORGED_ADMIN = {"X-ModelForge-Admin-Token": "mfa_0000000000000000_" + "x" * 43}
FORGED_AGENT = {"Authorization": "Bearer mfc_0000000000000000_" + "x" * 43}


def concrete(rule: str) -> str:
    """The rule with each wildcard filled in (``<node_id>`` -> ``x``)."""
    return re.sub(r"<[^>]+>", "x", rule)


def routes_by_caller(app: bottle.Bottle) -> dict[str, list[bottle.Route]]:
    grouped: dict[str, list[bottle.Route]] = {caller: [] for caller in auth.CALLERS}
    for route in app.routes:
        grouped[route.config["auth"]].append(route)
    return grouped


def test_every_route_declares_a_known_caller(sqlite_control_plane):
    app = sqlite_control_plane.server.app
    assert app.routes, "the app has no routes"
    for route in app.routes:
        assert route.config.get("auth") in auth.CALLERS, (route.method, route.rule)
    grouped = routes_by_caller(app)
    # The walk below would prove nothing if the declarations it reads were all "public".
    assert len(grouped[auth.ADMIN]) >= 20 and len(grouped[auth.AGENT]) >= 6, {
        caller: len(routes) for caller, routes in grouped.items()
    }


def test_every_admin_and_scraper_route_refuses_without_a_valid_admin_token(sqlite_control_plane):
    cp = sqlite_control_plane
    grouped = routes_by_caller(cp.server.app)
    for route in grouped[auth.ADMIN] + grouped[auth.SCRAPER]:
        for headers in ({}, FORGED_ADMIN):
            response = requests.request(
                route.method, cp.url + concrete(route.rule), headers=headers, timeout=10
            )
            where = (route.method, route.rule, bool(headers))
            assert response.status_code == 401, where
            assert error_code(response).startswith("ADMIN_TOKEN_"), where


def test_every_agent_route_refuses_without_a_valid_credential(sqlite_control_plane):
    cp = sqlite_control_plane
    protocol = {HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION)}
    for route in routes_by_caller(cp.server.app)[auth.AGENT]:
        url = cp.url + concrete(route.rule)
        for headers, code in ((protocol, "CREDENTIAL_MISSING"), (protocol | FORGED_AGENT, None)):
            # The credential is checked before the body is read: an empty body changes nothing.
            response = requests.request(route.method, url, headers=headers, json={}, timeout=10)
            where = (route.method, route.rule, code)
            assert response.status_code == 401, where
            assert error_code(response) == (code or "CREDENTIAL_INVALID"), where
            assert response.json()["compatibility"] == "COMPATIBLE", where
        missing = requests.request(route.method, url, json={}, timeout=10)
        assert (missing.status_code, missing.json()["compatibility"]) == (426, "UNKNOWN")


def test_every_console_session_route_sends_pages_to_sign_in_and_refuses_actions(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    for route in routes_by_caller(cp.server.app)[auth.SESSION]:
        response = requests.request(
            route.method, cp.url + concrete(route.rule), allow_redirects=False, timeout=10
        )
        where = (route.method, route.rule)
        if route.method == "GET":
            assert response.status_code == 303, where
            assert response.headers["Location"].endswith(auth.SIGN_IN_PATH), where
        else:
            assert response.status_code == 401, where


def test_a_route_that_declares_no_caller_refuses_to_install(sqlite_settings, monkeypatch):
    """make_app prepares every route: one added without ``auth=`` stops the build."""
    real = admin.add_routes

    def with_an_undeclared_route(app: bottle.Bottle, context) -> None:
        real(app, context)

        @app.get("/api/v1/admin/undeclared")
        def undeclared():
            return "reachable by anyone"

    monkeypatch.setattr(admin, "add_routes", with_an_undeclared_route)
    store = Store(sqlite_settings.database_url, Clock())
    try:
        with pytest.raises(auth.UndeclaredRoute, match="GET /api/v1/admin/undeclared declares no"):
            make_app(sqlite_settings, store)
    finally:
        store.close()


@contextlib.contextmanager
def serve_without_flusher(settings):
    """The real server, but without the heartbeat buffer's background flusher, so that only
    requests can cause a flush: whether one did is then plain to see."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(settings.database_url, ManualClock())
    store.migrate()
    _, token = admin_tokens.create_admin_token(store, "tests", audit.CLI_ACTOR)
    server = create_server(settings, store, "127.0.0.1", 0)
    stop = threading.Event()
    loop = EventLoop(server._map)

    def run():
        while not stop.is_set():
            loop.turn(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield ControlPlane(
            f"http://127.0.0.1:{server.effective_port}", settings, store, token, server.heartbeats
        )
    finally:
        stop.set()
        thread.join(timeout=5)
        for dispatcher in list(server._map.values()):
            dispatcher.close()
        server.task_dispatcher.shutdown(timeout=5)
        store.close()


def stored_heartbeat(cp, node_id: str):
    with cp.store.connection():
        return Node.get_by_id(node_id).last_heartbeat_at


def test_admin_requests_without_a_valid_token_flush_nothing(tmp_path):
    """Admin requests with no token or a forged one flushed the heartbeat buffer (a store
    write) before they were refused, so anyone who could reach the port could make the
    control plane write: only an authenticated admin read flushes, and only the real
    token's uses are recorded."""
    with serve_without_flusher(make_settings(tmp_path / "state")) as cp:
        node = enroll_node(cp)
        assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
        assert stored_heartbeat(cp, node["node_id"]) is None  # acknowledged, buffered
        forged = "mfa_" + cp.admin_token.split("_")[1] + "_" + "x" * 43
        for headers in ({}, {"X-ModelForge-Admin-Token": forged}):
            for method, path in [
                ("GET", "/api/v1/admin/hardware/nodes"),
                ("GET", f"/api/v1/admin/hardware/nodes/{node['node_id']}"),
                ("GET", "/api/v1/admin/alerts"),
                ("GET", "/api/v1/admin/audit-events"),
                ("GET", "/metrics"),
                ("POST", f"/api/v1/admin/hardware/nodes/{node['node_id']}/cordon"),
            ]:
                response = requests.request(method, cp.url + path, headers=headers, timeout=10)
                assert response.status_code == 401, (method, path)
        assert stored_heartbeat(cp, node["node_id"]) is None  # no request caused a write
        with cp.store.connection():
            assert AdminToken.get().last_used_at is not None  # the real token's uses only
        assert cp.admin("GET", "/api/v1/admin/hardware/nodes").status_code == 200
        assert stored_heartbeat(cp, node["node_id"]) is not None  # an admin read flushes
