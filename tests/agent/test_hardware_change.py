"""The real agent over the test NVML library, when its node gains a GPU (issue 21): its
first inventory is the node's accepted hardware, the one after a restart with an eighth GPU
waits for an administrator (no telemetry for the new GPU meanwhile), and accepting it lets
the telemetry of every GPU through."""

from __future__ import annotations

import copy

from modelforge_contract import EXIT_OK
from tests.harness.agent_process import AgentProcess, agent_env, nvml_env, wait_until
from tests.harness.nvml import h100_80g_x8

NODES = "/api/v1/admin/hardware/nodes"


def env_for(cp, fake_nvml_dir, tmp_path, host, token=None):
    return agent_env(
        control_plane_url=cp.url,
        enrollment_token=token,
        accelerator_mode="nvidia",
        state_volume=tmp_path / "state",
        telemetry_interval_seconds=1,
        hostname="gpu-grown",
        **nvml_env(fake_nvml_dir, host, tmp_path / "nvml"),
    )


def test_a_gpu_the_agent_finds_after_a_restart_waits_for_an_admin(
    restartable_control_plane, fake_nvml_dir, tmp_path
):
    cp = restartable_control_plane
    full = h100_80g_x8()
    seven = {**copy.deepcopy(full), "devices": full["devices"][:7]}
    new_uuid = full["devices"][7]["uuid"]

    def node():
        fleet = cp.nodes()
        return fleet[0] if fleet else None

    def telemetry_of(count):
        shown = node()
        samples = ((shown or {}).get("telemetry") or {}).get("samples") or []
        return shown if len(samples) == count else None

    def held():
        shown = node()
        return shown if shown["hardware"]["pending"] else None

    token = cp.plane.mint()["token"]
    with AgentProcess(env_for(cp, fake_nvml_dir, tmp_path, seven, token), tmp_path / "a.log") as a:
        wait_until(lambda: telemetry_of(7), what="seven GPUs published")
        assert a.terminate()[0] == EXIT_OK
    node_id = node()["node_id"]
    assert node()["hardware"]["pending"] is False

    with AgentProcess(env_for(cp, fake_nvml_dir, tmp_path, full), tmp_path / "b.log") as agent:
        waiting = wait_until(held, what="the eighth GPU held")
        assert [g["uuid"] for g in waiting["hardware"]["difference"]["appeared"]] == [new_uuid]
        assert len(waiting["accelerators"]) == 7
        assert "hardware" in waiting["readiness"]["failing"]
        agent.wait_for_log(r"TELEMETRY_GPU_UNKNOWN|not a GPU of this node")
        assert telemetry_of(8) is None
        answer = cp.plane.admin("POST", f"{NODES}/{node_id}/accept-hardware")
        assert answer.status_code == 200, answer.text
        shown = wait_until(lambda: telemetry_of(8), what="telemetry of all eight GPUs")
        assert [g["uuid"] for g in shown["accelerators"]][-1] == new_uuid
        assert agent.terminate()[0] == EXIT_OK
