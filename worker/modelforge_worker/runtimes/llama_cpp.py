"""The ``llama.cpp`` runtime: llama.cpp's own ``llama-server`` as a child process.

It loads one GGUF of the replicated model directory, listens on 127.0.0.1 only, serves the
deployment's name (``--alias``), and sees exactly the lease's GPUs through
``CUDA_VISIBLE_DEVICES`` (set to nothing on a server without GPUs, so a CUDA build never
takes them all). The child dies with the worker (``PR_SET_PDEATHSIG``): nothing would track
it otherwise, so ``find`` never adopts one.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from modelforge_contract.deployments import (
    ROLE_HELPER,
    ROLE_MAIN,
    RUNTIME_LAUNCH_FAILED,
    SPLIT_OUTPUT_ON_MAIN,
    SPLIT_RESERVED_ARGS,
    reserved_arg,
)

from . import LaunchFailed, ServeSpec, gguf_header

LOG_LINES = 200
RPC_SERVER = "ggml-rpc-server"
_PR_SET_PDEATHSIG = 1


def find_binary(configured: str | None) -> Path | None:
    """MODELFORGE_WORKER_LLAMA_SERVER, else ``llama-server`` on PATH."""
    if configured:
        path = Path(configured)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which("llama-server")
    return Path(found) if found else None


def find_rpc_binary(configured: str | None, llama_server: str | None) -> Path | None:
    """MODELFORGE_WORKER_LLAMA_RPC_SERVER, else ``ggml-rpc-server`` beside the llama-server
    this worker runs (scripts/llama-server-build puts them together), else on PATH."""
    if configured:
        path = Path(configured)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    main = find_binary(llama_server)
    if main is not None:
        beside = main.parent / RPC_SERVER
        if beside.is_file() and os.access(beside, os.X_OK):
            return beside
    found = shutil.which(RPC_SERVER)
    return Path(found) if found else None


def unavailable(configured: str | None) -> str | None:
    """Why this worker cannot run llama.cpp (None: it can)."""
    if find_binary(configured) is not None:
        return None
    if configured:
        return f"MODELFORGE_WORKER_LLAMA_SERVER={configured} is not an executable file"
    return "no llama-server on PATH (set MODELFORGE_WORKER_LLAMA_SERVER)"


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class _Spawner:
    """Starts every runtime from one thread that lives as long as the worker: the kernel's
    "parent death" is the death of the *thread* that forked, and a request's thread ends
    as soon as it has answered."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[list[str], dict[str, Any], list[Any], threading.Event]]
        self._jobs = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            argv, options, box, done = self._jobs.get()
            try:
                box.append(subprocess.Popen(argv, **options))
            except OSError as exc:
                box.append(exc)
            done.set()

    def popen(self, argv: list[str], **options: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spawner", daemon=True)
                self._thread.start()
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((argv, options, box, done))
        done.wait()
        if isinstance(box[0], OSError):
            raise box[0]
        return box[0]


_SPAWNER = _Spawner()


def helper_command(binary: Path, spec: ServeSpec) -> list[str]:
    """A split deployment's helper: ggml-rpc-server on 127.0.0.1 only (its agent carries the
    main node's connections to it over the tunnels), with a tensor cache when it has one."""
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(spec.port)]
    if spec.cache_dir is not None:
        argv.append("--cache")
    return [*argv, *spec.args]


def split_placement(spec: ServeSpec, layers: int | None) -> tuple[int, list[float]]:
    """A split's main server: how many layers go to devices (``--n-gpu-layers``) and the
    devices' shares (``--tensor-split``). llama.cpp puts the RPC devices first, then this
    node's GPUs; on a CPU node the layers this node keeps stay before the offloaded ones
    (the first ``n + 1 - ngl`` of n, the output counting as one more)."""
    shares = list(spec.tensor_split) or [0.0] + [1.0] * len(spec.rpc)
    mine, helpers = shares[0], shares[1 : 1 + len(spec.rpc)]
    helpers += [helpers[-1] if helpers else 1.0] * (len(spec.rpc) - len(helpers))
    if spec.gpus:
        return 999, [*helpers, *([mine / len(spec.gpus)] * len(spec.gpus))]
    if layers is None:
        return 999, helpers
    total = mine + sum(helpers)
    kept = round(layers * mine / total) if total > 0 else 0
    kept = min(max(kept, 0), layers - 1)  # at least one layer on the helpers
    return layers + 1 - kept, helpers


def command(binary: Path, spec: ServeSpec, layers: int | None = None) -> list[str]:
    assert spec.model_file is not None
    argv = [
        str(binary),
        "--model",
        str(spec.model_dir / spec.model_file),
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--alias",
        spec.served_name,
    ]
    if spec.context_length:
        argv += ["--ctx-size", str(spec.context_length)]
    if spec.role == ROLE_MAIN:
        offloaded, tensor_split = split_placement(spec, layers)
        argv += ["--rpc", ",".join(spec.rpc), "--n-gpu-layers", str(offloaded)]
        argv += ["--tensor-split", ",".join(f"{share:g}" for share in tensor_split)]
        # The output layer on this node; no prompt cache (it copies the KV state back and
        # forth over the helpers' round trips).
        argv += ["--override-tensor", SPLIT_OUTPUT_ON_MAIN, "--cache-ram", "0"]
    elif spec.gpus and not any(a.split("=")[0] in ("-ngl", "--n-gpu-layers") for a in spec.args):
        argv += ["--n-gpu-layers", "999"]  # every layer on the lease's GPUs
    return [*argv, *spec.args]


class LlamaServer:
    """One running ``llama-server``."""

    def __init__(self, spec: ServeSpec, process: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.process = process
        self.started_at = time.time()
        self._lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._reader = threading.Thread(target=self._read, name=f"log-{spec.server_id}",
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def exit_reason(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"was killed by signal {-code} ({name})"
        return f"exited with status {code}"

    def log_tail(self) -> str:
        return "\n".join(self._lines)

    def ident(self) -> dict[str, object]:
        return {"pid": self.process.pid}

    def stop(self, timeout: float) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(1.0)


def launch(binary: Path, spec: ServeSpec) -> LlamaServer:
    """llama-server, or for a split deployment's helper ggml-rpc-server (``binary`` is then
    that one)."""
    reserved = reserved_arg(spec.args)
    if reserved is None and spec.role == ROLE_MAIN:
        reserved = reserved_arg(spec.args, SPLIT_RESERVED_ARGS)
    if reserved is not None:
        raise LaunchFailed(
            RUNTIME_LAUNCH_FAILED, f"the argument {reserved} is set by the worker itself"
        )
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("MODELFORGE_", "LLAMA_ARG_", "LLAMA_CACHE", "GGML_RPC"))
    }  # nothing of ours, no overrides
    # Exactly the lease's GPUs; none at all for a server without any (never "all").
    env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
    if spec.role == ROLE_HELPER:
        argv, cwd = helper_command(binary, spec), "/"
        if spec.cache_dir is not None:
            env["LLAMA_CACHE"] = str(spec.cache_dir)  # the tensor cache: <it>/rpc
    else:
        if spec.model_file is None:
            raise LaunchFailed(RUNTIME_LAUNCH_FAILED, "llama.cpp needs the GGUF file to load")
        if spec.role == ROLE_MAIN and not spec.rpc:
            raise LaunchFailed(RUNTIME_LAUNCH_FAILED, "a split's main server needs its helpers")
        model = spec.model_dir / spec.model_file
        if not model.is_file():
            raise LaunchFailed(
                RUNTIME_LAUNCH_FAILED, f"the model file {spec.model_file} is missing"
            )
        layers = None
        if spec.role == ROLE_MAIN and not spec.gpus:
            try:
                layers = gguf_header.layer_count(model)
            except (OSError, gguf_header.GgufError) as exc:
                raise LaunchFailed(RUNTIME_LAUNCH_FAILED, f"cannot split it: {exc}") from None
        argv, cwd = command(binary, spec, layers), str(spec.model_dir)
    try:
        process = _SPAWNER.popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, async-signal-safe
            close_fds=True,
        )
    except OSError as exc:
        raise LaunchFailed(
            RUNTIME_LAUNCH_FAILED, f"{binary.name} could not start ({exc.strerror or exc})"
        ) from None
    return LlamaServer(spec, process)
