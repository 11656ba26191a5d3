"""The ``modelforge`` CLI as a real process, and a fleet to point it at."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modelforge_appliance.core.clock import ManualClock

from .control_plane import ControlPlane, clean_env, make_settings, new_identity, run_cli, serve


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
