"""The audit trail: every mint, claim, refusal, admin token action and credential change."""

from __future__ import annotations

from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.store import audit

from ..support import new_identity


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
