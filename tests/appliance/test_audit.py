"""The audit trail: every mint, claim, refusal, admin token action and credential change."""

from __future__ import annotations

import json
import sqlite3

import pytest

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.store import audit
from tests.harness.control_plane import error_code, make_settings, new_identity, serve


def actions(cp, **query) -> list[dict]:
    params = {"limit": 500, **query}
    response = cp.admin("GET", "/api/v1/admin/audit-events", params=params)
    assert response.status_code == 200
    return response.json()["events"]


def test_enrollment_lifecycle_is_audited_newest_first_without_secrets(control_plane):
    cp = control_plane
    identity = new_identity()
    first_token = cp.mint()
    first = cp.enroll(first_token["token"], identity=identity).json()
    second = cp.enroll(cp.mint()["token"], identity=identity).json()
    cp.enroll(first_token["token"], identity=identity)  # refused: consumed
    unused = cp.mint()
    cp.admin("DELETE", f"/api/v1/admin/node-enrollments/{unused['enrollment_id']}")
    row, secret = admin_tokens.create_admin_token(cp.store, "script", audit.CLI_ACTOR)
    admin_tokens.revoke_admin_token(cp.store, row.token_id, audit.CLI_ACTOR)

    events = actions(cp)
    ids = [event["id"] for event in events]
    assert ids == sorted(ids, reverse=True)
    names = [event["action"] for event in reversed(events)]
    expected_order = [
        "admin_token.created",  # the fixture's token
        "enrollment.minted",
        "enrollment.claimed",
        "credential.issued",
        "enrollment.minted",
        "credential.revoked",
        "enrollment.reenrolled",
        "credential.issued",
        "enrollment.refused",
        "enrollment.minted",
        "enrollment.revoked",
        "admin_token.created",
        "admin_token.revoked",
    ]
    assert names == expected_order
    refused = next(e for e in events if e["action"] == "enrollment.refused")
    assert refused["detail"]["code"] == "ENROLLMENT_TOKEN_CONSUMED"
    node_events = actions(cp, node_id=first["node_id"])
    assert {e["action"] for e in node_events} == {
        "enrollment.claimed",
        "credential.issued",
        "credential.revoked",
        "enrollment.reenrolled",
    }
    assert all(e["node_id"] == first["node_id"] for e in node_events)
    assert all(e["actor"].startswith(("admin:", "cli", "enrollment:")) for e in events)
    text = str(events)
    for value in (
        first_token["token"],
        first["credential"],
        second["credential"],
        secret,
        identity["identity_secret"],
        cp.admin_token,
    ):
        assert value not in text


def test_audit_pages_backwards(sqlite_control_plane):
    cp = sqlite_control_plane
    for _ in range(5):
        cp.mint()
    page = cp.admin("GET", "/api/v1/admin/audit-events", params={"limit": 2}).json()
    assert len(page["events"]) == 2
    rest = cp.admin(
        "GET", "/api/v1/admin/audit-events", params={"limit": 50, "before": page["next_before"]}
    ).json()
    assert len(rest["events"]) == 4  # 3 more mints and the fixture's admin token
    assert rest["next_before"] is None
    assert max(e["id"] for e in rest["events"]) < min(e["id"] for e in page["events"])


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
    """Every replay of a consumed enrollment token wrote its own enrollment.refused audit
    row, so a replay loop grew the store without bound: repeats within the refusal window
    are counted, written as one row's unrecorded_repeats when the window ends or the server
    stops, and still counted in /metrics."""
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
    """Counting repeated refusals must not fold refusals of other tokens, or with other
    codes, into one: each is its own audit row."""
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
    """The audit query's limit and before took whatever int() takes: superscript, Arabic-
    Indic and full-width digits, a leading '+', and a 4,400-digit number beyond int()'s
    digit limit. Only ASCII digits are taken; anything else is 400 QUERY_INVALID."""
    response = sqlite_control_plane.admin("GET", f"/api/v1/admin/audit-events?{query}")
    assert (response.status_code, error_code(response)) == (400, "QUERY_INVALID")
