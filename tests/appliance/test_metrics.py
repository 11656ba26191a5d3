"""GET /metrics: admin-only Prometheus text with liveness, heartbeats, enrollments, latency."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families

from .test_agent_auth import enroll_node


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_what_happened_and_need_an_admin(clocked_control_plane, clock):
    cp = clocked_control_plane
    assert requests.get(f"{cp.url}/metrics", timeout=10).status_code == 401
    online, silent = enroll_node(cp), enroll_node(cp, hostname="gpu-2")
    enroll_node(cp, hostname="gpu-3")  # pending: never heartbeats
    token = cp.mint()["token"]
    cp.enroll(token)
    cp.enroll(token)  # refused: consumed
    assert cp.heartbeat(silent["credential"], silent["node_id"]).status_code == 200
    clock.advance(cp.settings.offline_after_seconds)
    for _ in range(3):
        assert cp.heartbeat(online["credential"], online["node_id"]).status_code == 200

    bearer = {"Authorization": f"Bearer {cp.admin_token}"}
    response = requests.get(f"{cp.url}/metrics", headers=bearer, timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    got = samples(response.text)
    nodes = {
        labels[0][1]: value for (name, labels), value in got.items() if name == "modelforge_nodes"
    }
    assert nodes == {"pending": 2, "online": 1, "stale": 0, "offline": 1, "decommissioned": 0}
    assert got[("modelforge_heartbeats_received_total", ())] == 4
    outcome = lambda code: got[("modelforge_enrollment_outcomes_total", (("code", code),))]  # noqa: E731
    assert outcome("ENROLLED") == 4
    assert outcome("ENROLLMENT_TOKEN_CONSUMED") == 1
    heartbeat_route = (("method", "POST"), ("route", "/api/v1/agent/heartbeat"), ("status", "200"))
    assert got[("modelforge_request_duration_seconds_count", heartbeat_route)] == 4
    assert online["credential"] not in response.text and token not in response.text
