"""The release manifest (docs/architecture.md §7): its shape, and how one image entry is checked.

Shared by the release tooling (``modelforge-release verify-bundle`` / ``verify-image``),
which compares a manifest with real images, and the console's Enroll node wizard, which
checks the ``images.modelforge-node-agent`` entry an operator pastes. Standard library only.

The image id is recorded for information and never compared: ``docker load`` may rewrite it.
What decides what a container of the image runs is compared instead: each entry binds the
runtime configuration (``config``: user, entrypoint, command, environment, working directory,
volumes, ports, health check, stop signal) besides the layers and labels.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from . import PROTOCOL_VERSION

# 2: each entry binds the image's runtime configuration (``config``). A schema 1 manifest
# bound layers and labels only, so an image with a changed user or command passed.
MANIFEST_SCHEMA = 2

CONTROL_PLANE_IMAGE = "modelforge-control-plane"
NODE_AGENT_IMAGE = "modelforge-node-agent"
RUNTIME_WORKER_IMAGE = "modelforge-runtime-worker"
RUNTIME_WORKER_CPU_IMAGE = "modelforge-runtime-worker-cpu"
IMAGE_NAMES = (
    CONTROL_PLANE_IMAGE,
    NODE_AGENT_IMAGE,
    RUNTIME_WORKER_IMAGE,
    RUNTIME_WORKER_CPU_IMAGE,
)

LABEL_TITLE = "org.opencontainers.image.title"
LABEL_VERSION = "org.opencontainers.image.version"
LABEL_REVISION = "org.opencontainers.image.revision"
LABEL_CREATED = "org.opencontainers.image.created"
LABEL_SOURCE = "org.opencontainers.image.source"
LABEL_LICENSES = "org.opencontainers.image.licenses"
LABEL_AGENT_PROTOCOL = "io.modelforge.agent-protocol"
REQUIRED_LABELS = (
    LABEL_TITLE,
    LABEL_VERSION,
    LABEL_REVISION,
    LABEL_CREATED,
    LABEL_LICENSES,
    LABEL_AGENT_PROTOCOL,
)
# Where the source is published: a URL, or no label at all (a build from a checkout whose
# origin is a local path, or none).
SOURCE_URL = re.compile(r"(?:https?|ssh|git)://[^\s/]+\S*")

ARCHITECTURES = ("amd64", "arm64")
OPERATING_SYSTEMS = ("linux",)
# The fields of an image configuration that decide what a container of it runs, in the
# terms of the configuration's ``config`` object (and of ``docker image inspect``'s Config).
RUNTIME_FIELDS = (
    "User",
    "Entrypoint",
    "Cmd",
    "Env",
    "WorkingDir",
    "Volumes",
    "ExposedPorts",
    "Healthcheck",
    "StopSignal",
)
_STRING_FIELDS = ("User", "WorkingDir", "StopSignal")
_LIST_FIELDS = ("Entrypoint", "Cmd", "Env")
_OBJECT_FIELDS = ("Volumes", "ExposedPorts", "Healthcheck")
# The fields of an entry that are compared; image_id is information only.
COMPARED_FIELDS = ("tag", "architecture", "os", "rootfs_layers", "labels", "config")

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# A release version as tags allow it (semver with pre-release, e.g. 1.3.0-rc.1).
_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry: the field it is about and what is wrong."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def is_version(value: Any) -> bool:
    return isinstance(value, str) and _VERSION.fullmatch(value) is not None


def runtime_config(config: Any) -> dict[str, Any]:
    """The runtime fields of an image configuration's ``config`` object (or of an entry's
    ``config``), each one present; an empty value (``""``, ``[]``, ``{}``) is ``None``, as
    docker treats it the same as an absent one."""
    source = config if isinstance(config, dict) else {}
    return {name: source.get(name) or None for name in RUNTIME_FIELDS}


def _config_problems(config: Any) -> list[Problem]:
    if not isinstance(config, dict):
        return [Problem("config", "must be an object of the image's runtime configuration")]
    problems = [
        Problem(f"config.{name}", "is missing") for name in RUNTIME_FIELDS if name not in config
    ]
    problems += [
        Problem(f"config.{name}", "is not a runtime field this release binds")
        for name in sorted(set(config) - set(RUNTIME_FIELDS))
    ]
    for name in RUNTIME_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if name in _STRING_FIELDS and not isinstance(value, str):
            problems.append(Problem(f"config.{name}", f"must be a string or null, not {value!r}"))
        elif name in _LIST_FIELDS and not (
            isinstance(value, list) and all(isinstance(item, str) for item in value)
        ):
            problems.append(Problem(f"config.{name}", "must be a list of strings or null"))
        elif name in _OBJECT_FIELDS and not isinstance(value, dict):
            problems.append(Problem(f"config.{name}", "must be an object or null"))
    return problems


def entry_problems(name: str, entry: Any, version: str | None = None) -> list[Problem]:
    """What is wrong with one image entry of the manifest, or [] when it is well formed.

    ``version``, when given, is the release the entry must belong to: the tag must be
    exactly ``<name>:<version>`` and the version label must say the same.
    """
    if not isinstance(entry, dict):
        return [Problem(name, "must be a JSON object")]
    problems: list[Problem] = []
    tag = entry.get("tag")
    tag_version = None
    if not isinstance(tag, str) or not tag.startswith(f"{name}:"):
        problems.append(Problem("tag", f"must be {name}:<version>, not {tag!r}"))
    else:
        tag_version = tag.removeprefix(f"{name}:")
        if version is not None and tag != f"{name}:{version}":
            problems.append(Problem("tag", f"must be exactly {name}:{version}, not {tag!r}"))
        elif not is_version(tag_version):
            problems.append(Problem("tag", f"{tag_version!r} is not a release version"))
    if entry.get("architecture") not in ARCHITECTURES:
        problems.append(
            Problem(
                "architecture",
                f"must be one of {', '.join(ARCHITECTURES)}, not {entry.get('architecture')!r}",
            )
        )
    if entry.get("os") not in OPERATING_SYSTEMS:
        problems.append(Problem("os", f"must be linux, not {entry.get('os')!r}"))
    layers = entry.get("rootfs_layers")
    if not isinstance(layers, list) or not layers:
        problems.append(Problem("rootfs_layers", "must be a non-empty list of sha256 digests"))
    else:
        for index, layer in enumerate(layers):
            if not is_digest(layer):
                problems.append(
                    Problem(f"rootfs_layers[{index}]", f"{layer!r} is not a sha256:<64 hex> digest")
                )
    problems.extend(_label_problems(entry.get("labels"), tag_version))
    problems.extend(_config_problems(entry.get("config")))
    image_id = entry.get("image_id")
    if image_id is not None and not is_digest(image_id):
        problems.append(Problem("image_id", f"{image_id!r} is not a sha256:<64 hex> digest"))
    return problems


def _label_problems(labels: Any, tag_version: str | None) -> list[Problem]:
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        return [Problem("labels", "must be an object of string labels")]
    problems = [
        Problem(f"labels.{label}", "is missing") for label in REQUIRED_LABELS if label not in labels
    ]
    if tag_version is not None and labels.get(LABEL_VERSION, tag_version) != tag_version:
        problems.append(
            Problem(
                f"labels.{LABEL_VERSION}",
                f"says {labels[LABEL_VERSION]!r} but the tag says {tag_version!r}",
            )
        )
    source = labels.get(LABEL_SOURCE)
    if source is not None and not SOURCE_URL.fullmatch(source):
        problems.append(
            Problem(f"labels.{LABEL_SOURCE}", f"{source!r} is not a URL (leave the label out)")
        )
    protocol = labels.get(LABEL_AGENT_PROTOCOL)
    if protocol is not None and protocol != str(PROTOCOL_VERSION):
        problems.append(
            Problem(
                f"labels.{LABEL_AGENT_PROTOCOL}",
                f"is {protocol!r}; this release speaks agent protocol {PROTOCOL_VERSION}",
            )
        )
    return problems


def entry_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[Problem]:
    """Where ``actual`` differs from ``expected`` in the compared fields (never image_id).

    Labels are compared one by one in both directions, so a missing, changed or extra
    label is each named; the layer list is compared in order and as a whole; each runtime
    field is compared whole (``config.User``, ``config.Env``, ...), an empty value the same
    as an absent one.
    """
    problems: list[Problem] = []
    for field in ("tag", "architecture", "os"):
        if expected.get(field) != actual.get(field):
            problems.append(
                Problem(field, f"expected {expected.get(field)!r}, found {actual.get(field)!r}")
            )
    want_layers, have_layers = (
        expected.get("rootfs_layers") or [],
        actual.get("rootfs_layers") or [],
    )
    if want_layers != have_layers:
        for index in range(max(len(want_layers), len(have_layers))):
            want = want_layers[index] if index < len(want_layers) else None
            have = have_layers[index] if index < len(have_layers) else None
            if want != have:
                problems.append(
                    Problem(f"rootfs_layers[{index}]", f"expected {want!r}, found {have!r}")
                )
    want_labels, have_labels = expected.get("labels") or {}, actual.get("labels") or {}
    for label in sorted(set(want_labels) | set(have_labels)):
        if want_labels.get(label) != have_labels.get(label):
            problems.append(
                Problem(
                    f"labels.{label}",
                    f"expected {want_labels.get(label)!r}, found {have_labels.get(label)!r}",
                )
            )
    problems += config_differences(expected.get("config"), actual.get("config"))
    return problems


def config_differences(expected: Any, actual: Any, prefix: str = "config") -> list[Problem]:
    """Each runtime field where ``actual`` differs from ``expected``, both values named."""
    want, have = runtime_config(expected), runtime_config(actual)
    return [
        Problem(f"{prefix}.{name}", f"expected {want[name]!r}, found {have[name]!r}")
        for name in RUNTIME_FIELDS
        if want[name] != have[name]
    ]


class ManifestError(ValueError):
    """The manifest file is not a release manifest this program understands.

    ``problems`` holds (image name, Problem) for each problem found in the image entries,
    so a caller can report them one by one; it is empty when the top level is wrong.
    """

    def __init__(self, message: str, problems: list[tuple[str, Problem]] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


def parse_manifest(text: str) -> dict[str, Any]:
    """Parse and check a whole release manifest; raise ManifestError naming what is wrong."""
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise ManifestError(f"not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise ManifestError("must be a JSON object")
    if manifest.get("schema") == 1:
        raise ManifestError(
            "schema 1 does not bind the images' runtime configuration (user, command, "
            f"environment); verify with the release's own manifest, schema {MANIFEST_SCHEMA}"
        )
    if manifest.get("schema") != MANIFEST_SCHEMA:
        raise ManifestError(f"schema must be {MANIFEST_SCHEMA}, not {manifest.get('schema')!r}")
    version = manifest.get("version")
    if not is_version(version):
        raise ManifestError(f"version {version!r} is not a release version")
    images = manifest.get("images")
    if not isinstance(images, dict) or not images:
        raise ManifestError("images must be a non-empty object")
    problems = [
        (name, problem)
        for name, entry in images.items()
        for problem in entry_problems(name, entry, version)
    ]
    unknown = sorted(set(images) - set(IMAGE_NAMES))
    problems += [(name, Problem("", "not an image of this release")) for name in unknown]
    if problems:
        raise ManifestError(
            "; ".join(
                f"images.{name}.{problem}" if problem.field else f"images.{name}: {problem.message}"
                for name, problem in problems
            ),
            problems,
        )
    return manifest
