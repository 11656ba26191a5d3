"""The split of the suite (tests/parts.py) holds: every test runs in exactly one of the heavy
and the quick part, a heavy test in exactly one of the heavy runs, the portable part is
quick, every test file has tests, and what must run on every CPython is in the portable
part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests.harness.control_plane import tomllib
from tests.parts import PARTS

ROOT = Path(__file__).resolve().parents[1]
# What depends on the interpreter (the issue that set the split names each): these files run
# whole on every CPython, but for the tests among them that are heavy.
PORTABLE_FILES = (
    "tests/test_portability.py",  # every module compiles and imports
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "contract").glob("test_*.py")),
    "tests/packaging/test_build.py",  # the archives and their launcher
    "tests/packaging/test_one_archive.py",
    "tests/release/test_verify_sums.py",  # the operators' verifiers
    "tests/release/test_archive.py",
    "tests/release/test_signing.py",
    "tests/agent/test_end_to_end.py",  # enroll, heartbeat, restart: the agent as a process
    "tests/appliance/test_restore_postgres.py",  # psycopg2's compiled module, real server
)


@pytest.fixture(scope="module")
def markers(tmp_path_factory) -> dict[str, set[str]]:
    """Every collected test of the suite and the names of its markers."""
    out = tmp_path_factory.mktemp("parts") / "markers.json"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "tests.harness.collect_markers", str(ROOT / "tests")],
        cwd=ROOT, env={**os.environ, "MF_TEST_MARKERS_OUT": str(out)},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return {test: set(names) for test, names in json.loads(out.read_text()).items()}


def in_part(part: str, names: set[str]) -> bool:
    return Expression.compile(PARTS[part]).evaluate(lambda name, **_: name in names)


def test_every_test_is_in_exactly_one_of_heavy_and_quick(markers):
    assert len(markers) > 1000
    both = [t for t, names in markers.items() if in_part("heavy", names) == in_part("quick", names)]
    assert both == []


def test_the_heavy_runs_take_every_heavy_test_once(markers):
    from tests.parts import HEAVY_RUNS

    wrong = {}
    for test, names in markers.items():
        runs = [run for run in HEAVY_RUNS if in_part(run, names)]
        if len(runs) != (1 if in_part("heavy", names) else 0):
            wrong[test] = runs
    assert wrong == {}


def test_the_portable_part_is_quick(markers):
    portable = [t for t, names in markers.items() if in_part("portable", names)]
    assert len(portable) > 300
    assert [t for t in portable if not in_part("quick", markers[t])] == []


def test_every_test_file_has_tests(markers):
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    collected = {test.split("::")[0] for test in markers}
    assert sorted(files - collected) == []


@pytest.mark.parametrize("path", PORTABLE_FILES)
def test_what_depends_on_the_interpreter_runs_on_every_python(markers, path):
    tests = {t: names for t, names in markers.items() if t.split("::")[0] == path}
    assert tests, f"{path} has no tests"
    left_out = [
        t
        for t, names in tests.items()
        if in_part("quick", names) and not in_part("portable", names)
    ]
    assert left_out == [], f"quick tests of {path} that other CPythons do not run: {left_out}"


def test_a_hung_test_fails_with_its_traceback_and_the_run_goes_on(tmp_path):
    """pytest-timeout, as the suite configures it ([tool.pytest.ini_options] timeout)."""
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < limit["timeout"] <= 900
    (tmp_path / "test_hang.py").write_text(
        "import threading\n\n"
        "def test_waits_for_ever():\n    threading.Event().wait()\n\n"
        "def test_after_it():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "timeout=1", "-rA",
         str(tmp_path / "test_hang.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "Timeout" in result.stdout and "threading.Event().wait()" in result.stdout
    assert "FAILED test_hang.py::test_waits_for_ever" in result.stdout
    assert "PASSED test_hang.py::test_after_it" in result.stdout


def test_the_quick_part_s_shards_take_every_file_once():
    from tests.harness.shard import parse_shard, shard_of

    files = [f"tests/f{i}.py" for i in range(7)] + ["tests/f0.py"]
    shards = [shard_of(files, k, 3) for k in (1, 2, 3)]
    assert set().union(*shards) == set(files)
    assert sum(len(s) for s in shards) == 7 and all(shards)
    assert shard_of(files, 1, 1) == set(files)
    assert parse_shard("2/2") == (2, 2)
    for bad in ("0/2", "3/2", "x", "1/"):
        with pytest.raises(ValueError, match="MF_TEST_SHARD"):
            parse_shard(bad)
