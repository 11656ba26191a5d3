"""`modelforge doctor` flags what would stop a first start, each with its fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modelforge_appliance.runtime import doctor
from tests.harness.control_plane import IN_CI, clean_env, free_port, tomllib
from tests.harness.pki import issue_server_cert, make_ca, tls_listener

from .conftest import ROOT

OTHER_UID = 65534  # nobody


def run_doctor(state_dir: Path, *args: str, **env: str) -> tuple[int, dict]:
    result = subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "doctor", "--json", *args],
        env=clean_env(MODELFORGE_STATE_DIR=str(state_dir), **env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, json.loads(result.stdout)


def failed(report: dict) -> dict[str, dict]:
    return {check["name"]: check for check in report["checks"] if not check["ok"]}


@pytest.fixture
def initialised(tmp_path) -> Path:
    """A state directory and store made by `modelforge init`, as the first start would."""
    state_dir = tmp_path / "state"
    result = subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "init", "--json"],
        env=clean_env(MODELFORGE_STATE_DIR=str(state_dir)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return state_dir


def test_doctor_passes_on_an_initialised_host(initialised):
    code, report = run_doctor(initialised, "--listen", f"127.0.0.1:{free_port()}")
    assert failed(report) == {}
    assert code == 0 and report["ok"] is True
    assert {check["name"] for check in report["checks"]} == {
        "python",
        "settings",
        "state_dir",
        "listen",
        "store",
        "clock",
    }


def test_doctor_flags_a_state_dir_owned_by_another_user(initialised):
    if os.geteuid() != 0:
        message = "needs root to chown the state directory to another user"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    os.chown(initialised, OTHER_UID, OTHER_UID)
    code, report = run_doctor(initialised, "--listen", f"127.0.0.1:{free_port()}")
    assert code == 1
    problem = failed(report)["state_dir"]
    assert "owned by" in problem["detail"]
    assert problem["fix"].startswith(f"chown -R root: {initialised}")


def test_doctor_flags_a_state_dir_others_can_read(initialised):
    initialised.chmod(0o750)
    code, report = run_doctor(initialised, "--listen", f"127.0.0.1:{free_port()}")
    assert code == 1
    assert failed(report)["state_dir"]["fix"] == f"chmod 0700 {initialised}"


def test_doctor_flags_a_taken_port(initialised):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, report = run_doctor(initialised, MODELFORGE_LISTEN=f"127.0.0.1:{port}")
    assert code == 1
    problem = failed(report)["listen"]
    assert f"127.0.0.1:{port} is already in use" in problem["detail"]
    assert "MODELFORGE_LISTEN" in problem["fix"]
    assert set(failed(report)) == {"listen"}


def test_doctor_knows_its_own_running_control_plane(initialised, tmp_path):
    """doctor called the control plane of its own state directory "another program" and
    told the operator to stop it."""
    import time

    port = free_port()
    env = clean_env(MODELFORGE_STATE_DIR=str(initialised), MODELFORGE_LISTEN=f"127.0.0.1:{port}")
    with (tmp_path / "serve.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "modelforge_appliance.cli", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        record = initialised / "serving.json"
        deadline = time.monotonic() + 60
        while not record.exists():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        code, report = run_doctor(initialised, MODELFORGE_LISTEN=f"127.0.0.1:{port}")
        listen = next(check for check in report["checks"] if check["name"] == "listen")
        assert listen["ok"], listen
        assert (
            f"this control plane already serves on 127.0.0.1:{port} (pid {server.pid}"
            in (listen["detail"])
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_doctor_flags_thresholds_out_of_order(initialised):
    code, report = run_doctor(
        initialised,
        MODELFORGE_NODE_STALE_AFTER_SECONDS="60",
        MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="45",
    )
    assert code == 1
    problem = failed(report)["settings"]
    assert "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS (45)" in problem["detail"]
    assert problem["fix"].startswith("set MODELFORGE_NODE_OFFLINE_AFTER_SECONDS above 60")


def test_doctor_flags_a_missing_store_without_creating_it(tmp_path):
    state_dir = tmp_path / "never-initialised"
    code, report = run_doctor(state_dir, "--listen", f"127.0.0.1:{free_port()}")
    assert code == 1
    assert set(failed(report)) == {"state_dir", "store"}
    assert "modelforge init" in failed(report)["store"]["fix"]
    assert not state_dir.exists()


def test_doctor_text_output_names_each_fix(initialised):
    initialised.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "doctor"],
        env=clean_env(MODELFORGE_STATE_DIR=str(initialised)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert f"fix: chmod 0700 {initialised}" in result.stdout


def test_clock_checks():
    jan_2025 = 1_735_689_600.0
    assert doctor.check_clock(jan_2025, None).ok
    assert doctor.check_clock(jan_2025, jan_2025 - 3600).ok
    assert not doctor.check_clock(86_400.0, None).ok  # 1970: no RTC battery
    behind = doctor.check_clock(jan_2025, jan_2025 + 3600)
    assert not behind.ok and "behind the newest record" in behind.detail
    assert not doctor.check_clock(jan_2025 + 10 * 365 * 86400, jan_2025).ok


def test_python_check_matches_requires_python():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    first, last = doctor.SUPPORTED_PYTHONS[0], doctor.SUPPORTED_PYTHONS[-1]
    assert requires == f">={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"
    # No gap in the supported set: every minor version in the range is carried.
    assert [minor for _, minor in doctor.SUPPORTED_PYTHONS] == list(range(first[1], last[1] + 1))
    for major, minor in doctor.SUPPORTED_PYTHONS:
        assert doctor.check_python((major, minor, 9), {}).ok
    assert doctor.check_python(tuple(sys.version_info[:3])).ok


DEBIAN_13 = {"ID": "debian", "VERSION_ID": "13", "PRETTY_NAME": "Debian GNU/Linux 13 (trixie)"}
UBUNTU_20 = {"ID": "ubuntu", "VERSION_ID": "20.04", "PRETTY_NAME": "Ubuntu 20.04.6 LTS"}
ALPINE = {"ID": "alpine", "VERSION_ID": "3.20.0", "PRETTY_NAME": "Alpine Linux v3.20"}


def test_python_check_names_the_fix_for_this_distribution():
    # Python 3.9 started by hand on Debian 13: its own python3 (3.13) is the way out.
    on_debian = doctor.check_python((3, 9, 2), DEBIAN_13)
    assert not on_debian.ok and "needs CPython 3.10–3.13" in on_debian.detail
    assert "Debian 13 / Proxmox VE 9 ships Python 3.13" in on_debian.fix
    assert "apt install python3" in on_debian.fix
    # Ubuntu 20.04's own python3 is too old: no apt line would help.
    too_old = doctor.check_python((3, 8, 10), UBUNTU_20)
    assert "Ubuntu 20.04 ships Python 3.8, which is too old" in too_old.fix
    assert "apt install" not in too_old.fix
    # A newer CPython than supported, on a system the doctor does not know.
    newer = doctor.check_python((3, 14, 0), ALPINE)
    assert "Python 3.14.0 is running" in newer.detail
    assert "Alpine Linux v3.20" in newer.fix and "3.10–3.13" in newer.fix
    assert "python3.11" not in on_debian.fix + too_old.fix + newer.fix


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA made as docs/node-agent.md says and one made with OpenSSL's defaults, each with a
    server certificate for 127.0.0.1."""
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "careful")
    issue_server_cert(directory, "careful", "good", ["127.0.0.1"])
    make_ca(directory, "defaults", careful=False)
    issue_server_cert(directory, "defaults", "weak", ["127.0.0.1"])
    return directory


def test_doctor_names_a_ca_that_python_3_13_agents_refuse(initialised, pki):
    """Whatever Python runs the doctor, it checks as agents on Python 3.13+ verify."""
    with tls_listener(pki / "weak.pem", pki / "weak.key") as port:
        code, report = run_doctor(
            initialised,
            "--ca-cert",
            str(pki / "defaults.pem"),
            "--listen",
            f"127.0.0.1:{free_port()}",
            MODELFORGE_PUBLIC_API_ORIGIN=f"https://127.0.0.1:{port}",
        )
    assert code == 1 and set(failed(report)) == {"tls"}
    problem = failed(report)["tls"]
    assert problem["detail"] == (
        f"agents on Python 3.13+ refuse 127.0.0.1:{port}: the CA certificate has no keyUsage "
        "extension; Python 3.13 and newer refuse such a certificate. Remake the CA with "
        "keyUsage=critical,keyCertSign,cRLSign (and reissue the server certificate) as "
        "docs/node-agent.md, section Private CA shows"
    )
    assert problem["fix"] == "docs/node-agent.md, section Private CA"


def test_doctor_passes_a_ca_made_as_documented(initialised, pki):
    with tls_listener(pki / "good.pem", pki / "good.key") as port:
        code, report = run_doctor(
            initialised,
            "--ca-cert",
            str(pki / "careful.pem"),
            "--listen",
            f"127.0.0.1:{free_port()}",
            MODELFORGE_PUBLIC_API_ORIGIN=f"https://127.0.0.1:{port}",
        )
    assert failed(report) == {} and code == 0
    tls = next(check for check in report["checks"] if check["name"] == "tls")
    assert tls["detail"].startswith(f"127.0.0.1:{port} (TLSv1.3) verifies against")


def test_doctor_tls_check_needs_an_https_origin(initialised, pki):
    code, report = run_doctor(
        initialised,
        "--ca-cert",
        str(pki / "careful.pem"),
        "--listen",
        f"127.0.0.1:{free_port()}",
    )
    assert code == 1
    assert "agents would not use TLS" in failed(report)["tls"]["detail"]
