"""The Bash start command the mint answer (and the wizard) gives, run by real bash, and
the Runtime Worker command beside it.

A stand-in ``modelforge-node-agent`` on PATH (or in a checkout's .venv) records the
environment and arguments it was started with. The command runs on a real pseudo-terminal, as an operator pastes it:
the token must not echo, the temporary env file must be mode 0600 while it exists and
gone after success, a failing agent, Ctrl-C (SIGINT) and SIGTERM; caller-side tracing
(``set -x``) must print no token.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from modelforge_appliance.identity.enrollment import (
    START_COMMAND,
    WORKER_SOCKET,
    agent_env_file,
    worker_command,
)
from modelforge_contract import AGENT_PYZ_PATH

TOKEN = "mfe_0123456789abcdef_" + "Tk9" * 14 + "x"
STANDIN = """#!/bin/bash
{ env; echo "ARGV=$*"; tr '\\0' ' ' < /proc/$$/cmdline; echo; } > "$STANDIN_RECORD"
exit "${STANDIN_EXIT:-0}"
"""


@pytest.fixture
def node(tmp_path):
    """A node's working directory with the generated env file and the stand-in agent."""
    work = tmp_path / "node"
    work.mkdir()
    (work / "modelforge-node.env").write_text(agent_env_file("http://127.0.0.1:8000"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    agent = bin_dir / "modelforge-node-agent"
    agent.write_text(STANDIN)
    agent.chmod(0o755)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(temp),
        "STANDIN_RECORD": str(tmp_path / "record"),
        "TERM": "dumb",
    }
    return {"work": work, "env": env, "temp": temp, "record": tmp_path / "record"}


class Terminal:
    """bash running the command on a real pty, as if pasted into an interactive shell."""

    def __init__(self, node: dict, command: str, **extra_env: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            # A shell on a terminal starts with Ctrl-C's SIGINT (and SIGQUIT) at their
            # defaults. A suite started with `&` from a script (scripts/test's quick runs)
            # ignores them, and bash cannot trap a signal ignored when it started: restore them.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGQUIT, signal.SIG_DFL)
            os.chdir(node["work"])
            os.execve("/bin/bash", ["bash", "-c", command], {**node["env"], **extra_env})  # noqa: S606
        self.output = b""

    def read_until(self, needle: bytes, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            assert time.monotonic() < deadline, f"{needle!r} never came: {self.output!r}"
            if not self._read(0.5):
                break
        assert needle in self.output, self.output

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:
            return False
        self.output += chunk
        return bool(chunk)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def finish(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self._read(0.2):
            assert time.monotonic() < deadline, f"bash did not end: {self.output!r}"
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._drain()
                return os.waitstatus_to_exitcode(status)
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)

    def interrupt(self, send, timeout: float = 30) -> int:
        """Send a signal until bash ends; return its exit status.

        Bash has a tiny window between arming its traps for ``read`` and blocking in it;
        a signal landing there is handled only at the next one, as when an operator
        presses Ctrl-C twice. Resending cannot hide the failure this test looks for (a
        trap that cleans up and then carries on reading never exits).
        """
        deadline = time.monotonic() + timeout
        while True:
            send()
            finish_by = time.monotonic() + 1
            while time.monotonic() < finish_by:
                self._read(0.1)
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._drain()
                    return os.waitstatus_to_exitcode(status)
            assert time.monotonic() < deadline, f"bash did not end: {self.output!r}"

    def _drain(self) -> None:
        while self._read(0.1):
            pass
        os.close(self.fd)


def temp_files(node) -> list[Path]:
    return sorted(node["temp"].iterdir())


def test_success_starts_the_agent_with_the_token_and_removes_the_file(node):
    terminal = Terminal(node, START_COMMAND)
    terminal.read_until(b"Enrollment token: ")
    [token_file] = temp_files(node)  # created before the prompt, for the operator's own user
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    terminal.type(TOKEN + "\r")
    assert terminal.finish() == 0
    assert TOKEN.encode() not in terminal.output  # not echoed
    record = node["record"].read_text()
    assert f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n" in record
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL=http://127.0.0.1:8000\n" in record
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE=nvidia\n" in record
    # Where the worker command below puts the worker's socket.
    assert f"MODELFORGE_AGENT_WORKER_SOCKET={WORKER_SOCKET}\n" in record
    # The host name is left to the machine: two nodes minted as "GPU Node" never share one.
    assert "MODELFORGE_AGENT_HOSTNAME" not in record
    argv_lines = [line for line in record.splitlines() if line.startswith(("ARGV=", "/bin/bash"))]
    assert argv_lines and not any(TOKEN in line for line in argv_lines)
    assert "tok=" not in record and "tok_file=" not in record  # no helper variables leak
    assert temp_files(node) == []


def test_a_failing_agent_leaves_no_token_file(node):
    terminal = Terminal(node, START_COMMAND, STANDIN_EXIT="3")
    terminal.read_until(b"Enrollment token: ")
    terminal.type(TOKEN + "\r")
    assert terminal.finish() == 3
    assert temp_files(node) == []
    assert TOKEN.encode() not in terminal.output


def test_ctrl_c_at_the_prompt_removes_the_file_and_starts_nothing(node):
    terminal = Terminal(node, START_COMMAND)
    terminal.read_until(b"Enrollment token: ")
    assert len(temp_files(node)) == 1
    # The terminal turns Ctrl-C into SIGINT for its foreground process group.
    assert terminal.interrupt(lambda: terminal.type("\x03")) == 130
    assert temp_files(node) == []
    assert not node["record"].exists()


def test_sigterm_removes_the_file_and_starts_nothing(node):
    terminal = Terminal(node, START_COMMAND)
    terminal.read_until(b"Enrollment token: ")
    assert len(temp_files(node)) == 1
    status = terminal.interrupt(lambda: os.killpg(terminal.pid, signal.SIGTERM))
    assert status in (143, -signal.SIGTERM)
    assert temp_files(node) == []
    assert not node["record"].exists()


def test_something_that_is_not_a_token_is_refused_and_never_sourced(node):
    marker = node["work"] / "pwned"
    terminal = Terminal(node, START_COMMAND)
    terminal.read_until(b"Enrollment token: ")
    terminal.type(f"$(touch {marker})\r")
    assert terminal.finish() == 2
    assert b"not an enrollment token" in terminal.output
    assert not marker.exists() and temp_files(node) == [] and not node["record"].exists()


def test_without_the_env_file_it_stops_before_asking(node):
    (node["work"] / "modelforge-node.env").unlink()
    terminal = Terminal(node, START_COMMAND)
    assert terminal.finish() == 2
    assert b"modelforge-node.env" in terminal.output and b"Enrollment token" not in terminal.output
    assert temp_files(node) == []


@pytest.mark.parametrize(
    "caller", ["set -x; ", "set -x; export SHELLOPTS; ", "set -o xtrace; export SHELLOPTS; "]
)
def test_tracing_in_the_callers_shell_prints_no_token(node, caller):
    result = subprocess.run(
        ["bash", "-c", caller + START_COMMAND],
        input=TOKEN + "\n",
        cwd=node["work"],
        env=node["env"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "+ " in result.stderr  # the caller really was tracing
    assert TOKEN not in result.stdout + result.stderr
    assert f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={TOKEN}" in node["record"].read_text()
    assert temp_files(node) == []


# -- finding the agent the way each documented install has it ------------------------------


def standin(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STANDIN)
    path.chmod(0o755)
    return path


def test_a_checkouts_agent_is_found_before_one_on_path(node):
    """Run from a checkout's root (where its modelforge-node.env sits), its .venv's agent."""
    standin(node["work"] / ".venv" / "bin" / "modelforge-node-agent")
    terminal = Terminal(node, START_COMMAND)
    terminal.read_until(b"Enrollment token: ")
    terminal.type(TOKEN + "\r")
    assert terminal.finish() == 0
    record = node["record"].read_text()
    assert ".venv/bin/modelforge-node-agent" in record  # its command line
    assert f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={TOKEN}\n" in record
    assert temp_files(node) == []


def test_without_any_agent_it_names_what_it_looked_for_and_asks_nothing(node):
    if Path(AGENT_PYZ_PATH).exists():
        pytest.skip(f"{AGENT_PYZ_PATH} is installed on this host")
    bare = {**node["env"], "PATH": "/usr/bin:/bin"}
    if any((Path(d) / "modelforge-node-agent").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("modelforge-node-agent is installed on this host")
    terminal = Terminal({**node, "env": bare}, START_COMMAND)
    assert terminal.finish() == 127
    said = terminal.output.decode()
    assert "modelforge: no node agent found" in said
    for looked in (
        ".venv/bin/modelforge-node-agent",
        "modelforge-node-agent on PATH",
        f"{AGENT_PYZ_PATH} (the agent pyz, run by /usr/bin/python3)",
    ):
        assert looked in said, said
    assert "Enrollment token" not in said and temp_files(node) == []


def run_worker_command(
    node: dict, mode: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The Runtime Worker command, pasted in the node's directory."""
    return subprocess.run(
        ["bash", "-c", worker_command(mode)],
        cwd=node["work"],
        env=node["env"] if env is None else env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_worker_command_listens_where_the_env_file_points_the_agent(node, tmp_path):
    from modelforge_node_agent.settings import DEFAULT_WORKER_SOCKET
    from modelforge_worker.settings import DEFAULT_SOCKET

    assert WORKER_SOCKET == DEFAULT_WORKER_SOCKET == DEFAULT_SOCKET  # the documented default
    standin(tmp_path / "bin" / "modelforge-runtime-worker")
    result = run_worker_command(node, "cpu")
    assert result.returncode == 0, result.stderr
    record = node["record"].read_text()
    assert f"MODELFORGE_WORKER_SOCKET={WORKER_SOCKET}\n" in record
    assert "MODELFORGE_WORKER_ACCELERATOR_MODE=cpu\n" in record
    assert (
        f"MODELFORGE_AGENT_WORKER_SOCKET={WORKER_SOCKET}\n"
        in (node["work"] / "modelforge-node.env").read_text()
    )

    # A checkout's own worker first; none at all is named, not a bare 127.
    standin(node["work"] / ".venv" / "bin" / "modelforge-runtime-worker")
    result = run_worker_command(node, "nvidia")
    assert result.returncode == 0
    assert ".venv/bin/modelforge-runtime-worker" in node["record"].read_text()
    (node["work"] / ".venv" / "bin" / "modelforge-runtime-worker").unlink()
    bare = {**node["env"], "PATH": "/usr/bin:/bin"}
    if any((Path(d) / "modelforge-runtime-worker").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("modelforge-runtime-worker is installed on this host")
    result = run_worker_command(node, "cpu", env=bare)
    assert result.returncode == 127
    assert "no runtime worker found: looked for .venv/bin/modelforge-runtime-worker" in (
        result.stderr
    )
    assert "modelforge-runtime-worker on PATH" in result.stderr


def test_run_again_on_an_enrolled_node_it_starts_the_agent_without_asking_a_token(node, tmp_path):
    """A restart of a node started with this command: its identity is in the env file's state
    volume, so the agent starts as it is; it used to ask for a token the node no longer has."""
    state = tmp_path / "agent-state"
    state.mkdir(mode=0o700)
    env_file = node["work"] / "modelforge-node.env"
    env_file.write_text(env_file.read_text().replace("/var/lib/modelforge-node-agent", str(state)))
    fresh = Terminal(node, START_COMMAND)  # no identity yet: it asks
    fresh.read_until(b"Enrollment token: ")
    fresh.interrupt(lambda: os.kill(fresh.pid, signal.SIGINT))
    (state / "identity.json").write_text('{"node_id": "n"}')
    again = Terminal(node, START_COMMAND)
    assert again.finish() == 0
    assert b"Enrollment token" not in again.output
    assert b"enrolled already" in again.output and b"no token needed" in again.output
    record = node["record"].read_text()
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" not in record
    assert f"MODELFORGE_AGENT_STATE_VOLUME={state}\n" in record
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL=http://127.0.0.1:8000\n" in record
    assert "state=" not in record and temp_files(node) == []


def test_the_worker_command_follows_a_socket_edited_in_the_env_file(node, tmp_path):
    standin(tmp_path / "bin" / "modelforge-runtime-worker")
    env_file = node["work"] / "modelforge-node.env"
    moved = tmp_path / "sockets" / "worker.sock"
    env_file.write_text(env_file.read_text().replace(WORKER_SOCKET, str(moved)))
    result = run_worker_command(node, "cpu")
    assert result.returncode == 0, result.stderr
    record = node["record"].read_text()
    assert f"MODELFORGE_WORKER_SOCKET={moved}\n" in record
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL" not in record  # only the socket is read from it
    assert "sock=" not in record
