"""Container work items at submit (issue 21): whatever the node's dockerd would refuse, and
whatever the admin's maxima do not allow, is a field-named 400 with nothing stored; what is
stored carries the fence's limits. A cancel reaches the running node on its next renewal."""

from __future__ import annotations

import pytest

from modelforge_appliance.core.settings import load_settings
from modelforge_contract import LEASE_LOST, PATH_ADMIN_AUDIT
from modelforge_contract import containers as fence
from tests.harness.control_plane import error_code, serve
from tests.harness.scripted_node import WORK, WorkNode, submit

IMAGE_ID = "sha256:" + "ab" * 32


def container(**given) -> dict:
    return {
        "capability": "container",
        "input": {"image": "trainer:1.4", "image_id": IMAGE_ID, **given},
    }


REFUSED = [
    # What dockerd (or execve) would refuse, which reached the node before.
    ({"env": {"TOKEN": "a\x00b"}}, "FIELD_FORMAT", "input.env.TOKEN"),
    ({"env": {"A=B": "x"}}, "FIELD_FORMAT", "input.env.A=B"),
    ({"env": {"\x1b[2J": "x"}}, "FIELD_FORMAT", "input.env.\\x1b[2J"),
    ({"memory_bytes": 4 * 2**20}, "FIELD_RANGE", "input.memory_bytes"),
    ({"memory_bytes": fence.MEMORY_MIN_BYTES - 1}, "FIELD_RANGE", "input.memory_bytes"),
    ({"image": "Trainer:1.4"}, "FIELD_FORMAT", "input.image"),
    ({"image": "trainer 1.4"}, "FIELD_FORMAT", "input.image"),
    ({"image": "trainer:"}, "FIELD_FORMAT", "input.image"),
    ({"image": "-trainer:1"}, "FIELD_FORMAT", "input.image"),
    ({"image": "trainer@sha256:abc"}, "FIELD_FORMAT", "input.image"),
    ({"image": "a" * 256 + ":1"}, "FIELD_RANGE", "input.image"),
    ({"command": ["a\x00b"]}, "FIELD_TYPE", "input.command[0]"),
    ({"pids_limit": 0}, "FIELD_RANGE", "input.pids_limit"),
    ({"cpus": 0}, "FIELD_RANGE", "input.cpus"),
    ({"tmp_bytes": 0}, "FIELD_RANGE", "input.tmp_bytes"),
    ({"log_bytes": 1}, "FIELD_RANGE", "input.log_bytes"),
    ({"swap_bytes": -1}, "FIELD_RANGE", "input.swap_bytes"),
    ({"capabilities": ["ALL"]}, "FIELD_CHOICE", "input.capabilities[0]"),
    ({"run_as_root": "yes"}, "FIELD_TYPE", "input.run_as_root"),
    # What the admin's maxima (the defaults here) do not allow.
    ({"run_as_root": True}, "FIELD_CHOICE", "input.run_as_root"),
    ({"capabilities": ["CHOWN", "SYS_ADMIN"]}, "FIELD_CHOICE", "input.capabilities[1]"),
    ({"pids_limit": 4097}, "FIELD_RANGE", "input.pids_limit"),
    ({"cpus": 64.5}, "FIELD_RANGE", "input.cpus"),
    ({"memory_bytes": 64 * 2**30 + 1}, "FIELD_RANGE", "input.memory_bytes"),
    ({"swap_bytes": 1}, "FIELD_RANGE", "input.swap_bytes"),
    ({"tmp_bytes": 2**30 + 1}, "FIELD_RANGE", "input.tmp_bytes"),
    ({"log_bytes": 64 * 2**20 + 1}, "FIELD_RANGE", "input.log_bytes"),
]


def test_what_docker_or_the_admin_would_refuse_is_a_field_named_400_and_nothing_is_stored(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    for given, code, field in REFUSED:
        response = cp.admin("POST", WORK, json=container(**given))
        assert (response.status_code, error_code(response)) == (400, code), (given, response.text)
        message = response.json()["error"]["message"]
        assert message.startswith(f"{field}:"), (given, message)
        assert "a\x00b" not in message  # a value is never echoed (it may be a secret)
    assert cp.admin("GET", WORK).json()["work"] == []
    events = cp.admin("GET", PATH_ADMIN_AUDIT).json()["events"]
    assert events and not [e for e in events if e["action"] == "work.submitted"]


def test_the_stored_item_says_the_fence_it_runs_under(sqlite_control_plane):
    cp = sqlite_control_plane
    item = cp.admin("POST", WORK, json=container()).json()
    assert {k: item["input"][k] for k in item["input"] if k not in ("image", "image_id")} == {
        "pids_limit": fence.PIDS_DEFAULT,
        "cpus": fence.CPUS_DEFAULT,
        "memory_bytes": fence.MEMORY_DEFAULT_BYTES,
        "swap_bytes": 0,
        "tmp_bytes": fence.TMP_DEFAULT_BYTES,
        "log_bytes": fence.LOG_DEFAULT_BYTES,
        "run_as_root": False,
        "capabilities": [],
    }
    asked = container(pids_limit=64, cpus=0.5, capabilities=["NET_BIND_SERVICE", "CHOWN", "CHOWN"])
    item = cp.admin("POST", WORK, json=asked).json()
    assert (item["input"]["pids_limit"], item["input"]["cpus"]) == (64, 0.5)
    assert item["input"]["capabilities"] == ["CHOWN", "NET_BIND_SERVICE"]


def test_the_admin_sets_the_maxima(tmp_path):
    settings = load_settings(
        {
            "MODELFORGE_STATE_DIR": str(tmp_path / "state"),
            "MODELFORGE_WORK_CONTAINER_MAX_PIDS": "100",
            "MODELFORGE_WORK_CONTAINER_MAX_MEMORY_BYTES": str(256 * 2**20),
            "MODELFORGE_WORK_CONTAINER_MAX_SWAP_BYTES": str(2**30),
            "MODELFORGE_WORK_CONTAINER_ALLOW_ROOT": "true",
            "MODELFORGE_WORK_CONTAINER_CAPABILITIES": "cap_sys_ptrace",
        }
    )
    with serve(settings) as cp:
        # No limit named: the default, or the maximum where that is lower.
        item = cp.admin("POST", WORK, json=container()).json()
        assert (item["input"]["pids_limit"], item["input"]["memory_bytes"]) == (100, 256 * 2**20)
        allowed = container(run_as_root=True, capabilities=["SYS_PTRACE"], swap_bytes=2**30)
        assert cp.admin("POST", WORK, json=allowed).status_code == 201
        for given, field in (
            ({"pids_limit": 101}, "input.pids_limit"),
            ({"memory_bytes": 256 * 2**20 + 1}, "input.memory_bytes"),
            ({"capabilities": ["CHOWN"]}, "input.capabilities[0]"),
        ):
            response = cp.admin("POST", WORK, json=container(**given))
            assert response.status_code == 400
            assert response.json()["error"]["message"].startswith(f"{field}:")
        assert len(cp.admin("GET", WORK).json()["work"]) == 2


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODELFORGE_WORK_CONTAINER_CAPABILITIES": "CHOWN,ALL"}, "'ALL' is not a Linux"),
        ({"MODELFORGE_WORK_CONTAINER_MAX_MEMORY_BYTES": str(2**20)}, "outside"),
        ({"MODELFORGE_WORK_CONTAINER_ALLOW_ROOT": "maybe"}, "is not true or false"),
        ({"MODELFORGE_WORK_CONTAINER_MAX_CPUS": "0"}, "MODELFORGE_WORK_CONTAINER_MAX_CPUS"),
    ],
    ids=["capability", "memory", "root", "cpus"],
)
def test_a_bad_maximum_is_a_setting_error(tmp_path, env, message):
    from modelforge_appliance.core.settings import ConfigError

    with pytest.raises(ConfigError) as refused:
        load_settings({"MODELFORGE_STATE_DIR": str(tmp_path), **env})
    assert message in str(refused.value)


def test_a_renewal_after_a_cancel_says_cancelled_to_that_node_only(sqlite_control_plane):
    """Before: the renewal of a cancelled item answered a bare LEASE_LOST, and the agent let
    the run go on to its timeout."""
    cp = sqlite_control_plane
    node, other = WorkNode(cp, "gpu-1").ready(), WorkNode(cp, "gpu-2").ready()
    work = submit(cp, constraints={"node_ids": [node.node_id]})
    lease = node.lease()
    assert lease["work_id"] == work["work_id"]
    assert node.renew(lease).status_code == 200
    cancelled = cp.admin("POST", f"{WORK}/{work['work_id']}/cancel")
    assert cancelled.json()["state"] == "cancelled"
    renewal = node.renew(lease)
    assert (renewal.status_code, error_code(renewal)) == (409, LEASE_LOST)
    assert renewal.json()["lease_end"] == "cancelled"
    # Another node naming that lease learns nothing about it.
    stranger = other.renew(lease)
    assert (stranger.status_code, error_code(stranger)) == (409, LEASE_LOST)
    assert "lease_end" not in stranger.json()
