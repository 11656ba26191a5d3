"""The Enroll node wizard's container path, exactly as the API hands it out, to a READY node.

The control plane runs from the release image with the release's manifest
(MODELFORGE_RELEASE_MANIFEST), published on 127.0.0.1 only: the test mints a ``cpu``
enrollment there and posts the manifest's node-agent entry to the image check, as the wizard
does. The answer's Compose file, start script and env file are saved unchanged in the node's
directory, and the script runs under real bash with Debian's docker-compose (v1), the token
fed to its no-echo prompt on stdin. The agent and its Runtime Worker (the -cpu image) must
make the node READY; the wizard's recreate command must drop the token and keep the node,
its hostname and its readiness; its cleanup command must remove the containers and keep the
state volume.

The agent reaches the control plane by name on the node's Compose network: the test
connects the control plane's container to that network once the script has created it (the
agent retries until it answers), and disconnects it before the cleanup removes the network.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from modelforge_appliance.fleet.node_agent_image import RECREATE_COMMAND
from modelforge_contract import HEADER_ADMIN_TOKEN
from tests.harness.release_images import (
    compose_service,
    control_plane_container,
    release_env,
    unique,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ALIAS = "control-plane"
ORIGIN = f"http://{ALIAS}:8000"  # the token's origin: how the node's containers reach it
MANIFEST_IN_CONTAINER = "/etc/modelforge/release-manifest.json"
TOKEN_VARIABLE = "MODELFORGE_AGENT_ENROLLMENT_TOKEN"


class ControlPlane:
    def __init__(self, url: str, admin_token: str) -> None:
        self.url, self.admin_token = url, admin_token

    def admin(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = {HEADER_ADMIN_TOKEN: self.admin_token}
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)


@pytest.fixture
def control_plane(docker_client, built_images, release_version, release_bundle, tmp_path):
    """The control plane image on 127.0.0.1 only, with the release's manifest mounted."""
    # A copy its service user (65532) can read, as an operator would install it.
    manifest = tmp_path / "release-manifest.json"
    shutil.copyfile(next(release_bundle.glob("modelforge-*-manifest.json")), manifest)
    manifest.chmod(0o644)
    with control_plane_container(
        docker_client,
        release_version,
        "mfwiz-cp",
        environment={
            "MODELFORGE_PUBLIC_API_ORIGIN": ORIGIN,
            "MODELFORGE_RELEASE_MANIFEST": MANIFEST_IN_CONTAINER,
        },
        volumes={str(manifest): {"bind": MANIFEST_IN_CONTAINER, "mode": "ro"}},
    ) as (container, url, admin_token):
        plane = ControlPlane(url, admin_token)
        plane.container = container  # type: ignore[attr-defined]
        plane.manifest = json.loads(manifest.read_text())  # type: ignore[attr-defined]
        yield plane


@pytest.fixture
def node_dir(tmp_path, docker_client):
    """The node's directory; its name is the Compose project's. Whatever the project left
    (containers, network, volumes) is removed at the end, by its labels."""
    project = unique("mfwiz").replace("-", "")
    directory = tmp_path / project
    directory.mkdir()
    try:
        yield directory
    finally:
        label = f"com.docker.compose.project={project}"
        for container in docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": label}
        ):
            container.remove(force=True)
        for network in docker_client.networks.list(filters={"label": label}):
            network.reload()
            for attached in network.containers:  # the control plane, if a check failed early
                network.disconnect(attached, force=True)
            network.remove()
        for volume in docker_client.volumes.list(filters={"label": label}):
            volume.remove(force=True)


def bash(directory: Path, command: str, stdin: str = "") -> subprocess.CompletedProcess:
    """A command as the operator runs it in the node's directory: real bash, the host's PATH
    (docker, and docker-compose v1), no ModelForge variables."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=directory,
        input=stdin,
        env=release_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wizards_files_bring_a_cpu_node_to_ready_and_the_recreate_drops_the_token(
    docker_client, control_plane, node_dir, release_version
):
    cp = control_plane
    project = node_dir.name

    # What the wizard does: mint for a CPU node, then check the pasted node-agent entry
    # with the mode it minted with.
    minted = cp.admin(
        "POST",
        "/api/v1/admin/node-enrollments",
        json={"display_name": "CPU box", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
    )
    assert minted.status_code == 201, minted.text
    minted = minted.json()
    assert minted["api_origin"] == ORIGIN
    token = minted["token"]
    entry = cp.manifest["images"]["modelforge-node-agent"]
    checked = cp.admin(
        "POST",
        "/api/v1/admin/node-agent-image/check",
        json={"entry": entry, "accelerator_mode": minted["accelerator_mode"]},
    )
    assert checked.status_code == 200, checked.text
    answer = checked.json()
    assert answer["worker_image"] == f"modelforge-runtime-worker-cpu:{release_version}"
    commands = {command["name"]: command for command in answer["commands"]}

    # Saved exactly as the wizard shows them, beside the mint answer's env file.
    (node_dir / minted["env_file_name"]).write_text(minted["env_file"])
    for name in ("compose_file", "start_script"):
        (node_dir / commands[name]["file"]).write_text(commands[name]["text"])
    script = commands["start_script"]["file"]
    assert f"bash {script}" in commands["start_script"]["title"]

    def logs() -> str:
        label = f"com.docker.compose.project={project}"
        found = docker_client.containers.list(
            all=True, ignore_removed=True, filters={"label": label}
        )
        return "\n".join(f"--- {c.name}\n{c.logs().decode()[-3000:]}" for c in found)

    started = bash(node_dir, f"bash {script}", stdin=token + "\n")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "using docker-compose (Compose v1)" in started.stdout
    assert "node agent started from" in started.stdout
    assert token not in started.stdout + started.stderr

    # The agent reaches the control plane on the node's network, as on a LAN.
    docker_client.networks.get(f"{project}_default").connect(cp.container, aliases=[ALIAS])

    def enrolled() -> Any:
        enrollments = cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]
        (mine,) = [e for e in enrollments if e["enrollment_id"] == minted["enrollment_id"]]
        return mine["node_id"]

    node_id = wait_for("the agent to enroll", enrolled, logs, timeout=120)

    def ready(after: str = "") -> Callable[[], Any]:
        def check() -> Any:
            node = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}").json()
            if (node["last_heartbeat_at"] or "") <= after:
                return None
            readiness = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}/readiness")
            assert readiness.status_code == 200, readiness.text
            body = readiness.json()
            return (node, body) if body["ready"] else None

        return check

    node, readiness = wait_for("the node to become READY", ready(), logs, timeout=120)
    checks = {check["name"]: check for check in readiness["checks"]}
    assert checks["worker"]["ok"], checks["worker"]
    assert "COMPATIBLE" in checks["worker"]["detail"]
    assert node["hostname"] == socket.gethostname()  # the host's, not the container id
    agent = compose_service(docker_client, project, "node-agent")
    assert f"{TOKEN_VARIABLE}={token}" in agent.attrs["Config"]["Env"]  # the first start's
    worker = compose_service(docker_client, project, "runtime-worker")
    # The agent polls a deployment's runtime on 127.0.0.1 of the worker's namespace.
    assert worker.attrs["HostConfig"]["NetworkMode"] != "none"
    assert agent.attrs["HostConfig"]["NetworkMode"] == f"container:{worker.id}"
    assert worker.attrs["Config"]["User"] == agent.attrs["Config"]["User"] == "65532:65532"
    assert not any(e.startswith(TOKEN_VARIABLE) for e in worker.attrs["Config"]["Env"])

    # The token is used: the wizard's recreate command (its readiness step shows this one),
    # beside the files.
    recreate = bash(node_dir, RECREATE_COMMAND)
    assert recreate.returncode == 0, recreate.stdout + recreate.stderr
    assert "the container no longer carries the enrollment token" in recreate.stdout
    again = compose_service(docker_client, project, "node-agent")
    assert again.id != agent.id
    assert not any(e.startswith(TOKEN_VARIABLE) for e in again.attrs["Config"]["Env"])
    node_again, readiness = wait_for(
        "the recreated node to be READY again",
        ready(after=node["last_heartbeat_at"]),
        logs,
        timeout=120,
    )
    assert (node_again["node_id"], node_again["hostname"]) == (node_id, node["hostname"])
    assert {c["name"]: c["ok"] for c in readiness["checks"]}["worker"] is True
    assert token not in logs()

    # The cleanup command: no containers left, the identity's volume kept. (The control
    # plane leaves the node's network first: Compose removes the network it made.)
    docker_client.networks.get(f"{project}_default").disconnect(cp.container)
    cleanup = bash(node_dir, commands["cleanup"]["text"])
    assert cleanup.returncode == 0, cleanup.stdout + cleanup.stderr
    label = f"com.docker.compose.project={project}"
    assert (
        docker_client.containers.list(all=True, ignore_removed=True, filters={"label": label}) == []
    )
    volumes = {v.name for v in docker_client.volumes.list(filters={"label": label})}
    assert f"{project}_modelforge-node-agent-state" in volumes
