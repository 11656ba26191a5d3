"""Regressions from the second review: each names what broke."""

from __future__ import annotations

import json
from dataclasses import replace

import requests

from modelforge_appliance.store.tables import Node

from ..support import make_settings, serve
from .test_agent_auth import enroll_node

PROXIED = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "cp.lan"}


def _enroll_through(cp, token: str, headers: dict) -> requests.Response:
    return cp.enroll(token, hostname="behind-proxy", headers=headers)


def raw_heartbeat(cp, node: dict, fields: str):
    """A heartbeat whose JSON text is written by hand: what json.dumps would never send."""
    body = f'{{"node_id": "{node["node_id"]}", {fields}}}'
    headers = {"Content-Type": "application/json"}
    return cp.agent(
        "POST", "/api/v1/agent/heartbeat", node["credential"], data=body, headers=headers
    )


def test_enrollment_through_a_trusted_tls_proxy_matches_the_public_origin(tmp_path):
    settings = replace(
        make_settings(tmp_path / "state"),
        public_api_origin="https://cp.lan",
        trusted_proxies=("127.0.0.1",),
    )
    with serve(settings) as cp:
        token = cp.mint()["token"]
        assert _enroll_through(cp, token, {}).status_code == 403  # plain http://127.0.0.1
        assert _enroll_through(cp, token, PROXIED).status_code == 201


def test_forwarded_headers_from_an_untrusted_client_are_ignored(tmp_path):
    settings = replace(make_settings(tmp_path / "state"), public_api_origin="https://cp.lan")
    with serve(settings) as cp:
        refused = _enroll_through(cp, cp.mint()["token"], PROXIED)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "ENROLLMENT_ORIGIN_MISMATCH"


def test_minting_through_an_unusable_host_header_is_a_400(sqlite_control_plane):
    cp = sqlite_control_plane
    for host in ("a" * 400 + ":1", "bad host"):
        response = cp.admin(
            "POST",
            "/api/v1/admin/node-enrollments",
            json={"display_name": "n", "expires_in_seconds": 900},
            headers={"Host": host},
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "HOST_INVALID"


def test_lone_surrogates_are_refused_and_cannot_stall_heartbeat_writes(sqlite_control_plane):
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


def test_a_batch_the_store_refuses_is_dropped_not_retried_forever(sqlite_control_plane):
    cp = sqlite_control_plane
    node = enroll_node(cp)
    assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
    # Whatever makes the store refuse a batch, later batches must still be written.
    buffer = cp.heartbeats
    poisoned = next(iter(buffer._pending.values()))
    buffer._pending[node["node_id"]] = replace(poisoned, health=object())
    assert buffer.flush() == 1  # dropped, logged
    assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
    assert buffer.flush() == 1
    with cp.store.connection():
        assert Node.get_by_id(node["node_id"]).last_heartbeat_at is not None


def test_decommissioned_nodes_credential_gets_403_not_401(sqlite_control_plane):
    cp = sqlite_control_plane
    node = enroll_node(cp)
    nodes = "/api/v1/admin/hardware/nodes"
    plan = cp.admin("POST", f"{nodes}/{node['node_id']}/decommission/preview").json()
    cp.admin(
        "POST",
        f"{nodes}/{node['node_id']}/decommission/execute",
        json={"confirmation": plan["confirmation"]},
    )
    refused = cp.heartbeat(node["credential"], node["node_id"])
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "NODE_DECOMMISSIONED")


def test_infinite_uptime_is_refused_so_answers_stay_json(sqlite_control_plane):
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
