"""Read an image tarball without a daemon, in one streaming pass, in constant memory.

Two layouts are understood:

- the ``docker save`` layout of Docker before 25 (what Debian's dockerd 20.10 writes):
  ``manifest.json`` naming, per image, its ``RepoTags``, a ``<id>.json`` configuration
  and ``<dir>/layer.tar`` files; Docker 25 and later write the same ``manifest.json``
  pointing into ``blobs/sha256/`` beside an OCI index;
- the OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/<hex>``) that
  containerd and skopeo write, where layers are usually gzip-compressed and the
  configuration's diff ids are the digests of the decompressed streams.

Every regular file is hashed as it streams past (and, when it is gzip, decompressed and
hashed again); only small JSON files are kept. The tarball's own SHA-256 comes out of the
same pass, so ``verify-bundle`` reads the largest file of a release once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelforge_contract.manifest import runtime_config

from .tarstream import ArchiveError, Member, scan

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# JSON documents (manifests, configurations, indexes) are kept in memory up to this size.
MAX_JSON_BYTES = 4 << 20
MAX_KEPT_BYTES = 64 << 20
OCI_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
OCI_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_BLOB = re.compile(r"blobs/sha256/([0-9a-f]{64})")
_CONFIG_NAME = re.compile(r"([0-9a-f]{64})\.json")
# The only entries each layout has (docker save before 25: per-layer directories; 25 and
# later: the same manifest.json over an OCI layout). Anything else is refused.
_OCI_FILES = r"oci-layout|index\.json|blobs/sha256/[0-9a-f]{64}"
_LAYOUT_FILES = {
    "docker": re.compile(
        r"manifest\.json|repositories|[0-9a-f]{64}\.json|[0-9a-f]{64}/(?:layer\.tar|json|VERSION)|"
        + _OCI_FILES
    ),
    "oci": re.compile(_OCI_FILES),
}
_LAYOUT_DIRECTORIES = {
    "docker": re.compile(r"[0-9a-f]{64}|blobs|blobs/sha256"),
    "oci": re.compile(r"blobs|blobs/sha256"),
}


@dataclass
class ArchiveImage:
    """One image found in the tarball, with what it claims and what its files are."""

    tags: list[str]
    source: str  # where it is described, e.g. "manifest.json[2]" or "index.json"
    config_name: str | None
    config: dict[str, Any] | None
    layer_names: list[str]
    problems: list[tuple[str, str]] = field(default_factory=list)  # (field, message)

    def entry(self, tag: str) -> dict[str, Any]:
        """The image in the manifest's terms, for ``entry_differences``."""
        config = self.config or {}
        return {
            "tag": tag,
            "architecture": config.get("architecture"),
            "os": config.get("os"),
            "rootfs_layers": list((config.get("rootfs") or {}).get("diff_ids") or []),
            "labels": dict((config.get("config") or {}).get("Labels") or {}),
            "config": runtime_config(config.get("config")),
        }


@dataclass
class Archive:
    layout: str  # "docker" or "oci"
    sha256: str  # sha256 hex of the whole tarball
    size: int
    members: dict[str, Member]
    images: list[ArchiveImage]
    problems: list[str] = field(default_factory=list)  # about the archive as a whole

    def find(self, tag: str) -> ArchiveImage | None:
        return next((image for image in self.images if tag in image.tags), None)


def _json(member: Member | None) -> Any:
    if member is None or member.data is None:
        return None
    try:
        return json.loads(member.data)
    except ValueError:
        return None


def _config_problems(name: str, member: Member | None) -> list[tuple[str, str]]:
    """A configuration's file name (docker) or blob name (OCI) is its own digest."""
    if member is None:
        return [("config", f"{name} is missing from the tarball")]
    match = _CONFIG_NAME.fullmatch(name) or _BLOB.fullmatch(name)
    if match and member.sha256 != "sha256:" + match.group(1):
        return [("config", f"{name} does not match its digest (it is {member.sha256})")]
    if _json(member) is None:
        return [("config", f"{name} is not a JSON image configuration")]
    return []


def _layer_problems(image: ArchiveImage, members: dict[str, Member]) -> list[tuple[str, str]]:
    """Each layer file, decompressed if need be, must hash to the diff id the config lists."""
    problems = []
    diff_ids = image.entry("")["rootfs_layers"]
    if len(diff_ids) != len(image.layer_names):
        problems.append(
            (
                "rootfs_layers",
                f"the configuration lists {len(diff_ids)} layers, the tarball has "
                f"{len(image.layer_names)} for this image",
            )
        )
    for index, name in enumerate(image.layer_names):
        member = members.get(name)
        field_name = f"rootfs_layers[{index}]"
        if member is None:
            problems.append((field_name, f"{name} is missing from the tarball"))
            continue
        blob = _BLOB.fullmatch(name)
        if blob and member.sha256 != "sha256:" + blob.group(1):
            problems.append(
                (field_name, f"{name} does not match its digest (it is {member.sha256})")
            )
        if member.error:
            problems.append((field_name, f"{name}: {member.error}"))
        elif member.compression == "zstd":
            problems.append(
                (field_name, f"{name} is zstd-compressed, which this tool cannot check")
            )
        elif index < len(diff_ids) and member.content_sha256 != diff_ids[index]:
            problems.append(
                (
                    field_name,
                    f"{name} has content {member.content_sha256}, the configuration says {diff_ids[index]}",
                )
            )
    return problems


def _docker_images(members: dict[str, Member]) -> list[ArchiveImage]:
    manifest = _json(members.get("manifest.json"))
    if not isinstance(manifest, list):
        raise ArchiveError("manifest.json is not a list of images")
    images = []
    for index, item in enumerate(manifest):
        if not isinstance(item, dict):
            raise ArchiveError(f"manifest.json[{index}] is not an object")
        config_name = str(item.get("Config") or "")
        image = ArchiveImage(
            tags=[str(tag) for tag in item.get("RepoTags") or []],
            source=f"manifest.json[{index}]",
            config_name=config_name,
            config=_json(members.get(config_name)),
            layer_names=[str(name) for name in item.get("Layers") or []],
        )
        image.problems += _config_problems(config_name, members.get(config_name))
        image.problems += _layer_problems(image, members)
        images.append(image)
    return images


def _short_tag(name: str) -> str:
    """``docker.io/library/x:1`` as Docker shows it locally: ``x:1``."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def _descriptors(
    members: dict[str, Member], index: Any, source: str, depth: int = 0
) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """Image manifest descriptors reachable from an index, with inherited annotations."""
    if depth > 4 or not isinstance(index, dict):
        return
    for descriptor in index.get("manifests") or []:
        if not isinstance(descriptor, dict):
            continue
        annotations = {str(k): str(v) for k, v in (descriptor.get("annotations") or {}).items()}
        media = descriptor.get("mediaType")
        if media in OCI_INDEX_TYPES:
            nested = _json(members.get(_blob_name(descriptor)))
            for inner, inner_annotations in _descriptors(members, nested, source, depth + 1):
                yield inner, {**annotations, **inner_annotations}
        else:
            yield descriptor, annotations


def _blob_name(descriptor: dict[str, Any]) -> str:
    digest = str(descriptor.get("digest") or "")
    return "blobs/" + digest.replace(":", "/", 1)


def _oci_images(members: dict[str, Member]) -> list[ArchiveImage]:
    index = _json(members.get("index.json"))
    if not isinstance(index, dict):
        raise ArchiveError("index.json is not an OCI image index")
    images = []
    for descriptor, notes in _descriptors(members, index, "index.json"):
        name = _blob_name(descriptor)
        manifest_member = members.get(name)
        tags = []
        if "io.containerd.image.name" in notes:
            tags.append(_short_tag(notes["io.containerd.image.name"]))
        ref = notes.get("org.opencontainers.image.ref.name", "")
        if ":" in ref:  # a full name:tag (skopeo's oci:DIR:name:tag), not a bare tag
            tags.append(_short_tag(ref))
        image = ArchiveImage(
            tags=tags, source=f"index.json ({name})", config_name=None, config=None, layer_names=[]
        )
        images.append(image)
        if manifest_member is None:
            image.problems.append(("manifest", f"{name} is missing from the tarball"))
            continue
        if manifest_member.sha256 != descriptor.get("digest"):
            image.problems.append(
                ("manifest", f"{name} does not match its digest (it is {manifest_member.sha256})")
            )
        manifest = _json(manifest_member)
        if not isinstance(manifest, dict):
            image.problems.append(("manifest", f"{name} is not an image manifest"))
            continue
        config_descriptor = manifest.get("config") or {}
        image.config_name = _blob_name(config_descriptor)
        image.config = _json(members.get(image.config_name))
        image.problems += _config_problems(image.config_name, members.get(image.config_name))
        image.layer_names = [
            _blob_name(layer) for layer in manifest.get("layers") or [] if isinstance(layer, dict)
        ]
        image.problems += _layer_problems(image, members)
    return images


def _layout_problems(layout: str, members: dict[str, Member], directories: list[str]) -> list[str]:
    files, folders = _LAYOUT_FILES[layout], _LAYOUT_DIRECTORIES[layout]
    problems = [
        f"{name} is not an entry of the {layout} image layout"
        for name in sorted(members)
        if not files.fullmatch(name)
    ]
    problems += [
        f"{name}/ is not a directory of the {layout} image layout"
        for name in sorted(directories)
        if not folders.fullmatch(name)
    ]
    return problems


def _repositories_problems(members: dict[str, Member], images: list[ArchiveImage]) -> list[str]:
    """docker save's ``repositories`` ({name: {tag: top layer id}}) must say what
    manifest.json says: ``docker load`` of an old format reads it instead."""
    member = members.get("repositories")
    if member is None:
        return []
    document = _json(member)
    if not isinstance(document, dict) or not all(
        isinstance(tags, dict) and all(isinstance(v, str) for v in tags.values())
        for tags in document.values()
    ):
        return ["repositories is not a {name: {tag: layer id}} object"]
    said = {
        f"{name}:{tag}": layer for name, tags in document.items() for tag, layer in tags.items()
    }
    tops = {
        tag: image.layer_names[-1].split("/")[0] if image.layer_names else None
        for image in images
        for tag in image.tags
    }
    problems = [
        f"repositories names {tag}, which manifest.json does not tag"
        for tag in sorted(set(said) - set(tops))
    ]
    problems += [
        f"repositories does not name {tag}, which manifest.json tags"
        for tag in sorted(set(tops) - set(said))
    ]
    problems += [
        f"repositories points {tag} at {said[tag]!r}, not at its top layer {tops[tag]}"
        for tag in sorted(set(said) & set(tops))
        if said[tag] != tops[tag]
    ]
    return problems


def read_archive(path: Path, progress: Any = None) -> Archive:
    """Scan the tarball and describe every image in it (problems are collected, not raised;
    an archive that readers could see differently raises ``ArchiveError``)."""
    sha256, size, members, directories = scan(path, progress)
    if "manifest.json" in members:
        images = _docker_images(members)
        archive = Archive("docker", sha256, size, members, images)
        archive.problems += _repositories_problems(members, images)
    elif "index.json" in members:
        archive = Archive("oci", sha256, size, members, _oci_images(members))
    else:
        raise ArchiveError(
            f"{path.name} holds neither manifest.json (docker save) nor index.json (OCI layout)"
        )
    archive.problems[:0] = _layout_problems(archive.layout, members, directories)
    return archive
