"""``modelforge-node-agent status``: node id, origin, the last successful heartbeat and why
not, like ``tailscale status``.

The running agent keeps ``status.json`` in its state volume (mode 0600, replaced atomically,
no secret in it): when each kind of call last succeeded or failed, and why it stopped. A
failure, a call's first success and a success after a failure are written at once; other
successes at most once a second (a fleet's work calls came to hundreds a second, and writing
the file for each cost an agent a quarter of its CPU). ``status``
reads it with ``identity.json`` and says whether the agent runs, without calling the control
plane itself.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from modelforge_contract import (
    AGENT_SERVICE,
    AGENT_STATE_DIR,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PATH_AGENT_HEARTBEAT,
    PATH_AGENT_WORK_COMPLETE,
    PATH_AGENT_WORK_RENEW,
    mask_secrets,
)
from modelforge_contract.files import write_atomically

from . import __version__, runtime
from .client import CallFailed, ControlPlaneClient, Refused, checked_interval
from .identity import NodeState, StateError, load_state
from .settings import ConfigError, load_settings

log = logging.getLogger(__name__)

STATUS_FILE_NAME = "status.json"
STATUS_FORMAT = 1
# Routine successes are written at most this often (seconds).
ROUTINE_WRITE_SECONDS = 1.0
# A running agent whose last good heartbeat is older than this many intervals is wedged, or
# its heartbeats stopped without failing: unhealthy. The interval is the control plane's
# (the last heartbeat answer), 10 s until one has answered.
STALE_AFTER_INTERVALS = 3
FIRST_INTERVAL_SECONDS = 10.0
# Paths that name one work item are recorded under their template: one entry per kind of
# call, however many items the node runs.
_ITEM_PATHS = tuple(
    (template, *template.split("<work_id>"))
    for template in (PATH_AGENT_WORK_RENEW, PATH_AGENT_WORK_COMPLETE)
)

# What a failure name means, and the next thing to check (docs/node-agent.md, Diagnosing).
WHY = {
    "ConnectError": "nothing listens at that address and port, or a firewall rejects the "
    "connection: check that the control plane runs and the URL",
    "DNSError": "the URL's host name does not resolve: check MODELFORGE_AGENT_CONTROL_PLANE_URL "
    "or set MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS",
    "ConnectTimeout": "packets are dropped on the way, or the control plane is overloaded",
    "ReadTimeout": "the control plane accepted the call but did not answer in time",
    "TLSError": "the certificate is not trusted or not valid for the host name "
    "(MODELFORGE_AGENT_CA_CERT_PATH)",
    "HTTP 401": "the control plane refused the node credential: re-enroll with a fresh token",
    "HTTP 403": "the credential belongs to another node, or the node was decommissioned",
    "HTTP 426": "the control plane does not speak this agent's protocol: upgrade one of them",
}


def status_path(state_volume: Path) -> Path:
    return state_volume / STATUS_FILE_NAME


class StatusRecorder:
    """Keeps status.json current for one run of the agent; never stops the agent."""

    def __init__(
        self,
        state_volume: Path,
        url: str,
        accelerator_mode: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = status_path(state_volume)
        self.clock = clock
        self._lock = threading.Lock()
        self._warned = False
        self._written_at = 0.0
        self.data: dict[str, Any] = {
            "format": STATUS_FORMAT,
            "pid": os.getpid(),
            "started_at": clock(),
            "control_plane_url": url,
            "accelerator_mode": accelerator_mode,
            "agent_version": __version__,
            "runtime": runtime.current(),
            "command": shlex.join(sys.argv),  # never holds a secret: tokens come by env or file
            "node_id": None,
            "calls": {},
            "stopped": None,
            # The process's start time (clock ticks since boot, /proc/PID/stat field 22):
            # with the pid it names this process and no later one that reuses the pid.
            "process_started": process_started(os.getpid()),
            "heartbeat_interval_seconds": FIRST_INTERVAL_SECONDS,
        }

    def enrolled(self, state: NodeState) -> None:
        with self._lock:
            self.data["node_id"] = state.node_id
            self._write()

    def succeeded(self, method: str, path: str) -> None:
        now = self.clock()
        with self._lock:
            call = self.data["calls"].setdefault(f"{method} {route(path)}", {})
            news = "ok_at" not in call or call.get("failed_at", 0) > call["ok_at"]
            call["ok_at"] = now
            if news or now - self._written_at >= ROUTINE_WRITE_SECONDS:
                self._write()

    def heartbeat_interval(self, seconds: float | None) -> None:
        if seconds is None:
            return
        with self._lock:
            if self.data.get("heartbeat_interval_seconds") != seconds:
                self.data["heartbeat_interval_seconds"] = seconds
                self._write()

    def failed(self, method: str, path: str, failure: CallFailed) -> None:
        with self._lock:
            call = self.data["calls"].setdefault(f"{method} {route(path)}", {})
            now = self.clock()
            if call.get("failed_at") is None or call.get("ok_at", 0) > call["failed_at"]:
                call["failing_since"] = now  # the first failure after the last success
            call.update(
                failed_at=now,
                failure=failure.describe(),
                code=failure.code if isinstance(failure, Refused) else None,
            )
            self._write()

    def worker(self, state: Any) -> None:
        """The runtime worker as the agent last found it (a WorkerState): the node is not
        ready without a usable one, and `status` says so."""
        with self._lock:
            self.data["worker"] = {
                "usable": bool(state.usable),
                "problem": mask_secrets(state.problem)[:500] if state.problem else None,
            }
            self._write()

    def stopped(self, exit_status: int, message: str | None) -> None:
        with self._lock:
            self.data["stopped"] = {
                "at": self.clock(),
                "exit_status": exit_status,
                "message": mask_secrets(message)[:1000] if message else None,
            }
            self._write()

    def _write(self) -> None:
        self._written_at = self.clock()
        try:
            write_atomically(self.path, json.dumps(self.data), mode=0o600)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot keep %s current (%s)", self.path, exc.strerror)


def route(path: str) -> str:
    """The path as recorded: a work item's path becomes its template."""
    for template, prefix, suffix in _ITEM_PATHS:
        middle = path[len(prefix) : len(path) - len(suffix)]
        if path.startswith(prefix) and path.endswith(suffix) and middle and "/" not in middle:
            return template
    return path


@dataclass
class RecordingClient(ControlPlaneClient):
    """The client, noting each call's outcome in status.json."""

    recorder: StatusRecorder | None = None

    def call(
        self, method: str, path: str, body: dict[str, Any], authenticated: bool = True
    ) -> dict[str, Any]:
        try:
            answer = super().call(method, path, body, authenticated)
        except CallFailed as failure:
            if self.recorder is not None:
                self.recorder.failed(method, path, failure)
            raise
        if self.recorder is not None:
            if path == PATH_AGENT_HEARTBEAT:
                self.recorder.heartbeat_interval(
                    checked_interval(answer.get("heartbeat_interval_seconds"))
                )
            self.recorder.succeeded(method, path)
        return answer


def process_started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None where /proc cannot
    tell (another PID namespace, no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow its last ')'.
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def _alive(pid: Any, started: Any = None) -> bool:
    """The recorded agent process still runs: the pid exists and, when its start time was
    recorded, it is the same process (a pid reused by another program is not the agent)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if isinstance(started, int):
        now = process_started(pid)
        return now is None or now == started
    return True


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _why(failure: str | None) -> str | None:
    if not failure:
        return None
    for name, meaning in WHY.items():
        if failure.startswith(name):
            return meaning
    if failure.startswith("HTTP 5"):
        return "the control plane (or a proxy in front of it) failed to answer; check its log"
    return None


def _start_hint(recorded: dict[str, Any]) -> str:
    how = recorded.get("runtime")
    if how == runtime.SYSTEMD:
        return f"sudo systemctl start {AGENT_SERVICE}"
    if how == runtime.CONTAINER:
        return "start the agent's container again (docker start NAME)"
    command = recorded.get("command")
    return f"start it again: {command}" if isinstance(command, str) else "start the agent"


def read_status(state_volume: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(status_path(state_volume).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("format") == STATUS_FORMAT else None


def report(state: NodeState | None, recorded: dict[str, Any] | None, url: str | None) -> dict:
    """The status answer (``--json``); ``healthy`` decides the exit status."""
    now = time.time()
    recorded = recorded or {}
    running = _alive(recorded.get("pid"), recorded.get("process_started")) and not recorded.get(
        "stopped"
    )
    interval = recorded.get("heartbeat_interval_seconds")
    interval = interval if isinstance(interval, int | float) and interval > 0 else None
    beat = (recorded.get("calls") or {}).get(f"POST {PATH_AGENT_HEARTBEAT}") or {}
    ok_at, failed_at = beat.get("ok_at"), beat.get("failed_at")
    failing = failed_at is not None and (ok_at is None or failed_at > ok_at)
    stopped = recorded.get("stopped")
    worker = recorded.get("worker") if isinstance(recorded.get("worker"), dict) else None
    problem = None
    if state is None or not state.node_id:
        problem = "this host has not joined a control plane yet"
        next_step = "run `modelforge-node-agent join URL --token-file -` with a fresh token"
    elif state.credential_refused:
        problem = f"the control plane refused this node's credential ({state.credential_refused})"
        next_step = "re-enroll: join again with a fresh token (docs/node-agent.md)"
    elif not running:
        problem = "the agent is not running" + (
            f" (it stopped {ago(now - stopped['at'])} ago with exit status "
            f"{stopped['exit_status']})"
            if stopped
            else ""
        )
        next_step = (stopped or {}).get("message") or _start_hint(recorded)
    elif failing:
        problem = f"heartbeats fail: {beat.get('failure')}"
        next_step = _why(beat.get("failure")) or "see the agent's log"
    elif ok_at is None:
        problem = "no heartbeat has succeeded yet"
        next_step = "wait a few seconds; see the agent's log if it stays so"
    elif now - ok_at > STALE_AFTER_INTERVALS * (interval or FIRST_INTERVAL_SECONDS):
        problem = (
            f"the last heartbeat succeeded {ago(now - ok_at)} ago, more than "
            f"{STALE_AFTER_INTERVALS} intervals of {interval or FIRST_INTERVAL_SECONDS:g}s: the "
            "agent runs but does not heartbeat"
        )
        next_step = "see the agent's log, and restart the agent if it stays so"
    elif worker is not None and not worker.get("usable"):
        problem = (
            "the node is NOT READY: the agent heartbeats, but its runtime worker is not usable"
            f" ({worker.get('problem') or 'no reason given'})"
        )
        next_step = (
            "start the runtime worker beside the agent on the socket the agent names, or fix "
            "what it says (docs/work.md); the agent finds it again within seconds"
        )
    else:
        next_step = None
    return {
        "node_id": state.node_id if state else None,
        "identity_id": state.identity_id if state else None,
        "control_plane_url": recorded.get("control_plane_url") or url,
        "running": running,
        "pid": recorded.get("pid") if running else None,
        "accelerator_mode": recorded.get("accelerator_mode"),
        "agent_version": recorded.get("agent_version"),
        "last_heartbeat_at": ok_at,
        "last_heartbeat_age_seconds": round(now - ok_at, 1) if ok_at else None,
        "last_failure": beat.get("failure") if failing else None,
        "last_failure_at": failed_at if failing else None,
        "failing_since": (beat.get("failing_since") or failed_at) if failing else None,
        "stopped": stopped,
        "worker": worker,
        "healthy": problem is None,
        "problem": problem,
        "next_step": next_step,
    }


def render(answer: dict[str, Any]) -> str:
    now = time.time()
    beat = (
        f"ok {ago(now - answer['last_heartbeat_at'])} ago"
        if answer["last_heartbeat_at"]
        else "never succeeded"
    )
    if answer["last_failure"]:
        since = answer.get("failing_since") or answer["last_failure_at"]
        beat = f"failing since {ago(now - since)}: {answer['last_failure']}" + (
            f" (last ok {ago(now - answer['last_heartbeat_at'])} ago)"
            if answer["last_heartbeat_at"]
            else ""
        )
    agent = (
        f"running (pid {answer['pid']}), {answer['accelerator_mode']} mode, "
        f"version {answer['agent_version']}"
        if answer["running"]
        else "not running"
    )
    lines = [
        f"{'node':14} {answer['node_id'] or 'not joined'}",
        f"{'control plane':14} {answer['control_plane_url'] or '-'}",
        f"{'agent':14} {agent}",
        f"{'heartbeat':14} {beat}",
    ]
    if answer["problem"]:
        lines.append(f"{'problem':14} {answer['problem']}")
        lines.append(f"{'next step':14} {answer['next_step']}")
    return "\n".join(lines)


@click.command("status")
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The agent's settings file, to find its state volume (default: as the agent would).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The agent's state volume (default: MODELFORGE_AGENT_STATE_VOLUME, else "
    f"{AGENT_STATE_DIR}).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def status_command(obj: dict, env_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """Node id, control plane, whether the agent runs, its last heartbeat and why not.

    Reads the state volume; calls nothing. Exits 0 when the agent runs and its last heartbeat
    succeeded, 1 otherwise.
    """
    try:
        settings = load_settings(env_file=env_file or obj.get("env_file"))
    except ConfigError as error:
        click.echo(f"modelforge-node-agent: {error}", err=True)
        sys.exit(error.exit_code)
    volume = state_dir.absolute() if state_dir else settings.state_volume
    try:
        state = load_state(volume)
    except StateError as error:
        click.echo(
            f"modelforge-node-agent: {error}; run status as the agent's user or root", err=True
        )
        sys.exit(EXIT_USAGE)
    answer = report(state, read_status(volume), settings.control_plane_url)
    click.echo(json.dumps(answer, indent=2) if as_json else render(answer))
    sys.exit(EXIT_OK if answer["healthy"] else EXIT_CHECK_FAILED)
