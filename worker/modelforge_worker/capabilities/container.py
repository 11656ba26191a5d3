"""``container``: run a local image, pinned by id, fenced; never pull, never leave it.

The image is named by tag and must resolve to the pinned ``image_id``; the container is
created from that id, so a tag moved in between cannot swap what runs. Fenced by default
(modelforge_contract.containers has the defaults and docker's floors): no network unless the
item asks for it, a memory limit (swap only as asked), a CPU quota, a pids limit, a read-only
root with a small tmpfs on /tmp, a capped json-file log, a non-root user, every capability
dropped but the ones the item names, no-new-privileges. The item's timeout and a cancel are
enforced by a kill; GPUs by UUID, never "all": the container gets exactly the devices its
lease names (``DeviceRequest(device_ids=[…])``), an item asking GPUs on a CPU-mode worker
fails ``GPUS_ON_CPU_NODE``, and a count without UUIDs (an older control plane) fails closed;
its output is kept as the log tail, and the container is removed afterwards whatever
happened.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from typing import Any

from modelforge_contract import (
    CONTAINER_FAILED,
    GPUS_ON_CPU_NODE,
    IMAGE_ID_MISMATCH,
    IMAGE_NOT_FOUND,
    WORK_INPUT_INVALID,
    WORK_TIMED_OUT,
)
from modelforge_contract import containers as fence
from modelforge_contract.deployments import GPUS_UNAVAILABLE

from . import (
    CapabilityFailure,
    Outcome,
    RunContext,
    cancelled_failure,
    clean_log,
    remove_container,
    remove_labelled,
    succeeded,
)

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BYTES = fence.MEMORY_DEFAULT_BYTES
LOG_LINES = 400
LABEL_WORK_ID = "org.modelforge.work-id"
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_NAME_SAFE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,110}")
KNOWN_FIELDS = frozenset(
    {
        "image",
        "image_id",
        "command",
        "env",
        "network",
        "memory_bytes",
        "swap_bytes",
        "cpus",
        "pids_limit",
        "tmp_bytes",
        "log_bytes",
        "run_as_root",
        "capabilities",
        "gpus",
    }
)


def _whole(given: dict[str, Any], name: str, default: int, low: int) -> tuple[int, str | None]:
    value = given.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return default, f"{name} must be a whole number of at least {low}"
    return value, None


def _checked_input(given: dict[str, Any]) -> dict[str, Any]:
    """The input with every default filled in, or WORK_INPUT_INVALID naming each problem:
    whatever dockerd would refuse is refused here, before it is asked."""
    problems = [f"unknown field {name}" for name in sorted(set(given) - KNOWN_FIELDS)]
    image = given.get("image")
    if not isinstance(image, str) or fence.image_reference_problem(image):
        problems.append("image must be a tag such as name:1.0")
    if not isinstance(given.get("image_id"), str) or not _IMAGE_ID.fullmatch(given["image_id"]):
        problems.append("image_id must be sha256:<64 hex digits>")
    command = given.get("command")
    if command is not None and not (
        isinstance(command, list)
        and all(isinstance(part, str) and "\x00" not in part for part in command)
    ):
        problems.append("command must be a list of strings without NUL")
    env = given.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str)
        and fence.ENV_NAME.fullmatch(k)
        and isinstance(v, str)
        and fence.env_value_problem(v) is None
        for k, v in env.items()
    ):
        problems.append("env must map NAME to a string without NUL")
    spec: dict[str, Any] = {}
    for name, default, low in (
        ("memory_bytes", fence.MEMORY_DEFAULT_BYTES, fence.MEMORY_MIN_BYTES),
        ("swap_bytes", fence.SWAP_DEFAULT_BYTES, 0),
        ("pids_limit", fence.PIDS_DEFAULT, fence.PIDS_MIN),
        ("tmp_bytes", fence.TMP_DEFAULT_BYTES, fence.TMP_MIN_BYTES),
        ("log_bytes", fence.LOG_DEFAULT_BYTES, fence.LOG_MIN_BYTES),
    ):
        spec[name], problem = _whole(given, name, default, low)
        problems += [problem] if problem else []
    cpus = given.get("cpus", fence.CPUS_DEFAULT)
    if (
        isinstance(cpus, bool)
        or not isinstance(cpus, int | float)
        or not math.isfinite(cpus)
        or cpus < fence.CPUS_MIN
    ):
        problems.append(f"cpus must be a number of at least {fence.CPUS_MIN}")
    if not isinstance(given.get("run_as_root", False), bool):
        problems.append("run_as_root must be true or false")
    capabilities = given.get("capabilities") or []
    if not isinstance(capabilities, list) or not all(
        c in fence.LINUX_CAPABILITIES for c in capabilities
    ):
        problems.append("capabilities must be a list of Linux capability names such as CHOWN")
    gpus = given.get("gpus")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        problems.append("gpus must be a whole number (0 for none)")
    if problems:
        raise CapabilityFailure(WORK_INPUT_INVALID, "; ".join(problems))
    return {
        **given,
        **spec,
        "env": env,
        "cpus": float(cpus),
        "run_as_root": given.get("run_as_root") is True,
        "capabilities": sorted(set(capabilities)),
        "network": given.get("network") is True,
    }


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


def gpu_devices(asked: int | None, context: RunContext) -> list[str]:
    """The GPU UUIDs the container gets: those its lease names (the first ``asked`` of them
    when the item names a count; none for 0), never "all GPUs"."""
    leased = list(context.gpus)
    if context.accelerator_mode != "nvidia":
        if (asked or 0) > 0 or (asked is None and leased):
            wanted = asked if asked else len(leased)
            raise CapabilityFailure(
                GPUS_ON_CPU_NODE,
                f"the item asks {wanted} GPU(s) but this runtime worker runs in cpu mode; "
                "it was not run without them (submit it without gpus, or place it on an "
                "NVIDIA node with a gpu_count constraint)",
            )
        return []
    if asked == 0:
        return []
    if asked is None:
        return leased
    if len(leased) < asked:
        raise CapabilityFailure(
            GPUS_UNAVAILABLE,
            f"the item asks {asked} GPU(s) but its lease names {len(leased)} by UUID (a "
            "control plane from before GPUs by UUID?); refusing rather than requesting every "
            "GPU: upgrade the control plane",
        )
    return leased[:asked]


def _device_requests(device_ids: list[str]) -> list[Any]:
    if not device_ids:
        return []
    from docker.types import DeviceRequest

    return [DeviceRequest(device_ids=list(device_ids), capabilities=[["gpu"]])]


def granted_gpus(attrs: dict[str, Any]) -> list[str]:
    """The GPU UUIDs dockerd holds for a container, from its inspection."""
    requests = (attrs.get("HostConfig") or {}).get("DeviceRequests") or []
    return [uuid for request in requests for uuid in request.get("DeviceIDs") or []]


def _host_config(spec: dict[str, Any], host_cpus: int) -> dict[str, Any]:
    """The fence as docker's create arguments (docs/work.md, "Limits")."""
    from docker.types import LogConfig

    # dockerd refuses a quota above the host's CPUs: a larger ask gets all of them.
    cpus = min(spec["cpus"], float(max(1, host_cpus)))
    return {
        "network_mode": "bridge" if spec["network"] else "none",
        "mem_limit": spec["memory_bytes"],
        "memswap_limit": spec["memory_bytes"] + spec["swap_bytes"],
        "nano_cpus": max(1, round(cpus * 1e9)),
        "pids_limit": spec["pids_limit"],
        "read_only": True,
        "tmpfs": {fence.TMP_PATH: f"rw,nosuid,nodev,size={spec['tmp_bytes']},mode=1777"},
        "log_config": LogConfig(
            type="json-file",
            config={
                "max-size": str(max(1, spec["log_bytes"] // fence.LOG_FILES)),
                "max-file": str(fence.LOG_FILES),
            },
        ),
        "user": "0:0" if spec["run_as_root"] else fence.NON_ROOT_USER,
        "cap_drop": ["ALL"],
        "cap_add": spec["capabilities"] or None,
        "security_opt": ["no-new-privileges:true"],
        "privileged": False,
        "ipc_mode": "private",
        "device_requests": _device_requests(spec["gpu_devices"]),
    }


def _container_name(work_id: str | None) -> str:
    """docker's name grammar; an id that does not fit it gets a random name (the label keeps
    the id)."""
    safe = work_id if work_id and _NAME_SAFE.fullmatch(work_id) else uuid.uuid4().hex
    return f"modelforge-work-{safe}"


def run(given: dict[str, Any], context: RunContext) -> Outcome:
    spec = _checked_input(given)
    spec["gpu_devices"] = gpu_devices(spec.get("gpus"), context)  # before dockerd is asked
    client = _client()
    try:
        image = _pinned_image(client, spec["image"], spec["image_id"])
        if context.cancelled:
            raise cancelled_failure()
        host = _host_config(spec, int(client.info().get("NCPU") or 1))
        container = client.containers.create(
            image.id,
            command=spec.get("command"),
            name=_container_name(context.work_id),
            environment=spec["env"],
            labels={LABEL_WORK_ID: context.work_id or ""},
            detach=True,
            **host,
        )
        spec["cpus_applied"] = host["nano_cpus"] / 1e9
        spec["gpus_granted"] = granted_gpus(container.attrs)  # dockerd's record of it
        try:
            return _run_to_end(container, spec, context)
        finally:
            remove_container(container)
    finally:
        client.close()


def cancel_leftovers(work_id: str) -> int:
    """Remove the containers labelled with ``work_id`` that no run of this worker holds (left
    by a worker that stopped mid-run); how many."""
    client = _client()
    try:
        return remove_labelled(client, f"{LABEL_WORK_ID}={work_id}")
    finally:
        client.close()


def _kill(container_id: str) -> None:
    from docker.errors import APIError

    client = _client()
    try:
        client.api.kill(container_id)
    except APIError as exc:
        if exc.status_code != 409:  # 409: it is not running (any more), nothing to stop
            raise
    finally:
        client.close()


def _run_to_end(container: Any, spec: dict[str, Any], context: RunContext) -> Outcome:
    import requests
    from docker.errors import APIError

    began = time.monotonic()
    # A cancel from now on kills the container; one that came before it started skips it.
    context.on_cancel(lambda: _kill(container.id))
    timed_out = False
    exit_code = None
    refused = None
    if not context.cancelled:
        try:
            container.start()
        except APIError as exc:
            if not context.cancelled:
                # e.g. 'could not select device driver "" with capabilities: [[gpu]]' on a
                # node without the NVIDIA container runtime.
                refused = str(exc.explanation or exc)[:500]
    if not context.cancelled and refused is None:
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
        "cancelled": context.cancelled,
        "network": spec["network"],
        "memory_bytes": spec["memory_bytes"],
        "swap_bytes": spec["swap_bytes"],
        "cpus": spec["cpus_applied"],
        "pids_limit": spec["pids_limit"],
        "tmp_bytes": spec["tmp_bytes"],
        "log_bytes": spec["log_bytes"],
        "user": "root" if spec["run_as_root"] else fence.NON_ROOT_USER,
        "capabilities": spec["capabilities"],
        "gpus_requested": bool(spec["gpus_granted"]),
        "gpus": spec["gpus_granted"],
        "seconds": round(time.monotonic() - began, 3),
    }
    if context.cancelled:
        raise cancelled_failure(result=result, log=log_tail)
    if refused is not None:
        raise CapabilityFailure(
            CONTAINER_FAILED,
            f"dockerd could not start the container: {refused}",
            result=result,
            log=log_tail,
        )
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
