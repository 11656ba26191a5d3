"""API keys with limits and their usage (issue 36): scope, requests per minute, tokens per
day, expiry, and usage that equals what the runtime reported, on a real control plane with
the agent's real tunnel client and a stand-in runtime whose answers carry ``usage``."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.identity.api_keys import KeyLimits, create_api_key, list_api_keys
from modelforge_appliance.relay.limits import UsageBook, usage_report
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import ApiKey
from tests.harness.control_plane import run_cli, store_env

from . import test_relay

# The relay tests' fixtures: a control plane, the stand-in runtime, a node serving `svc`.
cp, origin, relay = test_relay.cp, test_relay.origin, test_relay.relay

USAGE = {"prompt_tokens": 10, "completion_tokens": 20}


@pytest.fixture(autouse=True)
def answers_with_usage(origin):
    origin.json_body = json.dumps({"choices": [], "usage": USAGE}).encode()


def key_with(cp, **limits) -> str:
    _, secret = create_api_key(cp.store, "limited", "tests", KeyLimits(**limits))
    return secret


def error_of(response) -> dict:
    return json.loads(response.read())["error"]


def models_of(cp, key: str) -> list[str]:
    import requests

    answer = requests.get(
        cp.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    return [m["id"] for m in answer.json()["data"]]


def test_a_key_limited_to_deployments_is_refused_others_and_lists_only_its_own(cp, relay):
    mine = key_with(cp, deployments=("svc",))
    elsewhere = key_with(cp, deployments=("chat-b",))
    assert relay.request({"model": "svc"}, key=mine).status == 200
    refused = relay.request({"model": "svc"}, key=elsewhere)
    assert refused.status == 403
    error = error_of(refused)
    assert error["code"] == "API_KEY_SCOPE" and "chat-b" in error["message"]
    # A name it may not call is refused before any deployment is looked up.
    assert relay.request({"model": "nope"}, key=elsewhere).status == 403
    assert models_of(cp, mine) == ["svc"]
    assert models_of(cp, elsewhere) == []
    assert models_of(cp, relay.key) == ["svc"]  # a key without limits sees everything


def test_a_key_with_three_requests_a_minute_gets_429_on_the_fourth(cp, relay):
    key = key_with(cp, rpm=3)
    for _ in range(3):
        answer = relay.request({"model": "svc"}, key=key)
        assert answer.status == 200
        answer.read()
    refused = relay.request({"model": "svc"}, key=key)
    assert refused.status == 429
    assert 1 <= int(refused.getheader("Retry-After")) <= 60
    body = json.loads(refused.read())
    assert body["error"]["code"] == "RATE_LIMITED" and body["limit"] == 3
    # Another key is not held back by it.
    assert relay.request({"model": "svc"}).status == 200


def test_tokens_per_day_refuse_once_the_runtime_reported_tokens_reach_the_limit(cp, relay):
    key = key_with(cp, tokens_per_day=60)  # two answers of 30 tokens each
    for _ in range(2):
        answer = relay.request({"model": "svc"}, key=key)
        assert answer.status == 200
        answer.read()
    refused = relay.request({"model": "svc"}, key=key)
    assert refused.status == 429
    assert int(refused.getheader("Retry-After")) <= 86400
    body = json.loads(refused.read())
    assert body["error"]["code"] == "QUOTA_EXCEEDED"
    assert body["limit"] == 60 and body["used"] == 60


def test_requests_in_flight_together_overshoot_the_daily_tokens_by_at_most_their_own(cp, relay):
    key = key_with(cp, tokens_per_day=45)  # one answer (30) leaves room for one more

    def ask() -> int:
        answer = relay.request({"model": "svc"}, key=key)
        answer.read()
        return answer.status

    assert ask() == 200
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: ask(), range(4)))
    answered = statuses.count(200)
    assert answered >= 1 and set(statuses) <= {200, 429}
    book = cp.server.app.usage_book
    key_id = key.split("_")[1]
    # What was used is what the answers reported: no more than the requests in flight.
    assert book.tokens_today(key_id) == 30 * (1 + answered)
    assert ask() == 429


def test_an_expired_key_gets_401_api_key_expired(cp, relay):
    key = key_with(cp)
    key_id = key.split("_")[1]
    with cp.store.write():
        ApiKey.update(expires_at=cp.store.clock.now() - 1).where(ApiKey.key_id == key_id).execute()
    refused = relay.request({"model": "svc"}, key=key)
    assert refused.status == 401
    assert error_of(refused)["code"] == "API_KEY_EXPIRED"


def test_usage_equals_the_runtime_reported_usage_by_key_deployment_and_day(cp, relay):
    first, second = key_with(cp), key_with(cp)
    for key, count in ((first, 3), (second, 2)):
        for _ in range(count):
            answer = relay.request({"model": "svc"}, key=key)
            assert answer.status == 200
            answer.read()
    by_key = cp.admin("GET", "/api/v1/admin/usage?by=key").json()["usage"]
    rows = {row["key_id"]: row for row in by_key}
    for key, count in ((first, 3), (second, 2)):
        row = rows[key.split("_")[1]]
        assert row["name"] == "limited" and row["requests"] == count and row["errors"] == 0
        assert row["prompt_tokens"] == 10 * count and row["completion_tokens"] == 20 * count
    [deployment] = cp.admin("GET", "/api/v1/admin/usage?by=deployment").json()["usage"]
    assert deployment["deployment"] == "svc" and deployment["requests"] == 5
    assert deployment["prompt_tokens"] == 50 and deployment["completion_tokens"] == 100
    [day] = cp.admin("GET", "/api/v1/admin/usage?by=day&since=2000-01-01").json()["usage"]
    assert day["requests"] == 5
    [owner] = cp.admin("GET", "/api/v1/admin/usage?by=user").json()["usage"]
    assert owner["user"] == "admin" and owner["requests"] == 5  # both keys are admin's
    assert cp.admin("GET", "/api/v1/admin/usage?by=planet").status_code == 400
    assert cp.admin("GET", "/api/v1/admin/usage?since=yesterday").status_code == 400
    # The CLI reads what the control plane wrote.
    done = run_cli("usage", "--by", "deployment", "--json", env=store_env(cp.settings), check=True)
    assert json.loads(done.stdout)["usage"] == [deployment]


def test_a_key_s_tokens_of_the_day_survive_a_restart_on_either_store(database_url):
    store = Store(database_url, ManualClock(1_800_000_000))
    store.migrate()
    made, _ = create_api_key(store, "batch", "tests")
    book = UsageBook(store)
    book.add(made["key_id"], "svc", prompt=7, completion=5)
    book.add(made["key_id"], "other", prompt=1, completion=1, error=True)
    book.flush()
    book.add(made["key_id"], "svc", prompt=3, completion=0)
    book.flush()  # added to the stored counts, not written over them
    again = UsageBook(store)  # a restarted control plane reads what was written
    assert again.tokens_today(made["key_id"]) == 17
    again.add(made["key_id"], "svc", prompt=1, completion=1)
    assert again.tokens_today(made["key_id"]) == 19
    by_deployment = {r["deployment"]: r for r in usage_report(store, "deployment", None)}
    assert by_deployment["svc"]["requests"] == 2 and by_deployment["svc"]["prompt_tokens"] == 10
    assert by_deployment["other"]["errors"] == 1
    [owner] = usage_report(store, "user", "2000-01-01")
    assert owner["user"] == "admin" and owner["requests"] == 3
    store.close()


def test_usage_and_key_limits_survive_a_backup_and_restore(tmp_path):
    from modelforge_appliance.store import backup
    from tests.harness.control_plane import make_settings

    settings = make_settings(tmp_path / "state")
    store = Store(settings.database_url, ManualClock(1_800_000_000))
    store.migrate()
    made, _ = create_api_key(store, "batch", "tests", KeyLimits(("svc",), None, 5, 100))
    book = UsageBook(store)
    book.add(made["key_id"], "svc", prompt=4, completion=6)
    book.flush()
    copy = tmp_path / "backup.sqlite3"
    backup.backup(settings, copy)
    book.add(made["key_id"], "svc", prompt=1, completion=1)
    book.flush()
    store.close()
    backup.restore(settings, copy, ManualClock(1_800_000_100))
    store = Store(settings.database_url, ManualClock(1_800_000_100))
    [row] = usage_report(store, "key", None)
    assert row["requests"] == 1 and row["prompt_tokens"] == 4 and row["completion_tokens"] == 6
    [key] = [k for k in list_api_keys(store) if k["key_id"] == made["key_id"]]
    assert key["rpm"] == 5 and key["tokens_per_day"] == 100 and key["deployments"] == ["svc"]
    store.close()
