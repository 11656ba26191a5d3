"""The wizard's image step: pasted manifest entries checked by the admin API, and the
generated verification run by real bash against a real image in the real dockerd."""

from __future__ import annotations

import copy
import io
import json
import re
import subprocess
import tarfile
from dataclasses import replace

import pytest

from modelforge_appliance.fleet import node_agent_image
from modelforge_contract import __version__
from modelforge_contract.manifest import REQUIRED_LABELS, runtime_config
from tests.harness.control_plane import error_code, make_settings, serve
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
    commands = {c["name"]: c["text"] for c in answer.json()["commands"]}
    assert f"image: modelforge-node-agent:{RELEASE}\n" in commands["compose_file"]
    assert "pull_policy: never" in commands["compose_file"]
    assert not re.search(r"mf[ec]_[0-9a-f]{8}", commands["compose_file"] + commands["start_script"])
    script = commands["start_script"]
    assert "up -d --no-build --pull never node-agent" in script
    assert "image_id=$(inspect '{{.Id}}')" in script
    assert script.index("image_id=") < script.index(" up -d ")  # noted before Compose starts
    assert "{{.Image}}" in script.split(" up -d ")[1]  # and compared after
    assert "--no-build --pull never --force-recreate" in node_agent_image.RECREATE_COMMAND
    assert " -v" not in node_agent_image.CLEANUP_COMMAND.split("#")[0]


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
    script = node_agent_image.start_script(entry["tag"], entry)
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    answer = sqlite_control_plane.admin(
        "POST", CHECK, json={"entry": {**entry, "labels": {**entry["labels"], 'a"b': "x"}}}
    )
    assert 'labels.a"b' in problems_of(answer)


# -- the generated verification against a real image ------------------------------------


def _build_image(docker_client, version: str) -> str:
    """A tiny real image (FROM scratch, so nothing is pulled) with the release labels."""
    labels = entry_for(version)["labels"]
    dockerfile = (
        "FROM scratch\nCOPY agent.txt /agent.txt\nCOPY more.txt /more.txt\n"
        'USER 65532:65532\nENV LANG=C.UTF-8 A_VALUE="<a & b>"\nWORKDIR /\nEXPOSE 8000/tcp\n'
        'CMD ["python3", "-m", "modelforge_node_agent.main"]\n'
        + "".join(f"LABEL {name}={json.dumps(value)}\n" for name, value in labels.items())
    )
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (
            ("Dockerfile", dockerfile),
            ("agent.txt", "agent"),
            ("more.txt", "more"),
        ):
            raw = data.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    context.seek(0)
    tag = f"modelforge-node-agent:{version}"
    docker_client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    return tag


@pytest.mark.docker
def test_the_generated_script_verifies_a_really_loaded_image(docker_client, tmp_path):
    version = "0.0.0-test.1"
    tag = _build_image(docker_client, version)
    try:
        attrs = docker_client.images.get(tag).attrs
        entry = {
            **entry_for(version),
            "architecture": attrs["Architecture"],
            "os": attrs["Os"],
            "rootfs_layers": attrs["RootFS"]["Layers"],
            "config": runtime_config(attrs["Config"]),
            "image_id": "sha256:" + "0" * 64,  # ignored
        }
        assert entry["config"]["ExposedPorts"] == {"8000/tcp": {}}

        def verify(candidate: dict) -> subprocess.CompletedProcess:
            script = tmp_path / "start.sh"
            script.write_text(node_agent_image.start_script(tag, candidate))
            return subprocess.run(
                ["bash", str(script), "--verify-only"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )

        good = verify(entry)
        assert good.returncode == 0, good.stderr
        assert f"verified {tag} (local image id {attrs['Id']})" in good.stdout

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
        docker_client.images.remove(tag, force=True)
