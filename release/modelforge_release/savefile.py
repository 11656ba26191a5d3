"""The images tarball in the ``docker save`` layout, written the one way this project writes it.

``docker load`` reads ``manifest.json`` (per image: ``Config``, ``RepoTags``, ``Layers``),
each ``<config digest>.json`` and each ``<diff id>/layer.tar``. Written here, the archive is
canonical, so the same images give the same bytes on every build:

- entries sorted by name, each a regular file under a plain relative name, each once;
  a layer two images share is one file both manifests name (no links at all);
- owner 0:0 with no user or group name, mode 0644, the modification time of the release
  (``SOURCE_DATE_EPOCH``), POSIX pax format;
- every layer's bytes are checked against its diff id as they are copied.

``modelforge-release images`` writes it to load the images it built; ``bundle`` rewrites
dockerd's own ``docker save`` into it (dockerd 20.10 links shared layers and writes a
``repositories`` file, which the verifiers would refuse).
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20


@dataclass(frozen=True)
class SavedLayer:
    diff_id: str  # sha256:<hex> of the uncompressed layer tar
    size: int
    open: Callable[[], BinaryIO]


@dataclass(frozen=True)
class SavedImage:
    tag: str
    config: bytes  # the image configuration, exactly as dockerd will hash it
    layers: list[SavedLayer]

    @property
    def config_name(self) -> str:
        return hashlib.sha256(self.config).hexdigest() + ".json"


class LayerMismatch(Exception):
    """A layer's bytes do not hash to its diff id."""


def layer_name(diff_id: str) -> str:
    return diff_id.removeprefix("sha256:") + "/layer.tar"


class _Checked:
    """Reads a layer through, hashing it; tarfile copies exactly ``size`` bytes."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.digest = file, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.digest.update(data)
        return data


def write_image_archive(images: list[SavedImage], target: Path, epoch: int) -> None:
    """Write ``images`` to ``target`` in the canonical ``docker save`` layout."""
    entries: dict[str, tuple[int, Callable[[], BinaryIO], str | None]] = {}
    manifest = []
    for image in images:
        entries[image.config_name] = (len(image.config), _bytes(image.config), None)
        for layer in image.layers:
            entries.setdefault(layer_name(layer.diff_id), (layer.size, layer.open, layer.diff_id))
        manifest.append(
            {
                "Config": image.config_name,
                "RepoTags": [image.tag],
                "Layers": [layer_name(layer.diff_id) for layer in image.layers],
            }
        )
    document = json.dumps(manifest, indent=1).encode()
    entries["manifest.json"] = (len(document), _bytes(document), None)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            size, source, diff_id = entries[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = size, epoch, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with source() as file:
                checked = _Checked(file)
                tar.addfile(info, checked)  # type: ignore[arg-type]
            if diff_id is not None and "sha256:" + checked.digest.hexdigest() != diff_id:
                raise LayerMismatch(
                    f"{name}: the layer's bytes hash to sha256:{checked.digest.hexdigest()}, "
                    f"not to its diff id {diff_id}"
                )


def _bytes(data: bytes) -> Callable[[], BinaryIO]:
    return lambda: io.BytesIO(data)


def read_docker_save(path: Path) -> tuple[tarfile.TarFile, list[SavedImage]]:
    """The images of a ``docker save`` tarball (any layout docker writes, links followed),
    as ``SavedImage``s reading from the open tarball. The caller closes it."""
    tar = tarfile.open(path)  # noqa: SIM115 - handed to the caller, who closes it
    try:
        manifest = json.loads(_read(tar, "manifest.json"))
        images = []
        for item in manifest:
            config = _read(tar, item["Config"])
            diff_ids = json.loads(config)["rootfs"]["diff_ids"]
            if len(diff_ids) != len(item["Layers"]):
                raise ValueError(
                    f"{item['Config']} lists {len(diff_ids)} layers, not {len(item['Layers'])}"
                )
            layers = [
                SavedLayer(diff_id, _member(tar, name).size, _opener(tar, name))
                for diff_id, name in zip(diff_ids, item["Layers"], strict=True)
            ]
            for tag in item.get("RepoTags") or []:
                images.append(SavedImage(tag, config, layers))
    except BaseException:
        tar.close()
        raise
    return tar, images


def _member(tar: tarfile.TarFile, name: str) -> tarfile.TarInfo:
    """The regular file ``name`` is, following docker's links between layer directories."""
    info = tar.getmember(name)
    for _ in range(16):
        if info.issym():
            info = tar.getmember(
                posixpath.normpath(posixpath.join(posixpath.dirname(info.name), info.linkname))
            )
        elif info.islnk():
            info = tar.getmember(info.linkname)
        else:
            return info
    raise ValueError(f"{name}: too many links")


def _read(tar: tarfile.TarFile, name: str) -> bytes:
    file = tar.extractfile(_member(tar, name))
    if file is None:
        raise ValueError(f"{name} is not a file in the saved tarball")
    return file.read()


def _opener(tar: tarfile.TarFile, name: str) -> Callable[[], BinaryIO]:
    def open_layer() -> BinaryIO:
        file = tar.extractfile(_member(tar, name))
        if file is None:
            raise ValueError(f"{name} is not a file in the saved tarball")
        return file

    return open_layer
