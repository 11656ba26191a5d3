"""The ``serve`` capability: the model runtimes this worker runs for its agent.

The worker owns them, so an agent restart finds them again (``GET /v1/servers``) instead of
starting duplicates: ``POST /v1/servers`` launches one (the same ``server_id`` again answers
the one already running), ``POST /v1/servers/stop`` stops one. The agent checks readiness
itself; the worker only starts, watches and stops (docs/deployments.md).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

from modelforge_contract.deployments import (
    ROLE_HELPER,
    ROLES,
    RUNTIME_LAUNCH_FAILED,
    RUNTIME_LLAMA_CPP,
    RUNTIME_LLAMA_CPP_RPC,
    RUNTIME_VLLM,
)
from modelforge_contract.models import ManifestError, check_relative_path

from .capabilities import clean_log
from .runtimes import Launched, LaunchFailed, ServeSpec, llama_cpp

log = logging.getLogger(__name__)

STOP_SECONDS = 20.0
LOG_TAIL_CHARS = 4000
_ID_CHARS = set("0123456789abcdefghijklmnopqrstuvwxyz-_")
_LOOPBACK_ENDPOINT = re.compile(r"127\.0\.0\.1:[1-9][0-9]{0,4}")


def free_port() -> int:
    """A loopback port nothing listens on now (the runtime binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class BadRequest(Exception):
    """The agent's request is malformed; the message names the field."""


def spec_from(body: dict[str, Any], accelerator_mode: str, port: int) -> ServeSpec:
    """The launch request checked field by field (the agent is trusted, its input less so)."""
    server_id = body.get("server_id")
    if not isinstance(server_id, str) or not 0 < len(server_id) <= 64 or set(server_id) - _ID_CHARS:
        raise BadRequest("server_id must be an id")
    runtime = body.get("runtime")
    if runtime not in (RUNTIME_LLAMA_CPP, RUNTIME_VLLM):
        raise BadRequest("runtime must be llama.cpp or vllm")
    name = body.get("served_name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise BadRequest("served_name must be the deployment's name")
    role = body.get("role")
    if role is not None and (runtime != RUNTIME_LLAMA_CPP or role not in ROLES):
        raise BadRequest("role must be main or helper, for llama.cpp")
    model_dir = body.get("model_dir")
    if role == ROLE_HELPER and model_dir is None:
        model_dir = "/"  # a helper loads no file: the main node sends it its tensors
    if not isinstance(model_dir, str) or not Path(model_dir).is_absolute():
        raise BadRequest("model_dir must be an absolute path")
    rpc = body.get("rpc") or []
    if not isinstance(rpc, list) or not all(
        isinstance(e, str) and _LOOPBACK_ENDPOINT.fullmatch(e) for e in rpc
    ):
        raise BadRequest("rpc must be a list of 127.0.0.1:<port> endpoints")
    tensor_split = body.get("tensor_split") or []
    if not isinstance(tensor_split, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= 1e6
        for x in tensor_split
    ):
        raise BadRequest("tensor_split must be a list of non-negative numbers")
    cache_dir = body.get("cache_dir")
    if cache_dir is not None and (
        not isinstance(cache_dir, str) or not Path(cache_dir).is_absolute()
    ):
        raise BadRequest("cache_dir must be an absolute path")
    if cache_dir is not None and not os.access(cache_dir, os.W_OK | os.X_OK):
        log.warning("server %s: cannot write its tensor cache %s; running without one",
                    server_id, cache_dir)  # fmt: skip
        cache_dir = None
    model_file = body.get("model_file")
    if model_file is not None:
        try:
            check_relative_path(model_file)
        except ManifestError as exc:
            raise BadRequest(f"model_file: {exc}") from None
    gpus = body.get("gpus") or []
    if not isinstance(gpus, list) or not all(isinstance(g, str) and 0 < len(g) <= 96 for g in gpus):
        raise BadRequest("gpus must be a list of GPU UUIDs")
    if gpus and accelerator_mode != "nvidia":
        raise LaunchFailed(
            "GPUS_ON_CPU_NODE",
            f"the server was given {len(gpus)} GPU(s) but this worker runs in "
            f"{accelerator_mode} mode; refusing rather than running without them",
        )
    context_length = body.get("context_length")
    if context_length is not None and (
        isinstance(context_length, bool) or not isinstance(context_length, int)
    ):
        raise BadRequest("context_length must be a whole number")
    args = body.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise BadRequest("args must be a list of strings")
    image_id = body.get("image_id")
    if image_id is not None and not isinstance(image_id, str):
        raise BadRequest("image_id must be a string")
    return ServeSpec(
        server_id=server_id,
        runtime=runtime,
        served_name=name,
        model_dir=Path(model_dir),
        model_file=model_file,
        gpus=tuple(gpus),
        port=port,
        context_length=context_length,
        args=tuple(args),
        image_id=image_id,
        accelerator_mode=accelerator_mode,
        role=role,
        rpc=tuple(rpc),
        tensor_split=tuple(float(x) for x in tensor_split),
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
    )


def view(launched: Launched) -> dict[str, Any]:
    spec = launched.spec
    return {
        "server_id": spec.server_id,
        "runtime": spec.runtime,
        "served_name": spec.served_name,
        "port": spec.port,
        "role": spec.role,
        "gpus": list(spec.gpus),
        "ident": launched.ident(),
        "started_at": launched.started_at,
        "exit": launched.exit_reason(),
        "log_tail": clean_log(launched.log_tail())[-LOG_TAIL_CHARS:],
    }


class Servers:
    """The runtimes this worker runs, by server id."""

    def __init__(
        self, accelerator_mode: str, llama_server: str | None, llama_rpc_server: str | None = None
    ) -> None:
        self.accelerator_mode = accelerator_mode
        self.llama_server = llama_server
        self.llama_rpc_server = llama_rpc_server
        self._by_id: dict[str, Launched] = {}
        self._lock = threading.Lock()
        self._adopted = False

    def runtimes(self) -> list[str]:
        """The runtimes this worker can launch now."""
        offered = []
        if llama_cpp.unavailable(self.llama_server) is None:
            offered.append(RUNTIME_LLAMA_CPP)
        if _vllm_unavailable() is None:
            offered.append(RUNTIME_VLLM)
        if llama_cpp.find_rpc_binary(self.llama_rpc_server, self.llama_server) is not None:
            offered.append(RUNTIME_LLAMA_CPP_RPC)  # can be a split deployment's helper
        return offered

    def _adopt(self) -> None:
        """Once: containers a previous worker started (child processes die with it)."""
        if self._adopted:
            return
        self._adopted = True
        if _vllm_unavailable() is not None:
            return
        from .runtimes import vllm

        try:
            for launched in vllm.running():
                self._by_id.setdefault(launched.spec.server_id, launched)
        except Exception as exc:  # dockerd went away: nothing to adopt
            log.warning("could not look for running vllm servers: %s", type(exc).__name__)

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            self._adopt()
            running = list(self._by_id.values())
        return [view(s) for s in running]

    def launch(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start the server (or answer the one running under that id)."""
        with self._lock:
            self._adopt()
            existing = self._by_id.get(str(body.get("server_id")))
            if existing is not None and existing.exit_reason() is None:
                return view(existing)
            spec = spec_from(body, self.accelerator_mode, free_port())
            if existing is not None:
                existing.stop(STOP_SECONDS)  # ended: removed before the new one
            if spec.role == ROLE_HELPER:
                binary = llama_cpp.find_rpc_binary(self.llama_rpc_server, self.llama_server)
                if binary is None:
                    raise LaunchFailed(
                        RUNTIME_LAUNCH_FAILED,
                        "no ggml-rpc-server here: this node cannot be a split's helper "
                        "(set MODELFORGE_WORKER_LLAMA_RPC_SERVER)",
                    )
                launched: Launched = llama_cpp.launch(binary, spec)
            elif spec.runtime == RUNTIME_LLAMA_CPP:
                binary = llama_cpp.find_binary(self.llama_server)
                if binary is None:
                    raise LaunchFailed(
                        RUNTIME_LAUNCH_FAILED, llama_cpp.unavailable(self.llama_server) or ""
                    )
                launched = llama_cpp.launch(binary, spec)
            else:
                problem = _vllm_unavailable()
                if problem is not None:
                    raise LaunchFailed(RUNTIME_LAUNCH_FAILED, problem)
                from .runtimes import vllm

                launched = vllm.launch(spec)
            self._by_id[spec.server_id] = launched
        log.info(
            "server %s launched: %s as %s on 127.0.0.1:%d with %d GPU(s)",
            spec.server_id,
            spec.runtime,
            spec.served_name,
            spec.port,
            len(spec.gpus),
        )
        return view(launched)

    def stop(self, server_id: str) -> bool:
        with self._lock:
            self._adopt()
            launched = self._by_id.pop(server_id, None)
        if launched is None:
            return False
        launched.stop(STOP_SECONDS)
        log.info("server %s stopped (%s)", server_id, launched.exit_reason() or "stopped")
        return True

    def stop_all(self) -> int:
        with self._lock:
            running, self._by_id = list(self._by_id.values()), {}
        for launched in running:
            launched.stop(STOP_SECONDS)
        return len(running)


def _vllm_unavailable() -> str | None:
    try:
        from .runtimes import vllm
    except ImportError:
        return "this worker has no vllm runtime"
    return vllm.available()
