"""Regressions from the outside review of the control plane (issue 14): each names what broke."""

from __future__ import annotations

import contextlib
import json
import resource
import sqlite3
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import requests

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.core.settings import ConfigError, load_settings
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.runtime.connections import EventLoop
from modelforge_appliance.runtime.server import create_server
from modelforge_appliance.store import audit
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import AdminToken, Node

from ..support import ControlPlane, error_code, make_settings, new_identity, serve
from .test_agent_auth import enroll_node
from .test_settings_and_cli import ROOT, modelforge

# -- unauthenticated requests write nothing ------------------------------------------------


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


# -- replayed consumed tokens -------------------------------------------------------------------


def refusal_rows(db_path) -> list[dict]:
    db = sqlite3.connect(db_path)
    try:
        rows = db.execute(
            "SELECT detail FROM audit_event WHERE action = 'enrollment.refused' ORDER BY id"
        ).fetchall()
    finally:
        db.close()
    return [json.loads(detail) for (detail,) in rows]


def test_a_replayed_consumed_token_is_counted_not_written_per_attempt(tmp_path):
    settings = make_settings(tmp_path / "state")
    db_path = settings.state_dir / "modelforge.sqlite3"
    clock = ManualClock()
    with serve(settings, clock) as cp:
        token = cp.mint()["token"]
        assert cp.enroll(token).status_code == 201
        for _ in range(30):
            assert error_code(cp.enroll(token)) == "ENROLLMENT_TOKEN_CONSUMED"
        rows = refusal_rows(db_path)
        assert len(rows) == 1 and "unrecorded_repeats" not in rows[0]
        clock.advance(audit.REFUSAL_WINDOW_SECONDS + 1)
        assert cp.enroll(token).status_code == 410
        rows = refusal_rows(db_path)
        assert [row.get("unrecorded_repeats") for row in rows] == [None, 29]
        for _ in range(5):
            cp.enroll(token)
        metrics = cp.admin("GET", "/metrics").text
        assert (
            'modelforge_enrollment_outcomes_total{code="ENROLLMENT_TOKEN_CONSUMED"} 36.0' in metrics
        )
    # Stopping writes what was only counted.
    rows = refusal_rows(db_path)
    assert [row.get("unrecorded_repeats") for row in rows] == [None, 29, 5]
    assert all(row["code"] == "ENROLLMENT_TOKEN_CONSUMED" for row in rows)


def test_refusals_of_different_tokens_or_codes_are_each_written(sqlite_settings):
    clock = ManualClock()
    with serve(sqlite_settings, clock) as cp:
        first, second = cp.mint()["token"], cp.mint()["token"]
        for token in (first, second):
            assert cp.enroll(token).status_code == 201
            assert cp.enroll(token).status_code == 410
        expired = cp.mint(expires=300)["token"]
        clock.advance(301)
        assert error_code(cp.enroll(expired)) == "ENROLLMENT_TOKEN_EXPIRED"
        events = cp.admin("GET", "/api/v1/admin/audit-events", params={"limit": 500}).json()
        refused = [e for e in events["events"] if e["action"] == "enrollment.refused"]
        assert len(refused) == 3


# -- validation holes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    ["gpu\x7f1", "gpu\x851", "gpu\x9b[31m", "gpu\u202e1", "gpu\u20661", "gpu\u200f1", "gpu\u061c"],
    ids=["DEL", "NEL", "CSI", "RLO", "LRI", "RLM", "ALM"],
)
def test_del_c1_controls_and_bidi_marks_are_refused(sqlite_control_plane, bad):
    cp = sqlite_control_plane
    minted = cp.mint()
    refused = cp.enroll(minted["token"], hostname=bad)
    assert (refused.status_code, error_code(refused)) == (400, "FIELD_TYPE")
    mint = cp.admin(
        "POST",
        "/api/v1/admin/node-enrollments",
        json={"display_name": bad, "expires_in_seconds": 900},
    )
    assert (mint.status_code, error_code(mint)) == (400, "FIELD_TYPE")
    assert cp.enroll(minted["token"], hostname="gpu-1").status_code == 201  # token unspent


def test_an_identity_secret_with_spaces_is_refused_instead_of_enrolling_once(sqlite_control_plane):
    cp = sqlite_control_plane
    identity = new_identity()
    padded = {**identity, "identity_secret": identity["identity_secret"] + " "}
    token = cp.mint()["token"]
    refused = cp.enroll(token, identity=padded)
    assert (refused.status_code, error_code(refused)) == (400, "FIELD_FORMAT")
    first = cp.enroll(token, identity=identity)  # the same token was not spent
    assert first.status_code == 201
    again = cp.enroll(cp.mint()["token"], identity=identity)
    assert again.status_code == 201
    assert again.json()["node_id"] == first.json()["node_id"]
    assert again.json()["reenrolled"] is True
    padded_again = cp.enroll(cp.mint()["token"], identity=padded)
    assert error_code(padded_again) == "FIELD_FORMAT"


@pytest.mark.parametrize(
    "query",
    [
        "limit=%B2",
        "limit=%C2%B2",
        "limit=%D9%A1",
        "before=" + "9" * 4400,
        "before=%EF%BC%91",
        "limit=+5",
    ],
)
def test_audit_query_parameters_only_take_ascii_digits(sqlite_control_plane, query):
    response = sqlite_control_plane.admin("GET", f"/api/v1/admin/audit-events?{query}")
    assert (response.status_code, error_code(response)) == (400, "QUERY_INVALID")


def test_a_decommissioned_node_cannot_be_uncordoned(sqlite_control_plane, tmp_path):
    cp = sqlite_control_plane
    node = enroll_node(cp)
    nodes = f"/api/v1/admin/hardware/nodes/{node['node_id']}"
    plan = cp.admin("POST", f"{nodes}/decommission/preview").json()
    executed = cp.admin(
        "POST", f"{nodes}/decommission/execute", json={"confirmation": plan["confirmation"]}
    )
    assert executed.status_code == 200
    refused = cp.admin("POST", f"{nodes}/uncordon")
    assert (refused.status_code, error_code(refused)) == (409, "NODE_DECOMMISSIONED")
    cordon = cp.admin("POST", f"{nodes}/cordon")
    assert cordon.status_code == 200 and cordon.json()["cordoned"] is True
    view = cp.admin("GET", nodes).json()
    assert view["cordoned"] is True and view["liveness"] == "decommissioned"
    actions = [
        e["action"]
        for e in cp.admin(
            "GET", "/api/v1/admin/audit-events", params={"node_id": node["node_id"]}
        ).json()["events"]
    ]
    assert "node.uncordoned" not in actions


def test_admin_token_last_used_at_moves(sqlite_settings):
    clock = ManualClock()
    with serve(sqlite_settings, clock) as cp:

        def last_used():
            with cp.store.connection():
                return AdminToken.get().last_used_at

        assert last_used() is None
        assert cp.admin("GET", "/api/v1/admin/alerts").status_code == 200
        assert last_used() == clock.now()
        first = clock.now()
        clock.advance(30)
        cp.admin("GET", "/api/v1/admin/alerts")
        assert last_used() == first  # to the minute: no write for every request
        clock.advance(31)
        cp.admin("GET", "/api/v1/admin/alerts")
        assert last_used() == clock.now()
        listed = admin_tokens.list_admin_tokens(cp.store)[0]
        assert listed["last_used_at"] is not None


# -- MODELFORGE_TRUSTED_PROXY ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["*", "10.0.0.0/8", "proxy.lan", "127.0.0.1,junk", "127.0.0.1;10.0.0.1", "localhost", " , "],
)
def test_a_trusted_proxy_that_is_not_addresses_exits_2(tmp_path, value):
    result = modelforge(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"MODELFORGE_STATE_DIR": str(tmp_path / "s"), "MODELFORGE_TRUSTED_PROXY": value},
    )
    assert result.returncode == 2
    assert "MODELFORGE_TRUSTED_PROXY" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_trusted_proxies_are_addresses_in_canonical_form():
    settings = load_settings({"MODELFORGE_TRUSTED_PROXY": " 127.0.0.1 , 0:0:0:0:0:0:0:1,10.0.0.5"})
    assert settings.trusted_proxies == ("127.0.0.1", "::1", "10.0.0.5")
    assert load_settings({}).trusted_proxies == ()


PROXIED = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "cp.lan"}


@pytest.mark.parametrize(
    ("proxies", "status"),
    [(("10.9.9.9", "127.0.0.1"), 201), (("10.9.9.9", "::1"), 403)],
    ids=["listed", "not-listed"],
)
def test_forwarded_headers_are_believed_only_from_a_listed_proxy(tmp_path, proxies, status):
    settings = replace(
        make_settings(tmp_path / "state"),
        public_api_origin="https://cp.lan",
        trusted_proxies=proxies,
    )
    with serve(settings) as cp:
        response = cp.enroll(cp.mint()["token"], hostname="behind-proxy", headers=PROXIED)
        assert response.status_code == status, response.text


def test_a_malformed_forwarded_header_from_the_proxy_is_a_json_400(tmp_path):
    settings = replace(make_settings(tmp_path / "state"), trusted_proxies=("127.0.0.1",))
    with serve(settings) as cp:
        response = requests.get(
            cp.url + "/healthz", headers={"X-Forwarded-Proto": "https, http"}, timeout=10
        )
        assert (response.status_code, error_code(response)) == (400, "REQUEST_MALFORMED")


# -- connection settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"MODELFORGE_CONNECTION_LIMIT": "lots"}, ["MODELFORGE_CONNECTION_LIMIT"]),
        ({"MODELFORGE_CONNECTION_LIMIT": "5"}, ["MODELFORGE_CONNECTION_LIMIT"]),
        ({"MODELFORGE_REQUEST_TIMEOUT_SECONDS": "0"}, ["MODELFORGE_REQUEST_TIMEOUT_SECONDS"]),
        (
            {"MODELFORGE_IDLE_TIMEOUT_SECONDS": "10"},
            ["MODELFORGE_IDLE_TIMEOUT_SECONDS", "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS"],
        ),
    ],
)
def test_connection_settings_are_validated(env, names):
    with pytest.raises(ConfigError) as refused:
        load_settings(env)
    for name in names:
        assert name in str(refused.value)


def limit_files(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_limit_the_process_cannot_hold_exits_2(tmp_path):
    env = {
        "MODELFORGE_STATE_DIR": str(tmp_path / "s"),
        "MODELFORGE_CONNECTION_LIMIT": "5000",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "serve", "--listen", "127.0.0.1:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_files(256, 1024),
    )
    assert result.returncode == 2
    assert "MODELFORGE_CONNECTION_LIMIT=5000" in result.stderr
    assert "1024" in result.stderr


def test_serve_raises_its_own_soft_file_limit_to_fit_the_connections(tmp_path):
    code = (
        "import resource, sys\n"
        "from modelforge_appliance.runtime.server import ensure_file_descriptors\n"
        "print(ensure_file_descriptors(3000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_files(256, 8192),
        check=True,
    )
    assert result.stdout.split() == ["3064", "3064"]
