"""The ``vllm`` runtime: vLLM's OpenAI server in a container, from an image the administrator
loaded on the node, pinned by id and never pulled.

The container runs ``--model /model --served-model-name <name> --host 127.0.0.1 --port
<port>`` (and ``--max-model-len`` for a context length, then the deployment's own
arguments) on the host's network, so it listens on the node's loopback only. The replicated
model directory is mounted read-only at ``/model``; the container gets exactly the lease's
GPUs (``DeviceRequest(device_ids=[…])``, none on a CPU node, never "all"); it is fenced as
``container`` items are where that fits a server (every capability dropped,
no-new-privileges, a read-only root with a tmpfs on /tmp, a pids limit, a capped log) and
runs as the owner of the model directory, offline (no hub download). It is labelled with its
server id, so a worker started again finds it (``find``, ``running``) instead of starting a
second one: a container outlives the worker that started it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from modelforge_contract import IMAGE_ID_MISMATCH, IMAGE_NOT_FOUND, deployments
from modelforge_contract import containers as fence
from modelforge_contract.deployments import RUNTIME_LAUNCH_FAILED, RUNTIME_VLLM

from ..capabilities import clean_log, remove_container, remove_labelled
from . import LaunchFailed, ServeSpec

log = logging.getLogger(__name__)

LABEL_SERVER_ID = "modelforge.server_id"
LABEL_SPEC = "modelforge.spec"  # the ServeSpec as JSON, for a worker that adopts it
MODEL_MOUNT = "/model"
LOG_LINES = 200
PIDS_LIMIT = 4096
TMP_BYTES = 4 * 2**30  # torch and triton caches (HOME is /tmp); pages count as memory
SHM_BYTES = 8 * 2**30  # /dev/shm for the workers of a tensor-parallel server
LOG_BYTES = 16 * 2**20
# Arguments the worker sets itself (the control plane refuses the contract's at deploy; these
# are checked again here, with vLLM's own spellings): an extra argument may not move the
# address, the port, the served name or the model, nor put a key or TLS in front of the
# agent's readiness poll.
RESERVED_ARGS = deployments.RESERVED_ARGS | frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--uds",
        "--api-key",
        "--ssl-keyfile",
        "--ssl-certfile",
        "--download-dir",
    }
)
# Offline: a tokenizer or config named by hub id must not be fetched at launch.
ENVIRONMENT = {
    "HOME": fence.TMP_PATH,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_NAME_SAFE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,100}")


def _docker() -> Any:
    import docker

    return docker.from_env(timeout=60)


def available() -> str | None:
    """None when this worker can launch vLLM containers (the docker SDK and an answering
    dockerd), else why not."""
    try:
        import docker  # noqa: F401 - only whether it is there
    except ImportError:
        return "the docker SDK is not installed"
    try:
        client = _docker()
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        return f"dockerd does not answer ({type(exc).__name__})"
    return None


def reserved_arg(args: tuple[str, ...]) -> str | None:
    """The first argument the worker sets itself (``--port``, ``--host=…``, ``--api_key``), or
    None: the contract's check with vLLM's own spellings added."""
    return deployments.reserved_arg(args, RESERVED_ARGS)


def command(spec: ServeSpec) -> list[str]:
    argv = [
        "--model",
        MODEL_MOUNT,
        "--served-model-name",
        spec.served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
    ]
    if spec.context_length:
        argv += ["--max-model-len", str(spec.context_length)]
    return [*argv, *spec.args]


def container_name(server_id: str) -> str:
    safe = server_id if _NAME_SAFE.fullmatch(server_id) else hashlib.sha256(server_id.encode())
    if not isinstance(safe, str):
        safe = safe.hexdigest()[:32]
    return f"modelforge-server-{safe}"


def _spec_label(spec: ServeSpec) -> str:
    return json.dumps(
        {
            "server_id": spec.server_id,
            "served_name": spec.served_name,
            "model_dir": str(spec.model_dir),
            "model_file": spec.model_file,
            "gpus": list(spec.gpus),
            "port": spec.port,
            "context_length": spec.context_length,
            "args": list(spec.args),
            "image_id": spec.image_id,
            "accelerator_mode": spec.accelerator_mode,
        },
        sort_keys=True,
    )


def _spec_of(labels: dict[str, str]) -> ServeSpec | None:
    try:
        given = json.loads(labels.get(LABEL_SPEC) or "")
        return ServeSpec(
            server_id=str(given["server_id"]),
            runtime=RUNTIME_VLLM,
            served_name=str(given["served_name"]),
            model_dir=Path(given["model_dir"]),
            model_file=given.get("model_file"),
            gpus=tuple(given.get("gpus") or ()),
            port=int(given["port"]),
            context_length=given.get("context_length"),
            args=tuple(given.get("args") or ()),
            image_id=given.get("image_id"),
            accelerator_mode=str(given.get("accelerator_mode") or "cpu"),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _pinned_image(client: Any, image_id: str | None) -> Any:
    from docker.errors import ImageNotFound

    if not isinstance(image_id, str) or not _IMAGE_ID.fullmatch(image_id):
        raise LaunchFailed(
            IMAGE_NOT_FOUND,
            "a vllm deployment names its image by id (settings.image_id, sha256:<64 hex>): "
            "the worker never pulls",
        )
    try:
        image = client.images.get(image_id)
    except ImageNotFound:
        raise LaunchFailed(
            IMAGE_NOT_FOUND,
            f"image {image_id} is not on this node; load it (docker load) first: the worker "
            "never pulls",
        ) from None
    if image.id != image_id:
        raise LaunchFailed(
            IMAGE_ID_MISMATCH,
            f"image {image_id} resolves to {image.id} on this node; refusing to run",
        )
    return image


def _owner(path: Path) -> str:
    """``uid:gid`` of the model directory: the runtime reads the files as their owner, with
    no capability (so not as a root that could read anything)."""
    stat = os.stat(path)
    return f"{stat.st_uid}:{stat.st_gid}"


def _create_arguments(spec: ServeSpec) -> dict[str, Any]:
    from docker.types import DeviceRequest, LogConfig

    devices = []
    if spec.gpus:
        devices = [DeviceRequest(device_ids=list(spec.gpus), capabilities=[["gpu"]])]
    return {
        "command": command(spec),
        "name": container_name(spec.server_id),
        "labels": {LABEL_SERVER_ID: spec.server_id, LABEL_SPEC: _spec_label(spec)},
        "environment": dict(ENVIRONMENT),
        "detach": True,
        "network_mode": "host",  # --host 127.0.0.1: the node's loopback, nothing else
        "volumes": {str(spec.model_dir): {"bind": MODEL_MOUNT, "mode": "ro"}},
        "user": _owner(spec.model_dir),
        "read_only": True,
        "tmpfs": {fence.TMP_PATH: f"rw,nosuid,nodev,size={TMP_BYTES},mode=1777"},
        "shm_size": SHM_BYTES,
        "pids_limit": PIDS_LIMIT,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "privileged": False,
        "ipc_mode": "private",
        "log_config": LogConfig(
            type="json-file", config={"max-size": str(LOG_BYTES // 2), "max-file": "2"}
        ),
        "device_requests": devices,
    }


def launch(spec: ServeSpec) -> VllmServer:
    """Start the server's container; LaunchFailed (IMAGE_NOT_FOUND, IMAGE_ID_MISMATCH,
    RUNTIME_LAUNCH_FAILED) with nothing left running when it cannot."""
    from docker.errors import APIError

    if spec.gpus and spec.accelerator_mode != "nvidia":
        raise LaunchFailed(
            "GPUS_ON_CPU_NODE",
            f"the server was given {len(spec.gpus)} GPU(s) but this worker runs in "
            f"{spec.accelerator_mode} mode; refusing rather than running without them",
        )
    reserved = reserved_arg(spec.args)
    if reserved is not None:
        raise LaunchFailed(
            RUNTIME_LAUNCH_FAILED, f"the argument {reserved} is set by the worker itself"
        )
    if not spec.model_dir.is_dir():
        raise LaunchFailed(RUNTIME_LAUNCH_FAILED, f"the model directory {spec.model_dir} is gone")
    try:
        client = _docker()
        client.ping()
    except Exception as exc:  # the SDK raises several unrelated types for "no daemon"
        raise LaunchFailed(
            RUNTIME_LAUNCH_FAILED, f"dockerd does not answer ({type(exc).__name__})"
        ) from None
    try:
        image = _pinned_image(client, spec.image_id)
        # One container per server id: what an ended run of it left goes first.
        remove_labelled(client, f"{LABEL_SERVER_ID}={spec.server_id}")
        try:
            container = client.containers.create(image.id, **_create_arguments(spec))
        except APIError as exc:
            raise LaunchFailed(
                RUNTIME_LAUNCH_FAILED,
                f"dockerd could not create the container: {str(exc.explanation or exc)[:500]}",
            ) from None
        try:
            container.start()
        except APIError as exc:
            # e.g. 'could not select device driver "" with capabilities: [[gpu]]' on a node
            # without the NVIDIA container runtime.
            remove_container(container)
            raise LaunchFailed(
                RUNTIME_LAUNCH_FAILED,
                f"dockerd could not start the container: {str(exc.explanation or exc)[:500]}",
            ) from None
        return VllmServer(spec, container.id, time.time())
    finally:
        client.close()


def _started_at(attrs: dict[str, Any]) -> float:
    stamp = (attrs.get("State") or {}).get("StartedAt") or ""
    try:  # RFC 3339 with nanoseconds: keep the microseconds Python reads
        head, _, rest = stamp.partition(".")
        fraction = "".join(c for c in rest if c.isdigit())[:6]
        moment = datetime.datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00")
        return moment.timestamp()
    except ValueError:
        return time.time()


def _adopted(attrs: dict[str, Any]) -> VllmServer | None:
    spec = _spec_of((attrs.get("Config") or {}).get("Labels") or {})
    if spec is None:
        return None
    return VllmServer(spec, attrs["Id"], _started_at(attrs))


def running() -> list[VllmServer]:
    """Every vLLM container of this node's servers still running (from before a restart)."""
    client = _docker()
    try:
        found = client.containers.list(
            ignore_removed=True, filters={"label": LABEL_SERVER_ID, "status": "running"}
        )
        servers = [_adopted(container.attrs) for container in found]
        return [server for server in servers if server is not None]
    finally:
        client.close()


def find(server_id: str) -> VllmServer | None:
    """The running container of ``server_id``, adopted (None when there is none)."""
    return next((s for s in running() if s.spec.server_id == server_id), None)


class VllmServer:
    """One vLLM container; every answer is read from dockerd."""

    def __init__(self, spec: ServeSpec, container_id: str, started_at: float) -> None:
        self.spec = spec
        self.container_id = container_id
        self.started_at = started_at
        self._ended: str | None = None

    def _inspect(self) -> dict[str, Any] | None:
        from docker.errors import NotFound

        client = _docker()
        try:
            return client.api.inspect_container(self.container_id)
        except NotFound:
            return None
        finally:
            client.close()

    def exit_reason(self) -> str | None:
        if self._ended is not None:
            return self._ended
        attrs = self._inspect()
        if attrs is None:
            return "removed"
        state = attrs.get("State") or {}
        if state.get("Running") or state.get("Status") in ("created", "restarting"):
            return None
        if state.get("OOMKilled"):
            return "killed (out of memory)"
        code = state.get("ExitCode")
        if code == 137:  # SIGKILL: docker kill, or the kernel
            return "killed"
        return f"exited with status {code}"

    def log_tail(self) -> str:
        from docker.errors import NotFound

        client = _docker()
        try:
            raw = client.api.logs(self.container_id, stdout=True, stderr=True, tail=LOG_LINES)
        except NotFound:
            return ""
        finally:
            client.close()
        return clean_log(raw.decode("utf-8", "replace"))

    def ident(self) -> dict[str, object]:
        return {"container_id": self.container_id}

    def stop(self, timeout: float) -> None:
        """docker stop (SIGTERM, SIGKILL after ``timeout``), then remove the container."""
        from docker.errors import APIError, NotFound

        before = self.exit_reason()
        client = _docker()
        try:
            try:
                client.api.stop(self.container_id, timeout=max(1, math.ceil(timeout)))
            except NotFound:
                pass
            except APIError as exc:
                log.warning("docker stop %s: %s", self.container_id[:12], exc.explanation)
            self._ended = before or self.exit_reason()
            with contextlib.suppress(NotFound):
                client.api.remove_container(self.container_id, force=True)
        finally:
            client.close()
