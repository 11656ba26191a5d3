"""The ``modelforge`` CLI as a real process, and a fleet to point it at."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modelforge_appliance.clock import ManualClock

from ..support import ControlPlane, make_settings, new_identity, serve

CLI = [sys.executable, "-m", "modelforge_appliance.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    """The test run's environment without any MODELFORGE_* (and no virtualenv settings file
    can apply either: the tests' interpreter runs from scripts/test's .venv, and explicit
    variables win over it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    return {**env, **extra}


def run_cli(
    *args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        env=env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class Node:
    node_id: str
    credential: str
    hostname: str


@dataclass
class Fleet:
    """A control plane served in this process over the SQLite file the CLI also opens."""

    plane: ControlPlane
    env: dict[str, str]
    state_dir: Path

    def cli(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return run_cli(*args, env=self.env, stdin=stdin)

    def enroll(self, hostname: str, name: str = "GPU Node") -> Node:
        token = self.plane.mint(name)["token"]
        answer = self.plane.enroll(token, hostname=hostname, identity=new_identity())
        assert answer.status_code == 201, answer.text
        body = answer.json()
        return Node(body["node_id"], body["credential"], hostname)

    def heartbeat(self, node: Node) -> None:
        assert self.plane.heartbeat(node.credential, node.node_id).status_code == 200
        self.plane.heartbeats.flush()


@contextlib.contextmanager
def fleet(tmp_path: Path, past: bool = True) -> Iterator[Fleet]:
    """A fleet whose clock reads 2001 (``past``): what it records is long past for the CLI's
    real clock, so a node that heartbeats here reads offline there without any waiting."""
    settings = make_settings(tmp_path / "state")
    with serve(settings, ManualClock(start=1_000_000_000.0) if past else None) as plane:
        env = clean_env(MODELFORGE_STATE_DIR=str(settings.state_dir))
        yield Fleet(plane, env, settings.state_dir)
