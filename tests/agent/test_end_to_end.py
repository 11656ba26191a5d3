"""The agent as a real process against a real control plane on a loopback port."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modelforge_contract import (
    EXIT_CREDENTIAL_REFUSED,
    EXIT_ENROLLMENT_REFUSED,
    EXIT_OK,
    OFFLINE,
    ONLINE,
    STALE,
)
from tests.harness.agent_process import AgentProcess, agent_env, nvml_env, run_agent, wait_until
from tests.harness.control_plane import free_port
from tests.harness.nvml import h100_80g_x8

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython


def nvidia_agent_env(cp, fake_nvml_dir, tmp_path, token, state="state"):
    return agent_env(
        control_plane_url=cp.url,
        enrollment_token=token,
        accelerator_mode="nvidia",
        state_volume=tmp_path / state,
        telemetry_interval_seconds=1,
        hostname="gpu-node-1",
        **nvml_env(fake_nvml_dir, h100_80g_x8(), tmp_path / "nvml"),
    )


def cpu_agent_env(cp, tmp_path, token, state="state"):
    return agent_env(
        control_plane_url=cp.url,
        enrollment_token=token,
        accelerator_mode="cpu",
        state_volume=tmp_path / state,
    )


def only_node(cp):
    fleet = cp.nodes()
    assert len(fleet) == 1, fleet
    return fleet[0]


def audit_actions(cp):
    events = cp.plane.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    return [event["action"] for event in events]


def published_everything(cp):
    fleet = cp.nodes()
    node = fleet[0] if fleet else None
    return (
        node
        if node and node["telemetry_at"] and node["inventory_at"] and (node["liveness"] == ONLINE)
        else None
    )


def online_with_inventory(cp):
    fleet = cp.nodes()
    node = fleet[0] if fleet else None
    return node if node and node["inventory_at"] and node["liveness"] == ONLINE else None


def test_enroll_publish_restart_and_new_identity(
    restartable_control_plane, fake_nvml_dir, tmp_path
):
    cp = restartable_control_plane
    token = cp.plane.mint()["token"]
    env = nvidia_agent_env(cp, fake_nvml_dir, tmp_path, token)

    with AgentProcess(env, tmp_path / "first.log") as agent:
        node = wait_until(lambda: published_everything(cp), what="enroll and publish")
        expected = h100_80g_x8()["devices"]
        assert [gpu["uuid"] for gpu in node["accelerators"]] == [gpu["uuid"] for gpu in expected]
        assert {gpu["mig_mode"] for gpu in node["accelerators"]} == {"disabled"}
        assert node["accelerators"][0]["memory_total_bytes"] == 85520809984
        assert len(node["telemetry"]["samples"]) == 8
        assert node["health"]["gpu_probe"] == "ok"
        # Process arguments are world-readable: the token and credential are never in them.
        cmdline = Path(f"/proc/{agent.process.pid}/cmdline").read_text()
        state = json.loads((tmp_path / "state" / "identity.json").read_text())
        assert token not in cmdline and state["credential"] not in cmdline
        beat = node["last_heartbeat_at"]
        wait_until(lambda: only_node(cp)["last_heartbeat_at"] != beat, what="a second heartbeat")
        status, took = agent.terminate()
    assert status == EXIT_OK and took < 1.0, agent.log()
    node_id = node["node_id"]
    state_file = tmp_path / "state" / "identity.json"
    assert (state_file.stat().st_mode & 0o777) == 0o600

    # Restart with the token still set: same node, the token is not sent again.
    with AgentProcess(env, tmp_path / "second.log") as agent:
        agent.wait_for_log(rf"already enrolled as node {node_id}; .*can be removed")
        beat = only_node(cp)["last_heartbeat_at"]
        wait_until(
            lambda: only_node(cp)["last_heartbeat_at"] != beat, what="heartbeat after restart"
        )
        assert agent.terminate()[0] == EXIT_OK
    assert only_node(cp)["node_id"] == node_id
    actions = audit_actions(cp)
    assert actions.count("enrollment.claimed") == 1
    assert "enrollment.refused" not in actions and "enrollment.reenrolled" not in actions

    # Deleting the identity file is the one way to become a new node. The old token is spent:
    state_file.unlink()
    refused = run_agent(env, timeout=30)
    assert refused.returncode == EXIT_ENROLLMENT_REFUSED, refused.stderr
    assert "ENROLLMENT_TOKEN_CONSUMED" not in refused.stderr  # the agent's words, not the body's
    assert "already used" in refused.stderr
    # ... a fresh token enrolls the host as a second node.
    env = {**env, "MODELFORGE_AGENT_ENROLLMENT_TOKEN": cp.plane.mint()["token"]}
    with AgentProcess(env, tmp_path / "third.log") as agent:
        new_id = agent.wait_for_log(r"enrolled as node ([0-9a-f-]{36})")[0]
        assert agent.terminate()[0] == EXIT_OK
    assert new_id != node_id
    assert sorted(node["node_id"] for node in cp.nodes()) == sorted([node_id, new_id])


@pytest.mark.slow
def test_control_plane_restart_backoff_liveness_and_recovery(restartable_control_plane, tmp_path):
    cp = restartable_control_plane
    env = cpu_agent_env(cp, tmp_path, cp.plane.mint()["token"])
    with AgentProcess(env, tmp_path / "agent.log") as agent:
        node = wait_until(lambda: online_with_inventory(cp), what="online with its inventory")
        node_id = node["node_id"]
        identity_before = (tmp_path / "state" / "identity.json").read_bytes()

        cp.stop()
        # Liveness as the control plane computes it while no heartbeat arrives.
        states = []
        heartbeat_failure = (
            r"ConnectError on POST /api/v1/agent/heartbeat \(backoff 1s…16s\): retry in (\d+)s"
        )

        def offline_and_backed_off():
            liveness = cp.nodes()[0]["liveness"]
            if not states or states[-1] != liveness:
                states.append(liveness)
            return liveness == OFFLINE and "4" in re.findall(heartbeat_failure, agent.log())

        wait_until(offline_and_backed_off, timeout=20, what="offline and the 4s step")
        assert states[-2:] == [STALE, OFFLINE], states
        # The real schedule against a stopped server: 1 s, 2 s, 4 s ...
        assert re.findall(heartbeat_failure, agent.log())[:3] == ["1", "2", "4"], agent.log()

        cp.start()
        agent.wait_for_log(r"POST /api/v1/agent/heartbeat succeeded after \d+ failed tries")
        wait_until(lambda: cp.nodes()[0]["liveness"] == ONLINE, what="online again")
        assert agent.terminate()[0] == EXIT_OK
    assert [n["node_id"] for n in cp.nodes()] == [node_id]
    assert (tmp_path / "state" / "identity.json").read_bytes() == identity_before


def test_revoked_credential_stops_the_agent_then_reenrolling_keeps_the_node(
    restartable_control_plane, tmp_path
):
    cp = restartable_control_plane
    env = cpu_agent_env(cp, tmp_path, cp.plane.mint()["token"])
    with AgentProcess(env, tmp_path / "agent.log") as agent:
        node = wait_until(
            lambda: (
                (n := cp.nodes()) and n[0]["liveness"] == ONLINE and n[0]["inventory_at"] and n[0]
            ),
            what="online with its inventory",
        )
        revoked = cp.plane.admin(
            "DELETE", f"/api/v1/admin/hardware/nodes/{node['node_id']}/credential"
        )
        assert revoked.status_code == 200 and len(revoked.json()["revoked"]) == 1
        assert agent.wait(timeout=10) == EXIT_CREDENTIAL_REFUSED
        log = agent.log()
    # One refused call, then the agent stopped: the heartbeat, or the inventory when the
    # control plane asked for it again (its first heartbeat answer's "accepts" does),
    # whichever came first.
    assert log.count("HTTP 401 on ") == 1, log
    assert re.search(r"HTTP 401 on (POST|PUT|GET) /api/v1/agent/", log), log
    assert "credential refused (CREDENTIAL_REVOKED)" in log
    assert "(docs/node-agent.md, 'Re-enroll a node')" in log

    # Restarting without a fresh token stops again, without calling the control plane.
    again = run_agent({**env, "MODELFORGE_AGENT_ENROLLMENT_TOKEN": ""}, timeout=30)
    assert again.returncode == EXIT_CREDENTIAL_REFUSED
    assert "HTTP 401" not in again.stderr and "credential refused" in again.stderr

    # The runbook step: a fresh token re-enrolls the same identity onto the same node.
    env = {**env, "MODELFORGE_AGENT_ENROLLMENT_TOKEN": cp.plane.mint()["token"]}
    with AgentProcess(env, tmp_path / "reenroll.log") as agent:
        agent.wait_for_log(rf"re-enrolled .* as node {node['node_id']}")
        beat = only_node(cp)["last_heartbeat_at"]
        wait_until(lambda: only_node(cp)["last_heartbeat_at"] != beat, what="heartbeat")
        assert agent.terminate()[0] == EXIT_OK


def test_sigterm_during_enrollment_backoff_stops_within_a_second(tmp_path):
    env = agent_env(
        control_plane_url=f"http://127.0.0.1:{free_port()}",
        enrollment_token="mfe_0123456789abcdef_" + "B" * 43,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
    )
    with AgentProcess(env, tmp_path / "agent.log") as agent:
        agent.wait_for_log(r"ConnectError on POST /api/v1/agent/enroll \(backoff 1s…16s\)")
        status, took = agent.terminate()
    assert status == EXIT_OK and took < 1.0
