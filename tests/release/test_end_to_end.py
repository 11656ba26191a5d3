"""One host, the release images and the bundle's compose files as an operator uses them.

The control plane from docker-compose.yml serves; an agent from docker-compose.node-agent.yml
with its CPU runtime worker from docker-compose.runtime-worker.yml (the env file and the token
the API returned, the ``-cpu`` worker image) enrolls, shows online and becomes READY; its
identity survives ``down``/``up`` with the same state volume; the recovery compose file enrolls a
disposable identity and, after its credential is revoked, re-enrolls it under the same node
id. Compose v1 (Debian's docker-compose) runs the files; the test talks to the control plane
on 127.0.0.1 only, the containers reach it on their compose network.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from modelforge_contract import HEADER_ADMIN_TOKEN
from tests.harness.control_plane import free_port
from tests.harness.release_images import (
    compose_service,
    release_env,
    run_release,
    unique,
    wait_for,
    wait_for_healthz,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CONTROL_PLANE = ["docker-compose.yml"]
# A node names its own files only, as docs/node-agent.md does: no control-plane-state volume.
NODE = ["docker-compose.node-agent.yml", "docker-compose.runtime-worker.yml"]
BOTH = CONTROL_PLANE + NODE  # this test's one project: the node reaches control-plane by name
RECOVERY = ["docker-compose.node-recovery.yml"]
ORIGIN = "http://control-plane:8000"  # how the agents reach it on the compose network


class Deployment:
    def __init__(self, project: str, port: int, env: dict[str, str], directory: Path) -> None:
        self.project, self.port, self.env = project, port, env
        self.directory = directory  # the release bundle, which ships the compose files
        self.url = f"http://127.0.0.1:{port}"
        self.admin_token = ""

    def compose(self, files: list[str], *args: str, **extra: str) -> subprocess.CompletedProcess:
        argv = ["docker-compose", "-p", self.project]
        for name in files:
            argv += ["-f", str(self.directory / name)]
        result = subprocess.run(
            [*argv, *args],
            cwd=self.directory,
            env={**self.env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"docker-compose {' '.join(args)}:\n{result.stderr[-3000:]}"
        return result

    def container(self, client: Any, service: str) -> Any:
        return compose_service(client, self.project, service)

    def admin(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = {HEADER_ADMIN_TOKEN: self.admin_token}
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def mint(self, name: str, accelerator_mode: str = "cpu") -> dict[str, Any]:
        response = self.admin(
            "POST",
            "/api/v1/admin/node-enrollments",
            json={
                "display_name": name,
                "expires_in_seconds": 900,
                "accelerator_mode": accelerator_mode,
            },
        )
        assert response.status_code == 201, response.text
        return response.json()

    def nodes(self) -> list[dict[str, Any]]:
        response = self.admin("GET", "/api/v1/admin/hardware/nodes")
        assert response.status_code == 200, response.text
        return response.json()["nodes"]


@pytest.fixture
def deployment(docker_client, built_images, release_version, release_bundle, tmp_path):
    project = unique("mfe2e")
    port = free_port()
    env = release_env(
        MODELFORGE_CONTROL_PLANE_IMAGE=f"modelforge-control-plane:{release_version}",
        MODELFORGE_NODE_AGENT_IMAGE=f"modelforge-node-agent:{release_version}",
        MODELFORGE_RUNTIME_WORKER_IMAGE=f"modelforge-runtime-worker-cpu:{release_version}",
        MODELFORGE_WORKER_ACCELERATOR_MODE="cpu",
        MODELFORGE_CONTROL_PLANE_PUBLISH=f"127.0.0.1:{port}",
        MODELFORGE_PUBLIC_API_ORIGIN=ORIGIN,
        MODELFORGE_HEARTBEAT_INTERVAL_SECONDS="1",
        MODELFORGE_NODE_STALE_AFTER_SECONDS="5",
        MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="10",
    )
    plane = Deployment(project, port, env, release_bundle)
    try:
        yield plane
    finally:
        # Everything of this project only: its containers, network and volumes.
        empty = tmp_path / "empty.env"
        empty.touch()
        result = subprocess.run(
            ["docker-compose", "-p", project]
            + [arg for name in BOTH + RECOVERY for arg in ("-f", str(release_bundle / name))]
            + ["down", "-v", "--remove-orphans"],
            cwd=release_bundle,
            env={
                **env,
                "MODELFORGE_AGENT_CONTROL_PLANE_URL": ORIGIN,
                "MODELFORGE_NODE_AGENT_ENV_FILE": str(empty),
            },
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"cleaning up {project} failed:\n{result.stderr}"


def test_control_plane_and_agent_from_the_compose_files(
    deployment, docker_client, release_bundle, tmp_path
):
    # The control plane, and its first admin token.
    deployment.compose(CONTROL_PLANE, "up", "-d", "--no-build", "control-plane")
    control_plane = deployment.container(docker_client, "control-plane")
    wait_for_healthz(control_plane, deployment.url + "/healthz")
    # Only stdout is the answer: stderr says which store the command used.
    code, (output, said) = control_plane.exec_run(["modelforge", "init", "--json"], demux=True)
    assert code == 0, (said or b"").decode()
    assert b"modelforge: store /var/lib/modelforge/modelforge.sqlite3" in said
    deployment.admin_token = json.loads(output)["admin_token"]

    # The operator's steps: mint, save the env file, capture the image id, start the agent.
    minted = deployment.mint("GPU Node")
    assert minted["api_origin"] == ORIGIN
    env_file = tmp_path / minted["env_file_name"]
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu\n" in minted["env_file"]
    env_file.write_text(minted["env_file"])
    manifest = next(release_bundle.glob("*-manifest.json"))
    checked = run_release(
        "verify-image", "--manifest", manifest, "--image", "modelforge-node-agent", "--json"
    )
    assert checked.returncode == 0, checked.stderr
    image_id = json.loads(checked.stdout)["image_id"]
    deployment.env["MODELFORGE_NODE_AGENT_ENV_FILE"] = str(env_file)
    # The env file leaves the host name to the machine: the operator's export names it.
    assert "MODELFORGE_AGENT_HOSTNAME=" not in minted["env_file"].replace("# MODELFORGE", "")
    deployment.env["MODELFORGE_NODE_AGENT_HOSTNAME"] = "gpu-node"
    deployment.compose(
        NODE,
        "up",
        "-d",
        "--no-build",
        "node-agent",
        MODELFORGE_AGENT_ENROLLMENT_TOKEN=minted["token"],
    )
    agent = deployment.container(docker_client, "node-agent")
    assert run_release("verify-container", agent.id, "--image-id", image_id).returncode == 0

    def agent_logs() -> str:
        return deployment.container(docker_client, "node-agent").logs().decode()

    def online(count: int, after: str = "") -> Callable[[], Any]:
        def check() -> Any:
            nodes = deployment.nodes()
            ready = [
                n
                for n in nodes
                if n["liveness"] == "online" and (n["last_heartbeat_at"] or "") > after
            ]
            return nodes if len(nodes) == count and len(ready) == count else None

        return check

    (node,) = wait_for("the agent to enroll and heartbeat", online(1), agent_logs)
    assert node["hostname"] == "gpu-node"
    assert minted["token"] not in agent_logs()

    def worker_logs() -> str:
        return agent_logs() + deployment.container(docker_client, "runtime-worker").logs().decode()

    def ready() -> Any:
        answer = deployment.admin(
            "GET", f"/api/v1/admin/hardware/nodes/{node['node_id']}/readiness"
        )
        assert answer.status_code == 200, answer.text
        return answer.json() if answer.json()["ready"] else None

    # Online is not enough: the agent finds its worker on the shared socket and is READY.
    readiness = wait_for("the node to be ready", ready, worker_logs)
    assert {check["name"]: check["ok"] for check in readiness["checks"]}["worker"] is True

    # Dropping the used token as docs/node-agent.md step 4 does: the agent alone is
    # recreated; the worker (and any runtime it runs) is left as it is, under Compose v1 too.
    worker_before = deployment.container(docker_client, "runtime-worker").id
    agent_before = deployment.container(docker_client, "node-agent").id
    deployment.compose(
        NODE, "up", "-d", "--no-build", "--no-deps", "--force-recreate", "node-agent"
    )
    assert deployment.container(docker_client, "node-agent").id != agent_before
    assert deployment.container(docker_client, "runtime-worker").id == worker_before
    wait_for("the node to be ready after the recreate", ready, worker_logs)

    # down/up without the token: the same node, from the identity in the state volume.
    deployment.compose(BOTH, "down")
    deployment.compose(BOTH, "up", "-d", "--no-build")
    wait_for_healthz(
        deployment.container(docker_client, "control-plane"), deployment.url + "/healthz"
    )
    (again,) = wait_for(
        "the agent to come back", online(1, after=node["last_heartbeat_at"]), agent_logs
    )
    assert (again["node_id"], again["hostname"]) == (node["node_id"], "gpu-node")
    wait_for("the node to be ready again", ready, worker_logs)
    credentials = deployment.admin(
        "GET", f"/api/v1/admin/hardware/nodes/{node['node_id']}/credentials"
    ).json()
    assert credentials["active"] == 1 and credentials["revoked"] == 0

    # The recovery rehearsal: a disposable identity, its credential revoked, re-enrolled.
    first = deployment.mint("recovery rehearsal")
    deployment.env["MODELFORGE_AGENT_CONTROL_PLANE_URL"] = ORIGIN

    def rehearsal_logs() -> str:
        return deployment.container(docker_client, "node-agent-rehearsal").logs().decode()

    deployment.compose(
        RECOVERY, "up", "-d", "--no-build", MODELFORGE_AGENT_ENROLLMENT_TOKEN=first["token"]
    )
    nodes = wait_for("the rehearsal agent to enroll", online(2), rehearsal_logs)
    (rehearsal,) = [n for n in nodes if n["hostname"] == "recovery-rehearsal"]
    revoked = deployment.admin(
        "DELETE", f"/api/v1/admin/hardware/nodes/{rehearsal['node_id']}/credential"
    )
    assert revoked.status_code == 200, revoked.text

    def exited() -> Any:
        container = deployment.container(docker_client, "node-agent-rehearsal")
        return container.status == "exited" and container.attrs["State"]["ExitCode"]

    assert wait_for("the revoked agent to stop", exited, rehearsal_logs) == 6  # credential refused
    second = deployment.mint("recovery rehearsal")
    deployment.compose(
        RECOVERY, "up", "-d", "--no-build", MODELFORGE_AGENT_ENROLLMENT_TOKEN=second["token"]
    )
    nodes = wait_for(
        "the re-enrolled agent", online(2, after=rehearsal["last_heartbeat_at"]), rehearsal_logs
    )
    assert {n["node_id"] for n in nodes} == {node["node_id"], rehearsal["node_id"]}
    credentials = deployment.admin(
        "GET", f"/api/v1/admin/hardware/nodes/{rehearsal['node_id']}/credentials"
    ).json()
    assert credentials["active"] == 1 and credentials["revoked"] >= 1


def unraid_run_arguments(template: Path, **values: str) -> tuple[str, list[str], str]:
    """(name, docker run arguments, image) as Unraid's Docker manager builds them from the
    template: each Config's value (or ``values[Name]``) as -e, -p or -v, then ExtraParams."""
    import shlex
    import xml.etree.ElementTree as ET

    root = ET.parse(template).getroot()  # noqa: S314 - our own file from the repository
    arguments = [f"--net={root.findtext('Network')}"]
    for config in root.findall("Config"):
        value = values.get(config.get("Name"), config.text or config.get("Default") or "")
        kind, target = config.get("Type"), config.get("Target")
        if kind == "Variable":
            arguments += ["-e", f"{target}={value}"]
        elif kind == "Port":
            arguments += ["-p", f"{value}:{target}/{config.get('Mode')}"]
        elif kind == "Path":
            arguments += ["-v", f"{value}:{target}:{config.get('Mode')}"]
    arguments += shlex.split(root.findtext("ExtraParams") or "")
    return root.findtext("Name"), arguments, root.findtext("Repository")


def test_a_cpu_node_becomes_ready_against_the_unraid_templates_control_plane(
    deployment, docker_client, release_bundle, release_version, tmp_path
):
    """Unraid: the control plane from the bundle's template, run as the Docker manager runs
    it (its --user 99:100, read-only root, appdata owned 99:100 and 0700), and a CPU node from
    the bundle's compose files, which reaches it on the node stack's network."""
    import os

    appdata = tmp_path / "appdata"
    appdata.mkdir(mode=0o700)
    os.chown(appdata, 99, 100)
    models = tmp_path / "models"  # the template's read-only models folder
    models.mkdir()
    name, arguments, image = unraid_run_arguments(
        release_bundle / "modelforge-control-plane.xml",
        **{
            "API port": f"127.0.0.1:{deployment.port}",
            "Appdata": str(appdata),
            "Models": str(models),
            "MODELFORGE_PUBLIC_API_ORIGIN": ORIGIN,
            "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "1",
            "MODELFORGE_NODE_STALE_AFTER_SECONDS": "5",
            "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "10",
        },
    )
    assert image.startswith("modelforge-control-plane:")  # the version the operator loaded
    container_name = unique(name)
    started = subprocess.run(
        [
            "docker",
            "run",
            "-d",
            f"--name={container_name}",
            *arguments,
            f"modelforge-control-plane:{release_version}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    control_plane = docker_client.containers.get(container_name)
    try:
        wait_for_healthz(control_plane, deployment.url + "/healthz")
        assert control_plane.attrs["Config"]["User"] == "99:100"
        code, (output, said) = control_plane.exec_run(["modelforge", "init", "--json"], demux=True)
        assert code == 0, (said or b"").decode()
        deployment.admin_token = json.loads(output)["admin_token"]

        minted = deployment.mint("unraid node")
        env_file = tmp_path / minted["env_file_name"]
        env_file.write_text(minted["env_file"])
        deployment.env["MODELFORGE_NODE_AGENT_ENV_FILE"] = str(env_file)
        deployment.env["MODELFORGE_NODE_AGENT_HOSTNAME"] = "unraid-node"
        deployment.compose(
            NODE,  # the node stack only: the control plane is Unraid's
            "up",
            "-d",
            "--no-build",
            "node-agent",
            MODELFORGE_AGENT_ENROLLMENT_TOKEN=minted["token"],
        )
        # The node reaches the control plane by the name its origin gives, on its network
        # (on Unraid: the server's address); the agent retries until it answers. The agent is
        # in the worker's network namespace, so the network is the worker's.
        agent = deployment.container(docker_client, "node-agent")
        worker = deployment.container(docker_client, "runtime-worker")
        assert agent.attrs["HostConfig"]["NetworkMode"].startswith("container:")
        (network,) = worker.attrs["NetworkSettings"]["Networks"]
        docker_client.networks.get(network).connect(control_plane, aliases=["control-plane"])

        def logs() -> str:
            return control_plane.logs().decode()[-3000:] + agent.logs().decode()[-3000:]

        def ready() -> Any:
            nodes = deployment.nodes()
            if not nodes:
                return None
            answer = deployment.admin(
                "GET", f"/api/v1/admin/hardware/nodes/{nodes[0]['node_id']}/readiness"
            ).json()
            return answer if answer["ready"] else None

        readiness = wait_for("the Unraid-served node to be ready", ready, logs)
        assert {check["name"]: check["ok"] for check in readiness["checks"]}["worker"] is True
        assert minted["token"] not in logs()
    finally:
        control_plane.remove(force=True)
