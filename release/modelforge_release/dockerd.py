"""What the release tooling asks dockerd, through the docker SDK: a loaded image in the
manifest's terms, one ``docker save`` of several images, and the two daemon-side checks
(``verify-image``, ``verify-container``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract.manifest import (
    Problem,
    config_differences,
    entry_differences,
    runtime_config,
)

log = logging.getLogger(__name__)

_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")


class DaemonError(Exception):
    """dockerd is unreachable or refused a request; the message says what to do."""


def connect(timeout: int = 300) -> Any:
    """A docker SDK client for the daemon named by DOCKER_HOST (default: the local socket)."""
    try:
        import docker
    except ImportError:
        raise DaemonError(
            "this command talks to dockerd through the docker SDK, which is not installed: "
            "pip install -e '.[release]' in the checkout (scripts/test installs it; "
            "scripts/run does not)"
        ) from None

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        raise DaemonError(
            f"cannot reach dockerd ({type(exc).__name__}: {exc}); start it, or set DOCKER_HOST"
        ) from None
    return client


def is_image_id(value: str) -> bool:
    return _IMAGE_ID.fullmatch(value) is not None


def local_image(client: Any, tag: str) -> dict[str, Any] | None:
    """``docker image inspect`` of an exact tag, or None when dockerd has no such tag."""
    import docker.errors

    try:
        attrs = client.api.inspect_image(tag)
    except docker.errors.ImageNotFound:
        return None
    except docker.errors.APIError as exc:
        raise DaemonError(f"dockerd refused to inspect {tag}: {exc.explanation or exc}") from None
    if tag not in (attrs.get("RepoTags") or []):
        return None  # found by id prefix or digest, not by this tag
    return attrs


def image_entry(attrs: dict[str, Any], tag: str) -> dict[str, Any]:
    """A loaded image in the manifest's terms (docs/architecture.md §7)."""
    return {
        "tag": tag,
        "architecture": attrs.get("Architecture"),
        "os": attrs.get("Os"),
        "rootfs_layers": list((attrs.get("RootFS") or {}).get("Layers") or []),
        "labels": dict((attrs.get("Config") or {}).get("Labels") or {}),
        "config": runtime_config(attrs.get("Config")),
        "image_id": attrs.get("Id"),
    }


def save_images(client: Any, tags: list[str], chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """One ``docker save`` of several images: layers they share are written once.

    The SDK's ``get_image`` saves a single name, so this calls the same endpoint
    (``GET /images/get?names=…``) with every name, through the SDK's own session.
    """
    api = client.api
    response = api._get(api._url("/images/get"), params={"names": tags}, stream=True)
    import docker.errors

    try:
        api._raise_for_status(response)
    except docker.errors.APIError as exc:
        raise DaemonError(
            f"dockerd refused to save {', '.join(tags)}: {exc.explanation or exc}"
        ) from None
    yield from response.iter_content(chunk_size)


@dataclass
class ImageCheck:
    name: str
    tag: str
    image_id: str | None  # the local id (dockerd's), reported so a script can pin it
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_image(client: Any, name: str, expected: dict[str, Any]) -> ImageCheck:
    """The loaded image tagged exactly as the entry says, against the entry: RootFS
    layers, architecture, os, every label and every runtime field. The image id is never
    compared."""
    tag = str(expected.get("tag"))
    attrs = local_image(client, tag)
    if attrs is None:
        return ImageCheck(
            name,
            tag,
            None,
            [
                Problem(
                    "tag",
                    f"dockerd has no image tagged {tag}; load the bundle with docker image load",
                )
            ],
        )
    return ImageCheck(name, tag, attrs["Id"], entry_differences(expected, image_entry(attrs, tag)))


@dataclass
class ContainerCheck:
    container: str
    expected_image_id: str
    image_id: str | None
    created_from: str | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# Environment variables a container may set or change over its image's: the settings an
# operator configures (docs/configuration.md) and the NVIDIA Container Toolkit's. Any other
# variable added or changed (PYTHONSTARTUP, LD_PRELOAD, PATH, ...) changes what runs.
OPERATOR_ENV_PREFIXES = ("MODELFORGE_", "NVIDIA_")
OPERATOR_ENV_NAMES = ("TZ",)


def _operator_variable(name: str) -> bool:
    return name.startswith(OPERATOR_ENV_PREFIXES) or name in OPERATOR_ENV_NAMES


def _variables(env: list[str] | None) -> dict[str, str]:
    pairs = (item.partition("=") for item in env or [])
    return {name: value for name, _, value in pairs}


def container_config_problems(
    image_config: Any, container_config: Any, user: str | None = None
) -> list[str]:
    """How a container's effective configuration departs from its image's, beyond what an
    operator may set: every runtime field but the environment must be the image's (the
    user may be ``user`` instead, when the operator runs it as another one on purpose, as
    Unraid's template does); the environment may add or change only operator settings
    (``OPERATOR_ENV_PREFIXES``)."""
    image, container = runtime_config(image_config), runtime_config(container_config)
    if user is not None:
        image["User"] = user
    problems = [
        str(problem)
        for problem in config_differences(
            {**image, "Env": None, "Volumes": None, "ExposedPorts": None},
            {**container, "Env": None, "Volumes": None, "ExposedPorts": None},
        )
    ]
    want, have = _variables(image["Env"]), _variables(container["Env"])
    for name in sorted(set(want) | set(have)):
        if want.get(name) == have.get(name) or _operator_variable(name):
            continue
        if name not in have:
            problems.append(f"config.Env: removes {name}={want[name]!r}")
        elif name not in want:
            problems.append(f"config.Env: adds {name}={have[name]!r}")
        else:
            problems.append(f"config.Env: {name} is {have[name]!r}, the image sets {want[name]!r}")
    return problems


def verify_container(
    client: Any, container: str, image_id: str, user: str | None = None
) -> ContainerCheck:
    """The container was created from exactly this image id (captured before it started),
    and runs it as the image says: user, entrypoint, command, working directory, health
    check, stop signal, and no environment beyond the operator's settings."""
    import docker.errors

    try:
        attrs = client.api.inspect_container(container)
    except docker.errors.NotFound:
        return ContainerCheck(
            container, image_id, None, None, [f"no container {container} in dockerd"]
        )
    except docker.errors.APIError as exc:
        raise DaemonError(
            f"dockerd refused to inspect {container}: {exc.explanation or exc}"
        ) from None
    actual = attrs.get("Image")
    created_from = (attrs.get("Config") or {}).get("Image")
    check = ContainerCheck(container, image_id, actual, created_from)
    if actual != image_id:
        check.problems.append(
            f"container {container} runs image {actual} (created from {created_from}), "
            f"not {image_id}: the tag was moved to another image after the id was captured"
        )
        return check
    try:
        image = client.api.inspect_image(image_id)
    except docker.errors.ImageNotFound:
        check.problems.append(f"dockerd no longer has image {image_id}")
        return check
    except docker.errors.APIError as exc:
        raise DaemonError(
            f"dockerd refused to inspect {image_id}: {exc.explanation or exc}"
        ) from None
    check.problems += [
        f"container {container}: {problem}"
        for problem in container_config_problems(image.get("Config"), attrs.get("Config"), user)
    ]
    return check
