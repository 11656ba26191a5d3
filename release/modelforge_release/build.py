"""Building the images: every layer written once, each image checked and described by a
configuration made here, all of them loaded into dockerd in one ``docker load``.

No base image is pulled. dockerd keeps the layers exactly as given, so the RootFS layer
digests are the SHA-256 of the tars built here, the same on every build of the same commit,
wherever the checkout lives; the configurations are deterministic too (``created`` from
``SOURCE_DATE_EPOCH``), and so are the image ids.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from modelforge_contract import PROTOCOL_VERSION
from modelforge_contract.manifest import (
    IMAGE_NAMES,
    LABEL_AGENT_PROTOCOL,
    LABEL_CREATED,
    LABEL_LICENSES,
    LABEL_REVISION,
    LABEL_SOURCE,
    LABEL_TITLE,
    LABEL_VERSION,
)

from .image_checks import forbidden_paths, merged_view, missing_libraries
from .images import (
    LABEL_DEBIAN_LOCK,
    LABEL_DESCRIPTION,
    LABEL_PYZ,
    LICENSES,
    PATH,
    SERVICE_USER,
    SPECS,
    BuildContext,
    BuildError,
    ImageSpec,
)
from .layers import LAYER_BUILDERS, LAYER_DESCRIPTIONS, build_pyz
from .names import control_plane_archive
from .rootfs import Layer, Tree, write_layer
from .savefile import SavedImage, SavedLayer, write_image_archive


@dataclass
class BuiltImage:
    spec: ImageSpec
    layers: list[Layer]
    config: bytes

    def tag(self, version: str) -> str:
        return f"{self.spec.name}:{version}"

    @property
    def config_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.config).hexdigest()


def image_labels(ctx: BuildContext, spec: ImageSpec) -> dict[str, str]:
    labels = {
        LABEL_TITLE: spec.name,
        LABEL_DESCRIPTION: spec.description,
        LABEL_VERSION: ctx.version,
        LABEL_REVISION: ctx.revision,
        LABEL_CREATED: ctx.created,
        LABEL_LICENSES: LICENSES,
        LABEL_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
        LABEL_DEBIAN_LOCK: ctx.lock.digest(),
    }
    if ctx.source_url is not None:
        labels[LABEL_SOURCE] = ctx.source_url
    if LABEL_PYZ in spec.extra_labels:
        archive = ctx.dist / control_plane_archive(ctx.lock.architecture)
        labels[LABEL_PYZ] = hashlib.sha256(archive.read_bytes()).hexdigest()
    return labels


def image_config(ctx: BuildContext, spec: ImageSpec, layers: list[Layer]) -> bytes:
    config: dict[str, Any] = {
        "User": SERVICE_USER,
        "Env": [f"PATH={PATH}", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"]
        + [f"{name}={value}" for name, value in spec.env],
        "Cmd": list(spec.cmd),
        "WorkingDir": "/",
        "Labels": image_labels(ctx, spec),
    }
    if spec.exposed_ports:
        config["ExposedPorts"] = {port: {} for port in spec.exposed_ports}
    document = {
        "architecture": ctx.lock.architecture,
        "os": "linux",
        "created": ctx.created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {
                "created": ctx.created,
                "created_by": f"modelforge-release images: {layer.name} layer",
                "comment": LAYER_DESCRIPTIONS[layer.name],
            }
            for layer in layers
        ],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def write_archive(images: list[BuiltImage], version: str, target: Path, epoch: int) -> None:
    """The images in the canonical ``docker save`` layout that ``docker load`` reads."""
    write_image_archive(
        [
            SavedImage(
                image.tag(version),
                image.config,
                [
                    SavedLayer(
                        layer.diff_id, layer.path.stat().st_size, partial(layer.path.open, "rb")
                    )
                    for layer in image.layers
                ],
            )
            for image in images
        ],
        target,
        epoch,
    )


# -- the whole build -----------------------------------------------------------------------------


def build_layers(ctx: BuildContext, names: list[str]) -> dict[str, tuple[Tree, Layer]]:
    built: dict[str, tuple[Tree, Layer]] = {}
    for index, name in enumerate(names, start=1):
        started = time.monotonic()
        tree = Tree(name)
        LAYER_BUILDERS[name](ctx, tree)
        layer = write_layer(tree, ctx.work_dir / "layers" / f"{name}.tar", ctx.epoch)
        ctx.timings[f"layer {name}"] = time.monotonic() - started
        ctx.say(
            f"[{index}/{len(names)}] layer {name}: {layer.files} files, "
            f"{layer.size / (1 << 20):.1f} MiB, {layer.diff_id[:19]}… "
            f"({time.monotonic() - started:.1f}s)"
        )
        built[name] = (tree, layer)
    return built


def check_image(ctx: BuildContext, spec: ImageSpec, trees: list[Tree]) -> None:
    view = merged_view(trees)
    forbidden = forbidden_paths(view)
    if forbidden:
        raise BuildError(f"{spec.name} would contain {', '.join('/' + p for p in forbidden)}")
    libraries = (f"usr/lib/{ctx.multiarch}", "usr/lib", "usr/lib64")
    missing = missing_libraries(view, libraries)
    if missing:
        raise BuildError(f"{spec.name}: " + "; ".join(missing[:10]))


def build_images(ctx: BuildContext, names: tuple[str, ...] = IMAGE_NAMES) -> list[BuiltImage]:
    """Build the pyz files and every layer; check and describe each image. Nothing is loaded."""
    started = time.monotonic()
    if ctx.lock.architecture not in ("amd64", "arm64"):
        raise BuildError(f"unsupported architecture {ctx.lock.architecture}")
    build_pyz(ctx)
    wanted = [SPECS[name] for name in names]
    layer_names = list(dict.fromkeys(layer for spec in wanted for layer in spec.layers))
    built = build_layers(ctx, layer_names)
    images = []
    for spec in wanted:
        trees = [built[name][0] for name in spec.layers]
        check_image(ctx, spec, trees)
        layers = [built[name][1] for name in spec.layers]
        images.append(BuiltImage(spec, layers, image_config(ctx, spec, layers)))
    ctx.timings["build"] = time.monotonic() - started
    return images


def load_images(client: Any, ctx: BuildContext, images: list[BuiltImage]) -> dict[str, Any]:
    """One ``docker load`` of all images; then dockerd's own view of each, checked."""
    started = time.monotonic()
    archive = ctx.work_dir / f"images-{ctx.version}.tar"
    write_archive(images, ctx.version, archive, ctx.epoch)
    size = archive.stat().st_size
    ctx.say(f"loading {len(images)} images into dockerd ({size / (1 << 20):.1f} MiB)")
    with archive.open("rb") as file:
        # The answer is a stream of progress messages; the load is done when it ends.
        for message in client.api.load_image(file):
            if isinstance(message, dict) and message.get("error"):
                raise BuildError(f"docker load failed: {message['error']}")
    archive.unlink()
    result = {}
    for image in images:
        tag = image.tag(ctx.version)
        attrs = client.images.get(tag).attrs
        loaded = attrs["RootFS"]["Layers"]
        expected = [layer.diff_id for layer in image.layers]
        if loaded != expected:
            raise BuildError(
                f"dockerd reports layers {loaded} for {tag}, the build made {expected}"
            )
        result[image.spec.name] = {
            "tag": tag,
            "image_id": attrs["Id"],
            "rootfs_layers": loaded,
            "size": attrs["Size"],
        }
        ctx.say(f"{tag}: {attrs['Id'][:19]}…, {attrs['Size'] / 1e6:.1f} MB")
    ctx.timings["load"] = time.monotonic() - started
    return result
