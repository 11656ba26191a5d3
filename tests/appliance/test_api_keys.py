"""Client API keys (identity/api_keys.py) on SQLite and PostgreSQL: created, listed and revoked
over the admin API and the CLI; the secret shown once and stored nowhere; authentication's
refusals; last use to the minute without a write per request; revocation final across a
restore; an audit trail without the secret."""

from __future__ import annotations

import json
import re

import pytest

from modelforge_appliance.core import tokens
from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.core.errors import Invalid, NotFound, Unauthorized
from modelforge_appliance.identity import api_keys
from modelforge_appliance.store import backup, finality
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import ApiKey
from modelforge_contract import EXIT_NOT_FOUND, EXIT_USAGE
from tests.harness.control_plane import error_code, make_settings, run_cli, store_env

KEYS = "/api/v1/admin/api-keys"
SECRET = re.compile(r"mfk_([0-9a-f]{16})_[A-Za-z0-9_-]{43}")


def secret_part(secret: str) -> str:
    return secret.split("_", 2)[2]


@pytest.fixture
def store(database_url):
    store = Store(database_url, ManualClock())
    store.migrate()
    yield store
    store.close()


def everything_stored(store: Store) -> str:
    """Every row of the tables a key touches, as text."""
    with store.connection():
        rows = [
            row
            for query in (
                "SELECT * FROM api_key",
                "SELECT * FROM audit_event",
                "SELECT * FROM finality",
            )
            for row in store.db.execute_sql(query).fetchall()
        ]
    return json.dumps(rows, default=str)


def refusal(store: Store, authorization: str | None) -> str:
    with pytest.raises(Unauthorized) as refused:
        api_keys.authenticate_api_key(store, authorization)
    assert refused.value.status == 401
    return refused.value.code


# -- over the admin API ----------------------------------------------------------------------


def test_create_list_and_revoke_over_the_admin_api(control_plane):
    cp = control_plane
    made = cp.admin("POST", KEYS, json={"name": "chat frontend"})
    assert made.status_code == 201, made.text
    body = made.json()
    key_id, secret = body["key_id"], body["secret"]
    assert SECRET.fullmatch(secret) and SECRET.fullmatch(secret).group(1) == key_id
    assert body["name"] == "chat frontend" and body["state"] == "active"
    assert body["created_by"].startswith("admin:") and body["created_at"]
    assert body["last_used_at"] is None and body["revoked_at"] is None
    assert "digest" not in body

    listed = cp.admin("GET", KEYS)
    assert listed.status_code == 200
    (row,) = listed.json()["api_keys"]
    assert row == {k: v for k, v in body.items() if k != "secret"}
    assert secret_part(secret) not in listed.text

    # The key authenticates; its last use shows in the list.
    assert api_keys.authenticate_api_key(cp.store, f"Bearer {secret}").key_id == key_id
    (row,) = cp.admin("GET", KEYS).json()["api_keys"]
    assert row["last_used_at"] is not None

    revoked = cp.admin("DELETE", f"{KEYS}/{key_id}")
    assert revoked.status_code == 200
    assert revoked.json()["state"] == "revoked" and revoked.json()["revoked_at"]
    assert revoked.json()["revoked_by"] == body["created_by"]
    assert secret_part(secret) not in revoked.text
    again = cp.admin("DELETE", f"{KEYS}/{key_id}")
    assert again.status_code == 200 and again.json() == revoked.json()  # nothing changes
    assert refusal(cp.store, f"Bearer {secret}") == "API_KEY_REVOKED"

    for missing in ("0123456789abcdef", "not-a-key-id"):
        response = cp.admin("DELETE", f"{KEYS}/{missing}")
        assert (response.status_code, error_code(response)) == (404, "NOT_FOUND")

    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=50")
    actions = [(e["action"], e["detail"]) for e in events.json()["events"]]
    assert ("api_key.created", {"key_id": key_id, "name": "chat frontend"}) in actions
    assert ("api_key.revoked", {"key_id": key_id, "name": "chat frontend"}) in actions
    assert [a for a, _ in actions].count("api_key.revoked") == 1  # the second changed nothing
    assert secret_part(secret) not in events.text
    assert secret_part(secret) not in everything_stored(cp.store)


@pytest.mark.parametrize(
    "body, code",
    [
        ({}, "FIELD_REQUIRED"),
        ({"name": ""}, "FIELD_RANGE"),
        ({"name": "x" * 121}, "FIELD_RANGE"),
        ({"name": "line\nbreak"}, "FIELD_TYPE"),
        ({"name": "zero\u200bwidth"}, "FIELD_TYPE"),
        ({"name": 7}, "FIELD_TYPE"),
        ({"name": "ok", "secret": "mine"}, "FIELD_UNKNOWN"),
    ],
)
def test_a_bad_create_is_refused_and_makes_nothing(sqlite_control_plane, body, code):
    cp = sqlite_control_plane
    response = cp.admin("POST", KEYS, json=body)
    assert (response.status_code, error_code(response)) == (400, code)
    assert cp.admin("GET", KEYS).json() == {"api_keys": []}


def test_the_admin_routes_need_an_admin(sqlite_control_plane):
    cp = sqlite_control_plane
    for method, path in (("POST", KEYS), ("GET", KEYS), ("DELETE", f"{KEYS}/0123456789abcdef")):
        response = cp.admin(method, path, headers={"X-ModelForge-Admin-Token": ""})
        assert response.status_code == 401, (method, path)
        assert error_code(response).startswith("ADMIN_TOKEN_")


# -- authentication --------------------------------------------------------------------------


def test_authentication_accepts_the_key_and_refuses_everything_else(store):
    view, secret = api_keys.create_api_key(store, "batch", "cli")
    key_id = view["key_id"]
    caller = api_keys.authenticate_api_key(store, f"Bearer {secret}")
    assert caller == api_keys.ApiKeyCaller(key_id, "batch")
    assert api_keys.authenticate_api_key(store, f"bearer  {secret} ").key_id == key_id

    assert refusal(store, None) == "API_KEY_MISSING"
    assert refusal(store, "") == "API_KEY_MISSING"
    wrong_secret = f"mfk_{key_id}_{'A' * 43}"
    other, other_secret = api_keys.create_api_key(store, "other", "cli")
    for malformed in (
        "Bearer",
        "Bearer ",
        f"Basic {secret}",
        secret,  # no scheme
        f"Bearer mfc_{key_id}_{secret_part(secret)}",  # another kind of secret
        f"Bearer mfk_{key_id}_short",
        f"Bearer {secret}x\x00",
        f"Bearer mfk_0123456789abcdef_{secret_part(secret)}",  # unknown id
        f"Bearer {wrong_secret}",  # the right id, a wrong secret
        f"Bearer mfk_{other['key_id']}_{secret_part(secret)}",  # another key's id
    ):
        assert refusal(store, malformed) == "API_KEY_INVALID", malformed

    api_keys.revoke_api_key(store, key_id, "cli")
    assert refusal(store, f"Bearer {secret}") == "API_KEY_REVOKED"
    # A revoked key's id with a wrong secret learns nothing more than an unknown one.
    assert refusal(store, f"Bearer {wrong_secret}") == "API_KEY_INVALID"
    assert api_keys.authenticate_api_key(store, f"Bearer {other_secret}").name == "other"
    assert secret_part(secret) not in everything_stored(store)


def test_every_key_is_checked_by_a_constant_time_compare(store, monkeypatch):
    """Known id or not, the secret is compared through tokens.digest_matches (hmac)."""
    view, secret = api_keys.create_api_key(store, "timing", "cli")
    compared = []
    real = tokens.digest_matches

    def spy(candidate: str, stored: str) -> bool:
        compared.append(stored)
        return real(candidate, stored)

    monkeypatch.setattr(tokens, "digest_matches", spy)
    refusal(store, f"Bearer mfk_{view['key_id']}_{'B' * 43}")
    refusal(store, f"Bearer mfk_0123456789abcdef_{'B' * 43}")
    api_keys.authenticate_api_key(store, f"Bearer {secret}")
    assert len(compared) == 3
    assert compared[0] == compared[2] == tokens.digest(secret)
    assert compared[1] != compared[0]  # the placeholder: an unknown id costs a compare too


def test_last_use_moves_to_the_minute_without_a_write_per_request(store, monkeypatch):
    view, secret = api_keys.create_api_key(store, "busy", "cli")
    header = f"Bearer {secret}"

    def last_used() -> float | None:
        with store.connection():
            return ApiKey.get(ApiKey.key_id == view["key_id"]).last_used_at

    writes = []
    real_write = store.write

    def counting_write(*args, **kwargs):
        writes.append(kwargs)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store, "write", counting_write)
    first = store.clock.now()
    api_keys.authenticate_api_key(store, header)
    assert last_used() == first and len(writes) == 1
    for _ in range(200):  # a busy client within the minute: reads only
        store.clock.advance(0.25)
        api_keys.authenticate_api_key(store, header)
    assert last_used() == first and len(writes) == 1
    store.clock.advance(20)  # 70 s after the first use
    api_keys.authenticate_api_key(store, header)
    assert last_used() == store.clock.now() and len(writes) == 2
    assert writes == [{"flushed": False}] * 2  # a timestamp: no disk flush of its own
    # A refused request writes nothing at all.
    store.clock.advance(3600)
    refusal(store, f"Bearer mfk_{view['key_id']}_{'C' * 43}")
    assert len(writes) == 2


# -- the CLI ---------------------------------------------------------------------------------


def test_create_list_and_revoke_from_the_command_line(settings):
    store = Store(settings.database_url, ManualClock())
    store.migrate()
    store.close()
    env = store_env(settings)
    made = run_cli("api-keys", "create", "--name", "notebook", env=env, check=True)
    secret, key_id = SECRET.search(made.stdout).group(0, 1)
    assert "not shown again" in made.stdout
    assert secret_part(secret) not in made.stderr

    made_json = json.loads(run_cli("api-keys", "create", "--name", "ci", "--json", env=env).stdout)
    assert SECRET.fullmatch(made_json["secret"]) and made_json["created_by"] == "cli"

    listed = run_cli("api-keys", "list", env=env, check=True)
    assert key_id in listed.stdout and "notebook" in listed.stdout and "never" in listed.stdout
    rows = json.loads(run_cli("api-keys", "list", "--json", env=env, check=True).stdout)
    assert [row["name"] for row in rows["api_keys"]] == ["notebook", "ci"]
    assert all("secret" not in row and "digest" not in row for row in rows["api_keys"])
    for text in (listed.stdout, json.dumps(rows)):
        assert secret_part(secret) not in text and secret_part(made_json["secret"]) not in text

    revoked = json.loads(run_cli("api-keys", "revoke", key_id, "--json", env=env).stdout)
    assert revoked["state"] == "revoked" and revoked["revoked_by"] == "cli"
    text = run_cli("api-keys", "revoke", key_id, env=env, check=True).stdout
    assert "Revoked API key" in text
    missing = run_cli("api-keys", "revoke", "0123456789abcdef", env=env)
    assert missing.returncode == EXIT_NOT_FOUND and "api-keys list" in missing.stderr
    bad = run_cli("api-keys", "create", "--name", "", env=env)
    assert bad.returncode == EXIT_USAGE and "Traceback" not in bad.stderr

    store = Store(settings.database_url, ManualClock())
    try:
        assert refusal(store, f"Bearer {secret}") == "API_KEY_REVOKED"
        assert api_keys.authenticate_api_key(store, f"Bearer {made_json['secret']}").name == "ci"
        stored = everything_stored(store)
        assert secret_part(secret) not in stored and secret_part(made_json["secret"]) not in stored
    finally:
        store.close()
    if settings.database_url.startswith("sqlite"):  # the file and its WAL, byte for byte
        for path in settings.state_dir.iterdir():
            if path.is_file():
                content = path.read_bytes()
                for shown in (secret, made_json["secret"]):
                    assert secret_part(shown).encode() not in content, path.name


# -- revocation is final ---------------------------------------------------------------------


def test_a_revocation_lands_in_the_finality_record_whoever_makes_it(store):
    by_service, _ = api_keys.create_api_key(store, "a", "cli")
    by_hand, _ = api_keys.create_api_key(store, "b", "cli")
    active, _ = api_keys.create_api_key(store, "c", "cli")
    api_keys.revoke_api_key(store, by_service["key_id"], "admin:0123456789abcdef")
    with store.write():  # hand-written SQL: the store's trigger records it all the same
        store.db.execute_sql(
            "UPDATE api_key SET revoked_at = 5 WHERE key_id = ?".replace("?", store.db.param),
            (by_hand["key_id"],),
        )
    entries = {e.subject_id: e for e in finality.read_store(store) if e.kind == "api_key"}
    assert set(entries) == {by_service["key_id"], by_hand["key_id"]}
    assert entries[by_service["key_id"]].reason == "admin:0123456789abcdef"
    assert active["key_id"] not in entries


def test_a_revoked_key_is_revoked_again_by_the_record_after_an_outside_restore(
    store, settings, tmp_path
):
    """An outside restore (a pg_restore, a file put back) brings the row back active; the
    saved record (save-finality, restore-finality) makes it final again, on both stores."""
    view, secret = api_keys.create_api_key(store, "restored", "cli")
    api_keys.revoke_api_key(store, view["key_id"], "cli")
    saved = tmp_path / "record.json"
    backup.save_finality(store, saved)
    assert secret_part(secret) not in saved.read_text()
    # What the database restored from before the revocation holds: the key, active.
    with store.write():
        store.db.execute_sql(
            "UPDATE api_key SET revoked_at = NULL, revoked_by = NULL WHERE key_id = ?".replace(
                "?", store.db.param
            ),
            (view["key_id"],),
        )
    assert api_keys.authenticate_api_key(store, f"Bearer {secret}").key_id == view["key_id"]
    done = backup.restore_finality(settings, saved, store.clock)
    assert done["made_final"]["api_keys"] == 1
    assert refusal(store, f"Bearer {secret}") == "API_KEY_REVOKED"
    (row,) = api_keys.list_api_keys(store)
    assert row["state"] == "revoked" and row["revoked_by"] == "cli"


def test_a_key_revoked_after_a_backup_stays_revoked_when_the_backup_is_restored(tmp_path):
    settings = make_settings(tmp_path / "state")
    clock = ManualClock()
    store = Store(settings.database_url, clock)
    store.migrate()
    kept, kept_secret = api_keys.create_api_key(store, "kept", "cli")
    later, later_secret = api_keys.create_api_key(store, "revoked later", "cli")
    taken = tmp_path / "backup.sqlite3"
    backup.backup(settings, taken)
    api_keys.revoke_api_key(store, later["key_id"], "cli")
    store.close()

    done = backup.restore(settings, taken, clock)
    assert done["kept_from_current_store"]["api_keys"] == 1
    store = Store(settings.database_url, clock)
    try:
        store.migrate()
        assert refusal(store, f"Bearer {later_secret}") == "API_KEY_REVOKED"
        assert api_keys.authenticate_api_key(store, f"Bearer {kept_secret}").name == "kept"
        # The record travels on: restoring the same backup again keeps it revoked.
        store.close()
        backup.restore(settings, taken, clock)
        store = Store(settings.database_url, clock)
        assert refusal(store, f"Bearer {later_secret}") == "API_KEY_REVOKED"
    finally:
        store.close()
    for path in (taken, *settings.state_dir.iterdir()):
        if path.is_file():
            for shown in (kept_secret, later_secret):
                assert secret_part(shown).encode() not in path.read_bytes(), path.name


def test_a_store_from_before_api_keys_migrates_and_keeps_its_record(tmp_path, database_url):
    """Migration 13 on a store the previous release left (schema 12): the table and its
    trigger arrive, and what was final before stays final."""
    from modelforge_appliance.identity import admin_tokens
    from modelforge_appliance.store.migrations import SCHEMA_VERSION
    from tests.harness.old_schema import downgrade

    store = Store(database_url, ManualClock())
    store.migrate()
    token, _ = admin_tokens.create_admin_token(store, "t", "cli")
    admin_tokens.revoke_admin_token(store, token.token_id, "cli")
    with store.connection():
        downgrade(store.db, 12)
    store.close()
    store = Store(database_url, ManualClock())
    try:
        assert store.migrate() == list(range(13, SCHEMA_VERSION + 1))
        view, secret = api_keys.create_api_key(store, "new", "cli")
        api_keys.revoke_api_key(store, view["key_id"], "cli")
        kinds = {(e.kind, e.subject_id) for e in finality.read_store(store)}
        assert {("admin_token", token.token_id), ("api_key", view["key_id"])} <= kinds
    finally:
        store.close()


def test_a_revoke_of_an_unknown_or_misshapen_id_is_not_found(store):
    for key_id in ("0123456789abcdef", "", "x" * 500, "abc\x00def", "ABCDEF0123456789"):
        with pytest.raises(NotFound):
            api_keys.revoke_api_key(store, key_id, "cli")
    with pytest.raises(Invalid):
        api_keys.create_api_key(store, "\u202eevil", "cli")
    assert api_keys.list_api_keys(store) == []


# -- wrong keys, throttled per address (identity/key_guesses.py) -------------------------


def test_a_burst_of_wrong_keys_from_one_address_is_throttled_and_logged_once(
    sqlite_control_plane, caplog
):
    import requests

    from modelforge_appliance.identity.key_guesses import BURST

    cp = sqlite_control_plane
    _, key = api_keys.create_api_key(cp.store, "right", "tests")
    models = f"{cp.url}/v1/models"

    def call(authorization: str | None) -> requests.Response:
        headers = {"Authorization": authorization} if authorization else {}
        return requests.get(models, headers=headers, timeout=30)

    assert call(f"Bearer {key}").status_code == 200
    caplog.set_level("INFO")
    wrong = "Bearer mfk_0123456789abcdef_" + "x" * 43
    answers = [call(wrong) for _ in range(BURST)]
    assert [(a.status_code, error_code(a)) for a in answers] == [(401, "API_KEY_INVALID")] * BURST
    throttled = call(wrong)
    assert (throttled.status_code, error_code(throttled)) == (429, "API_KEY_THROTTLED")
    assert 1 <= int(throttled.headers["Retry-After"]) <= 60
    # Every key from that address waits, the right one too; a call without one is no guess.
    assert error_code(call(f"Bearer {key}")) == "API_KEY_THROTTLED"
    assert error_code(call(None)) == "API_KEY_MISSING"
    said = [r.getMessage() for r in caplog.records]
    assert sum("wrong API keys from 127.0.0.1" in line for line in said) == 1
    assert not [line for line in said if "API_KEY_INVALID" in line]  # not one line per guess
    assert key.split("_", 2)[2] not in caplog.text and "x" * 43 not in caplog.text


def test_the_wrong_key_window_ends_and_a_right_key_clears_the_count():
    from modelforge_appliance.identity.key_guesses import WrongKeyThrottle

    now = [1000.0]
    throttle = WrongKeyThrottle(burst=3, window=60, clock=lambda: now[0], max_addresses=2)
    for _ in range(2):
        throttle.wrong("10.0.0.1")
    throttle.right("10.0.0.1")  # a matching key: the count starts again
    for _ in range(2):
        throttle.wrong("10.0.0.1")
    throttle.check("10.0.0.1")  # two of three: not yet
    throttle.wrong("10.0.0.1")
    with pytest.raises(Exception, match="too many wrong API keys") as refused:
        throttle.check("10.0.0.1")
    assert refused.value.extra == {"retry_after_seconds": 60}
    throttle.check("10.0.0.2")  # another address is not held up
    now[0] += 59.5
    with pytest.raises(Exception, match="try again in 1 s"):
        throttle.check("10.0.0.1")
    now[0] += 1
    throttle.check("10.0.0.1")  # the window ended
    # Bounded: the oldest address is forgotten first.
    for address in ("a", "b", "c"):
        throttle.wrong(address)
    assert list(throttle._counts) == ["b", "c"]
