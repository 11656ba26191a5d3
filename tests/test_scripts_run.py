"""The README's first command: scripts/run serves /healthz and mints the first token once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.harness.control_plane import clean_env, free_port, wait_until_answering

ROOT = Path(__file__).resolve().parents[1]
# scripts/run writes this checkout's .venv/modelforge.env, which every interpreter's run of
# the suite shares: once, in the part of scripts/test that has the machine to itself.
pytestmark = pytest.mark.checkout


def run_once(state_dir: Path, log_path: Path) -> str:
    """Start scripts/run, wait for /healthz, stop it; return what it printed."""
    port = free_port()
    env = clean_env(MODELFORGE_STATE_DIR=str(state_dir), MODELFORGE_LISTEN=f"127.0.0.1:{port}")
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [str(ROOT / "scripts" / "run")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            # A fresh clone installs its virtualenv first.
            response = wait_until_answering(
                f"http://127.0.0.1:{port}/healthz", process, log_path, timeout=300
            )
            assert response.status_code == 200
            assert response.json() == {"status": "ok"}
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            assert process.wait(timeout=15) == 0
    return log_path.read_text()


@pytest.fixture
def venv_settings():
    """scripts/run here writes this clone's .venv/modelforge.env; put back what was there."""
    path = ROOT / ".venv" / "modelforge.env"
    before = path.read_bytes() if path.exists() else None
    yield path
    if before is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(before)


def test_scripts_run_serves_healthz_and_reuses_its_state(tmp_path, venv_settings):
    first = run_once(tmp_path / "state", tmp_path / "first.log")
    # The CLI of this virtualenv finds the store scripts/run serves.
    assert f"MODELFORGE_STATE_DIR={tmp_path / 'state'}\n" in venv_settings.read_text()
    assert "First admin token (shown once" in first
    assert first.count("mfa_") == 1
    assert "Enroll a node" in first
    assert re.search(
        r"Console: http://127\.0\.0\.1:\d+/console/ \(its password: modelforge admin-password set\)",
        first,
    )
    second = run_once(tmp_path / "state", tmp_path / "second.log")
    assert "already initialised" in second
    assert "mfa_" not in second
