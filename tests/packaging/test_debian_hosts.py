"""The archives on the systems they are meant for: a Debian 12 and a Debian 13 root made with
debootstrap (each with only its own python3: 3.11 and 3.13), and a Debian 13 root of the
other machine architecture run through qemu-user-static.

Each archive is started as an operator starts it, ``./modelforge.pyz …`` through its
``#!/usr/bin/env python3`` line, inside the root (tests/harness/debian_roots.py). The
control plane keeps its store in the real PostgreSQL server scripts/test runs; servers in a
root share the host's network, so the test talks to them on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from modelforge_contract import HEADER_ADMIN_TOKEN, PATH_ADMIN_ENROLLMENTS, PATH_ADMIN_NODES
from tests.harness.control_plane import free_port, fresh_postgres_database, wait_until_answering
from tests.harness.debian_roots import DEBIAN_ARCH, debian_root_or_skip, in_root

from .conftest import HOST_MACHINE, OTHER_MACHINE, stop

pytestmark = [pytest.mark.slow, pytest.mark.roots]  # tests/parts.py: beside the image builds

# Debian release -> the python3 it ships.
RELEASES = {"bookworm": "3.11", "trixie": "3.13"}
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Under qemu every Python start costs seconds: wait longer for the foreign root.
NATIVE_PATIENCE, EMULATED_PATIENCE = 120, 600


@dataclass
class Host:
    """A Debian root with a scratch directory /tmp/mf-… in it that the test removes."""

    root: Path
    work: Path  # on this machine
    patience: int

    @property
    def inside(self) -> str:
        return f"/tmp/{self.work.name}"

    def install(self, archive: Path, name: str) -> str:
        """Copy an archive in, read-only, as /opt/modelforge would hold it; its path inside."""
        target = self.work / "opt" / name
        shutil.copyfile(archive, target)
        target.chmod(0o555)
        return f"{self.inside}/opt/{name}"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "SHIV_ROOT": f"{self.inside}/shiv",
            "MODELFORGE_STATE_DIR": f"{self.inside}/state",
            **extra,
        }

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            in_root(self.root, argv, env, cwd=f"{self.inside}/opt"),
            capture_output=True,
            text=True,
            timeout=self.patience,
            check=False,
        )

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            return subprocess.Popen(
                in_root(self.root, argv, env, cwd=f"{self.inside}/opt"),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )


@pytest.fixture
def debian() -> Iterator[Callable[[str, str], Host]]:
    """debian(suite, machine) -> Host; scratch directories go when the test ends."""
    made: list[Path] = []

    def make(suite: str, machine: str) -> Host:
        root = debian_root_or_skip(suite, DEBIAN_ARCH[machine])
        work = Path(tempfile.mkdtemp(prefix="mf-", dir=root / "tmp"))
        made.append(work)
        (work / "opt").mkdir()
        patience = NATIVE_PATIENCE if machine == HOST_MACHINE else EMULATED_PATIENCE
        return Host(root, work, patience)

    yield make
    for work in made:
        shutil.rmtree(work, ignore_errors=True)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}{result.stderr}"
    return result.stdout


def admin(url: str, token: str, method: str, path: str, **kwargs) -> requests.Response:
    headers = {HEADER_ADMIN_TOKEN: token}
    return requests.request(method, url + path, headers=headers, timeout=30, **kwargs)


def wait_online(url: str, token: str, hostname: str, agent: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 120
    node = None
    while time.monotonic() < deadline:
        assert agent.poll() is None, f"the agent exited {agent.returncode}:\n{log.read_text()}"
        fleet = admin(url, token, "GET", PATH_ADMIN_NODES)
        assert fleet.status_code == 200, fleet.text
        node = next((n for n in fleet.json()["nodes"] if n["hostname"] == hostname), None)
        if node is not None and node["liveness"] == "online":
            return node
        time.sleep(0.5)
    pytest.fail(f"the node never came online (last seen: {node}):\n{log.read_text()}")


def seal_work_secret(host: Host, env: dict[str, str]) -> None:
    """``work submit`` of a container item with an env value: the archive's cryptography
    seals it (the answer shows it masked)."""
    job = {"image": "trainer:1.4", "image_id": "sha256:" + "4f" * 32, "env": {"T": "secret"}}
    argv = ["./modelforge.pyz", "work", "submit", "container", "--input", json.dumps(job)]
    submitted = json.loads(ok(host.run([*argv, "--json"], env)))
    assert submitted["input"]["env"] == {"T": "<sealed>"}


@pytest.mark.parametrize("suite", sorted(RELEASES))
def test_archives_run_on_debian_with_its_own_python3(
    suite, debian, appliance_pyz, agent_pyz, tmp_path
):
    host = debian(suite, HOST_MACHINE)
    python = ok(
        host.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], {})
    )
    assert python.strip() == RELEASES[suite]
    host.install(appliance_pyz, "modelforge.pyz")
    host.install(agent_pyz, "modelforge-node-agent.pyz")

    with fresh_postgres_database() as database_url:
        env = host.env(MODELFORGE_DATABASE_URL=database_url)
        # ./modelforge.pyz through its shebang: the release's /usr/bin/python3 runs it.
        assert ok(host.run(["./modelforge.pyz", "--version"], env)).startswith("modelforge ")
        token = json.loads(ok(host.run(["./modelforge.pyz", "init", "--json"], env)))["admin_token"]
        # The compiled psycopg2 for this CPython loads from the unpacked archive.
        unpacked = next((host.work / "shiv").glob("modelforge.pyz_*/site-packages"))
        probe = (
            "import sys; sys.path.insert(0, sys.argv[1]); import psycopg2, psycopg2.extensions; "
            "print(psycopg2.extensions.libpq_version(), psycopg2._psycopg.__file__)"
        )
        inside = f"{host.inside}/{unpacked.relative_to(host.work)}"
        loaded = ok(host.run(["python3", "-I", "-c", probe, inside], {}))
        tag = RELEASES[suite].replace(".", "")
        assert f"_psycopg.cpython-{tag}-{HOST_MACHINE}-linux-gnu.so" in loaded
        # So does its stable-ABI cryptography, which seals a work item's env.
        seal_work_secret(host, env)

        port = free_port()
        listen = ["--listen", f"127.0.0.1:{port}"]
        doctor = json.loads(ok(host.run(["./modelforge.pyz", "doctor", "--json", *listen], env)))
        assert doctor["ok"] is True
        python_check = next(c for c in doctor["checks"] if c["name"] == "python")
        assert python_check["detail"].startswith(f"Python {RELEASES[suite]}.")
        store = next(c for c in doctor["checks"] if c["name"] == "store")
        assert store["detail"].startswith("postgresql://")

        log = tmp_path / "serve.log"
        server = host.start(["./modelforge.pyz", "serve", *listen], env, log)
        try:
            url = f"http://127.0.0.1:{port}"
            health = wait_until_answering(url + "/healthz", server, log, timeout=host.patience)
            assert health.json() == {"status": "ok"}
            minted = admin(
                url,
                token,
                "POST",
                PATH_ADMIN_ENROLLMENTS,
                json={"display_name": f"{suite} node", "expires_in_seconds": 900},
            )
            assert minted.status_code == 201, minted.text
            hostname = f"{suite}-agent"
            agent_env = {
                **host.env(),
                "MODELFORGE_AGENT_CONTROL_PLANE_URL": url,
                "MODELFORGE_AGENT_ENROLLMENT_TOKEN": minted.json()["token"],
                "MODELFORGE_AGENT_HOSTNAME": hostname,
                "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
                "MODELFORGE_AGENT_STATE_VOLUME": f"{host.inside}/agent-state",
            }
            agent_log = tmp_path / "agent.log"
            running = host.start(["./modelforge-node-agent.pyz"], agent_env, agent_log)
            try:
                wait_online(url, token, hostname, running, agent_log)
            finally:
                stop(running)
        finally:
            stop(server)


def test_the_other_machines_archive_under_qemu(
    debian, foreign_appliance_pyz, appliance_pyz, agent_pyz, tmp_path
):
    """The archive for the other architecture, in a Debian 13 root of that architecture run
    by qemu-user-static: --help, init and /healthz; this machine's archive, started there,
    names the one to use; the one agent archive runs there too."""
    host = debian("trixie", OTHER_MACHINE)
    machine = ok(host.run(["python3", "-c", "import platform; print(platform.machine())"], {}))
    assert machine.strip() == OTHER_MACHINE
    host.install(foreign_appliance_pyz, "modelforge.pyz")
    host.install(appliance_pyz, f"modelforge-{HOST_MACHINE}.pyz")
    host.install(agent_pyz, "modelforge-node-agent.pyz")
    env = host.env()

    version = ok(host.run(["./modelforge-node-agent.pyz", "--version"], env))
    assert version.startswith("modelforge-node-agent ")

    assert "Usage:" in ok(host.run(["./modelforge.pyz", "--help"], env))
    wrong = host.run([f"./modelforge-{HOST_MACHINE}.pyz", "--help"], env)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().endswith(f"use modelforge-{OTHER_MACHINE}.pyz instead")

    token = json.loads(ok(host.run(["./modelforge.pyz", "init", "--json"], env)))["admin_token"]
    assert token.startswith("mfa_")
    seal_work_secret(host, env)
    port = free_port()
    log = tmp_path / "serve.log"
    server = host.start(["./modelforge.pyz", "serve", "--listen", f"127.0.0.1:{port}"], env, log)
    try:
        health = wait_until_answering(
            f"http://127.0.0.1:{port}/healthz", server, log, timeout=host.patience
        )
        assert health.json() == {"status": "ok"}
    finally:
        stop(server)
