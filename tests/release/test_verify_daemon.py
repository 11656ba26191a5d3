"""verify-image and verify-container against the real dockerd, after a real
``docker image load`` of the bundle."""

from __future__ import annotations

import json

import pytest

from modelforge_contract.manifest import IMAGE_NAMES
from tests.harness.release_images import (
    bundle_files,
    remove_tags,
    rewrite_config_docker,
    run_release,
    tags,
    unique,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

AGENT = "modelforge-node-agent"


def load(docker_client, tarball):
    """What ``docker image load -i TARBALL`` asks of dockerd."""
    with open(tarball, "rb") as file:
        for message in docker_client.api.load_image(file):
            assert not message.get("error"), message


@pytest.fixture(scope="module")
def loaded_bundle(docker_client, release_bundle, release_version):
    """The bundle's images, untagged from the build and loaded again from the tarball."""
    remove_tags(docker_client, tags(release_version))
    for tag in tags(release_version):
        with pytest.raises(Exception, match="No such image|not found"):
            docker_client.api.inspect_image(tag)
    load(docker_client, bundle_files(release_bundle)["tarball"])
    return release_bundle


def verify_image(manifest, name, *extra):
    return run_release("verify-image", "--manifest", manifest, "--image", name, *extra)


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_every_loaded_image_matches_its_manifest_entry(loaded_bundle, docker_client, name):
    manifest = bundle_files(loaded_bundle)["manifest"]
    result = verify_image(manifest, name, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    entry = json.loads(manifest.read_text())["images"][name]
    assert report["ok"] and report["tag"] == entry["tag"]
    assert report["image_id"] == docker_client.api.inspect_image(entry["tag"])["Id"]


def edited_manifest(bundle, tmp_path, change):
    manifest = json.loads(bundle_files(bundle)["manifest"].read_text())
    change(manifest)
    path = tmp_path / bundle_files(bundle)["manifest"].name
    path.write_text(json.dumps(manifest))
    return path


def agent_entry(manifest):
    return manifest["images"][AGENT]


CHANGES = {
    "tag": (
        lambda m: agent_entry(m).__setitem__("tag", f"{AGENT}:9.9.9"),
        f"images.{AGENT}.tag: must be exactly",
    ),
    "label": (
        lambda m: agent_entry(m)["labels"].__setitem__(
            "org.opencontainers.image.revision", "0" * 40
        ),
        f"images.{AGENT}.labels.org.opencontainers.image.revision: expected '{'0' * 40}'",
    ),
    "extra label": (
        lambda m: agent_entry(m)["labels"].__setitem__("io.example.extra", "x"),
        f"images.{AGENT}.labels.io.example.extra: expected 'x', found None",
    ),
    "layer": (
        lambda m: agent_entry(m)["rootfs_layers"].append("sha256:" + "1" * 64),
        f"images.{AGENT}.rootfs_layers[2]: expected 'sha256:1111",
    ),
    "architecture": (
        lambda m: agent_entry(m).__setitem__("architecture", "arm64"),
        f"images.{AGENT}.architecture: expected 'arm64', found 'amd64'",
    ),
    "os": (
        lambda m: agent_entry(m).__setitem__("os", "windows"),
        f"images.{AGENT}.os: must be linux",
    ),
    "missing image": (lambda m: m["images"].pop(AGENT), f"images.{AGENT}: not in this manifest"),
    "user": (
        lambda m: agent_entry(m)["config"].__setitem__("User", "0:0"),
        f"images.{AGENT}.config.User: expected '0:0', found '65532:65532'",
    ),
    "command": (
        lambda m: agent_entry(m)["config"].__setitem__("Cmd", ["python3"]),
        f"images.{AGENT}.config.Cmd: expected ['python3'], found ['python3', '-m'",
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_verify_image_names_what_differs(loaded_bundle, tmp_path, change):
    apply, expected = CHANGES[change]
    result = verify_image(edited_manifest(loaded_bundle, tmp_path, apply), AGENT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert expected in result.stderr


def test_an_image_that_is_not_loaded_is_named(loaded_bundle, tmp_path, release_version):
    version = f"{release_version}-absent"

    def elsewhere(manifest):
        manifest["version"] = version
        for name, entry in manifest["images"].items():
            entry["tag"] = f"{name}:{version}"
            entry["labels"]["org.opencontainers.image.version"] = version

    result = verify_image(edited_manifest(loaded_bundle, tmp_path, elsewhere), AGENT)
    assert result.returncode == 1
    assert f"images.{AGENT}.tag: dockerd has no image tagged {AGENT}:{version}" in result.stderr


def test_a_loaded_image_whose_id_changed_but_not_its_content_still_passes(
    loaded_bundle, docker_client, tmp_path
):
    files = bundle_files(loaded_bundle)
    entry = json.loads(files["manifest"].read_text())["images"][AGENT]
    rewritten = tmp_path / "rewritten.tar"
    new_id = rewrite_config_docker(files["tarball"], rewritten, AGENT)
    try:
        load(docker_client, rewritten)
        assert docker_client.api.inspect_image(entry["tag"])["Id"] == new_id != entry["image_id"]
        result = verify_image(files["manifest"], AGENT, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["image_id"] == new_id
    finally:
        docker_client.api.tag(entry["image_id"], entry["tag"])  # the released image again
        docker_client.images.remove(new_id, force=True)


def test_a_loaded_image_whose_configuration_runs_something_else_fails_verify_image(
    loaded_bundle, docker_client, tmp_path
):
    """Loaded by docker (the genuine layers and labels, another configuration): the image
    would run as root with another command; verify-image names both."""
    files = bundle_files(loaded_bundle)
    entry = json.loads(files["manifest"].read_text())["images"][AGENT]
    rewritten = tmp_path / "rewritten.tar"

    def as_root(config):
        config["config"]["User"] = "0:0"
        config["config"]["Cmd"] = ["python3", "-c", "import os; print(os.environ)"]

    new_id = rewrite_config_docker(files["tarball"], rewritten, AGENT, as_root)
    try:
        load(docker_client, rewritten)
        result = verify_image(files["manifest"], AGENT)
        assert result.returncode == 1
        assert f"images.{AGENT}.config.User: expected '65532:65532', found '0:0'" in result.stderr
        assert f"images.{AGENT}.config.Cmd: expected" in result.stderr
    finally:
        docker_client.api.tag(entry["image_id"], entry["tag"])  # the released image again
        docker_client.images.remove(new_id, force=True)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ({"user": "0:0"}, "config.User: expected '65532:65532', found '0:0'"),
        ({"command": ["python3", "-c", "pass"]}, "config.Cmd: expected"),
        ({"entrypoint": ["/bin/sh"]}, "config.Entrypoint: expected None"),
        ({"environment": {"PYTHONSTARTUP": "/tmp/x.py"}}, "config.Env: adds PYTHONSTARTUP="),
        ({"environment": {"PATH": "/tmp"}}, "config.Env: PATH is '/tmp', the image sets"),
        ({"working_dir": "/tmp"}, "config.WorkingDir: expected '/', found '/tmp'"),
    ],
)
def test_verify_container_checks_how_the_container_runs_its_image(
    loaded_bundle, docker_client, how, expected
):
    manifest = json.loads(bundle_files(loaded_bundle)["manifest"].read_text())
    image_id = manifest["images"][AGENT]["image_id"]
    tag = manifest["images"][AGENT]["tag"]
    # What an operator sets is theirs to set: the agent's settings and the toolkit's.
    operator = docker_client.containers.create(
        tag,
        name=unique(),
        environment={
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": "https://cp",
            "NVIDIA_VISIBLE_DEVICES": "0",
        },
    )
    changed = docker_client.containers.create(tag, name=unique(), **how)
    try:
        ok = run_release("verify-container", operator.name, "--image-id", image_id)
        assert ok.returncode == 0, ok.stderr
        refused = run_release("verify-container", changed.name, "--image-id", image_id)
        assert refused.returncode == 1
        assert f"container {changed.name}: {expected}" in refused.stderr, refused.stderr
        if "user" in how:  # a user chosen on purpose (Unraid's 99:100) is said so
            said = run_release(
                "verify-container", changed.name, "--image-id", image_id, "--user", how["user"]
            )
            assert said.returncode == 0, said.stderr
    finally:
        operator.remove(force=True)
        changed.remove(force=True)


def test_verify_container_catches_a_tag_moved_after_the_id_was_captured(
    loaded_bundle, docker_client
):
    manifest = json.loads(bundle_files(loaded_bundle)["manifest"].read_text())
    agent, other = manifest["images"][AGENT], manifest["images"]["modelforge-control-plane"]
    tag = f"{unique()}/node-agent:pinned"
    docker_client.api.tag(agent["tag"], tag)
    captured = docker_client.api.inspect_image(tag)["Id"]
    containers = []
    try:
        good = docker_client.containers.create(tag, name=unique())
        containers.append(good)
        result = run_release("verify-container", good.name, "--image-id", captured, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["image_id"] == captured

        docker_client.api.tag(other["tag"], tag)  # someone re-tags another image
        moved = docker_client.containers.create(tag, name=unique())
        containers.append(moved)
        result = run_release("verify-container", moved.name, "--image-id", captured)
        assert result.returncode == 1
        assert f"container {moved.name} runs image {other['image_id']}" in result.stderr
        assert f"not {captured}" in result.stderr
    finally:
        for container in containers:
            container.remove(force=True)
        remove_tags(docker_client, [tag])


def test_verify_container_refuses_a_malformed_id_and_names_a_missing_container(loaded_bundle):
    assert run_release("verify-container", "x", "--image-id", "abc").returncode == 2
    missing = unique()
    result = run_release("verify-container", missing, "--image-id", "sha256:" + "2" * 64)
    assert result.returncode == 1
    assert f"no container {missing}" in result.stderr
    assert result.stdout == f"{missing}: FAILED\n"  # no Python None printed
