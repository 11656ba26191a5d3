"""``modelforge-release bundle``: the release directory.

    DIR/modelforge-<version>-images.tar     one docker save of the four images
    DIR/modelforge-<version>-manifest.json  what each image is (docs/architecture.md §7)
    DIR/modelforge-x86_64.pyz, modelforge-aarch64.pyz, modelforge-node-agent.pyz,
        modelforge-runtime-worker.pyz
    DIR/docker-compose*.yml, modelforge-control-plane.xml, modelforge*.service
                                            the compose files, the Unraid template, the units
    DIR/SHA256SUMS                          in SHA256SUMS.template's order

The images must already be in dockerd under ``<name>:<version>``
(``modelforge-release images``); the manifest is made from dockerd's own view of them.
"""

from __future__ import annotations

import calendar
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from modelforge_contract.files import fsync_directory, write_atomically
from modelforge_contract.manifest import (
    CONTROL_PLANE_IMAGE,
    IMAGE_NAMES,
    LABEL_CREATED,
    LABEL_REVISION,
    MANIFEST_SCHEMA,
    ManifestError,
    entry_problems,
    parse_manifest,
)

from .digest import Progress, sha256_file
from .dockerd import image_entry, local_image, save_images
from .names import (
    AGENT_PYZ,
    CONTROL_PLANE_ARCHIVES,
    DEPLOYMENT_FILES,
    LABEL_PYZ,
    SIGNATURE_NAME,
    SUMS_NAME,
    WORKER_PYZ,
    control_plane_archive,
    manifest_name,
    release_names,
    tarball_name,
)
from .savefile import LayerMismatch, read_docker_save, write_image_archive
from .sums import (
    compute_entries,
    names_relative_to,
    order_by_template,
    write_sums,
)


class BundleError(Exception):
    """The bundle cannot be made; the message says what to do."""


@dataclass
class BundleResult:
    directory: Path
    version: str
    files: list[dict[str, Any]] = field(default_factory=list)
    images: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "version": self.version,
            "files": self.files,
            "images": self.images,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


def release_manifest(client: Any, version: str) -> dict[str, Any]:
    """The manifest of the four images dockerd holds under ``<name>:<version>``."""
    images, problems = {}, []
    for name in IMAGE_NAMES:
        tag = f"{name}:{version}"
        attrs = local_image(client, tag)
        if attrs is None:
            problems.append(
                f"dockerd has no {tag}: run modelforge-release images --version {version}"
            )
            continue
        entry = image_entry(attrs, tag)
        problems += [f"{tag}: {problem}" for problem in entry_problems(name, entry, version)]
        images[name] = entry
    if problems:
        raise BundleError("; ".join(problems))
    labels = images[CONTROL_PLANE_IMAGE]["labels"]
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "version": version,
        "revision": labels[LABEL_REVISION],
        "created": labels[LABEL_CREATED],
        "images": images,
    }
    try:
        parse_manifest(json.dumps(manifest))  # the verifiers' own check, before anything is written
    except ManifestError as exc:
        raise BundleError(f"the manifest would not verify: {exc}") from None
    return manifest


def _save(client: Any, tags: list[str], target: Path, epoch: int, progress: TextIO | None) -> int:
    """dockerd's ``docker save`` of ``tags``, rewritten into the canonical layout
    (``savefile.py``): the same images give the same tarball, byte for byte."""
    saved = target.with_name(f".{target.name}.saved")
    partial = target.with_name(f".{target.name}.partial")
    meter = (
        Progress(progress, f"saving {target.name}", 0)
        if progress is not None and progress.isatty()
        else None
    )
    written = 0
    try:
        with saved.open("wb") as file:
            for chunk in save_images(client, tags):
                file.write(chunk)
                written += len(chunk)
                if meter:
                    meter.update(written)
        tar, images = read_docker_save(saved)
        with tar:
            by_tag = {image.tag: image for image in images}
            missing = [tag for tag in tags if tag not in by_tag]
            if missing:
                raise BundleError(f"docker save did not write {', '.join(missing)}")
            try:
                write_image_archive([by_tag[tag] for tag in tags], partial, epoch)
            except LayerMismatch as exc:
                raise BundleError(f"dockerd saved a damaged layer: {exc}") from None
        with partial.open("rb+") as file:
            os.fsync(file.fileno())
        os.replace(partial, target)
        fsync_directory(target.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        saved.unlink(missing_ok=True)
        if meter:
            meter.close()
    return target.stat().st_size


def release_epoch(manifest: dict[str, Any]) -> int:
    """The release's time (its ``created``, from SOURCE_DATE_EPOCH) as a Unix time."""
    return calendar.timegm(time.strptime(manifest["created"], "%Y-%m-%dT%H:%M:%SZ"))


def make_bundle(
    client: Any,
    version: str,
    out: Path,
    dist: Path,
    source: Path,
    template: list[str] | None = None,
    progress: TextIO | None = None,
) -> BundleResult:
    result = BundleResult(out, version)
    say = (
        (lambda message: (progress.write(message + "\n"), progress.flush()))
        if progress
        else (lambda message: None)
    )
    started = time.monotonic()
    manifest = release_manifest(client, version)
    names = (*CONTROL_PLANE_ARCHIVES.values(), AGENT_PYZ, WORKER_PYZ)
    pyz_sources = {name: dist / name for name in names}
    missing = [str(path) for path in pyz_sources.values() if not path.is_file()]
    if missing:
        raise BundleError(f"missing {', '.join(missing)}: modelforge-release images builds them")
    deployment = {name: source / path for name, path in DEPLOYMENT_FILES.items()}
    missing = [str(path) for path in deployment.values() if not path.is_file()]
    if missing:
        raise BundleError(
            f"missing {', '.join(missing)}: give --source, the checkout the images came from"
        )
    image = manifest["images"][CONTROL_PLANE_IMAGE]
    in_image = pyz_sources[control_plane_archive(image["architecture"])]
    if image["labels"].get(LABEL_PYZ) != sha256_file(in_image):
        raise BundleError(
            f"{in_image} is not the archive inside "
            f"{CONTROL_PLANE_IMAGE}:{version}; build both again with modelforge-release images"
        )
    out.mkdir(parents=True, exist_ok=True)
    result.seconds["inspect"] = time.monotonic() - started

    started = time.monotonic()
    tags = [manifest["images"][name]["tag"] for name in IMAGE_NAMES]
    say(f"saving {len(tags)} images to {out / tarball_name(version)}")
    size = _save(client, tags, out / tarball_name(version), release_epoch(manifest), progress)
    result.seconds["save"] = time.monotonic() - started
    say(f"saved {size / (1 << 20):.1f} MiB in {result.seconds['save']:.1f}s")

    write_atomically(  # public, as SHA256SUMS and every other file of the release is
        out / manifest_name(version),
        (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(),
        mode=0o644,
    )
    for name, path in {**pyz_sources, **deployment}.items():
        if path.resolve() != (out / name).resolve():
            shutil.copyfile(path, out / name)

    started = time.monotonic()
    named = names_relative_to(out, [out / name for name in release_names(version)])
    named = order_by_template(named, template or release_names(version))
    say("hashing the release files for SHA256SUMS")
    entries = compute_entries(named, progress=progress)
    stale = out / SIGNATURE_NAME
    if stale.exists():  # it signed the SHA256SUMS about to be replaced
        stale.unlink()
        say(f"removed {stale}: it signed the previous SHA256SUMS; sign the new one")
    write_sums(out / SUMS_NAME, entries)
    result.seconds["sums"] = time.monotonic() - started
    result.files = [
        {"name": entry.name, "sha256": entry.digest, "size": (out / entry.name).stat().st_size}
        for entry in entries
    ]
    result.images = {
        name: {
            "tag": entry["tag"],
            "image_id": entry["image_id"],
            "rootfs_layers": entry["rootfs_layers"],
        }
        for name, entry in manifest["images"].items()
    }
    return result
