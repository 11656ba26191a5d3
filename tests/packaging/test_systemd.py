"""The units: clean under systemd-analyze verify, rated by its offline security check."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness.control_plane import IN_CI

from .conftest import ROOT

UNITS = ROOT / "systemd"
# Issue 5: the control plane rates 2.0 or better (lower is better); the agent,
# which must keep the NVIDIA devices, is held to the same bar.
EXPOSURE_LIMITS = {"modelforge.service": 2.0, "modelforge-node-agent.service": 2.0}


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        message = "systemd-analyze is not installed (scripts/test installs it as root)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def directives(unit: str) -> dict[str, list[str]]:
    """Every Key=value of a unit file, repeated keys kept in order."""
    found: dict[str, list[str]] = {}
    for line in (UNITS / unit).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


@pytest.mark.parametrize("unit", sorted(EXPOSURE_LIMITS))
def test_unit_verifies_clean(unit):
    result = subprocess.run(
        [systemd_analyze(), "verify", str(UNITS / unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr


@pytest.mark.parametrize(("unit", "limit"), sorted(EXPOSURE_LIMITS.items()))
def test_unit_security_exposure_within_limit(unit, limit):
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", "--no-pager", str(UNITS / unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= limit, result.stdout


@pytest.mark.parametrize("unit", sorted(EXPOSURE_LIMITS))
def test_unit_keeps_state_and_cache_where_the_service_owns_them(unit):
    found = directives(unit)
    name = unit.removesuffix(".service")
    assert found["StateDirectory"] == [name]
    assert found["CacheDirectory"] == [name]
    assert f"SHIV_ROOT=%C/{name}" in " ".join(found["Environment"])
    assert found["EnvironmentFile"] == [f"/etc/modelforge/{name}.env"]
    assert found["Restart"] == ["on-failure"]
    assert found["StartLimitBurst"] and found["StartLimitIntervalSec"]
    assert found["UMask"] == ["0077"]
    assert found["ProtectSystem"] == ["strict"]
    assert found["CapabilityBoundingSet"] == [""]
    # The archive is read from an install path the service cannot write, by the system's
    # own python3 (any of CPython 3.10-3.13), never a versioned name like python3.11.
    interpreter, archive = found["ExecStart"][0].split()[:2]
    assert interpreter == "/usr/bin/python3"
    assert Path(archive).parent == Path("/opt/modelforge")


def test_agent_unit_keeps_nvidia_devices_and_nvml():
    found = directives("modelforge-node-agent.service")
    assert found.get("PrivateDevices", ["no"]) == ["no"]
    assert found["DevicePolicy"] == ["closed"]
    assert "char-nvidia-frontend rw" in found["DeviceAllow"]
    assert "char-nvidia-uvm rw" in found["DeviceAllow"]
    # NVML reads /proc/driver/nvidia; ProcSubset=pid would hide it.
    assert "ProcSubset" not in found


def test_control_plane_unit_has_no_devices():
    found = directives("modelforge.service")
    assert found["PrivateDevices"] == ["yes"]
    assert "DeviceAllow" not in found


def test_control_plane_unit_has_descriptors_for_the_default_connection_limit():
    """The unit grants what the default MODELFORGE_CONNECTION_LIMIT needs, instead of leaving
    serve to raise its own soft limit under a filter of the @resources system calls."""
    from modelforge_appliance.core.settings import load_settings
    from modelforge_appliance.runtime.server import SPARE_DESCRIPTORS

    limit = int(directives("modelforge.service")["LimitNOFILE"][0])
    assert limit >= load_settings({}).connection_limit + SPARE_DESCRIPTORS
    assert "~@privileged @resources" in directives("modelforge.service")["SystemCallFilter"]
