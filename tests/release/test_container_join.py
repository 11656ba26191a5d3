"""The container join command `modelforge enroll` prints, run as printed, to a READY node.

The control plane runs from the release image on Docker's default bridge, published on
127.0.0.1 only; the token is minted for its bridge address, which the node's containers
(also on the default bridge) reach. The printed command runs under real bash on a pty, the
token typed at the join's no-echo prompt. Only what is global to the host is made the test's
own: the host state and artifact directories, the container and volume names, the image
tags (this run's version) and ``sudo`` (the test is root). Its runtime worker (the -cpu
image) starts first; the agent, in the worker's network namespace, must find it on the
shared socket volume and the node be READY.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import socket
import time
from typing import Any

import pytest
import requests

from modelforge_appliance.identity.join_commands import (
    AGENT_IMAGE_UID,
    CONTAINER_ARTIFACT_ROOT,
    WORKER_SOCKET_VOLUME,
)
from modelforge_contract import (
    AGENT_SERVICE,
    AGENT_STATE_DIR,
    HEADER_ADMIN_TOKEN,
    PATH_ADMIN_ENROLLMENTS,
    WORKER_SERVICE,
    __version__,
)
from tests.harness.release_images import (
    control_plane_container,
    release_env,
    unique,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def run_on_a_pty(command: str, token: str, timeout: float = 300) -> tuple[int, str]:
    """bash -c COMMAND with a terminal (the join's ``docker run -it`` needs one); the token is
    typed when the prompt appears. (exit status, everything the terminal showed)"""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execve("/bin/bash", ["bash", "-c", command], release_env())  # noqa: S606
    shown, typed = b"", False
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert time.monotonic() < deadline, f"the join command did not end:\n{shown!r}"
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            if not typed and b"Enrollment token:" in shown:
                os.write(fd, token.encode() + b"\n")
                typed = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace")


def test_the_printed_container_join_ends_in_a_ready_node(
    docker_client, built_images, release_version, tmp_path
):
    names = {
        WORKER_SERVICE: unique("mfjoin-worker"),
        AGENT_SERVICE: unique("mfjoin-agent"),
        WORKER_SOCKET_VOLUME: unique("mfjoin-socket"),
    }
    state, artifacts = tmp_path / "state", tmp_path / "artifacts"
    with contextlib.ExitStack() as cleanup:
        plane, url, admin_token = cleanup.enter_context(
            control_plane_container(docker_client, release_version, "mfjoin-cp")
        )
        cleanup.callback(remove_node, docker_client, names)
        headers = {HEADER_ADMIN_TOKEN: admin_token}
        plane.reload()
        address = plane.attrs["NetworkSettings"]["Networks"]["bridge"]["IPAddress"]
        # Minted through the address the node uses: the token is locked to that origin.
        minted = requests.post(
            url + PATH_ADMIN_ENROLLMENTS,
            headers={**headers, "Host": f"{address}:8000"},
            json={"display_name": "gpu-01", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
            timeout=30,
        ).json()
        assert minted["api_origin"] == f"http://{address}:8000" and minted["warnings"] == []
        command = minted["join_commands"]["container"]
        assert command.startswith("sudo install -d ")

        here = command.replace("sudo ", "")
        here = here.replace(f" {AGENT_STATE_DIR} && ", f" {state} && ", 1)
        here = here.replace(f"-v {AGENT_STATE_DIR}:", f"-v {state}:")
        here = here.replace(f" {CONTAINER_ARTIFACT_ROOT} && ", f" {artifacts} && ", 1)
        here = here.replace(f"-v {CONTAINER_ARTIFACT_ROOT}:", f"-v {artifacts}:")
        for global_name, own in names.items():
            here = here.replace(f"--name {global_name} ", f"--name {own} ")
            here = here.replace(f"-v {global_name}:", f"-v {own}:")
            here = here.replace(
                f"--network container:{global_name} ", f"--network container:{own} "
            )
        here = here.replace(f":{__version__} ", f":{release_version} ")
        assert f"-v {AGENT_STATE_DIR}:" not in here  # the host side is the test's
        assert f"-v {CONTAINER_ARTIFACT_ROOT}:" not in here
        status, shown = run_on_a_pty(here, minted["token"])
        assert status == 0, shown
        assert minted["token"] not in shown  # typed at a no-echo prompt
        assert state.stat().st_uid == AGENT_IMAGE_UID == artifacts.stat().st_uid

        agent = docker_client.containers.get(names[AGENT_SERVICE])
        worker = docker_client.containers.get(names[WORKER_SERVICE])
        # The agent polls a runtime's 127.0.0.1 port in the worker's namespace.
        assert worker.attrs["HostConfig"]["NetworkMode"] != "none"
        assert agent.attrs["HostConfig"]["NetworkMode"].startswith("container:")

        def logs() -> str:
            return agent.logs().decode()[-3000:] + worker.logs().decode()[-3000:]

        def ready() -> Any:
            nodes = requests.get(
                url + "/api/v1/admin/hardware/nodes", headers=headers, timeout=30
            ).json()["nodes"]
            if not nodes:
                return None
            answer = requests.get(
                url + f"/api/v1/admin/hardware/nodes/{nodes[0]['node_id']}/readiness",
                headers=headers,
                timeout=30,
            ).json()
            return answer if answer["ready"] else None

        readiness = wait_for("the joined node to be ready", ready, logs, timeout=120)
        assert {check["name"]: check["ok"] for check in readiness["checks"]}["worker"] is True
        # Recorded under this host's name (it was the join container's random id).
        [node] = requests.get(
            url + "/api/v1/admin/hardware/nodes", headers=headers, timeout=30
        ).json()["nodes"]
        assert node["hostname"].lower() == socket.gethostname().lower()
        assert minted["token"] not in logs()


def remove_node(client: Any, names: dict[str, str]) -> None:
    """The node's containers and socket volume, those that were made."""
    for name in (names[AGENT_SERVICE], names[WORKER_SERVICE]):
        with contextlib.suppress(Exception):  # not created when an earlier step failed
            client.containers.get(name).remove(force=True)
    with contextlib.suppress(Exception):
        client.volumes.get(names[WORKER_SOCKET_VOLUME]).remove(force=True)
