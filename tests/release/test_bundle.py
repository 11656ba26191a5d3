"""The release directory, and verify-bundle against it in both tarball layouts.

Every mutation is applied to a copy of a real bundle (the tarball dockerd 20.10 saved, or
the OCI layout skopeo wrote from it), SHA256SUMS is written again where the mutation is not
about the sums, and verify-bundle must fail naming the file, the image and the field.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from modelforge_contract.manifest import IMAGE_NAMES, parse_manifest
from modelforge_release.names import release_names
from tests.harness.release_cli import flip_byte
from tests.harness.release_images import (
    bundle_files,
    clone_bundle,
    edit_manifest,
    layer_offset,
    resum,
    rewrite_config_docker,
    rewrite_tar,
    run_release,
    skopeo_oci_tarball,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

AGENT = "modelforge-node-agent"
WORKER = "modelforge-runtime-worker"


@pytest.fixture(params=["docker", "oci"])
def bundle(request):
    """The release directory in each layout."""
    return request.getfixturevalue("release_bundle" if request.param == "docker" else "oci_bundle")


def verify(directory, *extra):
    return run_release("verify-bundle", directory, *extra)


def test_the_bundle_holds_exactly_the_release_files_and_sha256sum_accepts_it(
    release_bundle, release_version, docker_client
):
    names = sorted(path.name for path in release_bundle.iterdir())
    assert names == sorted([*release_names(release_version), "SHA256SUMS"])
    checked = subprocess.run(
        ["sha256sum", "-c", "--strict", "SHA256SUMS"],
        cwd=release_bundle,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count(": OK") == len(release_names(release_version))
    manifest = parse_manifest(bundle_files(release_bundle)["manifest"].read_text())
    assert sorted(manifest["images"]) == sorted(IMAGE_NAMES)
    for entry in manifest["images"].values():
        attrs = docker_client.api.inspect_image(entry["tag"])
        assert entry["rootfs_layers"] == attrs["RootFS"]["Layers"]
        assert entry["image_id"] == attrs["Id"]


def test_verify_bundle_accepts_the_release_in_both_layouts(bundle):
    result = verify(bundle, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["problems"] == []
    assert all(image["ok"] for image in report["images"].values()) and len(report["images"]) == 4
    assert {file["status"] for file in report["files"]} == {"OK"}
    text = verify(bundle)
    assert text.returncode == 0
    assert f"images.{AGENT}: OK" in text.stdout


def mutate_manifest(change):
    def apply(directory):
        edit_manifest(directory, change)
        resum(directory)

    return apply


def set_field(field, value):
    return mutate_manifest(lambda m: m["images"][AGENT].__setitem__(field, value))


def other_digest(manifest):
    layers = manifest["images"][AGENT]["rootfs_layers"]
    layers[1] = "sha256:" + "0" * 64


def other_label(manifest):
    manifest["images"][AGENT]["labels"]["org.opencontainers.image.licenses"] = "MIT"


def flip_layer_byte(directory):
    tarball = bundle_files(directory)["tarball"]
    _, offset, size = layer_offset(tarball, AGENT, 1)
    flip_byte(tarball, offset + size // 2)  # SHA256SUMS is left as released


def drop_worker_from_tarball(directory):
    tarball = bundle_files(directory)["tarball"]
    original = tarball.with_name("original.tar")
    tarball.rename(original)

    def change(name, data):
        if name == "manifest.json":
            return json.dumps(
                [
                    e
                    for e in json.loads(data)
                    if not any(t.startswith(WORKER + ":") for t in e["RepoTags"])
                ]
            ).encode()
        if name == "index.json":
            index = json.loads(data)
            index["manifests"] = [
                d
                for d in index["manifests"]
                if not d["annotations"]["org.opencontainers.image.ref.name"].startswith(
                    WORKER + ":"
                )
            ]
            return json.dumps(index).encode()
        return None

    rewrite_tar(original, tarball, change)
    original.unlink()
    resum(directory)


def extra_file_in_sums(directory):
    (directory / "extra.txt").write_text("not part of the release\n")
    sums = directory / "SHA256SUMS"
    digest = subprocess.run(
        ["sha256sum", "extra.txt"], cwd=directory, capture_output=True, text=True, check=True
    ).stdout
    sums.write_text(sums.read_text() + digest)


MUTATIONS = {
    # name: (mutation, needs its own tarball copy, what stderr must say)
    "flipped byte in a layer": (
        flip_layer_byte,
        True,
        [f"images.{AGENT}.rootfs_layers[1]: ", "SHA-256 is"],
    ),
    "changed tag": (
        set_field("tag", f"{AGENT}:9.9.9"),
        False,
        [f"-manifest.json: images.{AGENT}.tag: must be exactly"],
    ),
    "changed label": (
        mutate_manifest(other_label),
        False,
        [
            f"images.{AGENT}.labels.org.opencontainers.image.licenses: expected 'MIT', found 'Apache-2.0'"
        ],
    ),
    "changed layer": (
        mutate_manifest(other_digest),
        False,
        [f"images.{AGENT}.rootfs_layers[1]: expected 'sha256:000"],
    ),
    "changed os": (set_field("os", "windows"), False, [f"images.{AGENT}.os: must be linux"]),
    "changed architecture": (
        set_field("architecture", "arm64"),
        False,
        [f"images.{AGENT}.architecture: expected 'arm64', found 'amd64'"],
    ),
    "image missing from the manifest": (
        mutate_manifest(lambda m: m["images"].pop(WORKER)),
        False,
        [f"-manifest.json: images.{WORKER}: is missing from the manifest"],
    ),
    "image missing from the tarball": (
        drop_worker_from_tarball,
        True,
        [f"-images.tar: images.{WORKER}.tag: no image in the tarball is tagged {WORKER}:"],
    ),
    "extra file in SHA256SUMS": (
        extra_file_in_sums,
        False,
        ["SHA256SUMS: lists extra.txt, which is not a file of release"],
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_verify_bundle_names_each_mutation(bundle, mutation, tmp_path):
    apply, copy_tarball, expected = MUTATIONS[mutation]
    directory = clone_bundle(bundle, tmp_path / bundle.name, copy_tarball=copy_tarball)
    apply(directory)
    result = verify(directory)
    assert result.returncode == 1, result.stdout + result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "do not use this release" in result.stderr
    # The JSON report carries the same finding, field by field.
    report = json.loads(verify(directory, "--json").stdout)
    assert not report["ok"] and report["problems"]


@pytest.mark.parametrize("layout", ["docker", "oci"])
def test_an_image_whose_id_changed_but_not_its_content_still_passes(
    layout, release_bundle, release_version, tmp_path
):
    """The image id is information only: a configuration rewritten without touching the
    tag, layers, architecture, os or labels gives a new id and still verifies."""
    directory = clone_bundle(release_bundle, tmp_path / release_bundle.name)
    files = bundle_files(directory)
    files["tarball"].unlink()  # a hard link to the released tarball; replaced below
    rewritten = tmp_path / "rewritten.tar"
    new_id = rewrite_config_docker(bundle_files(release_bundle)["tarball"], rewritten, AGENT)
    if layout == "docker":
        rewritten.rename(files["tarball"])
    else:
        skopeo_oci_tarball(rewritten, release_version, tmp_path, files["tarball"])
    manifest = json.loads(files["manifest"].read_text())
    assert new_id != manifest["images"][AGENT]["image_id"]
    resum(directory)
    result = verify(directory, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layout"] == layout
