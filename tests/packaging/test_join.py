"""The join command for the agent pyz under systemd, run by real bash in a temporary root:
the env file lands 0600 where the unit's EnvironmentFile= reads it, the state is persisted,
and the agent started as the unit starts it comes online. The same command a second time is
refused and changes nothing; a revoked node re-enrolls in one restart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelforge_appliance.identity.join_commands import AGENT_PYZ_INTERPRETER
from modelforge_contract import (
    AGENT_ENV_FILE,
    AGENT_PYZ_PATH,
    AGENT_STATE_DIR,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_USAGE,
    ONLINE,
    PATH_ADMIN_ENROLLMENTS,
)
from modelforge_contract.envfile import parse_env_file
from tests.harness.control_plane import clean_env, make_settings, serve

from .conftest import ROOT, stop

UNIT = ROOT / "systemd" / "modelforge-node-agent.service"


def unit_directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


class Host:
    """A temporary root standing in for /: /etc, /var/lib, /var/cache, /opt under it."""

    def __init__(self, root: Path, pyz: Path) -> None:
        self.root, self.pyz = root, pyz
        self.env_file = root / AGENT_ENV_FILE.lstrip("/")
        self.state = root / AGENT_STATE_DIR.lstrip("/")
        self.logs = root / "logs"
        self.logs.mkdir(parents=True)
        self.starts = 0

    def run_join(self, command: str, token: str) -> subprocess.CompletedProcess:
        """The printed command, with this root's pyz and --root, run by bash."""
        join, _, start = command.partition(" && ")
        assert start == (
            "sudo systemctl enable --now modelforge-runtime-worker modelforge-node-agent"
        ), command
        here = join.replace(f"sudo {AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH}", self.python())
        here = here.replace(" join ", f" join --root {self.root} ", 1)
        return subprocess.run(
            ["bash", "-c", here],
            input=token + "\n",
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(SHIV_ROOT=str(self.root / "root-shiv")),
        )

    def python(self) -> str:
        return f"{sys.executable} -I -S {self.pyz}"

    def start_as_the_unit(self) -> subprocess.Popen:
        """ExecStart= with the unit's Environment= and EnvironmentFile= (which wins)."""
        found = unit_directives()
        state, cache = str(self.root / "var/lib"), str(self.root / "var/cache")
        env = clean_env()
        for assignment in found["Environment"]:
            name, _, value = assignment.partition("=")
            env[name] = value.replace("%S", state).replace("%C", cache)
        (env_file,) = found["EnvironmentFile"]
        assert env_file == AGENT_ENV_FILE
        env.update(parse_env_file(self.env_file.read_text()))
        (exec_start,) = found["ExecStart"]
        assert exec_start == f"{AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH}"
        self.starts += 1
        log = (self.logs / f"start-{self.starts}.log").open("w")
        return subprocess.Popen(
            [sys.executable, "-I", "-S", str(self.pyz)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return (self.logs / f"start-{self.starts}.log").read_text()


def wait_for(check, what: str, process: subprocess.Popen | None = None, host=None):
    deadline = time.monotonic() + 60
    while True:
        value = check()
        if value:
            return value
        if process is not None and process.poll() is not None:
            pytest.fail(f"the agent exited {process.returncode} before {what}:\n{host.log()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_join_command_for_the_agent_pyz_under_systemd(agent_pyz, tmp_path):
    settings = make_settings(
        tmp_path / "cp",
        heartbeat_interval_seconds=1,
        stale_after_seconds=3,
        offline_after_seconds=6,
    )
    with serve(settings) as cp:
        minted = cp.admin(
            "POST",
            PATH_ADMIN_ENROLLMENTS,
            json={"display_name": "gpu", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
        ).json()
        command = minted["join_commands"]["systemd"]
        host = Host(tmp_path / "root", agent_pyz)
        joined = host.run_join(command, minted["token"])
        assert joined.returncode == 0, joined.stderr
        assert (
            "sudo systemctl enable --now modelforge-runtime-worker modelforge-node-agent"
            in joined.stdout
        )
        assert host.env_file.stat().st_mode & 0o777 == 0o600
        settings_text = host.env_file.read_text()
        assert minted["token"] not in settings_text
        assert parse_env_file(settings_text) == {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": cp.url,
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
        }
        state = json.loads((host.state / "identity.json").read_text())
        assert state["node_id"] and (host.state / "identity.json").stat().st_mode & 0o777 == 0o600

        def node():
            cp.heartbeats.flush()
            nodes = cp.admin("GET", "/api/v1/admin/hardware/nodes").json()["nodes"]
            assert [n["node_id"] for n in nodes] == [state["node_id"]]
            return nodes[0]

        agent = host.start_as_the_unit()
        try:
            wait_for(lambda: node()["liveness"] == ONLINE, "online", agent, host)

            before = {p.name: p.read_bytes() for p in (host.env_file, host.state / "identity.json")}
            again = host.run_join(command, cp.mint()["token"])
            assert again.returncode == EXIT_USAGE
            assert "already joined" in again.stderr and "Traceback" not in again.stderr
            after = {p.name: p.read_bytes() for p in (host.env_file, host.state / "identity.json")}
            assert after == before

            # Revoked while it runs, with no fresh token: it stops with 6, which systemd
            # does not restart (RestartPreventExitStatus=).
            cp.admin("DELETE", f"/api/v1/admin/hardware/nodes/{state['node_id']}/credential")
            assert agent.wait(timeout=30) == EXIT_CREDENTIAL_REFUSED
            assert "6" in unit_directives()["RestartPreventExitStatus"][0].split()
        finally:
            stop(agent)

        # The operator joins again with a fresh token (the refusal is on record), then
        # restarts the unit once: same node, online.
        rejoined = host.run_join(command, cp.mint()["token"])
        assert rejoined.returncode == 0, rejoined.stderr
        agent = host.start_as_the_unit()
        try:
            wait_for(
                lambda: node()["liveness"] == ONLINE and node()["inventory_at"], "back", agent, host
            )
            assert "re-enrolled" in rejoined.stderr
        finally:
            stop(agent)

        # Revoked while stopped, and a fresh token put in the env file: one start re-enrolls.
        cp.admin("DELETE", f"/api/v1/admin/hardware/nodes/{state['node_id']}/credential")
        with host.env_file.open("a") as settings_file:
            settings_file.write(f"MODELFORGE_AGENT_ENROLLMENT_TOKEN={cp.mint()['token']}\n")
        agent = host.start_as_the_unit()
        try:
            wait_for(lambda: "re-enrolling at once" in host.log(), "the re-enrollment", agent, host)

            def credentials():
                path = f"/api/v1/admin/hardware/nodes/{state['node_id']}/credentials"
                return cp.admin("GET", path).json()

            # The node still looks online from the last run's heartbeats: what shows the
            # re-enrollment is a new active credential, then heartbeats made with it.
            wait_for(lambda: credentials()["active"] == 1, "a new credential", agent, host)
            beat = node()["last_heartbeat_at"]
            wait_for(lambda: node()["last_heartbeat_at"] != beat, "a heartbeat", agent, host)
            assert node()["liveness"] == ONLINE and agent.poll() is None
            assert credentials()["revoked"] == 2
        finally:
            stop(agent)
        assert host.starts == 3


def test_join_commands_name_what_the_unit_runs():
    (exec_start,) = unit_directives()["ExecStart"]
    assert exec_start == f"{AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH}"
    assert unit_directives()["EnvironmentFile"] == [AGENT_ENV_FILE]
    # The identity's directory first (the artifact root is the second, test_systemd.py).
    assert unit_directives()["StateDirectory"][0] == Path(AGENT_STATE_DIR).name
