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

TAG = "modelforge-node-agent:1.0.0"


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
    layer_dir: str = "bbbb",
    format: int = tarfile.PAX_FORMAT,
) -> Path:
    base, base_id = layer_bytes(tmp_path, "base", b"python\n" * 1000)
    app, app_id = layer_bytes(tmp_path, "app", b"agent\n")
    config = config_for([base_id, app_id])
    second = config_for([base_id])
    files = {
        "aaaa/layer.tar": base,
        f"{layer_dir}/layer.tar": app,
        f"{sha(config)}.json": config,
        f"{sha(second)}.json": second,
    }
    manifest = [
        {
            "Config": f"{sha(config)}.json",
            "RepoTags": [TAG],
            "Layers": ["aaaa/layer.tar", f"{layer_dir}/layer.tar"],
        },
        {
            "Config": f"{sha(second)}.json",
            "RepoTags": ["modelforge-runtime-worker-cpu:1.0.0"],
            "Layers": ["cccc/layer.tar" if shared_link else "aaaa/layer.tar"],
        },
    ]
    files["manifest.json"] = json.dumps(manifest).encode()
    links = {"cccc/layer.tar": "../aaaa/layer.tar"} if shared_link else None
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
    assert archive.members["aaaa/layer.tar"].data is None
    assert archive.members["manifest.json"].data is not None


def test_a_layer_linked_from_another_image_is_followed(tmp_path):
    archive = read_archive(docker_tarball(tmp_path, shared_link=True))
    image = archive.find("modelforge-runtime-worker-cpu:1.0.0")
    assert image is not None and image.problems == []


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
