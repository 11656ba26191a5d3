"""docs/install-systemd.md, sections 3 and 4, end in a node that readiness calls READY.

systemd does not run here, so each unit is run the way systemd would run it: its own
ExecStart=, Environment= and EnvironmentFile=, as its User= and Group= (with their
supplementary groups), its UMask= and WorkingDirectory=, in the state, cache and runtime
directories it declares, made with its modes and owners — all read from the unit files,
under a temporary root standing in for /. The users are made by the doc's own useradd
lines when the host lacks them. The control plane is its pyz serving on 127.0.0.1."""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from modelforge_appliance.identity.join_commands import AGENT_PYZ_INTERPRETER
from modelforge_contract import (
    AGENT_ENV_FILE,
    AGENT_PYZ_PATH,
    HEADER_ADMIN_TOKEN,
    PATH_ADMIN_ENROLLMENTS,
)
from modelforge_contract.envfile import parse_env_file
from modelforge_node_agent.settings import DEFAULT_WORKER_SOCKET
from tests.harness.control_plane import IN_CI, clean_env, free_port

from .conftest import ROOT, init_pyz, pyz_command, serving_pyz, stop, unit_directives

DOC = ROOT / "docs" / "install-systemd.md"
WORKER_UNIT = "modelforge-runtime-worker.service"
AGENT_UNIT = "modelforge-node-agent.service"
# What systemd gives every service before Environment= (systemd.exec(5), "Environment
# Variables in Spawned Processes"); nothing of this test's own environment.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# systemd's specifiers for a system unit, and where each directive's directory lives.
SPECIFIERS = {"%t": "run", "%S": "var/lib", "%C": "var/cache"}
DIRECTORIES = {
    "RuntimeDirectory": "run",
    "StateDirectory": "var/lib",
    "CacheDirectory": "var/cache",
}
DEADLINE_SECONDS = 120  # bounds a failure only


def needs_root_and_setpriv() -> None:
    problem = None
    if os.geteuid() != 0:
        problem = "needs root to make the service users and run the units as them"
    elif shutil.which("setpriv") is None:
        problem = "setpriv (util-linux) is not installed"
    elif not Path(AGENT_PYZ_INTERPRETER).is_file():
        problem = f"{AGENT_PYZ_INTERPRETER}, the units' interpreter, is missing"
    if problem:
        if IN_CI:
            pytest.fail(problem)
        pytest.skip(problem)


def doc_commands(starting: str) -> list[str]:
    """The doc's shell lines (continuations joined) that start with ``starting``."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [re.sub(r"\s+", " ", line) for line in lines if line.startswith(starting)]


def in_group(user: str, group: str) -> bool:
    return user in grp.getgrnam(group).gr_mem or pwd.getpwnam(user).pw_gid == (
        grp.getgrnam(group).gr_gid
    )


def ensure_users(worker_user: str, agent_user: str) -> None:
    """As the doc tells the operator: the worker's user, then the agent's in its group."""
    for user in (worker_user, agent_user):
        (useradd,) = [c for c in doc_commands("sudo useradd ") if c.split()[-1] == user]
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["bash", "-c", useradd.removeprefix("sudo ")], check=True, timeout=60)
    if not in_group(agent_user, worker_user):  # made before the worker was documented
        (usermod,) = [
            c.removeprefix("# A modelforge-agent made before this release: ")
            for c in doc_commands("# A modelforge-agent made before this release: ")
        ]
        assert usermod == f"sudo usermod -aG {worker_user} {agent_user}", usermod
        subprocess.run(["bash", "-c", usermod.removeprefix("sudo ")], check=True, timeout=60)
    assert in_group(agent_user, worker_user)


class Host:
    """A temporary root standing in for /, reachable by the service users (0755)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir()

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def expand(self, value: str) -> str:
        for specifier, folder in SPECIFIERS.items():
            value = value.replace(specifier, str(self.root / folder))
        return value

    def install(self, archive: Path, destination: str) -> None:
        """sudo install -m 0444 ARCHIVE /opt/modelforge/…"""
        target = self.path(destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(archive, target)
        target.chmod(0o444)

    def start_as_the_unit(self, unit: str, extra: dict[str, str] | None = None):
        """ExecStart= as User=/Group= with the unit's directories and environment."""
        found = unit_directives(unit)
        (user,), (group,) = found["User"], found["Group"]
        account = pwd.getpwnam(user)
        gid = grp.getgrnam(group).gr_gid
        env = {
            "PATH": SYSTEMD_PATH,
            "HOME": account.pw_dir,
            "USER": user,
            "LOGNAME": user,
            "SHELL": account.pw_shell,
        }
        for directive, folder in DIRECTORIES.items():
            for name in found.get(directive, []):
                made = self.root / folder / name
                made.mkdir(parents=True, exist_ok=True)
                mode = found.get(f"{directive}Mode", ["0755"])[0]
                made.chmod(int(mode, 8))
                for path in (made, *made.rglob("*")):
                    os.chown(path, account.pw_uid, gid, follow_symlinks=False)
                env[directive.upper().replace("DIRECTORY", "_DIRECTORY")] = str(made)
        for assignment in found.get("Environment", []):
            name, _, value = assignment.partition("=")
            env[name] = self.expand(value)
        env.update(extra or {})
        for env_file in found.get("EnvironmentFile", []):
            env.update(parse_env_file(self.path(env_file).read_text(), env_file))
        (exec_start,) = found["ExecStart"]
        interpreter, archive = exec_start.split()
        assert interpreter == AGENT_PYZ_INTERPRETER and archive.startswith("/opt/modelforge/")
        log = (self.logs / f"{unit}.log").open("w")
        return subprocess.Popen(
            # -I -S: nothing from the system's site-packages stands in for what the pyz lacks.
            ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups",
             "--no-new-privs", "--", interpreter, "-I", "-S", str(self.path(archive))],
            env=env,
            cwd=self.expand(found["WorkingDirectory"][0]),
            umask=int(found["UMask"][0], 8),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def log(self, unit: str) -> str:
        return (self.logs / f"{unit}.log").read_text()


@pytest.fixture
def host() -> Iterator[Host]:
    # Not under pytest's tmp_path: its parents are root's alone (0700).
    root = Path(tempfile.mkdtemp(prefix="mf-node-", dir="/tmp"))
    try:
        root.chmod(0o755)
        yield Host(root)
    finally:
        shutil.rmtree(root)


@pytest.fixture
def control_plane(appliance_pyz, tmp_path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """The control plane pyz serving on 127.0.0.1: (url, admin token, its CLI's env)."""
    port = free_port()
    env = clean_env(
        SHIV_ROOT=str(tmp_path / "cp-shiv"),
        MODELFORGE_STATE_DIR=str(tmp_path / "cp-state"),
        MODELFORGE_HEARTBEAT_INTERVAL_SECONDS="1",
        MODELFORGE_NODE_STALE_AFTER_SECONDS="5",
        MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="10",
    )
    admin_token = init_pyz(appliance_pyz, env)
    with serving_pyz(appliance_pyz, env, port, tmp_path / "serve.log") as url:
        yield url, admin_token, env


def test_the_systemd_install_of_a_node_ends_ready(
    appliance_pyz, agent_pyz, worker_pyz, control_plane, host
):
    needs_root_and_setpriv()
    url, admin_token, cli_env = control_plane
    worker_unit, agent_unit = unit_directives(WORKER_UNIT), unit_directives(AGENT_UNIT)
    (worker_user,), (agent_user,) = worker_unit["User"], agent_unit["User"]
    ensure_users(worker_user, agent_user)

    # Section 3: the worker's archive, its env file (this node is CPU-only), its unit.
    host.install(worker_pyz, worker_unit["ExecStart"][0].split()[1])
    (worker_env,) = worker_unit["EnvironmentFile"]
    host.path(worker_env).parent.mkdir(parents=True)
    host.path(worker_env).write_text("MODELFORGE_WORKER_ACCELERATOR_MODE=cpu\n")
    host.path(worker_env).chmod(0o600)
    worker = host.start_as_the_unit(WORKER_UNIT)
    agent = None
    try:
        socket_path = host.expand(
            next(
                value.partition("=")[2]
                for value in worker_unit["Environment"]
                if value.startswith("MODELFORGE_WORKER_SOCKET=")
            )
        )
        # The agent's default socket, under this root, is the one the worker unit sets.
        assert host.path(DEFAULT_WORKER_SOCKET) == Path(socket_path)
        wait_for(lambda: Path(socket_path).exists(), "the worker's socket", worker, host)
        socket = Path(socket_path)
        assert socket.stat().st_mode & 0o777 == 0o660
        assert socket.parent.stat().st_mode & 0o777 == 0o750
        assert grp.getgrgid(socket.stat().st_gid).gr_name == worker_unit["Group"][0]
        assert refused_to("nobody", socket) == errno.EACCES  # nobody else reaches it

        # Section 4: the agent's archive, a cpu token, the printed join command, the unit.
        host.install(agent_pyz, AGENT_PYZ_PATH)
        minted = requests.post(
            url + PATH_ADMIN_ENROLLMENTS,
            headers={HEADER_ADMIN_TOKEN: admin_token},
            json={"display_name": "gpu-01", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
            timeout=30,
        )
        assert minted.status_code == 201, minted.text
        join, _, start = minted.json()["join_commands"]["systemd"].partition(" && ")
        units = " ".join(unit.removesuffix(".service") for unit in (WORKER_UNIT, AGENT_UNIT))
        assert start == f"sudo systemctl enable --now {units}"  # both units it runs below
        prefix = f"sudo {AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH} join "
        assert join.startswith(prefix), join
        here = f"{sys.executable} -I -S {host.path(AGENT_PYZ_PATH)} join --root {host.root} "
        joined = subprocess.run(
            ["bash", "-c", here + join.removeprefix(prefix)],
            input=minted.json()["token"] + "\n",
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(SHIV_ROOT=str(host.root / "root-shiv")),
        )
        assert joined.returncode == 0, joined.stderr
        assert agent_unit["EnvironmentFile"] == [AGENT_ENV_FILE]
        # The agent unit leaves the socket at its default, which is /run/… under this root.
        assert not any(
            v.startswith("MODELFORGE_AGENT_WORKER_SOCKET=") for v in agent_unit["Environment"]
        )
        agent = host.start_as_the_unit(
            AGENT_UNIT, {"MODELFORGE_AGENT_WORKER_SOCKET": str(host.path(DEFAULT_WORKER_SOCKET))}
        )
        state = host.path("/var/lib") / agent_unit["StateDirectory"][0] / "identity.json"
        node_id = json.loads(state.read_text())["node_id"]

        def readiness() -> dict | None:
            for process, unit in ((worker, WORKER_UNIT), (agent, AGENT_UNIT)):
                if process.poll() is not None:
                    pytest.fail(f"{unit} exited {process.returncode}:\n{host.log(unit)}")
            answer = requests.get(
                f"{url}/api/v1/admin/hardware/nodes/{node_id}/readiness",
                headers={HEADER_ADMIN_TOKEN: admin_token},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            return answer.json()

        deadline = time.monotonic() + DEADLINE_SECONDS
        answer = readiness()
        while not answer["ready"]:
            assert time.monotonic() < deadline, (
                f"never READY: {answer}\n{host.log(AGENT_UNIT)}\n{host.log(WORKER_UNIT)}"
            )
            time.sleep(0.5)
            answer = readiness()
        checks = {check["name"]: check for check in answer["checks"]}
        assert checks["worker"]["ok"] and "smoke" in checks["worker"]["detail"], checks["worker"]

        # The doc's success check, word for word: `mf nodes readiness NODE`.
        checked = subprocess.run(
            pyz_command(appliance_pyz, "nodes", "readiness", node_id),
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.startswith(f"node {node_id}: READY"), checked.stdout
        assert re.search(r"^\s+ok\s+worker\s", checked.stdout, re.M), checked.stdout
        assert "offers smoke" in host.log(AGENT_UNIT)

        # A runtime the worker starts opens models/<hex>/ under the agent's artifact root, at
        # the same path, as the worker's user: the agent opened that tree to its group
        # whatever its umask, while its identity stays its own.
        artifacts = Path(
            host.expand(
                next(
                    value.partition("=")[2]
                    for value in agent_unit["Environment"]
                    if value.startswith("MODELFORGE_AGENT_ARTIFACT_ROOT=")
                )
            )
        )
        assert artifacts.stat().st_mode & 0o777 == 0o750
        assert (artifacts / "partial").stat().st_mode & 0o777 == 0o700
        assert grp.getgrgid(artifacts.stat().st_gid).gr_name == worker_unit["Group"][0]
        assert (
            as_the_worker(
                worker_unit, "import os, sys; os.listdir(sys.argv[1])", artifacts / "models"
            )
            == 0
        )
        assert as_the_worker(worker_unit, "open(__import__('sys').argv[1])", state) == errno.EACCES
    finally:
        if agent is not None:
            stop(agent)
        stop(worker)
    # The worker removes its socket on the way out (the unit then removes the directory).
    assert worker.returncode == 0, host.log(WORKER_UNIT)
    assert not Path(socket_path).exists()


def as_the_worker(worker_unit: dict[str, list[str]], code: str, path: Path) -> int:
    """Run ``code`` (sys.argv[1] = PATH) as the worker's unit would: its exit status, or the
    errno of the OSError it raised."""
    probe = f"import sys\ntry:\n    {code}\nexcept OSError as e:\n    sys.exit(e.errno)\n"
    (user,), (group,) = worker_unit["User"], worker_unit["Group"]
    result = subprocess.run(
        ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups",
         AGENT_PYZ_INTERPRETER, "-I", "-S", "-c", probe, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    return result.returncode


def refused_to(user: str, socket: Path) -> int:
    """The errno connecting to ``socket`` as ``user`` (no supplementary groups) fails with."""
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    sys.exit(e.errno)\n"
    )
    result = subprocess.run(
        ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups",
         AGENT_PYZ_INTERPRETER, "-I", "-S", "-c", probe, str(socket)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    return result.returncode


def wait_for(check, what: str, process: subprocess.Popen, host: Host) -> None:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not check():
        if process.poll() is not None:
            pytest.fail(f"exited {process.returncode} before {what}:\n{host.log(WORKER_UNIT)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
