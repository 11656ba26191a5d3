"""``modelforge-runtime-worker``: HTTP on a unix socket the worker creates, never a port.

Only the local agent talks to it (docs/architecture.md §5): ``GET /v1/info`` says what this
worker is, ``POST /v1/run`` runs one capability to its end and answers its outcome, ``POST
/v1/cancel`` stops the runs of one work item (its container is killed). Every request
names its worker protocol (invariant 8); a run with a protocol this worker does not
accept is refused with 426 and the compatibility answer. Log lines name method, path,
status and the capability, never a body.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import click

from modelforge_contract import (
    COMPATIBLE,
    EXIT_OK,
    EXIT_USAGE,
    HEADER_WORKER_PROTOCOL,
    WORK_INPUT_INVALID,
    WORK_TIMEOUT_MAX_SECONDS,
    WORKER_ERROR,
    WORKER_PATH_CANCEL,
    WORKER_PATH_INFO,
    WORKER_PATH_RUN,
    WORKER_PROTOCOL_INCOMPATIBLE,
    WORKER_PROTOCOL_VERSION,
    worker_compatibility_of,
)
from modelforge_contract.deployments import (
    CAPABILITY_SERVE,
    WORKER_PATH_SERVER_STOP,
    WORKER_PATH_SERVERS,
)
from modelforge_contract.logs import configure_logging

from . import __version__
from .capabilities import CapabilityFailure, RunContext, failed, run_capability
from .runtimes import LaunchFailed
from .serving import BadRequest, Servers
from .settings import TABLE, ConfigError, WorkerSettings, load_settings

log = logging.getLogger("modelforge_worker")

MAX_REQUEST_BYTES = 2 * 2**20
STOP_RUNS_SECONDS = 20.0  # on SIGTERM, for cancelled runs to kill and remove their containers
SOCKET_MODE = 0o660
DOCKER_CHECK_SECONDS = 30


# What the caller (the node agent) should do when this worker refuses its protocol.
_CALLER_NEXT_STEPS = {
    "TOO_OLD": "Upgrade the node agent to a release that speaks worker protocol "
    f"{WORKER_PROTOCOL_VERSION}.",
    "TOO_NEW": "Upgrade the runtime worker to the release of the node agent.",
    "UNKNOWN": f"Send {HEADER_WORKER_PROTOCOL} with an integer worker protocol version; the "
    "node agent does so.",
}


GPUS_MAX = 64
_GPU_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")  # GPU-…, MIG-…; no comma


def gpu_uuids(value: object) -> tuple[str, ...] | None:
    """A run's ``gpus``: distinct GPU UUIDs (none when absent), or None when malformed."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > GPUS_MAX:
        return None
    if not all(isinstance(uuid, str) and _GPU_UUID.fullmatch(uuid) for uuid in value):
        return None
    if len(set(value)) != len(value):
        return None
    return tuple(value)


class SocketInUse(Exception):
    """Another worker already listens on the socket path, or the path is not a socket."""


def capabilities_offered(cache: dict[str, Any] | None = None) -> list[str]:
    """``smoke`` always; ``container`` while the docker SDK is installed and dockerd answers."""
    cache = cache if cache is not None else {}
    now = time.monotonic()
    if now - cache.get("checked", float("-inf")) > DOCKER_CHECK_SECONDS:
        cache["container"] = _docker_answers()
        cache["checked"] = now
    return ["smoke", "container"] if cache["container"] else ["smoke"]


def _docker_answers() -> bool:
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # the SDK raises several unrelated types for "no daemon"
        return False


class WorkerServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.docker_cache: dict[str, Any] = {}
        self.running = 0
        self.runs: dict[str, list[RunContext]] = {}  # by work id, while they run
        self.servers = Servers(
            settings.accelerator_mode, settings.llama_server, settings.llama_rpc_server
        )
        self.lock = threading.Lock()
        prepare_socket_path(settings.socket_path)
        # Created 0660 from the start: no moment where others could connect.
        previous = os.umask(0o117)
        try:
            super().__init__(str(settings.socket_path), Handler)
        finally:
            os.umask(previous)
        os.chmod(settings.socket_path, SOCKET_MODE)
        if settings.socket_group is not None:
            os.chown(settings.socket_path, -1, settings.socket_group)

    def info(self) -> dict[str, Any]:
        runtimes = self.servers.runtimes()
        capabilities = capabilities_offered(self.docker_cache)
        return {
            "worker_version": __version__,
            "protocol": WORKER_PROTOCOL_VERSION,
            "capabilities": [*capabilities, CAPABILITY_SERVE] if runtimes else capabilities,
            "runtimes": runtimes,
            "accelerator_mode": self.settings.accelerator_mode,
            "running": self.running,
        }

    def cancel(self, work_id: str) -> int:
        """Stop every run of ``work_id``; with none running here, remove the containers a
        stopped worker left for it. How many runs or containers were stopped."""
        with self.lock:
            runs = list(self.runs.get(work_id, ()))
        for context in runs:
            context.cancel()
        if runs or "container" not in capabilities_offered(self.docker_cache):
            return len(runs)
        from .capabilities import container

        try:
            return container.cancel_leftovers(work_id)
        except Exception as exc:  # no dockerd, or it refused: nothing of ours is running
            log.warning("could not look for leftover containers: %s", type(exc).__name__)
            return 0

    def stop_runs(self, timeout: float) -> int:
        """Cancel every run (each kills and removes its container); wait up to ``timeout``
        for them to end. How many were still running."""
        with self.lock:
            runs = [context for contexts in self.runs.values() for context in contexts]
        for context in runs:
            context.cancel()
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(runs)

    def server_close(self) -> None:
        super().server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.settings.socket_path)


def prepare_socket_path(path: Path) -> None:
    """Make the directory; clear a stale socket; refuse a live one or a non-socket."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        os.unlink(path)  # left behind by a worker that did not stop cleanly
        return
    finally:
        probe.close()
    raise SocketInUse(f"another worker already listens on {path}")


class Handler(BaseHTTPRequestHandler):
    server: WorkerServer
    protocol_version = "HTTP/1.1"
    server_version = f"modelforge-runtime-worker/{__version__}"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("http: " + format, *args)

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(raw)
        self.close_connection = True

    def _error(self, status: int, code: str, message: str, next_step: str, **extra: Any) -> None:
        log.info("%s %s -> %d %s", self.command, self.path, status, code)
        error = {"code": code, "message": message, "next_step": next_step}
        self._answer(status, {"error": error, **extra})

    def _compatible(self) -> bool:
        answer = worker_compatibility_of(self.headers.get(HEADER_WORKER_PROTOCOL))
        if answer == COMPATIBLE:
            return True
        self._error(
            426,
            WORKER_PROTOCOL_INCOMPATIBLE,
            f"worker protocol {self.headers.get(HEADER_WORKER_PROTOCOL)!r} is {answer}",
            _CALLER_NEXT_STEPS[answer],
            compatibility=answer,
        )
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == WORKER_PATH_SERVERS:
            if self._compatible():
                servers = self.server.servers.listing()
                self._answer(200, {"servers": servers, "compatibility": COMPATIBLE})
            return
        if self.path != WORKER_PATH_INFO:
            self._error(404, "NOT_FOUND", "no such path", f"Use {WORKER_PATH_INFO}.")
            return
        answer = worker_compatibility_of(self.headers.get(HEADER_WORKER_PROTOCOL))
        self._answer(200, {**self.server.info(), "compatibility": answer})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        raw = self._read_body()  # read before any answer, so a refusal never resets the client
        paths = (WORKER_PATH_RUN, WORKER_PATH_CANCEL, WORKER_PATH_SERVERS, WORKER_PATH_SERVER_STOP)
        if self.path not in paths:
            self._error(404, "NOT_FOUND", "no such path", f"Use {WORKER_PATH_RUN}.")
            return
        if not self._compatible():
            return
        if self.path in (WORKER_PATH_SERVERS, WORKER_PATH_SERVER_STOP):
            self._serve(raw)
            return
        if self.path == WORKER_PATH_CANCEL:
            self._cancel(raw)
            return
        request = self._parse_run(raw)
        if request is None:
            return
        capability, given, timeout, work_id, gpus = request
        context = RunContext(work_id, timeout, self.server.settings.accelerator_mode, gpus)
        with self.server.lock:
            self.server.running += 1
            if work_id:
                self.server.runs.setdefault(work_id, []).append(context)
        began = time.monotonic()
        try:
            outcome = run_capability(capability, given, context)
        except Exception as exc:  # a bug in a capability: answer failed, never hang the agent
            log.exception("capability %s crashed", capability)
            outcome = failed(CapabilityFailure(WORKER_ERROR, f"the worker failed: {exc!r}"))
        finally:
            with self.server.lock:
                self.server.running -= 1
                if work_id:
                    self.server.runs[work_id].remove(context)
                    if not self.server.runs[work_id]:
                        del self.server.runs[work_id]
        log.info(
            "POST %s -> 200 %s %s in %.2fs%s",
            self.path,
            capability,
            outcome.outcome,
            time.monotonic() - began,
            f" ({outcome.error['code']})" if outcome.error else "",
        )
        self._answer(200, {**outcome.view(), "compatibility": COMPATIBLE})

    def _serve(self, raw: bytes | None) -> None:
        """Launch (``/v1/servers``) or stop (``/v1/servers/stop``) one model server."""
        try:
            body = json.loads(raw) if raw is not None else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._error(
                400, WORK_INPUT_INVALID, "a JSON object is required", "Send {server_id, …}."
            )
            return
        if self.path == WORKER_PATH_SERVER_STOP:
            stopped = self.server.servers.stop(str(body.get("server_id")))
            log.info("POST %s -> 200 (%s)", self.path, "stopped" if stopped else "not running")
            self._answer(200, {"stopped": stopped, "compatibility": COMPATIBLE})
            return
        try:
            server = self.server.servers.launch(body)
        except BadRequest as bad:
            self._error(400, WORK_INPUT_INVALID, str(bad), "Send the server as the agent does.")
            return
        except LaunchFailed as failure:
            self._error(409, failure.code, failure.message, "See docs/deployments.md.")
            return
        self._answer(200, {"server": server, "compatibility": COMPATIBLE})

    def _cancel(self, raw: bytes | None) -> None:
        try:
            body = json.loads(raw) if raw is not None else None
        except ValueError:
            body = None
        work_id = body.get("work_id") if isinstance(body, dict) else None
        if not isinstance(work_id, str) or not 0 < len(work_id) <= 128:
            self._error(
                400,
                WORK_INPUT_INVALID,
                "the body must be {work_id}",
                "Send the work id of the run to stop, as the agent does.",
            )
            return
        cancelled = self.server.cancel(work_id)
        log.info("POST %s -> 200: %d run(s) stopped", self.path, cancelled)
        self._answer(200, {"cancelled": cancelled, "compatibility": COMPATIBLE})

    def _read_body(self) -> bytes | None:
        """The body, or None when it is missing, malformed in length or too large."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        if not 0 < length <= MAX_REQUEST_BYTES:
            return None
        return self.rfile.read(length)

    def _parse_run(
        self, raw: bytes | None
    ) -> tuple[str, dict[str, Any], float, str | None, tuple[str, ...]] | None:
        if raw is None:
            self._error(400, WORK_INPUT_INVALID, "a JSON body is required", "Send {capability,…}.")
            return None
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        timeout = body.get("timeout_seconds") if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("capability"), str)
            or not isinstance(body.get("input", {}), dict)
            or isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= WORK_TIMEOUT_MAX_SECONDS
            or not isinstance(body.get("work_id", ""), str | type(None))
            or gpu_uuids(body.get("gpus")) is None
        ):
            self._error(
                400,
                WORK_INPUT_INVALID,
                "the body must be {capability, input, timeout_seconds[, work_id][, gpus: "
                "[GPU UUID, …]]}",
                "Send the lease's capability, input, timeout and GPUs as the agent does.",
            )
            return None
        gpus = gpu_uuids(body.get("gpus")) or ()
        return (
            body["capability"],
            body.get("input") or {},
            float(timeout),
            body.get("work_id"),
            gpus,
        )


class WorkerCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        TABLE.write_help(formatter)
        with formatter.section("Exit statuses"):
            formatter.write_dl(
                [
                    (str(EXIT_OK), "stopped by SIGTERM or SIGINT"),
                    (str(EXIT_USAGE), "a setting is wrong, or the socket path is taken"),
                ]
            )


def serve(settings: WorkerSettings, stop: threading.Event) -> None:
    """Serve until ``stop`` is set; the socket is removed on the way out."""
    server = WorkerServer(settings)
    log.info(
        "ModelForge Runtime Worker %s (worker protocol %d, %s mode) on %s",
        __version__,
        WORKER_PROTOCOL_VERSION,
        settings.accelerator_mode,
        settings.socket_path,
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2})
    thread.start()
    try:
        stop.wait()
    finally:
        server.shutdown()
        thread.join()
        # No container outlives its worker: nothing would enforce its timeout or remove it.
        stopped = server.stop_runs(STOP_RUNS_SECONDS)
        if stopped:
            log.info("stopped %d run(s) on the way out", stopped)
        # No runtime outlives its worker either: nothing would watch it or free its GPUs.
        stopped = server.servers.stop_all()
        if stopped:
            log.info("stopped %d model server(s) on the way out", stopped)
        server.server_close()
        log.info("stopped")


@click.command(cls=WorkerCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__,
    message=f"modelforge-runtime-worker %(version)s (worker protocol {WORKER_PROTOCOL_VERSION})",
)
def main() -> None:
    """ModelForge Runtime Worker: runs the node's capabilities (smoke, container) for the local
    node agent, over a unix socket it creates with mode 0660. Configured by the environment."""
    try:
        settings = load_settings()
    except ConfigError as error:
        click.echo(f"modelforge-runtime-worker: {error}", err=True)
        sys.exit(error.exit_code)
    configure_logging(settings.log_level)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve(settings, stop)
    except (SocketInUse, OSError) as error:
        click.echo(f"modelforge-runtime-worker: {error}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(EXIT_OK)
