"""The rehearsal compose file is valid for Compose v1 and names a disposable identity."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .support import IN_CI

ROOT = Path(__file__).resolve().parents[1]


def compose_config(path: Path, **env: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        if IN_CI:
            pytest.fail("docker-compose is missing: scripts/test installs it as root")
        pytest.skip("docker-compose is not installed")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    return subprocess.run(
        [binary, "-f", str(path), "config"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_node_recovery_compose_file_is_valid_and_needs_a_control_plane_url():
    path = ROOT / "docker-compose.node-recovery.yml"
    refused = compose_config(path)
    assert refused.returncode != 0
    assert "set MODELFORGE_AGENT_CONTROL_PLANE_URL" in refused.stderr
    config = compose_config(path, MODELFORGE_AGENT_CONTROL_PLANE_URL="http://127.0.0.1:8000")
    assert config.returncode == 0, config.stderr
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE: cpu" in config.stdout
    assert "rehearsal-agent-state:/var/lib/modelforge-node-agent" in config.stdout
    assert "mfe_" not in path.read_text() and "mfc_" not in path.read_text()
