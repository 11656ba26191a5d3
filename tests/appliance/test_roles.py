"""Users with roles (issue 36): every admin route declares its action, and every route
answers every role as that action says; the last admin stays; a disabled user's token and
session stop at once; an operator mints and revokes only its own API keys; the audit names
the user. A real control plane on loopback, real tokens of real users."""

from __future__ import annotations

import re

import bottle
import pytest
import requests

from modelforge_appliance.core.errors import Conflict, Unauthorized
from modelforge_appliance.identity import admin_tokens, api_keys, users
from modelforge_appliance.identity.roles import MIN_ROLE
from modelforge_appliance.web.auth import ADMIN, Authentication, UndeclaredRoute, refuse_undeclared
from modelforge_contract import HEADER_ADMIN_TOKEN, ROLES
from tests.harness.console_client import ConsoleClient, set_password
from tests.harness.control_plane import make_settings, run_cli, serve, store_env

PASSWORD = "a long enough password"


@pytest.fixture
def cp(tmp_path):
    with serve(make_settings(tmp_path / "cp")) as plane:
        yield plane


def token_of(cp, name: str, role: str) -> str:
    users.add_user(cp.store, name, role, PASSWORD, "tests")
    _, secret = admin_tokens.create_admin_token(cp.store, f"{name}'s", "tests", name)
    return secret


def call(cp, token: str, method: str, path: str, **kwargs) -> requests.Response:
    headers = {HEADER_ADMIN_TOKEN: token}
    return requests.request(method, cp.url + path, headers=headers, timeout=30, **kwargs)


def concrete(rule: str) -> str:
    """A route's rule with every parameter filled in (a value that names nothing)."""
    return re.sub(r"<[^>]+>", "nothing-here", rule)


def test_every_admin_route_answers_each_role_as_its_declared_action_says(cp):
    tokens = {role: token_of(cp, f"{role}-user", role) for role in ROLES}
    checked = 0
    for route in cp.server.app.routes:
        if route.config.get("auth") != ADMIN:
            continue
        action = route.config.get("action")
        assert action in MIN_ROLE, f"{route.method} {route.rule} declares no known action"
        needed = users.RANK[MIN_ROLE[action]]
        body = None if route.method == "GET" else {}
        for role in ROLES:
            answer = call(cp, tokens[role], route.method, concrete(route.rule), json=body)
            code = (answer.json().get("error") or {}).get("code") if answer.content else None
            where = f"{route.method} {route.rule} as {role}"
            if users.RANK[role] < needed:
                assert answer.status_code == 403 and code == "ROLE_FORBIDDEN", where
                assert answer.json()["action"] == action, where
                assert answer.json()["role_needed"] == MIN_ROLE[action], where
            else:
                assert code != "ROLE_FORBIDDEN", where
        checked += 1
    assert checked >= 45


def test_a_route_without_an_action_stops_the_app_being_built(cp):
    app = bottle.Bottle()
    app.install(Authentication(cp.server.app.config.get("context") or _context(cp)))
    app.route("/api/v1/admin/undeclared", "GET", lambda: {}, auth=ADMIN)
    with pytest.raises(UndeclaredRoute, match="declares no action"):
        refuse_undeclared(app)


def _context(cp):
    from modelforge_appliance.web.http import ApiContext

    return ApiContext(cp.settings, cp.store, None, None, None, None)


def test_the_last_enabled_admin_can_be_neither_demoted_nor_disabled(cp):
    answer = cp.admin("PATCH", "/api/v1/admin/users/admin", json={"role": "viewer"})
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "LAST_ADMIN"
    answer = cp.admin("PATCH", "/api/v1/admin/users/admin", json={"disabled": True})
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "LAST_ADMIN"
    made = cp.admin("POST", "/api/v1/admin/users", json={"name": "bea", "role": "admin"})
    assert made.status_code == 201 and made.json()["password_set"] is False
    demoted = cp.admin("PATCH", "/api/v1/admin/users/admin", json={"role": "operator"})
    assert demoted.status_code == 200 and demoted.json()["role"] == "operator"
    # admin's own token is an operator's now: it may no longer change users.
    refused = cp.admin("PATCH", "/api/v1/admin/users/bea", json={"disabled": True})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "ROLE_FORBIDDEN"
    # The CLI acts with every right, and says LAST_ADMIN as well.
    done = run_cli("users", "disable", "bea", env=store_env(cp.settings))
    assert done.returncode == 1 and "LAST_ADMIN" in done.stderr


def test_a_disabled_user_s_token_and_session_stop_at_once_and_work_again_when_enabled(cp):
    token = token_of(cp, "carl", "operator")
    assert call(cp, token, "GET", "/api/v1/admin/hardware/nodes").status_code == 200
    set_password(cp)
    console = ConsoleClient(cp)
    assert console.http.post(cp.url + "/console/sign-in", json={"user": "carl",
                             "password": PASSWORD}, timeout=30).status_code == 200  # fmt: skip
    assert console.api("GET", "/admin/alerts").status_code == 200
    assert cp.admin("PATCH", "/api/v1/admin/users/carl", json={"disabled": True}).ok
    refused = call(cp, token, "GET", "/api/v1/admin/hardware/nodes")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "USER_DISABLED"
    assert console.api("GET", "/admin/alerts").status_code == 401
    signed_in = console.http.post(cp.url + "/console/sign-in", json={"user": "carl",
                                  "password": PASSWORD}, timeout=30)  # fmt: skip
    assert signed_in.status_code == 401  # the same answer as a wrong password
    assert cp.admin("PATCH", "/api/v1/admin/users/carl", json={"disabled": False}).ok
    assert call(cp, token, "GET", "/api/v1/admin/hardware/nodes").status_code == 200


def test_an_operator_mints_and_revokes_only_its_own_keys_and_the_audit_names_it(cp):
    token = token_of(cp, "dana", "operator")
    mine = call(cp, token, "POST", "/api/v1/admin/api-keys", json={"name": "dana's bot"})
    assert mine.status_code == 201 and mine.json()["owner"] == "dana"
    for_other = call(cp, token, "POST", "/api/v1/admin/api-keys",
                     json={"name": "x", "user": "admin"})  # fmt: skip
    assert for_other.status_code == 403
    assert for_other.json()["error"]["code"] == "ROLE_FORBIDDEN"
    admins, _ = api_keys.create_api_key(cp.store, "admin's", "tests")
    refused = call(cp, token, "DELETE", f"/api/v1/admin/api-keys/{admins['key_id']}")
    assert refused.status_code == 403
    assert call(cp, token, "DELETE", f"/api/v1/admin/api-keys/{mine.json()['key_id']}").ok
    # An admin mints for anyone.
    given = cp.admin("POST", "/api/v1/admin/api-keys", json={"name": "for dana", "user": "dana"})
    assert given.status_code == 201 and given.json()["owner"] == "dana"
    answer = cp.admin("GET", "/api/v1/admin/audit-events?limit=200")
    assert answer.status_code == 200, answer.text
    events = answer.json()["events"]
    created = [e for e in events if e["action"] == "api_key.created"]
    assert any(e["actor"].startswith("admin:") and e["actor"].endswith("(dana)") for e in created)


def test_users_over_the_cli_and_the_api_agree_and_never_show_a_password(cp):
    env = store_env(cp.settings)
    added = run_cli("users", "add", "erin", "--role", "viewer", "--password-stdin", "--json",
                    env=env, stdin=PASSWORD + "\n", check=True)  # fmt: skip
    assert '"role": "viewer"' in added.stdout and PASSWORD not in added.stdout
    listed = cp.admin("GET", "/api/v1/admin/users").json()["users"]
    erin = next(u for u in listed if u["name"] == "erin")
    assert erin["password_set"] is True and "password_hash" not in erin
    short = run_cli("users", "add", "finn", "--role", "viewer", "--password-stdin",
                    env=env, stdin="short\n")  # fmt: skip
    assert short.returncode != 0 and "12 characters" in short.stderr
    bad = cp.admin("POST", "/api/v1/admin/users", json={"name": "Bad Name", "role": "viewer"})
    assert bad.status_code == 400
    role = cp.admin("POST", "/api/v1/admin/users", json={"name": "gus", "role": "root"})
    assert role.status_code == 400 and role.json()["error"]["code"] == "FIELD_CHOICE"
    assert run_cli("users", "set-role", "erin", "operator", env=env, check=True).returncode == 0
    assert cp.admin("GET", "/api/v1/admin/users").json()["users"][1]["role"] == "operator"


def test_users_and_their_rules_on_either_store(database_url):
    from modelforge_appliance.core.clock import ManualClock
    from modelforge_appliance.store.database import Store

    store = Store(database_url, ManualClock(1_800_000_000))
    store.migrate()
    assert [u["name"] for u in users.list_users(store)] == ["admin"]  # made by migration 17
    users.add_user(store, "alice", "operator", PASSWORD, "cli")
    with pytest.raises(Conflict, match="last enabled admin"):
        users.set_role(store, "admin", "viewer", "cli")
    users.set_role(store, "alice", "admin", "cli")
    assert users.set_role(store, "admin", "viewer", "cli")["role"] == "viewer"
    users.set_disabled(store, "admin", True, "cli")
    with pytest.raises(Unauthorized, match="disabled"):
        users.role_of(store, "admin")
    _, secret = admin_tokens.create_admin_token(store, "t", "cli", "alice")
    assert admin_tokens.authenticate_admin(store, secret).user_name == "alice"
    store.close()
