"""Invariant 11: every bad request gets a 4xx in the one error shape and changes nothing."""

from __future__ import annotations

import json
import re

import pytest
import requests

from modelforge_appliance.store.tables import (
    AdminToken,
    ApiKey,
    Credential,
    EnrollmentToken,
    Node,
    WorkItem,
    WorkLease,
)
from tests.harness.control_plane import error_code, new_identity

from .test_agent_auth import enroll_node

CODE = re.compile(r"^[A-Z][A-Z0-9_]+$")


def assert_error_shape(response: requests.Response, label: str) -> str:
    assert 400 <= response.status_code < 500, (label, response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json"), label
    body = response.json()
    error = body["error"]
    assert set(error) == {"code", "message", "next_step"}, label
    assert CODE.match(error["code"]), label
    assert error["message"] and error["next_step"], label
    return error["code"]


def snapshot(store) -> dict:
    """Everything but the audit trail, which records refusals by design, and the stamps
    that say when an admin token or credential last authenticated a request."""
    with store.connection():
        return {
            model.__name__: sorted(
                repr({k: v for k, v in row.items() if k != "last_used_at"})
                for row in model.select().dicts()
            )
            for model in (
                AdminToken,
                Node,
                EnrollmentToken,
                Credential,
                WorkItem,
                WorkLease,
                ApiKey,
            )
        }


def endpoints(cp, node, token):
    """(method, path, auth headers, a valid body) for every endpoint that takes a body."""
    admin = {"X-ModelForge-Admin-Token": cp.admin_token}
    agent = {"X-ModelForge-Agent-Protocol": "1", "Authorization": f"Bearer {node['credential']}"}
    health = {"status": "ok", "gpu_probe": "not_applicable"}
    accelerator = {
        "index": 0,
        "name": "NVIDIA GeForce RTX 4090",
        "uuid": "GPU-1",
        "memory_total_bytes": 25769803776,
        "driver_version": "550.54.14",
        "cuda_version": "12.4",
        "pci_bus_id": "00000000:01:00.0",
    }
    sample = {
        "uuid": "GPU-1",
        "index": 0,
        "utilization_gpu_percent": 10,
        "memory_used_bytes": 1,
        "temperature_c": 40,
        "power_w": 30.5,
    }
    return [
        (
            "POST",
            "/api/v1/admin/node-enrollments",
            admin,
            {"display_name": "n", "expires_in_seconds": 900},
        ),
        (
            "POST",
            "/api/v1/agent/enroll",
            {"X-ModelForge-Agent-Protocol": "1"},
            {
                "token": token,
                "hostname": "h",
                "agent_version": "1",
                "accelerator_mode": "cpu",
                "identity": new_identity(),
            },
        ),
        (
            "POST",
            "/api/v1/agent/heartbeat",
            agent,
            {"node_id": node["node_id"], "agent_version": "1", "health": health},
        ),
        (
            "PUT",
            "/api/v1/agent/inventory",
            agent,
            {"node_id": node["node_id"], "agent_version": "1", "accelerators": [accelerator]},
        ),
        (
            "POST",
            "/api/v1/agent/telemetry",
            agent,
            {"node_id": node["node_id"], "samples": [sample]},
        ),
        ("POST", "/api/v1/admin/work", admin, {"capability": "smoke"}),
        ("POST", "/api/v1/admin/api-keys", admin, {"name": "client"}),
        (
            "POST",
            "/api/v1/agent/work/claim",
            agent,
            {"node_id": node["node_id"], "capabilities": ["smoke"], "work_slots": 2},
        ),
        (
            "PUT",
            f"/api/v1/admin/hardware/nodes/{node['node_id']}/work-slots",
            admin,
            {"work_slots_max": 2},
        ),
        (
            "POST",
            "/api/v1/agent/work/no-such-item/renew",
            agent,
            {"node_id": node["node_id"], "lease_id": "0" * 32},
        ),
        (
            "POST",
            "/api/v1/agent/work/no-such-item/complete",
            agent,
            {"node_id": node["node_id"], "lease_id": "0" * 32, "outcome": "succeeded"},
        ),
    ]


# Values that are right for these fields: no identity, a cpu node with no accelerators, a
# claim offering no capability (answered 204), seven work slots, and a node's maximum of
# seven or the default (null).
ACCEPTABLE = {
    ("identity", None),
    ("accelerators", ()),
    ("capabilities", ()),
    ("work_slots", 7),
    ("work_slots_max", 7),
    ("work_slots_max", None),
}
# docs/architecture.md §3: enroll optionally carries an identity; a claim without work_slots
# is an older agent's (one slot).
OPTIONAL = {"identity", "work_slots"}
WRONG_VALUES = [None, True, 7, -1, 1.5, "", "x" * 5000, [], {}, "\u0000"]


def _hashable(value):
    return (
        tuple(value)
        if isinstance(value, list)
        else repr(value)
        if isinstance(value, dict)
        else value
    )


def bad_bodies(valid: dict):
    """Malformed documents, then each field removed, replaced by each wrong value, and extra."""
    yield "not json", b"{nope", "application/json"
    yield "array", b"[]", "application/json"
    yield "NaN", b'{"a": NaN}', "application/json"
    yield "bad utf-8", b'{"a": "\xff"}', "application/json"
    yield "deep", b"[" * 100000 + b"]" * 100000, "application/json"
    yield "form", b"a=b", "application/x-www-form-urlencoded"
    yield "empty", b"", "application/json"
    yield "unknown field", json.dumps({**valid, "surprise": 1}).encode(), "application/json"
    for name in valid:
        without = {k: v for k, v in valid.items() if k != name}
        if name not in OPTIONAL:
            yield f"missing {name}", json.dumps(without).encode(), "application/json"
        for wrong in WRONG_VALUES:
            if wrong == valid[name] or (name, _hashable(wrong)) in ACCEPTABLE:
                continue
            body = json.dumps({**valid, name: wrong}).encode()
            yield f"{name}={wrong!r:.20}", body, "application/json"


def test_every_bad_body_on_every_endpoint_is_refused_cleanly(control_plane):
    cp = control_plane
    node = enroll_node(cp)
    token = cp.mint()["token"]
    before = snapshot(cp.store)
    codes = set()
    for method, path, headers, valid in endpoints(cp, node, token):
        for label, body, content_type in bad_bodies(valid):
            response = requests.request(
                method,
                cp.url + path,
                data=body,
                headers={**headers, "Content-Type": content_type},
                timeout=30,
            )
            code = assert_error_shape(response, f"{method} {path} {label}")
            codes.add(code)
            if label.startswith(("missing", "unknown")):
                assert code.startswith("FIELD_"), (path, label, code)
    assert snapshot(cp.store) == before
    assert {"BODY_NOT_JSON", "FIELD_REQUIRED", "FIELD_UNKNOWN", "FIELD_TYPE"} <= codes
    # The enrollment token survived all of it and still enrolls exactly once.
    assert cp.enroll(token, hostname="after").status_code == 201


def test_nested_fields_are_named_in_the_error(sqlite_control_plane):
    cp = sqlite_control_plane
    node = enroll_node(cp)
    body = {
        "node_id": node["node_id"],
        "agent_version": "1",
        "health": {"status": "sleepy", "gpu_probe": "ok"},
    }
    response = cp.agent("POST", "/api/v1/agent/heartbeat", node["credential"], json=body)
    assert response.json()["error"]["code"] == "FIELD_CHOICE"
    assert "health.status" in response.json()["error"]["message"]


def test_oversized_bodies_get_413(sqlite_control_plane):
    cp = sqlite_control_plane
    big = b'{"display_name": "' + b"x" * (cp.settings.max_body_bytes + 1) + b'"}'
    response = cp.admin(
        "POST",
        "/api/v1/admin/node-enrollments",
        data=big,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert assert_error_shape(response, "413") == "BODY_TOO_LARGE"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nowhere", 404),
        ("GET", "/api/v1/admin/hardware/nodes/not-a-node", 404),
        ("DELETE", "/api/v1/admin/node-enrollments/0000000000000000", 404),
        ("DELETE", "/api/v1/admin/hardware/nodes", 405),
        ("GET", "/api/v1/agent/heartbeat", 405),
        ("PATCH", "/api/v1/agent/enroll", 405),
        ("GET", "/api/v1/admin/audit-events?limit=0", 400),
        ("GET", "/api/v1/admin/audit-events?limit=x", 400),
        ("GET", "/api/v1/admin/audit-events?before=-1", 400),
        ("POST", "/healthz", 405),
    ],
)
def test_framework_and_query_errors_share_the_shape(sqlite_control_plane, method, path, status):
    response = sqlite_control_plane.admin(method, path)
    assert response.status_code == status
    assert_error_shape(response, path)


def test_revoking_a_consumed_enrollment_is_a_conflict(sqlite_control_plane):
    cp = sqlite_control_plane
    minted = cp.mint()
    assert cp.enroll(minted["token"]).status_code == 201
    response = cp.admin("DELETE", f"/api/v1/admin/node-enrollments/{minted['enrollment_id']}")
    assert response.status_code == 409
    assert assert_error_shape(response, "409") == "ENROLLMENT_NOT_REVOCABLE"


def test_nvidia_node_cannot_publish_an_empty_inventory(sqlite_control_plane):
    cp = sqlite_control_plane
    response = cp.enroll(cp.mint()["token"], accelerator_mode="nvidia")
    node = response.json()
    body = {"node_id": node["node_id"], "agent_version": "1", "accelerators": []}
    refused = cp.agent("PUT", "/api/v1/agent/inventory", node["credential"], json=body)
    assert refused.status_code == 400
    assert assert_error_shape(refused, "inventory") == "INVENTORY_EMPTY"


def raw_heartbeat(cp, node: dict, fields: str):
    """A heartbeat whose JSON text is written by hand: what json.dumps would never send."""
    body = f'{{"node_id": "{node["node_id"]}", {fields}}}'
    headers = {"Content-Type": "application/json"}
    return cp.agent(
        "POST", "/api/v1/agent/heartbeat", node["credential"], data=body, headers=headers
    )


def test_lone_surrogates_are_refused_and_cannot_stall_heartbeat_writes(sqlite_control_plane):
    """A lone surrogate (U+DFFF, U+D800) in a heartbeat's agent_version or an enrollment's
    hostname was accepted, and a heartbeat batch holding one could not be written, stalling
    every node's heartbeat writes: both are refused with a 400 naming the field, and a
    healthy node's heartbeat is still written."""
    cp = sqlite_control_plane
    bad, good = enroll_node(cp), enroll_node(cp, hostname="gpu-2")
    refused = raw_heartbeat(
        cp, bad, '"agent_version": "0.1.\\udfff", "health": {"status": "ok", "gpu_probe": "ok"}'
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "FIELD_TYPE"
    assert "agent_version" in refused.json()["error"]["message"]
    enroll = cp.enroll(cp.mint()["token"], hostname="h\ud800")
    assert enroll.status_code == 400
    # The healthy node's heartbeat is written and admin reads still answer.
    assert cp.heartbeat(good["credential"], good["node_id"]).status_code == 200
    view = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{good['node_id']}")
    assert view.status_code == 200 and view.json()["liveness"] == "online"


def test_infinite_uptime_is_refused_so_answers_stay_json(sqlite_control_plane):
    """An uptime_seconds of 1e400 parses as infinity; it was accepted, and the admin
    answers that show the node were no longer valid JSON. It is refused with a 400."""
    cp = sqlite_control_plane
    node = enroll_node(cp)
    refused = raw_heartbeat(
        cp,
        node,
        '"agent_version": "1", "health": {"status": "ok", '
        '"gpu_probe": "ok", "uptime_seconds": 1e400}',
    )
    assert refused.status_code == 400
    json.loads(cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node['node_id']}").text)


@pytest.mark.parametrize(
    "bad",
    ["gpu\x7f1", "gpu\x851", "gpu\x9b[31m", "gpu\u202e1", "gpu\u20661", "gpu\u200f1", "gpu\u061c"],
    ids=["DEL", "NEL", "CSI", "RLO", "LRI", "RLM", "ALM"],
)
def test_del_c1_controls_and_bidi_marks_are_refused(sqlite_control_plane, bad):
    """DEL, C1 controls (NEL, CSI) and bidi marks (RLO, LRI, RLM, ALM) got through the text
    checks in hostnames and display names, so a node could garble or disguise what
    terminals and the console show: each is refused as FIELD_TYPE, and the refused
    enrollment leaves its token unspent."""
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
