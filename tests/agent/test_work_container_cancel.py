"""Cancel stops a running container item (issue 21), end to end: the real control plane, a
real agent process, a real worker process and the real dockerd.

Before: the agent heard LEASE_LOST at its next renewal (every 20 s by default), dropped the
result and let the worker run on; the container ran until the item's timeout (41.9 s in the
reviewer's try). Now the renewal says "cancelled", the agent tells the worker, the worker
kills the container, and the slot is free for the next item."""

from __future__ import annotations

import pytest

from modelforge_worker.capabilities.container import LABEL_WORK_ID
from tests.harness.agent_process import wait_until
from tests.harness.probe_image import build_test_image
from tests.harness.work_node import WORK, short_dir, start_node, wait_for_state, wait_until_ready

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def probe_image(docker_client, tmp_path_factory):
    image = build_test_image(docker_client, tmp_path_factory.mktemp("image"))
    yield image
    docker_client.images.remove(image.tag, force=True)  # by tag: another build may share the id


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


def containers_of(docker_client, work_id: str) -> list:
    return docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_WORK_ID}={work_id}"}
    )


def test_a_cancelled_container_item_is_stopped_and_the_slot_goes_on(
    sqlite_control_plane, tmp_path, sockets, docker_client, probe_image
):
    cp = sqlite_control_plane
    node = start_node(cp, tmp_path / "n1", sockets, "cpu-node-1")
    try:
        wait_until_ready(cp, node)
        wait_until(
            lambda: "container" in node.worker.client.info()["capabilities"],
            what="the worker offering container",
        )
        long_running = {
            "capability": "container",
            "input": {
                "image": probe_image.tag,
                "image_id": probe_image.id,
                "command": ["echo", "started", "sleep", "600"],
            },
            "timeout_seconds": 900,
            "constraints": {"node_ids": [node.node_id]},
        }
        work_id = cp.admin("POST", WORK, json=long_running).json()["work_id"]

        def running():
            found = containers_of(docker_client, work_id)
            return found and "started" in found[0].logs().decode(errors="replace")

        wait_until(running, timeout=120, what="the container running")
        assert cp.admin("GET", f"{WORK}/{work_id}").json()["state"] == "leased"
        cancelled = cp.admin("POST", f"{WORK}/{work_id}/cancel").json()
        assert cancelled["state"] == "cancelled"
        # By outcome: the container goes; the deadline only bounds a failure (the item's
        # timeout is 900 s, so only the cancel can end it).
        wait_until(lambda: not containers_of(docker_client, work_id), timeout=120,
                   what="the cancelled container gone")  # fmt: skip
        node.agent.wait_for_log(rf"work {work_id}: the runtime worker stopped 1 run\(s\)")
        assert "POST /v1/cancel -> 200: 1 run(s) stopped" in node.worker.log()
        assert "container failed" in node.worker.log() and "(RUN_CANCELLED)" in node.worker.log()
        log = node.agent.log()
        assert f"work {work_id} was cancelled; stopping its run" in log
        item = cp.admin("GET", f"{WORK}/{work_id}").json()
        assert (item["state"], item["result"], item["error"]) == ("cancelled", None, None)

        # The slot is free again: the next item runs to its end on the same node.
        quick = {**long_running, "input": {**long_running["input"], "command": ["echo", "next"]}}
        next_id = cp.admin("POST", WORK, json=quick).json()["work_id"]
        done = wait_for_state(cp.store, next_id)
        assert done["state"] == "succeeded" and "next" in done["log_tail"]
        assert not containers_of(docker_client, next_id)
        assert cp.admin("GET", f"{WORK}/{work_id}").json()["state"] == "cancelled"
    finally:
        node.close()
