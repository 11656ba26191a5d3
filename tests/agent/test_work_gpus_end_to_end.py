"""GPUs by UUID end to end (issue 25): the real control plane, agent and worker processes on
the test NVML library's eight H100s, and the real dockerd. Two container items leased to the
node at once hold disjoint UUIDs, and dockerd holds exactly an item's UUIDs for its container
(read between create and start: this host has no NVIDIA container runtime, so dockerd then
refuses to start it). Before, the lease said only a count and the worker asked dockerd for
every GPU of the node."""

from __future__ import annotations

import pytest

from modelforge_contract import CONTAINER_FAILED
from modelforge_worker.capabilities.container import LABEL_WORK_ID
from tests.harness.agent_process import wait_until
from tests.harness.docker_watch import DockerStartWatch
from tests.harness.nvml import h100_80g_x8
from tests.harness.probe_image import build_test_image
from tests.harness.work_node import WORK, short_dir, start_node, wait_for_state, wait_until_ready

pytestmark = pytest.mark.docker


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


@pytest.fixture(scope="module")
def probe_image(docker_client, tmp_path_factory):
    image = build_test_image(docker_client, tmp_path_factory.mktemp("image"))
    yield image
    # By tag: another suite's build of the same files is the same image id.
    docker_client.images.remove(image.tag)


def containers_of(docker_client, work_id: str) -> list:
    return docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_WORK_ID}={work_id}"}
    )


def test_two_leased_items_hold_disjoint_uuids_and_dockerd_gets_exactly_them(
    sqlite_control_plane, tmp_path, sockets, fake_nvml_dir, docker_client, probe_image,
    monkeypatch,
):  # fmt: skip
    cp = sqlite_control_plane
    host = h100_80g_x8()
    uuids = [d["uuid"] for d in host["devices"]]
    watch = DockerStartWatch(docker_client)
    monkeypatch.setenv("DOCKER_HOST", watch.url)  # the worker process inherits it
    node = start_node(
        cp, tmp_path / "gpu", sockets, "gpu-node-1", mode="nvidia", host=host,
        fake_nvml_dir=fake_nvml_dir, work_slots="2",
    )  # fmt: skip
    try:
        wait_until_ready(cp, node)
        wait_until(
            lambda: "container" in node.worker.client.info()["capabilities"],
            what="the worker offering container",
        )
        image = {"image": probe_image.tag, "image_id": probe_image.id}
        # Holds four GPUs while it runs, and asks dockerd for none of them ("gpus": 0).
        holding = {
            "capability": "container",
            "input": {**image, "command": ["echo", "holding", "sleep", "600"], "gpus": 0},
            "constraints": {"gpu_count": 4},
            "timeout_seconds": 900,
        }
        first = cp.admin("POST", WORK, json=holding).json()["work_id"]

        def running():
            found = containers_of(docker_client, first)
            return found and "holding" in found[0].logs().decode(errors="replace")

        wait_until(running, timeout=120, what="the first container running")
        held = cp.admin("GET", f"{WORK}/{first}").json()
        assert held["state"] == "leased" and held["gpus"] == uuids[:4]

        asking = {"capability": "container", "input": {**image, "command": ["echo"], "gpus": 4}}
        second = cp.admin("POST", WORK, json=asking).json()["work_id"]
        done = wait_for_state(cp.store, second)
        assert done["gpus"] == uuids[4:]  # the four the first item does not hold
        assert cp.admin("GET", f"{WORK}/{first}").json()["state"] == "leased"  # at once
        # What dockerd held for each container when it was asked to start it.
        by_work = {
            seen["Config"]["Labels"][LABEL_WORK_ID]: seen["HostConfig"]["DeviceRequests"]
            for seen in watch.started.values()
        }
        assert by_work[first] == []
        assert [r["DeviceIDs"] for r in by_work[second]] == [uuids[4:]]
        assert by_work[second][0]["Capabilities"] == [["gpu"]]
        assert done["result"]["gpus"] == uuids[4:]
        if "nvidia" not in docker_client.info().get("Runtimes", {}):
            assert (done["state"], done["error"]["code"]) == ("failed", CONTAINER_FAILED)
            assert "device driver" in done["error"]["message"]
        assert not containers_of(docker_client, second)
        cancelled = cp.admin("POST", f"{WORK}/{first}/cancel").json()
        assert cancelled["state"] == "cancelled"
        wait_until(lambda: not containers_of(docker_client, first), timeout=120,
                   what="the first container gone")  # fmt: skip
    finally:
        node.close()
        watch.close()
