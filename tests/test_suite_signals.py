"""The suite runs with Ctrl-C's signals at their defaults, however scripts/test was started.

A run started with ``&`` from a non-interactive script inherits SIGINT and SIGQUIT ignored,
and a signal ignored at exec stays ignored in every program it starts: the ``bash`` of
tests/appliance/test_start_command.py could then not trap Ctrl-C, and failed on every CPython
of a fresh clone's scripts/test (issue 20). scripts/lib/pythons.sh's pytest_run puts them back
before pytest starts; this fails if a run ever inherits them ignored again.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ignored_signals(status: str) -> set[int]:
    mask = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return {number for number in range(1, 65) if mask & (1 << (number - 1))}


def test_this_run_does_not_ignore_ctrl_c():
    ignored = ignored_signals(Path("/proc/self/status").read_text())
    assert signal.SIGINT not in ignored and signal.SIGQUIT not in ignored, (
        "this pytest run started with SIGINT/SIGQUIT ignored: start it through "
        "scripts/lib/pythons.sh's pytest_run"
    )


def test_pytest_run_restores_signals_a_background_job_inherits_ignored(tmp_path):
    """The wrapper itself, started the way the quick runs are: with & from a script."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from pathlib import Path\n"
        "def test_probe():\n"
        f"    Path({str(tmp_path / 'status')!r}).write_text(Path('/proc/self/status').read_text())\n"
    )
    script = (
        f". {ROOT}/scripts/lib/pythons.sh\n"
        "trap '' INT QUIT\n"  # what & gives a job of a non-interactive shell
        f"pytest_run {sys.executable} -q -p no:cacheprovider {probe} &\n"
        "wait $!\n"
    )
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ignored = ignored_signals((tmp_path / "status").read_text())
    assert signal.SIGINT not in ignored and signal.SIGQUIT not in ignored
