"""Model runtimes the worker's ``serve`` capability launches (docs/deployments.md).

Each runtime module offers ``available() -> str | None`` (None when it can run here, else
why not), ``launch(spec) -> Launched`` and ``find(server_id) -> Launched | None`` (a
runtime still running from before a worker restart, when the runtime can outlive one: a
container can, a child process cannot). A ``Launched`` says whether it still runs and how
it ended, and stops. Every launch binds the runtime to 127.0.0.1 only, at ``spec.port``,
serves the model as ``spec.served_name``, and gets exactly ``spec.gpus`` (UUIDs; none on a
CPU node) — never "all GPUs".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ServeSpec:
    server_id: str
    runtime: str
    served_name: str  # the deployment's name: --alias / --served-model-name
    model_dir: Path  # the replicated model directory, read-only to the runtime
    model_file: str | None  # relative to model_dir: the GGUF for llama.cpp
    gpus: tuple[str, ...]  # GPU UUIDs from the serve lease
    port: int  # on 127.0.0.1
    context_length: int | None
    args: tuple[str, ...]
    image_id: str | None  # vllm: the image, pinned by id, never pulled
    accelerator_mode: str  # nvidia or cpu
    # A model split across nodes (docs/deployments.md): "main" runs llama-server with the
    # helpers' endpoints (their agents' loopback listeners) in ``rpc`` and the layer shares
    # in ``tensor_split``; "helper" runs ggml-rpc-server, with its tensor cache in
    # ``cache_dir``. None: one whole server.
    role: str | None = None
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    cache_dir: Path | None = None


class LaunchFailed(Exception):
    """The runtime could not be started; the message says why (no secret, no body)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Launched(Protocol):
    spec: ServeSpec
    started_at: float  # time.time() of the launch

    def exit_reason(self) -> str | None:
        """None while it runs; else how it ended ("exited with status 1", "killed by
        signal 9")."""

    def log_tail(self) -> str:
        """The last lines the runtime wrote (bounded)."""

    def ident(self) -> dict[str, object]:
        """What identifies it on this node: {"pid": …} or {"container_id": …}."""

    def stop(self, timeout: float) -> None:
        """SIGTERM (docker stop), then SIGKILL after ``timeout``; removes what it made."""
