"""The first hour, as README.md tells it: a fresh clone, `scripts/run` in the background, the
README's enroll command exactly as written, then its agent command (cpu mode): the node is
online and ready. Then the same with `scripts/run --listen 127.0.0.1:<port>`.

The clone makes its own virtualenv once (pip's cache keeps that to seconds); both runs use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness.control_plane import free_port, unavailable, wait_until_answering

ROOT = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"mfe_[0-9a-f]{8,32}_[A-Za-z0-9_-]{20,}")

pytestmark = pytest.mark.slow


def readme_commands() -> tuple[str, str, str]:
    """The README's CLI enroll command, its runtime worker command and its agent (join)
    command, exactly as written."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    enroll = [line for line in lines if line.startswith(".venv/bin/modelforge enroll ")]
    worker = [line for line in lines if line.endswith(".venv/bin/modelforge-runtime-worker")]
    agent = [line for line in lines if line.startswith(".venv/bin/modelforge-node-agent join ")]
    assert len(enroll) == 1 and len(worker) == 1 and len(agent) == 1, (enroll, worker, agent)
    return enroll[0], worker[0], agent[0]


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("newcomer") / "modelforge"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(path)], check=True, timeout=120)
    return path


def clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MODELFORGE_", "VIRTUAL_ENV", "PYTHON"))
    }


class Session:
    """Processes started the way a newcomer starts them, each in its own process group."""

    def __init__(self, clone: Path, logs: Path) -> None:
        self.clone, self.logs, self.processes = clone, logs, []

    def background(self, command: str, name: str, stdin: str | None = None):
        log = (self.logs / f"{name}.log").open("w")
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.clone,
            env=clean_env(),
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        process.stdin.write(stdin or "")
        process.stdin.close()
        self.processes.append((name, process))
        return process

    def run(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=self.clone,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def stop_all(self) -> dict[str, int]:
        codes = {}
        for name, process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            codes[name] = process.wait(timeout=30)
        return codes


def wait_ready(session: Session, timeout: float = 60) -> dict:
    """The node, once the clone's own CLI says it is online and READY."""
    deadline = time.monotonic() + timeout
    while True:
        listed = session.run(".venv/bin/modelforge nodes --json")
        nodes = json.loads(listed.stdout)["nodes"] if listed.returncode == 0 else []
        if nodes and nodes[0]["liveness"] == "online":
            readiness = session.run(f".venv/bin/modelforge nodes readiness {nodes[0]['node_id']}")
            if readiness.returncode == 0:
                return nodes[0]
        for name, process in session.processes:
            assert process.poll() is None, (
                f"{name} exited {process.returncode}:\n{session.log(name)}"
            )
        assert time.monotonic() < deadline, (listed.stderr, session.log("agent"))
        time.sleep(0.5)


def first_hour(clone: Path, logs: Path, run_args: str, port: int) -> None:
    enroll_command, worker_command, agent_command = readme_commands()
    shutil.rmtree(clone / "var", ignore_errors=True)
    session = Session(clone, logs)
    try:
        served = session.background(f"scripts/run {run_args}".strip(), "run")
        # The first run creates the clone's virtualenv.
        wait_until_answering(
            f"http://127.0.0.1:{port}/healthz", served, logs / "run.log", timeout=600
        )
        assert session.log("run").count("mfa_") == 1

        minted = session.run(enroll_command)  # exactly as the README writes it
        assert minted.returncode == 0, minted.stderr
        assert f"locked to http://127.0.0.1:{port} " in minted.stdout
        assert "store " in minted.stderr and str(clone / "var") in minted.stderr
        (token,) = set(TOKEN.findall(minted.stdout))
        printed = [line.strip() for line in minted.stdout.splitlines() if "agent join" in line]
        # The checkout's command printed for this token is the README's, for this origin:
        # the README asks for a CPU node, so the printed join command works on this box.
        readme_here = agent_command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        assert readme_here in printed
        # ...and so is the worker's, for the mode asked for.
        assert worker_command in [line.strip() for line in minted.stdout.splitlines()]

        session.background(worker_command, "worker")
        session.background(readme_here, "agent", stdin=token + "\n")
        node = wait_ready(session)
        assert node["accelerator_mode"] == "cpu"
        status = session.run(
            ".venv/bin/modelforge-node-agent status "
            "--env-file var/node-agent/modelforge-node-agent.env --json"
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["node_id"] == node["node_id"]
        assert token not in session.log("agent")
        wrapper = session.run(f"cd / && {clone}/scripts/modelforge nodes --json")
        assert [n["node_id"] for n in json.loads(wrapper.stdout)["nodes"]] == [node["node_id"]]
    finally:
        codes = session.stop_all()
    assert codes == {"agent": 0, "worker": 0, "run": 0}, codes


def test_the_readme_first_hour_on_the_default_address(clone, tmp_path):
    if not port_free(8000):
        unavailable("127.0.0.1:8000, scripts/run's default, is in use on this machine")
    first_hour(clone, tmp_path, "", 8000)


def test_the_readme_first_hour_with_listen(clone, tmp_path):
    port = free_port()
    first_hour(clone, tmp_path, f"--listen 127.0.0.1:{port}", port)
