"""The wizard's image step: pasted manifest entries checked by the admin API, the generated
Compose file read by real docker-compose (v1), and the generated script run by real bash
against real images in the real dockerd. Bringing a node to READY with them is
tests/release/test_wizard_node.py."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from modelforge_appliance.fleet import node_agent_image
from modelforge_contract import __version__
from modelforge_contract.manifest import REQUIRED_LABELS, runtime_config
from tests.harness.compose import compose_v1_binary, config_as_data, gpu_reservation
from tests.harness.control_plane import clean_env, error_code, make_settings, serve
from tests.harness.manifest_entries import sample_config

CHECK = "/api/v1/admin/node-agent-image/check"
RELEASE = "1.3.0-rc.1"
LAYERS = ["sha256:" + "a" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64]


def entry_for(version: str) -> dict:
    labels = {name: f"value of {name}" for name in REQUIRED_LABELS}
    labels["org.opencontainers.image.version"] = version
    labels["io.modelforge.agent-protocol"] = "1"
    return {
        "tag": f"modelforge-node-agent:{version}",
        "architecture": "amd64",
        "os": "linux",
        "rootfs_layers": list(LAYERS),
        "labels": labels,
        "config": sample_config(),
        "image_id": "sha256:" + "d" * 64,
    }


def problems_of(response) -> dict[str, str]:
    assert response.status_code == 400, response.text
    assert error_code(response) == "IMAGE_ENTRY_REJECTED"
    return {p["field"]: p["message"] for p in response.json()["problems"]}


@pytest.fixture
def released(tmp_path):
    """A control plane given the release manifest (MODELFORGE_RELEASE_MANIFEST)."""
    manifest = {
        "schema": 2,
        "version": RELEASE,
        "revision": "0" * 40,
        "created": "2026-11-01T00:00:00Z",
        "images": {"modelforge-node-agent": entry_for(RELEASE)},
    }
    path = tmp_path / f"modelforge-{RELEASE}-manifest.json"
    path.write_text(json.dumps(manifest))
    settings = replace(make_settings(tmp_path / "state"), release_manifest=path)
    with serve(settings) as cp:
        yield cp, manifest


def test_without_a_manifest_the_tag_must_be_this_control_planes_version(sqlite_control_plane):
    cp = sqlite_control_plane
    good = entry_for(__version__)
    accepted = cp.admin("POST", CHECK, json={"entry": good})
    assert accepted.status_code == 200, accepted.text
    body = accepted.json()
    assert body["image"] == f"modelforge-node-agent:{__version__}"
    assert body["ignored"] == ["image_id"]
    assert f"control plane version {__version__}" == body["checked_against"]

    other = entry_for("9.9.9")
    assert "tag" in problems_of(cp.admin("POST", CHECK, json={"entry": other}))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda e: e.update(tag="modelforge-node-agent:1.3.0"), "tag"),
        (lambda e: e.update(tag="modelforge-runtime-worker:1.3.0-rc.1"), "tag"),
        (
            lambda e: e["labels"].pop("org.opencontainers.image.licenses"),
            "labels.org.opencontainers.image.licenses",
        ),
        (lambda e: e["rootfs_layers"].__setitem__(1, "sha256:" + "e" * 64), "rootfs_layers[1]"),
        (lambda e: e["rootfs_layers"].pop(), "rootfs_layers[2]"),
        (lambda e: e.update(architecture="arm64"), "architecture"),
        (lambda e: e.update(architecture="x86"), "architecture"),
        (lambda e: e.update(os="windows"), "os"),
        (
            lambda e: e["labels"].update({"org.opencontainers.image.revision": "f" * 40}),
            "labels.org.opencontainers.image.revision",
        ),
        (lambda e: e["labels"].update({"com.example.extra": "x"}), "labels.com.example.extra"),
        (lambda e: e["config"].update(User="0:0"), "config.User"),
        (lambda e: e["config"].update(Cmd=["python3", "-c", "pass"]), "config.Cmd"),
        (lambda e: e["config"]["Env"].append("PYTHONSTARTUP=/tmp/x.py"), "config.Env"),
        (lambda e: e.pop("config"), "config"),
    ],
    ids=[
        "wrong-tag",
        "other-image",
        "missing-label",
        "changed-layer",
        "missing-layer",
        "other-architecture",
        "unknown-architecture",
        "wrong-os",
        "changed-label",
        "extra-label",
        "root-user",
        "other-command",
        "added-environment",
        "no-configuration",
    ],
)
def test_each_difference_from_the_release_is_rejected_naming_the_field(released, change, field):
    cp, manifest = released
    pasted = copy.deepcopy(manifest["images"]["modelforge-node-agent"])
    change(pasted)
    problems = problems_of(cp.admin("POST", CHECK, json={"entry": pasted}))
    assert field in problems, problems


def test_a_correct_entry_whose_image_id_differs_is_accepted(released):
    cp, manifest = released
    pasted = copy.deepcopy(manifest["images"]["modelforge-node-agent"])
    pasted["image_id"] = "sha256:" + "9" * 64  # docker load rewrote it
    answer = cp.admin("POST", CHECK, json={"entry": pasted})
    assert answer.status_code == 200, answer.text
    assert (
        answer.json()["checked_against"] == f"release manifest modelforge-{RELEASE}-manifest.json"
    )
    names = [command["name"] for command in answer.json()["commands"]]
    assert names == ["compose_file", "start_script", "cleanup"]
    # The whole manifest, or the entry under its name, is understood too.
    assert cp.admin("POST", CHECK, json={"entry": manifest}).status_code == 200
    wrapped = {"modelforge-node-agent": pasted}
    assert cp.admin("POST", CHECK, json={"entry": wrapped}).status_code == 200


def test_generated_compose_file_and_script_name_the_local_tag_and_never_pull(released):
    cp, manifest = released
    answer = cp.admin("POST", CHECK, json={"entry": manifest["images"]["modelforge-node-agent"]})
    body = answer.json()
    # Without a mode: nvidia, as for minting.
    assert (body["accelerator_mode"], body["worker_image"]) == (
        "nvidia",
        f"modelforge-runtime-worker:{RELEASE}",
    )
    commands = {c["name"]: c["text"] for c in body["commands"]}
    assert f"image: modelforge-node-agent:{RELEASE}\n" in commands["compose_file"]
    assert f"image: modelforge-runtime-worker:{RELEASE}\n" in commands["compose_file"]
    assert commands["compose_file"].count("pull_policy: never") == 2
    assert not re.search(r"mf[ec]_[0-9a-f]{8}", commands["compose_file"] + commands["start_script"])
    script = commands["start_script"]
    # Compose v2 when `docker compose version` works, with --pull never; v1 has no --pull.
    v2, v1 = script.split("if docker compose version >/dev/null 2>&1; then")[1].split("elif")[:2]
    assert "compose=(docker compose -f docker-compose.modelforge-node-agent.yml)" in v2
    assert "no_pull=(--pull never)" in v2
    v1_code = "\n".join(line for line in v1.splitlines() if not line.strip().startswith("#"))
    assert "command -v docker-compose" in v1_code and "no_pull=()" in v1_code
    assert "--pull" not in v1_code
    assert "compose=(docker-compose -f docker-compose.modelforge-node-agent.yml)" in v1
    up = '"${compose[@]}" up -d --no-build ${no_pull[@]+"${no_pull[@]}"}'
    assert f"{up} runtime-worker node-agent" in script
    assert f"{up} --force-recreate runtime-worker node-agent" in script
    assert "image_id=$(inspect '{{.Id}}')" in script
    assert script.index("image_id=") < script.index(" up -d ")  # noted before Compose starts
    assert "{{.Image}}" in script.split(" up -d ")[-1]  # and compared after
    assert 'MODELFORGE_NODE_AGENT_HOSTNAME="${MODELFORGE_NODE_AGENT_HOSTNAME:-$(hostname)}"' in (
        script
    )
    # The wizard's recreate and cleanup run the same script: one form for v1 and v2.
    assert node_agent_image.RECREATE_COMMAND == ("bash modelforge-node-agent-start.sh --recreate")
    assert node_agent_image.CLEANUP_COMMAND.startswith("bash modelforge-node-agent-start.sh --down")
    assert commands["cleanup"] == node_agent_image.CLEANUP_COMMAND
    down = script.split('if [ "$action" = --down ]; then')[1].split("\nfi\n")[0]
    assert '"${compose[@]}" down\n' in down and " -v" not in down  # the volumes stay


# -- the generated Compose file, read by real Compose v1 ------------------------------------


def compose_v1(directory: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [compose_v1_binary(), "-f", node_agent_image.COMPOSE_FILE, *args],
        cwd=directory,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def saved_files(directory: Path, answer: dict) -> Path:
    """The answer's files saved beside the mint answer's env file, as the wizard says."""
    directory.mkdir()
    (directory / node_agent_image.ENV_FILE).write_text(
        "MODELFORGE_AGENT_CONTROL_PLANE_URL=http://cp.lan:8000\n"
        "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu\n"
    )
    for command in answer["commands"]:
        if "file" in command:
            (directory / command["file"]).write_text(command["text"])
    return directory


def v1_model(directory: Path, **env: str) -> dict:
    result = compose_v1(directory, "config", **env)
    assert result.returncode == 0, result.stderr
    return config_as_data(result.stdout)


@pytest.mark.parametrize(
    ("mode", "worker", "gpus"),
    [
        ("cpu", "modelforge-runtime-worker-cpu", False),
        ("nvidia", "modelforge-runtime-worker", True),
        ("auto", "modelforge-runtime-worker-cpu", False),
    ],
)
def test_the_minted_mode_decides_the_worker_image_and_the_gpus(
    released, tmp_path, mode, worker, gpus
):
    cp, manifest = released
    entry = manifest["images"]["modelforge-node-agent"]
    answer = cp.admin("POST", CHECK, json={"entry": entry, "accelerator_mode": mode})
    assert answer.status_code == 200, answer.text
    assert answer.json()["worker_image"] == f"{worker}:{RELEASE}"
    model = v1_model(
        saved_files(tmp_path / "node", answer.json()), MODELFORGE_NODE_AGENT_HOSTNAME="gpu-07"
    )
    services = model["services"]
    assert set(services) == {"node-agent", "runtime-worker"}
    agent, runtime = services["node-agent"], services["runtime-worker"]
    assert runtime["image"] == f"{worker}:{RELEASE}"
    expected = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}] if gpus else []
    assert gpu_reservation(agent) == gpu_reservation(runtime) == expected
    # The worker as docker-compose.runtime-worker.yml runs it: read-only, no capabilities;
    # its socket in a volume the agent mounts at the same place; the agent in its network
    # namespace (a runtime it starts listens on 127.0.0.1 there, where the agent polls it),
    # so the node's host name is set on it (Docker refuses one on the agent); the agent's
    # artifact root mounted read-only at the same path, apart from the identity.
    assert "network_mode" not in runtime
    assert agent["network_mode"] == "service:runtime-worker"
    assert runtime["hostname"] == "gpu-07" and not agent.get("hostname")
    assert runtime["read_only"] is True and runtime["cap_drop"] == ["ALL"]
    root = "/var/lib/modelforge-artifacts"
    assert agent["environment"]["MODELFORGE_AGENT_ARTIFACT_ROOT"] == root
    assert f"modelforge-node-agent-artifacts:{root}:rw" in agent["volumes"]
    assert f"modelforge-node-agent-artifacts:{root}:ro" in runtime["volumes"]
    assert not [v for v in runtime["volumes"] if "/var/lib/modelforge-node-agent" in v]
    assert "modelforge-node-agent-artifacts" in model["volumes"]  # named: `down` keeps it
    assert runtime["environment"] == {
        "MODELFORGE_WORKER_SOCKET": "/run/modelforge-worker/worker.sock",
        "MODELFORGE_WORKER_ACCELERATOR_MODE": mode,
    }
    socket_volume = "modelforge-worker-socket:/run/modelforge-worker:rw"
    assert socket_volume in runtime["volumes"] and socket_volume in agent["volumes"]
    assert agent["environment"]["MODELFORGE_AGENT_WORKER_SOCKET"] == (
        "/run/modelforge-worker/worker.sock"
    )
    assert "runtime-worker" in agent["depends_on"]  # created first: its volume ownership
    assert agent["read_only"] is True and agent["cap_drop"] == ["ALL"]
    assert "modelforge-node-agent-state:/var/lib/modelforge-node-agent:rw" in agent["volumes"]
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" not in agent["environment"]


def test_compose_v1_reads_it_without_a_token_file_and_needs_the_host_name(
    sqlite_control_plane, tmp_path
):
    """v1 refused the old /dev/null default (`down` failed); without the token file the
    second env file is the env file again. The host name is never left to Docker."""
    cp = sqlite_control_plane
    answer = cp.admin(
        "POST", CHECK, json={"entry": entry_for(__version__), "accelerator_mode": "cpu"}
    )
    node = saved_files(tmp_path / "node", answer.json())
    refused = compose_v1(node, "config")
    assert refused.returncode != 0
    assert "MODELFORGE_NODE_AGENT_HOSTNAME" in refused.stderr
    model = v1_model(node, MODELFORGE_NODE_AGENT_HOSTNAME="gpu-07")
    assert model["services"]["node-agent"]["environment"]["MODELFORGE_AGENT_ACCELERATOR_MODE"] == (
        "cpu"
    )
    token_file = tmp_path / "token.env"
    token_file.write_text("MODELFORGE_AGENT_ENROLLMENT_TOKEN=mfe_0123456789abcdef_" + "x" * 43)
    with_token = v1_model(
        node,
        MODELFORGE_NODE_AGENT_HOSTNAME="gpu-07",
        MODELFORGE_NODE_AGENT_TOKEN_FILE=str(token_file),
    )
    agent_env = with_token["services"]["node-agent"]["environment"]
    assert agent_env["MODELFORGE_AGENT_ENROLLMENT_TOKEN"].startswith("mfe_")
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" not in with_token["services"]["runtime-worker"].get(
        "environment", {}
    )


def test_an_unknown_accelerator_mode_is_refused_naming_the_field(sqlite_control_plane):
    answer = sqlite_control_plane.admin(
        "POST", CHECK, json={"entry": entry_for(__version__), "accelerator_mode": "tpu"}
    )
    assert answer.status_code == 400 and error_code(answer) == "FIELD_CHOICE"
    assert "accelerator_mode" in answer.text


def run_script(directory: Path, *args: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/bash", node_agent_image.START_SCRIPT, *args],
        cwd=directory,
        env={**clean_env(), "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_script_refuses_an_unknown_option_and_a_host_without_compose(
    sqlite_control_plane, tmp_path
):
    answer = sqlite_control_plane.admin(
        "POST", CHECK, json={"entry": entry_for(__version__), "accelerator_mode": "cpu"}
    )
    node = saved_files(tmp_path / "node", answer.json())
    refused = run_script(node, "--restart", path=os.environ["PATH"])
    assert refused.returncode == 1
    assert "unknown option --restart: use --verify-only, --recreate or --down" in refused.stderr
    # A host whose docker has no compose plugin and no docker-compose: the real docker CLI
    # alone on PATH (Debian 12's docker.io has no plugin).
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker is not installed")
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        pytest.skip("this docker has Compose v2: the host without any Compose is not here")
    only_docker = tmp_path / "only-docker"
    only_docker.mkdir()
    (only_docker / "docker").symlink_to(docker)
    refused = run_script(node, "--down", path=str(only_docker))
    assert refused.returncode == 1, refused.stderr
    assert "neither docker compose (Compose v2) nor docker-compose (v1) runs here" in (
        refused.stderr
    )


def test_registry_images_must_be_pinned_by_digest(sqlite_control_plane):
    cp = sqlite_control_plane
    pinned = "registry.lan:5000/modelforge/modelforge-node-agent@sha256:" + "1" * 64
    answer = cp.admin("POST", CHECK, json={"registry_image": pinned})
    assert answer.status_code == 200, answer.text
    assert answer.json()["mode"] == "registry"
    assert 'docker pull "$image"' in answer.json()["commands"][1]["text"]
    for floating in (
        "modelforge-node-agent:latest",
        "registry.lan/x@sha256:abc",
        "a b@sha256:" + "1" * 64,
    ):
        assert "registry_image" in problems_of(
            cp.admin("POST", CHECK, json={"registry_image": floating})
        )


def test_an_unreadable_release_manifest_is_a_clear_503(tmp_path):
    settings = replace(
        make_settings(tmp_path / "state"), release_manifest=tmp_path / "missing.json"
    )
    with serve(settings) as cp:
        answer = cp.admin("POST", CHECK, json={"entry": entry_for(RELEASE)})
        assert answer.status_code == 503
        assert error_code(answer) == "RELEASE_MANIFEST_UNREADABLE"


def test_shell_metacharacters_in_labels_stay_data(sqlite_control_plane, tmp_path):
    """Label values are quoted into the script, never interpreted by bash."""
    entry = entry_for(__version__)
    marker = tmp_path / "pwned"
    entry["labels"]["org.opencontainers.image.title"] = f"$(touch {marker}) `touch {marker}` '\""
    script = node_agent_image.start_script(
        entry["tag"], entry, f"modelforge-runtime-worker-cpu:{__version__}"
    )
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    answer = sqlite_control_plane.admin(
        "POST", CHECK, json={"entry": {**entry, "labels": {**entry["labels"], 'a"b': "x"}}}
    )
    assert 'labels.a"b' in problems_of(answer)


# -- the generated verification against a real image ------------------------------------


def _build_image(docker_client, version: str, name: str = "modelforge-node-agent") -> str:
    """A tiny real image (FROM scratch, so nothing is pulled) with the release labels."""
    labels = entry_for(version)["labels"]
    labels["org.opencontainers.image.title"] = name
    dockerfile = (
        "FROM scratch\nCOPY agent.txt /agent.txt\nCOPY more.txt /more.txt\n"
        'USER 65532:65532\nENV LANG=C.UTF-8 A_VALUE="<a & b>"\nWORKDIR /\nEXPOSE 8000/tcp\n'
        'CMD ["python3", "-m", "modelforge_node_agent.main"]\n'
        + "".join(f"LABEL {key}={json.dumps(value)}\n" for key, value in labels.items())
    )
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for member, data in (
            ("Dockerfile", dockerfile),
            ("agent.txt", "agent"),
            ("more.txt", "more"),
        ):
            raw = data.encode()
            info = tarfile.TarInfo(member)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    context.seek(0)
    tag = f"{name}:{version}"
    docker_client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    return tag


@pytest.mark.docker
def test_the_generated_script_verifies_a_really_loaded_image(docker_client, tmp_path):
    import docker.errors

    version = f"0.0.0-test.{os.urandom(4).hex()}"  # this test's own tags
    tag = _build_image(docker_client, version)
    worker = f"modelforge-runtime-worker-cpu:{version}"
    try:
        attrs = docker_client.images.get(tag).attrs
        labels = {
            **entry_for(version)["labels"],
            "org.opencontainers.image.title": "modelforge-node-agent",
        }
        entry = {
            **entry_for(version),
            "labels": labels,
            "architecture": attrs["Architecture"],
            "os": attrs["Os"],
            "rootfs_layers": attrs["RootFS"]["Layers"],
            "config": runtime_config(attrs["Config"]),
            "image_id": "sha256:" + "0" * 64,  # ignored
        }
        assert entry["config"]["ExposedPorts"] == {"8000/tcp": {}}

        def verify(candidate: dict, worker: str = worker) -> subprocess.CompletedProcess:
            script = tmp_path / "start.sh"
            script.write_text(node_agent_image.start_script(tag, candidate, worker))
            return subprocess.run(
                ["bash", str(script), "--verify-only"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )

        # The worker image must be loaded too, and be the release's.
        refused = verify(entry)
        assert refused.returncode == 1
        assert f"{worker} is not loaded: run docker image load" in refused.stderr
        _build_image(docker_client, version, "modelforge-runtime-worker-cpu")
        worker_id = docker_client.images.get(worker).id
        good = verify(entry)
        assert good.returncode == 0, good.stderr
        assert f"verified {tag} (local image id {attrs['Id']})" in good.stdout
        assert f"verified {worker} (local image id {worker_id})" in good.stdout
        docker_client.images.get(worker).tag("modelforge-runtime-worker", version)
        refused = verify(entry, f"modelforge-runtime-worker:{version}")  # labelled -cpu
        assert refused.returncode == 1
        assert "worker labels.org.opencontainers.image.title is" in refused.stderr

        changed_layer = copy.deepcopy(entry)
        changed_layer["rootfs_layers"][-1] = "sha256:" + "e" * 64
        refused = verify(changed_layer)
        assert refused.returncode == 1 and "rootfs_layers" in refused.stderr

        changed_label = copy.deepcopy(entry)
        changed_label["labels"]["org.opencontainers.image.revision"] = "another"
        refused = verify(changed_label)
        assert refused.returncode == 1
        assert "labels.org.opencontainers.image.revision" in refused.stderr

        extra_label = copy.deepcopy(entry)
        extra_label["labels"]["com.example.extra"] = "x"
        refused = verify(extra_label)
        assert refused.returncode == 1 and "label names" in refused.stderr

        # What decides how the image runs is bound too: the image says 65532, the node was
        # handed one that runs as root, or another command, or an added variable.
        for field, value in (
            ("User", "0:0"),
            ("Cmd", ["python3", "-c", "print(open('/proc/self/environ').read())"]),
            ("Env", [*entry["config"]["Env"], "PYTHONSTARTUP=/tmp/x.py"]),
            ("Entrypoint", ["/bin/sh", "-c"]),
            ("ExposedPorts", {"22/tcp": {}}),
        ):
            refused = verify({**entry, "config": {**entry["config"], field: value}})
            assert refused.returncode == 1, (field, refused.stdout)
            assert f"config.{field} is" in refused.stderr, refused.stderr

        other_arch = {
            **entry,
            "architecture": "arm64" if attrs["Architecture"] != "arm64" else "amd64",
        }
        refused = verify(other_arch)
        assert refused.returncode == 1 and "architecture" in refused.stderr
    finally:
        for name in (tag, worker, f"modelforge-runtime-worker:{version}"):
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(name, force=True)


def test_the_wizards_bundle_steps_are_the_node_agent_docs_own_commands(tmp_path):
    """The wizard's image step leads with the signature check, as docs/node-agent.md does,
    and each command it shows is the documented one, word for word."""
    import re

    from modelforge_appliance.fleet.node_agent_image import bundle_steps
    from tests.harness.control_plane import make_settings

    steps = bundle_steps(make_settings(tmp_path / "state"))
    assert [s["name"] for s in steps] == ["verify_signature", "verify_sums", "load_images"]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "node-agent.md").read_text()
    flat = re.sub(r"\s+", " ", docs)
    for step in steps:
        assert re.sub(r"\s+", " ", step["text"]) in flat, step["text"]
