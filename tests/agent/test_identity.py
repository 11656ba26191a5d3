"""The identity file: mode 0600, atomic replacement, and a corrupt file stops the agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from modelforge_contract import EXIT_USAGE
from modelforge_node_agent.identity import (
    NodeState,
    StateError,
    load_state,
    new_identity,
    save_state,
    state_path,
)
from tests.harness.agent_process import AgentProcess, agent_env, run_agent, wait_until
from tests.harness.control_plane import free_port

CREDENTIAL = "mfc_0123456789abcdef_" + "C" * 43


def test_state_file_is_0600_whatever_the_umask(tmp_path):
    previous = os.umask(0)
    try:
        save_state(tmp_path, new_identity())
    finally:
        os.umask(previous)
    assert (state_path(tmp_path).stat().st_mode & 0o777) == 0o600


def test_state_round_trips_and_hides_secrets_from_repr(tmp_path):
    state = new_identity().with_enrollment("node-1", CREDENTIAL)
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert state.identity_secret not in repr(state) and CREDENTIAL not in repr(state)


def test_crash_between_write_and_rename_leaves_the_previous_file(tmp_path):
    first = new_identity().with_enrollment("node-1", CREDENTIAL)
    save_state(tmp_path, first)
    before = state_path(tmp_path).read_bytes()
    # A process that dies hard (no cleanup, no exception handlers) just before the rename.
    crash = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from modelforge_node_agent import identity\n"
        "os.replace = lambda *a: os._exit(9)\n"
        "state = identity.new_identity()\n"
        "identity.save_state(Path(sys.argv[1]), state)\n"
    )
    result = subprocess.run([sys.executable, "-c", crash, str(tmp_path)], timeout=30)
    assert result.returncode == 9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".identity.json.")]
    assert leftovers, "the crash happened after the temp file was written"
    assert state_path(tmp_path).read_bytes() == before
    assert load_state(tmp_path) == first


def test_failed_write_keeps_the_previous_file_and_cleans_up(tmp_path, monkeypatch):
    first = new_identity()
    save_state(tmp_path, first)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    try:
        save_state(tmp_path, new_identity())
    except StateError as error:
        assert "No space left" in str(error)
    else:
        raise AssertionError("a failed write must raise StateError")
    assert load_state(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["identity.json"]


def test_corrupt_identity_file_stops_the_agent_and_is_left_alone(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    good = new_identity()
    variants = {
        "truncated": b'{"format": 1, "identity_id": "abc',
        "secret for another id": json.dumps(
            {
                "format": 1,
                "identity_id": "00000000deadbeef",
                "identity_secret": good.identity_secret,
            }
        ).encode(),
        "not an object": b"[]",
    }
    for name, content in variants.items():
        state_path(state_dir).write_bytes(content)
        env = agent_env(
            control_plane_url=f"http://127.0.0.1:{free_port()}",
            enrollment_token="mfe_0123456789abcdef_" + "D" * 43,
            accelerator_mode="cpu",
            state_volume=state_dir,
        )
        result = run_agent(env, timeout=30)
        assert result.returncode == EXIT_USAGE, (name, result.stderr)
        assert "will not invent a new identity" in result.stderr, name
        assert "enrolling" not in result.stderr, name
        assert state_path(state_dir).read_bytes() == content, name


def test_identity_is_written_before_enrolling(tmp_path):
    env = agent_env(
        control_plane_url=f"http://127.0.0.1:{free_port()}",
        enrollment_token="mfe_0123456789abcdef_" + "E" * 43,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
    )
    with AgentProcess(env, tmp_path / "agent.log") as agent:
        agent.wait_for_log("ConnectError on POST /api/v1/agent/enroll")
        stored = load_state(tmp_path / "state")
        agent.terminate()
    assert isinstance(stored, NodeState) and stored.node_id is None
    assert stored.identity_id in agent.log()


def test_a_node_s_hostname_follows_what_its_agent_reports(restartable_control_plane, tmp_path):
    """Joined from a throw-away container, a node was recorded under that container's id;
    its agent, started under the host's name, puts the host's name on record (issue 37)."""
    from .test_end_to_end import audit_actions, cpu_agent_env, online_with_inventory, only_node

    cp = restartable_control_plane
    env = cpu_agent_env(cp, tmp_path, cp.plane.mint()["token"])
    with AgentProcess({**env, "MODELFORGE_AGENT_HOSTNAME": "3f2a9c1d0b7e"},
                      tmp_path / "first.log") as agent:  # fmt: skip
        wait_until(lambda: online_with_inventory(cp), what="enrolled and published")
        assert only_node(cp)["hostname"] == "3f2a9c1d0b7e"
        agent.terminate()
    with AgentProcess({**env, "MODELFORGE_AGENT_HOSTNAME": "gpu-box"}, tmp_path / "second.log"):
        wait_until(lambda: only_node(cp)["hostname"] == "gpu-box", what="the host's name")
    assert audit_actions(cp).count("node.hostname_changed") == 1
