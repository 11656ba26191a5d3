"""Heartbeat authentication (invariant 4), re-enrollment (invariant 6) and token refusals."""

from __future__ import annotations

import pytest

from modelforge_appliance.store.tables import Credential, Node
from modelforge_contract import (
    CREDENTIAL_INVALID,
    CREDENTIAL_MISSING,
    CREDENTIAL_NODE_MISMATCH,
    CREDENTIAL_REVOKED,
    ENROLLMENT_ORIGIN_MISMATCH,
    ENROLLMENT_TOKEN_CONSUMED,
    ENROLLMENT_TOKEN_EXPIRED,
    ENROLLMENT_TOKEN_INVALID,
    ENROLLMENT_TOKEN_REVOKED,
    IDENTITY_SECRET_MISMATCH,
)
from tests.harness.control_plane import error_code, new_identity


def enroll_node(cp, hostname="gpu-node-1", identity=None):
    response = cp.enroll(cp.mint()["token"], hostname=hostname, identity=identity)
    assert response.status_code == 201, response.text
    return response.json()


def test_heartbeat_matrix(control_plane):
    cp = control_plane
    identity = new_identity()
    first = enroll_node(cp, identity=identity)
    other = enroll_node(cp, hostname="gpu-node-2")

    assert cp.heartbeat(first["credential"], first["node_id"]).status_code == 200

    unknown = "mfc_0123456789abcdef_" + "A" * 43
    cases = {
        "unknown": (unknown, 401, CREDENTIAL_INVALID),
        "malformed": ("not-a-credential", 401, CREDENTIAL_INVALID),
        "wrong secret": (first["credential"][:-4] + "AAAA", 401, CREDENTIAL_INVALID),
        "other node": (other["credential"], 403, CREDENTIAL_NODE_MISMATCH),
    }
    for label, (credential, status, code) in cases.items():
        response = cp.heartbeat(credential, first["node_id"])
        assert (response.status_code, error_code(response)) == (status, code), label

    missing = cp.agent("POST", "/api/v1/agent/heartbeat", json={})
    assert (missing.status_code, error_code(missing)) == (401, CREDENTIAL_MISSING) or (
        missing.status_code == 400
    )

    # Re-enrollment revokes the previous credential: it then answers 401 REVOKED.
    again = enroll_node(cp, identity=identity)
    revoked = cp.heartbeat(first["credential"], first["node_id"])
    assert (revoked.status_code, error_code(revoked)) == (401, CREDENTIAL_REVOKED)
    assert cp.heartbeat(again["credential"], first["node_id"]).status_code == 200


def test_reenroll_with_same_identity_lands_on_same_node_and_revokes_old_credential(control_plane):
    cp = control_plane
    identity = new_identity()
    first = enroll_node(cp, identity=identity)
    second = enroll_node(cp, hostname="gpu-node-1-rebuilt", identity=identity)

    assert second["node_id"] == first["node_id"]
    assert second["reenrolled"] is True
    assert cp.heartbeat(first["credential"], first["node_id"]).status_code == 401
    assert cp.heartbeat(second["credential"], first["node_id"]).status_code == 200
    with cp.store.connection():
        assert Node.select().count() == 1
        assert Credential.select().where(Credential.revoked_at.is_null()).count() == 1
        assert Credential.select().where(Credential.revoked_at.is_null(False)).count() == 1

    # A revoked credential stays refused after yet another re-enrollment (invariant 5).
    enroll_node(cp, identity=identity)
    assert cp.heartbeat(first["credential"], first["node_id"]).status_code == 401


def test_wrong_identity_secret_is_refused_and_changes_nothing(control_plane):
    cp = control_plane
    identity = new_identity()
    first = enroll_node(cp, identity=identity)
    forged = {**new_identity(), "identity_id": identity["identity_id"]}
    forged["identity_secret"] = f"mfi_{identity['identity_id']}_{'B' * 43}"
    minted = cp.mint()

    refused = cp.enroll(minted["token"], identity=forged)
    assert (refused.status_code, error_code(refused)) == (403, IDENTITY_SECRET_MISMATCH)

    assert cp.heartbeat(first["credential"], first["node_id"]).status_code == 200
    enrollments = cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]
    state = {e["enrollment_id"]: e["state"] for e in enrollments}
    assert state[minted["enrollment_id"]] == "pending"  # the token was not spent
    with cp.store.connection():
        assert Node.select().count() == 1
        assert Credential.select().count() == 1


def test_consumed_revoked_and_unknown_tokens_have_their_own_codes(control_plane):
    cp = control_plane
    consumed = cp.mint()
    assert cp.enroll(consumed["token"]).status_code == 201
    revoked = cp.mint()
    assert cp.admin("DELETE", f"/api/v1/admin/node-enrollments/{revoked['enrollment_id']}").ok
    cases = [
        (consumed["token"], 410, ENROLLMENT_TOKEN_CONSUMED),
        (revoked["token"], 410, ENROLLMENT_TOKEN_REVOKED),
        ("mfe_0123456789abcdef_" + "C" * 43, 401, ENROLLMENT_TOKEN_INVALID),
        (consumed["token"][:-3] + "xyz", 401, ENROLLMENT_TOKEN_INVALID),
        ("garbage", 401, ENROLLMENT_TOKEN_INVALID),
    ]
    for token, status, code in cases:
        response = cp.enroll(token, hostname="late")
        assert (response.status_code, error_code(response)) == (status, code), token
    with cp.store.connection():
        assert Node.select().count() == 1


def test_expired_token_is_refused(clocked_control_plane, clock):
    cp = clocked_control_plane
    minted = cp.mint(expires=300)
    clock.advance(300)
    response = cp.enroll(minted["token"])
    assert (response.status_code, error_code(response)) == (410, ENROLLMENT_TOKEN_EXPIRED)


def test_expiry_is_exclusive_of_the_last_second(clocked_control_plane, clock):
    cp = clocked_control_plane
    minted = cp.mint(expires=300)
    clock.advance(299.5)
    assert cp.enroll(minted["token"]).status_code == 201


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:1", "evil.example:{port}"])
def test_enroll_for_another_api_origin_is_refused(sqlite_control_plane, host):
    cp = sqlite_control_plane
    minted = cp.mint()
    port = cp.url.rsplit(":", 1)[1]
    response = cp.enroll(minted["token"], headers={"Host": host.format(port=port)})
    assert (response.status_code, error_code(response)) == (403, ENROLLMENT_ORIGIN_MISMATCH)
    assert cp.enroll(minted["token"]).status_code == 201  # the refusal did not spend it


def test_an_identity_secret_with_spaces_is_refused_instead_of_enrolling_once(sqlite_control_plane):
    """An identity secret with a trailing space enrolled once, and the same identity could
    then never re-enroll onto its node: it is refused as FIELD_FORMAT before the token is
    spent, and the exact secret re-enrolls onto the same node."""
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
