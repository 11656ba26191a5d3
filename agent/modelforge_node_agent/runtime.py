"""How this agent runs — under systemd, in a container, or as a plain process — so that
what it tells the operator to do fits: edit the env file and restart the unit, recreate
the container, or set a variable and start it again.

Decided from what the process can see (its cgroup, the container markers), never from
``MODELFORGE_*`` settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from modelforge_contract import AGENT_ENV_FILE, AGENT_PYZ_PATH, AGENT_SERVICE

SYSTEMD = "systemd"
CONTAINER = "container"
PROCESS = "process"

_CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")


def detect(
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = Path("/"),
    pid: int | None = None,
    ppid: int | None = None,
) -> str:
    """systemd when a .service cgroup holds us; container when a runtime marked the root
    and we are its main process (pid 1, or right under an init) or came in by ``docker
    exec`` (no parent inside the container); a plain process otherwise — also a shell's
    child in a development container."""
    pid = os.getpid() if pid is None else pid
    ppid = os.getppid() if ppid is None else ppid
    marked = any((root / marker.lstrip("/")).exists() for marker in _CONTAINER_MARKERS)
    if marked and (pid == 1 or ppid in (0, 1)):
        return CONTAINER
    try:
        cgroups = proc_cgroup.read_text()
    except OSError:
        cgroups = ""
    if any(line.rstrip().endswith(".service") for line in cgroups.splitlines()):
        # A login shell's cgroup is a session scope; a service's ends in .service.
        return SYSTEMD
    return PROCESS


@functools.cache
def current() -> str:
    return detect()


# Set while `join` runs: its operator typed a join command, not a variable, so a refusal
# tells them to run join again rather than how to set MODELFORGE_AGENT_* for a start.
_JOINING: contextvars.ContextVar[bool] = contextvars.ContextVar("joining", default=False)


@contextlib.contextmanager
def joining() -> Iterator[None]:
    token = _JOINING.set(True)
    try:
        yield
    finally:
        _JOINING.reset(token)


def is_joining() -> bool:
    return _JOINING.get()


def agent_command() -> str:
    """How the operator runs this agent's command line here."""
    program = sys.argv[0] if sys.argv else ""
    if current() == CONTAINER or not program:
        return "python3 -m modelforge_node_agent.main"
    if program.endswith(".pyz"):
        return f"python3 {program or AGENT_PYZ_PATH}"
    if os.path.basename(program) == "modelforge-node-agent":
        return program
    return "python3 -m modelforge_node_agent.main"


def remove_token_step(how: str | None = None) -> str:
    """How to take the used enrollment token out of the agent's settings."""
    how = how or current()
    if how == SYSTEMD:
        return (
            f"delete the MODELFORGE_AGENT_ENROLLMENT_TOKEN line from {AGENT_ENV_FILE} (or the "
            "unit's EnvironmentFile=); no restart is needed"
        )
    if how == CONTAINER:
        return (
            "recreate the container without MODELFORGE_AGENT_ENROLLMENT_TOKEN, keeping its "
            "state volume"
        )
    return "unset MODELFORGE_AGENT_ENROLLMENT_TOKEN before the agent's next start"


def fresh_token_step(how: str | None = None) -> str:
    """How to hand the agent a fresh enrollment token, as this install runs it."""
    how = how or current()
    mint = "mint a fresh token (`modelforge enroll --name NAME` on the control plane)"
    if is_joining():
        sudo = "sudo " if agent_command().startswith("python3 ") and how != CONTAINER else ""
        return f"{mint}, then run `{sudo}{agent_command()} join URL --token-file -` again"
    if how == SYSTEMD:
        return (
            f"{mint}, then run `sudo {agent_command()} join URL --token-file -` and "
            f"`sudo systemctl restart {AGENT_SERVICE}`; or put it in {AGENT_ENV_FILE} as "
            f"MODELFORGE_AGENT_ENROLLMENT_TOKEN and restart the unit"
        )
    if how == CONTAINER:
        return (
            f"{mint}, set it as MODELFORGE_AGENT_ENROLLMENT_TOKEN and recreate the container "
            "with the same state volume"
        )
    return f"{mint}, set it as MODELFORGE_AGENT_ENROLLMENT_TOKEN and start the agent again"
