"""Liveness under an injected clock (invariant 7) and the protocol matrix (invariant 8)."""

from __future__ import annotations

import pytest

from modelforge_contract import PROTOCOL_INCOMPATIBLE

from .test_agent_auth import enroll_node


def liveness(cp, node_id: str) -> str:
    response = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}")
    assert response.status_code == 200, response.text
    return response.json()["liveness"]


def test_liveness_moves_pending_online_stale_offline_and_back(clocked_control_plane, clock):
    cp = clocked_control_plane
    node = enroll_node(cp)
    node_id = node["node_id"]
    assert liveness(cp, node_id) == "pending"

    assert cp.heartbeat(node["credential"], node_id).status_code == 200
    assert liveness(cp, node_id) == "online"
    steps = [(29.9, "online"), (0.1, "stale"), (59.8, "stale"), (0.2, "offline"), (3600, "offline")]
    for seconds, expected in steps:
        clock.advance(seconds)
        assert liveness(cp, node_id) == expected, seconds

    assert cp.heartbeat(node["credential"], node_id).status_code == 200
    assert liveness(cp, node_id) == "online"
    fleet = cp.admin("GET", "/api/v1/admin/hardware/nodes").json()["nodes"]
    assert [n["liveness"] for n in fleet] == ["online"]


def test_heartbeat_time_is_the_control_planes_clock(clocked_control_plane, clock):
    cp = clocked_control_plane
    node = enroll_node(cp)
    clock.advance(12.25)
    answer = cp.heartbeat(node["credential"], node["node_id"]).json()
    view = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node['node_id']}").json()
    assert answer["server_time"] == view["last_heartbeat_at"]
    assert answer["heartbeat_interval_seconds"] == cp.settings.heartbeat_interval_seconds


PROTOCOL_MATRIX = [
    ("0", "TOO_OLD"),
    ("1", "COMPATIBLE"),
    ("2", "TOO_NEW"),
    (None, "UNKNOWN"),
    ("x", "UNKNOWN"),
    ("1.0", "UNKNOWN"),
    ("", "UNKNOWN"),
]


@pytest.mark.parametrize(("header", "answer"), PROTOCOL_MATRIX)
def test_protocol_matrix_on_enroll_and_heartbeat(sqlite_control_plane, header, answer):
    cp = sqlite_control_plane
    node = enroll_node(cp)
    headers = {"X-ModelForge-Agent-Protocol": header}
    enroll = cp.enroll(cp.mint()["token"], hostname="second", headers=headers)
    beat = cp.heartbeat(node["credential"], node["node_id"], headers=headers)
    for response, ok_status in ((enroll, 201), (beat, 200)):
        assert response.json()["compatibility"] == answer
        if answer == "COMPATIBLE":
            assert response.status_code == ok_status
        else:
            assert response.status_code == 426
            assert response.json()["error"]["code"] == PROTOCOL_INCOMPATIBLE
            assert response.json()["error"]["next_step"]
