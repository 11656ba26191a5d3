"""Reading image tarballs of both layouts without a daemon, on small archives made here.

The real bundles (made by dockerd and by skopeo) are checked in test_bundle.py; these
cover the cases a real tool seldom writes: corrupt streams, zstd, links, stray files.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from modelforge_release.archive import ArchiveError, read_archive
from modelforge_release.rootfs import Tree, write_layer
from tests.harness.release_images import raw_entry

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

TAG = "modelforge-node-agent:1.0.0"
BASE_DIR, APP_DIR = "a" * 64, "b" * 64


def layer_bytes(tmp_path: Path, name: str, content: bytes) -> tuple[bytes, str]:
    tree = Tree(name)
    tree.add_file(f"opt/{name}", content)
    layer = write_layer(tree, tmp_path / f"{name}.tar", 1767225600)
    return layer.path.read_bytes(), layer.diff_id


def config_for(diff_ids: list[str]) -> bytes:
    return json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Labels": {"org.opencontainers.image.version": "1.0.0"}},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()


def write_tar(
    path: Path,
    files: dict[str, bytes],
    links: dict[str, str] | None = None,
    format: int = tarfile.PAX_FORMAT,
) -> Path:
    with tarfile.open(path, "w", format=format) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def docker_tarball(
    tmp_path: Path,
    shared_link: bool = False,
    layer_dir: str = APP_DIR,
    format: int = tarfile.PAX_FORMAT,
) -> Path:
    base, base_id = layer_bytes(tmp_path, "base", b"python\n" * 1000)
    app, app_id = layer_bytes(tmp_path, "app", b"agent\n")
    config = config_for([base_id, app_id])
    second = config_for([base_id])
    files = {
        f"{BASE_DIR}/layer.tar": base,
        f"{layer_dir}/layer.tar": app,
        f"{sha(config)}.json": config,
        f"{sha(second)}.json": second,
    }
    manifest = [
        {
            "Config": f"{sha(config)}.json",
            "RepoTags": [TAG],
            "Layers": [f"{BASE_DIR}/layer.tar", f"{layer_dir}/layer.tar"],
        },
        {
            "Config": f"{sha(second)}.json",
            "RepoTags": ["modelforge-runtime-worker-cpu:1.0.0"],
            "Layers": [f"{'c' * 64}/layer.tar" if shared_link else f"{BASE_DIR}/layer.tar"],
        },
    ]
    files["manifest.json"] = json.dumps(manifest).encode()
    links = {f"{'c' * 64}/layer.tar": f"../{BASE_DIR}/layer.tar"} if shared_link else None
    return write_tar(tmp_path / "images.tar", files, links, format)


def oci_tarball(tmp_path: Path, corrupt: str | None = None) -> Path:
    base, base_id = layer_bytes(tmp_path, "base", b"python\n" * 1000)
    compressed = gzip.compress(base, mtime=0)
    if corrupt == "gzip":
        compressed = compressed[:40] + bytes([compressed[40] ^ 0xFF]) + compressed[41:]
    if corrupt == "zstd":
        compressed = b"\x28\xb5\x2f\xfd" + compressed
    config = config_for([base_id])
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{sha(config)}",
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": f"sha256:{sha(compressed)}",
                }
            ],
        }
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": f"sha256:{sha(manifest)}",
                "annotations": {"org.opencontainers.image.ref.name": TAG},
            }
        ],
    }
    files = {
        "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
        "index.json": json.dumps(index).encode(),
        f"blobs/sha256/{sha(manifest)}": manifest,
        f"blobs/sha256/{sha(config)}": config,
        f"blobs/sha256/{sha(compressed)}": compressed,
    }
    return write_tar(tmp_path / "oci.tar", files)


def test_docker_layout_images_are_read_with_their_tags_layers_and_labels(tmp_path):
    path = docker_tarball(tmp_path)
    archive = read_archive(path)
    assert archive.layout == "docker"
    assert archive.sha256 == sha(path.read_bytes()) and archive.size == path.stat().st_size
    image = archive.find(TAG)
    assert image is not None and image.problems == []
    entry = image.entry(TAG)
    assert entry["architecture"] == "amd64" and entry["os"] == "linux"
    assert entry["labels"] == {"org.opencontainers.image.version": "1.0.0"}
    assert len(entry["rootfs_layers"]) == 2
    # Layers stream past; only the small JSON documents are kept.
    assert archive.members[f"{BASE_DIR}/layer.tar"].data is None
    assert archive.members["manifest.json"].data is not None


def test_a_well_formed_archive_has_no_archive_problems(tmp_path):
    assert read_archive(docker_tarball(tmp_path)).problems == []
    assert read_archive(oci_tarball(tmp_path)).problems == []


def test_a_layer_linked_from_another_image_is_refused(tmp_path):
    # dockerd 20.10's own save links a shared layer; the bundle writes no link at all.
    with pytest.raises(ArchiveError, match="is a symbolic link"):
        read_archive(docker_tarball(tmp_path, shared_link=True))


def members_of(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def rewrite(path: Path, target: Path, before=(), after=()) -> Path:
    """The archive's regular files, with extra raw entries before and after them."""
    files = members_of(path)
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in before:
            tar.addfile(info, io.BytesIO(data) if data else None)
        for name, data in files.items():
            tar.addfile(raw_entry(name, data=data)[0], io.BytesIO(data))
        for info, data in after:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return target


CONFIG_OF = "config"  # placeholder in the cases below: the first image's config file name


@pytest.mark.parametrize(
    ("case", "before", "after", "message"),
    [
        # The attack that passed: a link first, then a regular file under the same name;
        # the old reader let the link win, docker unpacks in order and takes the file.
        (
            "link-then-file",
            [raw_entry(CONFIG_OF, tarfile.SYMTYPE, link="manifest.json")],
            [],
            "is a symbolic link",
        ),
        ("file-then-link", [], [raw_entry(CONFIG_OF, tarfile.SYMTYPE, link="x")], "symbolic link"),
        ("file-twice", [], [raw_entry(CONFIG_OF, data=b"{}")], "appears twice"),
        ("hard-link", [], [raw_entry("x", tarfile.LNKTYPE, link="/etc/shadow")], "is a hard link"),
        ("symlink-out", [], [raw_entry("x", tarfile.SYMTYPE, link="/etc/passwd")], "symbolic link"),
        ("dot-dot", [], [raw_entry("../../evil", data=b"x")], "leaves the archive"),
        ("absolute", [], [raw_entry("/etc/cron.d/evil", data=b"x")], "absolute name"),
        ("device", [], [raw_entry("dev", tarfile.CHRTYPE)], "neither a regular file"),
        ("fifo", [], [raw_entry("pipe", tarfile.FIFOTYPE)], "neither a regular file"),
        ("dir-and-file", [raw_entry("manifest.json", tarfile.DIRTYPE)], [], "appears twice"),
    ],
)
def test_what_docker_might_read_differently_is_refused(tmp_path, case, before, after, message):
    path = docker_tarball(tmp_path)
    config = json.loads(members_of(path)["manifest.json"])[0]["Config"]

    def named(items):
        out = []
        for info, data in items:
            if info.name == CONFIG_OF:
                info.name = config
            out.append((info, data))
        return out

    bad = rewrite(path, tmp_path / f"{case}.tar", named(before), named(after))
    with pytest.raises(ArchiveError, match=message):
        read_archive(bad)


@pytest.mark.parametrize(
    ("name", "data"),
    [("evil.sh", b"#!/bin/sh\n"), ("x" * 64 + "/layer.tar.gz", b"x"), ("blobs/md5/abc", b"x")],
)
def test_an_entry_outside_the_layout_is_named(tmp_path, name, data):
    bad = rewrite(
        docker_tarball(tmp_path), tmp_path / "stray.tar", after=[raw_entry(name, data=data)]
    )
    assert any(problem.startswith(name) for problem in read_archive(bad).problems)


def test_a_repositories_file_must_say_what_the_manifest_says(tmp_path):
    path = docker_tarball(tmp_path)
    agreeing = {"modelforge-node-agent": {"1.0.0": APP_DIR}}
    agreeing["modelforge-runtime-worker-cpu"] = {"1.0.0": BASE_DIR}
    good = rewrite(
        path,
        tmp_path / "good.tar",
        after=[raw_entry("repositories", data=json.dumps(agreeing).encode())],
    )
    assert read_archive(good).problems == []
    hijack = {**agreeing, "busybox": {"latest": APP_DIR}}
    bad = rewrite(
        path,
        tmp_path / "bad.tar",
        after=[raw_entry("repositories", data=json.dumps(hijack).encode())],
    )
    assert read_archive(bad).problems == [
        "repositories names busybox:latest, which manifest.json does not tag"
    ]


def test_oci_layout_gzip_layers_are_checked_against_the_decompressed_diff_id(tmp_path):
    archive = read_archive(oci_tarball(tmp_path))
    assert archive.layout == "oci"
    image = archive.find(TAG)
    assert image is not None and image.problems == []


@pytest.mark.parametrize(
    ("corrupt", "message"), [("gzip", "gzip stream is corrupt"), ("zstd", "zstd")]
)
def test_a_layer_that_cannot_be_decompressed_is_named(tmp_path, corrupt, message):
    image = read_archive(oci_tarball(tmp_path, corrupt=corrupt)).find(TAG)
    assert image is not None
    fields = dict(image.problems)
    assert message in fields["rootfs_layers[0]"]


def test_a_configuration_that_does_not_match_its_name_is_named(tmp_path):
    path = docker_tarball(tmp_path)
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(files["manifest.json"])
    name = manifest[0]["Config"]
    files[name] = files[name].replace(b"amd64", b"arm64")
    image = read_archive(write_tar(tmp_path / "bad.tar", files)).find(TAG)
    assert image is not None
    assert ("config", f"{name} does not match its digest") in [
        (field, message.split(" (it is")[0]) for field, message in image.problems
    ]


def test_something_that_is_not_an_image_archive_is_refused(tmp_path):
    with pytest.raises(ArchiveError, match="neither manifest.json"):
        read_archive(write_tar(tmp_path / "other.tar", {"README": b"hello"}))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(ArchiveError):
        read_archive(junk)


@pytest.mark.parametrize("format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_long_member_names_in_either_extension_are_read(tmp_path, format):
    path = docker_tarball(tmp_path, layer_dir="d" * 140, format=format)
    image = read_archive(path).find(TAG)
    assert image is not None and image.problems == []
    assert image.layer_names[1] == "d" * 140 + "/layer.tar"


def test_an_archive_without_its_end_marker_is_still_read_and_hashed_whole(tmp_path):
    path = docker_tarball(tmp_path)
    data = path.read_bytes().rstrip(b"\0")
    data += b"\0" * (-len(data) % 512)  # whole blocks, but no two zero blocks at the end
    path.write_bytes(data)
    archive = read_archive(path)
    assert archive.sha256 == sha(data)
    assert archive.find(TAG).problems == []
