"""Debian's docker-compose (v1) in tests: find it, and read what ``config`` prints as data."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from .control_plane import IN_CI

# docker-compose (v1) is a Debian Python program: its YAML library reads its output.
_YAML_TO_JSON = "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"


def compose_v1_binary() -> str:
    """docker-compose's path; with CI=true its absence fails the test, else skips it."""
    binary = shutil.which("docker-compose")
    if binary is None:
        if IN_CI:
            pytest.fail("docker-compose is missing: scripts/test installs it as root")
        pytest.skip("docker-compose is not installed")
    return binary


def config_as_data(printed: str) -> dict:
    """What ``docker-compose config`` printed, read by the YAML library docker-compose uses."""
    converted = subprocess.run(
        [shutil.which("python3", path="/usr/bin") or "/usr/bin/python3", "-c", _YAML_TO_JSON],
        input=printed,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(converted.stdout)


def gpu_reservation(service: dict) -> list:
    """A service's device reservations (the NVIDIA GPUs, where it asks for them)."""
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
