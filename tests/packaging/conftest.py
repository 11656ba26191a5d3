"""The archives the packaging tests share: those scripts/test built once for the whole run
(tests/harness/archives.py), or one session build of each when run by hand.

The reproducibility test builds them a second time and compares; every other test reuses
the first build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness.archives import OUTPUTS, prebuilt, run_build
from tests.harness.control_plane import IN_CI, clean_env, wait_until_answering

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "packaging" / "build_pyz.py"
AGENT_ENTRY = ROOT / "agent" / "modelforge_node_agent" / "main.py"
# The control-plane archive for this machine (`uname -m`), and the other one.
HOST_MACHINE = platform.machine()
OTHER_MACHINE = "aarch64" if HOST_MACHINE == "x86_64" else "x86_64"


def load_packaging_module(name: str) -> ModuleType:
    """packaging/NAME.py as a module (the folder is not a package: `packaging` is PyPI's).
    The folder goes on sys.path, as it is when the scripts run, for their sibling imports."""
    folder = str(ROOT / "packaging")
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(f"mf_{name}", ROOT / "packaging" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def require_agent() -> None:
    """The agent package lands on its own branch; until it does, skip here and fail in CI."""
    if not AGENT_ENTRY.is_file() and not IN_CI:
        pytest.skip(
            f"{AGENT_ENTRY.relative_to(ROOT)} does not exist yet (the node agent is merged "
            "separately); with CI=true this fails instead"
        )


def build_pyz(target: str, dist: Path, work_dir: Path, source_root: Path = ROOT) -> Path:
    """Run packaging/build_pyz.py for one target; fail the test with its output."""
    result = run_build([target], dist, work_dir, source_root)
    if result.returncode != 0:
        pytest.fail(f"building the {target} pyz failed:\n{result.stdout}{result.stderr}")
    return dist / OUTPUTS[target]


def archive(target: str, dist: Path) -> Path:
    """The archive scripts/test built once for this run (tests/harness/archives.py), or, in a
    run without one, a build of this session's own."""
    return prebuilt(target) or build_pyz(target, dist, WORK_DIR)


@pytest.fixture(scope="session")
def pyz_dist(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


# Build tools per interpreter (the archives of a run by hand): no rebuilding them each time
# another CPython runs the tests. pip's download cache is shared.
WORK_DIR = ROOT / "build" / f"pyz-py{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.fixture(scope="session")
def appliance_pyz(pyz_dist) -> Path:
    """The control-plane archive for the machine the tests run on."""
    return archive(f"appliance-{HOST_MACHINE}", pyz_dist)


@pytest.fixture(scope="session")
def foreign_appliance_pyz(pyz_dist) -> Path:
    """The control-plane archive for the other supported machine."""
    return archive(f"appliance-{OTHER_MACHINE}", pyz_dist)


@pytest.fixture(scope="session")
def agent_pyz(pyz_dist) -> Path:
    require_agent()
    return archive("agent", pyz_dist)


@pytest.fixture(scope="session")
def worker_pyz(pyz_dist) -> Path:
    """The runtime worker's archive (architecture-free, like the agent's)."""
    return archive("worker", pyz_dist)


def unit_directives(unit: str) -> dict[str, list[str]]:
    """Every Key=value of systemd/UNIT, repeated keys kept in order."""
    found: dict[str, list[str]] = {}
    for line in (ROOT / "systemd" / unit).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def pyz_command(pyz: Path, *args: str) -> list[str]:
    """Run an archive with only the standard library around it (-I -S): nothing from this
    virtualenv or the system's site-packages can stand in for something the pyz lacks."""
    return [sys.executable, "-I", "-S", str(pyz), *args]


def shebang_env(**extra: str) -> dict[str, str]:
    """clean_env with this interpreter first on PATH: `./archive.pyz` runs under it through
    its `#!/usr/bin/env python3` line, as it runs under the system python3 on a host."""
    env = clean_env(**extra)
    here = Path(sys.base_prefix) / "bin"  # the interpreter itself, not this virtualenv
    assert (here / "python3").exists(), f"{here} has no python3 for the shebang to find"
    env["PATH"] = f"{here}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    return env


def init_pyz(pyz: Path, env: dict[str, str]) -> str:
    """``modelforge init --json`` from the control-plane archive: the first admin token."""
    init = subprocess.run(
        pyz_command(pyz, "init", "--json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert init.returncode == 0, init.stderr
    return json.loads(init.stdout)["admin_token"]


@contextlib.contextmanager
def serving_pyz(pyz: Path, env: dict[str, str], port: int, log_path: Path) -> Iterator[str]:
    """``modelforge serve`` from the control-plane archive on 127.0.0.1:PORT, its output in
    LOG_PATH, until the block ends: its URL, once /healthz answers."""
    with log_path.open("w") as log:
        process = subprocess.Popen(
            pyz_command(pyz, "serve", "--listen", f"127.0.0.1:{port}"),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_answering(url + "/healthz", process, log_path, timeout=60)
        yield url
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
