"""The archives run as an operator runs them: from a read-only install directory, with
the shiv cache in SHIV_ROOT, the control plane answering /healthz and a cpu-mode agent
enrolling against it end to end."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from modelforge_appliance.core import sealing
from modelforge_contract import (
    HEADER_ADMIN_TOKEN,
    PATH_ADMIN_ENROLLMENTS,
    PATH_ADMIN_NODES,
    PATH_ADMIN_WORK,
)
from tests.harness.control_plane import clean_env, free_port

from .conftest import init_pyz, pyz_command, serving_pyz, stop


@dataclass
class ServedAppliance:
    url: str
    admin_token: str
    install_dir: Path
    install_listing: list[str]
    shiv_root: Path
    state_dir: Path

    def admin(self, method: str, path: str, **kwargs) -> requests.Response:
        headers = {HEADER_ADMIN_TOKEN: self.admin_token}
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)


def read_only_install(pyz: Path, directory: Path, name: str | None = None) -> Path:
    """Copy the archive into a directory nobody may write (as /opt/modelforge is under
    ProtectSystem=strict), under the name the units use (modelforge-$(uname -m).pyz is
    installed as modelforge.pyz, docs/install-systemd.md)."""
    directory.mkdir(parents=True)
    installed = directory / (name or pyz.name)
    shutil.copyfile(pyz, installed)
    installed.chmod(0o555)
    directory.chmod(0o555)
    return installed


@pytest.fixture(scope="module")
def served_appliance(appliance_pyz, tmp_path_factory) -> Iterator[ServedAppliance]:
    base = tmp_path_factory.mktemp("appliance")
    installed = read_only_install(appliance_pyz, base / "opt", "modelforge.pyz")
    # HOME is unwritable too: shiv must use SHIV_ROOT, never ~/.shiv.
    home = base / "home"
    home.mkdir(mode=0o555)
    env = clean_env(
        SHIV_ROOT=str(base / "cache"),
        MODELFORGE_STATE_DIR=str(base / "state"),
        HOME=str(home),
    )
    admin_token = init_pyz(installed, env)
    assert admin_token

    port = free_port()
    doctor = subprocess.run(
        pyz_command(installed, "doctor", "--json", "--listen", f"127.0.0.1:{port}"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr

    try:
        with serving_pyz(installed, env, port, base / "serve.log") as url:
            yield ServedAppliance(
                url=url,
                admin_token=admin_token,
                install_dir=installed.parent,
                install_listing=[installed.name],
                shiv_root=base / "cache",
                state_dir=base / "state",
            )
    finally:
        installed.parent.chmod(0o755)


def test_appliance_pyz_serves_healthz_from_a_read_only_copy(served_appliance):
    response = requests.get(served_appliance.url + "/healthz", timeout=10)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    # Nothing was written next to the archive; shiv unpacked into SHIV_ROOT.
    assert sorted(os.listdir(served_appliance.install_dir)) == served_appliance.install_listing
    assert stat.S_IMODE(served_appliance.install_dir.stat().st_mode) == 0o555
    unpacked = [path.name for path in served_appliance.shiv_root.iterdir() if path.is_dir()]
    assert [name for name in unpacked if name.startswith("modelforge.pyz_")], unpacked


def test_appliance_pyz_seals_work_secrets_with_the_cryptography_it_carries(served_appliance):
    """The archive's own compiled cryptography seals a submitted env value; the key it made
    in the state directory (0600) opens it here, and no answer shows it."""
    token = f"hf_secret_0{secrets.token_hex(16)}"
    item = {"image": "trainer:1.4", "image_id": "sha256:" + "4f" * 32, "env": {"HF_TOKEN": token}}
    submitted = served_appliance.admin(
        "POST", PATH_ADMIN_WORK, json={"capability": "container", "input": item}
    )
    assert submitted.status_code == 201, submitted.text
    assert token not in submitted.text and submitted.json()["input"]["env"] == {
        "HF_TOKEN": "<sealed>"
    }
    key_file = served_appliance.state_dir / sealing.WORK_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    work_id = submitted.json()["work_id"]
    with sqlite3.connect(served_appliance.state_dir / "modelforge.sqlite3") as conn:
        (stored,) = conn.execute("SELECT input FROM work_item WHERE work_id = ?", (work_id,))
    sealed = json.loads(stored[0])["env"]["HF_TOKEN"]
    assert token not in stored[0] and sealing.is_sealed(sealed)
    context = f"work-item:{work_id}:input.env.HF_TOKEN"
    assert sealing.WorkKeys(key_file).open(sealed, context) == token


def test_agent_pyz_enrolls_in_cpu_mode_and_comes_online(served_appliance, agent_pyz, tmp_path):
    minted = served_appliance.admin(
        "POST",
        PATH_ADMIN_ENROLLMENTS,
        json={"display_name": "pyz e2e", "expires_in_seconds": 900},
    )
    assert minted.status_code == 201, minted.text
    hostname = f"pyz-e2e-{tmp_path.name[-12:]}".lower().replace("_", "-")
    installed = read_only_install(agent_pyz, tmp_path / "opt")
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    env = clean_env(
        SHIV_ROOT=str(tmp_path / "cache"),
        HOME=str(home),
        MODELFORGE_AGENT_CONTROL_PLANE_URL=served_appliance.url,
        MODELFORGE_AGENT_ENROLLMENT_TOKEN=minted.json()["token"],
        MODELFORGE_AGENT_HOSTNAME=hostname,
        MODELFORGE_AGENT_ACCELERATOR_MODE="cpu",
        MODELFORGE_AGENT_STATE_VOLUME=str(tmp_path / "agent-state"),
    )
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log:
        # No terminal: the agent must take the token from the environment, never prompt.
        agent = subprocess.Popen(
            pyz_command(installed),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        node = None
        while time.monotonic() < deadline:
            if agent.poll() is not None:
                pytest.fail(f"the agent exited {agent.returncode}:\n{log_path.read_text()}")
            fleet = served_appliance.admin("GET", PATH_ADMIN_NODES)
            assert fleet.status_code == 200, fleet.text
            node = next((n for n in fleet.json()["nodes"] if n["hostname"] == hostname), None)
            if node is not None and node["liveness"] == "online":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"node never came online (last seen: {node}):\n{log_path.read_text()}")
    finally:
        stop(agent)
        installed.parent.chmod(0o755)
    # The token never reaches the log.
    assert minted.json()["token"] not in log_path.read_text()


def test_appliance_pyz_serves_the_console_pages_and_static_files(served_appliance):
    """Templates, scripts and vendored files are package data inside the archive."""
    import hashlib

    page = requests.get(served_appliance.url + "/console/sign-in", timeout=10)
    assert page.status_code == 200
    assert "Content-Security-Policy" in page.headers
    assert 'data-testid="login-password"' in page.text or "admin-password set" in page.text
    vendored = json.loads(
        (
            Path(__file__).resolve().parents[2]
            / "appliance/modelforge_appliance/console/static/vendor/VENDORED.json"
        ).read_text()
    )
    for library in vendored["libraries"]:
        for name, record in library["files"].items():
            served = requests.get(
                f"{served_appliance.url}/console/static/vendor/{name}", timeout=10
            )
            assert served.status_code == 200, name
            assert hashlib.sha256(served.content).hexdigest() == record["sha256"]
    for script in ("console.js", "hardware.js", "wizard.js", "node.js"):
        assert requests.get(f"{served_appliance.url}/console/static/{script}", timeout=10).ok
