"""``container``: run a local image, pinned by id, under limits; never pull, never leave it.

The image is named by tag and must resolve to the pinned ``image_id``; the container is
created from that id, so a tag moved in between cannot swap what runs. No network unless
the item asks for it, a memory limit (swap included), the item's timeout enforced by a
kill, GPUs requested on NVIDIA nodes, its output kept as the log tail, and the container
removed afterwards whatever happened.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from modelforge_contract import (
    CONTAINER_FAILED,
    IMAGE_ID_MISMATCH,
    IMAGE_NOT_FOUND,
    WORK_INPUT_INVALID,
    WORK_TIMED_OUT,
)

from . import CapabilityFailure, Outcome, RunContext, clean_log, succeeded

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = 512 * 2**20
LOG_LINES = 400
LABEL_WORK_ID = "org.modelforge.work-id"
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def _checked_input(given: dict[str, Any]) -> dict[str, Any]:
    problems = []
    known = {"image", "image_id", "command", "env", "network", "memory_bytes", "gpus"}
    problems += [f"unknown field {name}" for name in sorted(set(given) - known)]
    if not isinstance(given.get("image"), str) or not given.get("image"):
        problems.append("image must be a tag such as name:1.0")
    if not isinstance(given.get("image_id"), str) or not _IMAGE_ID.fullmatch(given["image_id"]):
        problems.append("image_id must be sha256:<64 hex digits>")
    command = given.get("command")
    if command is not None and not (
        isinstance(command, list) and all(isinstance(part, str) for part in command)
    ):
        problems.append("command must be a list of strings")
    env = given.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(v, str) and _ENV_NAME.fullmatch(k) for k, v in env.items()
    ):
        problems.append("env must map NAME to a string")
    memory = given.get("memory_bytes", DEFAULT_MEMORY_BYTES)
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 4 * 2**20:
        problems.append("memory_bytes must be a whole number of at least 4 MiB")
    gpus = given.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        problems.append("gpus must be a whole number (0 for none)")
    if problems:
        raise CapabilityFailure(WORK_INPUT_INVALID, "; ".join(problems))
    return {**given, "env": env, "memory_bytes": memory, "network": given.get("network") is True}


def _client() -> Any:
    import docker

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        raise CapabilityFailure(
            CONTAINER_FAILED, f"dockerd does not answer ({type(exc).__name__})"
        ) from None
    return client


def _pinned_image(client: Any, tag: str, image_id: str) -> Any:
    from docker.errors import ImageNotFound

    try:
        image = client.images.get(tag)
    except ImageNotFound:
        raise CapabilityFailure(
            IMAGE_NOT_FOUND,
            f"image {tag} is not on this node; load it (docker load) first: the worker never pulls",
        ) from None
    if image.id != image_id:
        raise CapabilityFailure(
            IMAGE_ID_MISMATCH,
            f"image {tag} is {image.id} on this node, not the pinned {image_id}; refusing to run",
        )
    return image


def _device_requests(context: RunContext, gpus: int | None) -> list[Any]:
    if context.accelerator_mode != "nvidia" or gpus == 0:
        return []
    from docker.types import DeviceRequest

    return [DeviceRequest(count=-1 if gpus is None else gpus, capabilities=[["gpu"]])]


def run(given: dict[str, Any], context: RunContext) -> Outcome:
    spec = _checked_input(given)
    client = _client()
    try:
        image = _pinned_image(client, spec["image"], spec["image_id"])
        name = f"modelforge-work-{context.work_id or uuid.uuid4().hex}"[:128]
        container = client.containers.create(
            image.id,
            command=spec.get("command"),
            name=name,
            environment=spec["env"],
            network_mode="bridge" if spec["network"] else "none",
            mem_limit=spec["memory_bytes"],
            memswap_limit=spec["memory_bytes"],
            labels={LABEL_WORK_ID: context.work_id or ""},
            device_requests=_device_requests(context, spec.get("gpus")),
            detach=True,
        )
        try:
            return _run_to_end(container, spec, context)
        finally:
            _remove(container)
    finally:
        client.close()


def _run_to_end(container: Any, spec: dict[str, Any], context: RunContext) -> Outcome:
    import requests

    began = time.monotonic()
    container.start()
    timed_out = False
    exit_code = None
    try:
        exit_code = container.wait(timeout=max(1.0, context.remaining()))["StatusCode"]
    except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
        timed_out = True
        container.kill()
        container.wait(timeout=30)
    output = container.logs(stdout=True, stderr=True, tail=LOG_LINES)
    log_tail = clean_log(output.decode("utf-8", "replace"))
    result = {
        "image": spec["image"],
        "image_id": spec["image_id"],
        "exit_code": exit_code,
        "timed_out": timed_out,
        "network": spec["network"],
        "memory_bytes": spec["memory_bytes"],
        "gpus_requested": bool(_device_requests(context, spec.get("gpus"))),
        "seconds": round(time.monotonic() - began, 3),
    }
    if timed_out:
        raise CapabilityFailure(
            WORK_TIMED_OUT,
            f"the container ran past its {context.timeout_seconds:g}s timeout and was killed",
            result=result,
            log=log_tail,
        )
    if exit_code != 0:
        raise CapabilityFailure(
            CONTAINER_FAILED, f"the container exited with {exit_code}", result=result, log=log_tail
        )
    return succeeded(result, log_tail)


def _remove(container: Any) -> None:
    try:
        container.remove(force=True)
    except Exception as exc:  # logged: a leftover container is named for the operator
        log.error("could not remove container %s: %s", container.name, type(exc).__name__)
