"""The wheel pip builds from this tree, installed the way an operator installs it: into a
fresh virtualenv, not editable, with the extras docs/work.md names. Every package folder of
the tree must be in it and import from it, and every command must start (``--help``).

The archives copy whole folders and the rest of the suite runs on an editable install, so
nothing else would notice a package the build leaves out (as it once left out relay/,
deployments/ and the worker's runtimes/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.harness.control_plane import clean_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Each part's folder and the import package in it (pyproject.toml's packages.find roots).
ROOTS = ("contract", "appliance", "agent", "worker", "release")
COMMANDS = (
    "modelforge",
    "modelforge-node-agent",
    "modelforge-runtime-worker",
    "modelforge-release",
)


def tree_packages() -> dict[str, Path]:
    """Every package folder of the tree (one with an __init__.py), by its dotted name."""
    found = {}
    for root in ROOTS:
        for init in sorted((ROOT / root).glob("modelforge_*/**/__init__.py")):
            folder = init.parent
            found[".".join(folder.relative_to(ROOT / root).parts)] = folder
    return found


def tree_files() -> set[str]:
    """Every file under each part's import package (templates, static files and vendored
    libraries too), as a wheel names it; bytecode aside."""
    files = set()
    for root in ROOTS:
        for path in (ROOT / root).glob("modelforge_*/**/*"):
            inside = path.relative_to(ROOT / root)
            if path.is_file() and "__pycache__" not in inside.parts and path.suffix != ".pyc":
                files.add(inside.as_posix())
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tree's files: setuptools' build/ folder keeps what an earlier
    build staged (a deleted module would ride along), and the tree stays untouched."""
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    for root in ROOTS:
        shutil.copytree(ROOT / root, source / root, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
         "--quiet", "--wheel-dir", str(out), str(source)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("modelforge-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel and every extra a host installs (not editable)."""
    home = tmp_path_factory.mktemp("venv") / "venv"
    venv.EnvBuilder(with_pip=True).create(home)
    python = home / "bin" / "python"
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
         f"{wheel}[appliance,agent,worker,release]"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return home


def test_the_wheel_holds_every_file_of_every_package_folder(wheel):
    packages = tree_packages()
    assert {"modelforge_appliance.relay", "modelforge_worker.runtimes"} <= set(packages)
    with zipfile.ZipFile(wheel) as archive:
        inside = {n for n in archive.namelist() if not n.startswith("modelforge-")}
    missing = sorted(tree_files() - inside)
    assert missing == [], f"the wheel leaves out {missing}"
    # Nothing beyond our import packages: no tests, no packaging scripts, no build output.
    assert {n.split("/")[0] for n in inside} == {name.split(".")[0] for name in packages}


def test_every_package_imports_from_the_installed_wheel(installed, tmp_path):
    packages = sorted(tree_packages())
    script = (
        "import importlib, json, sys\n"
        "print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))\n"
    )
    # -I: neither the tree (the working directory) nor PYTHONPATH can stand in for the wheel
    result = subprocess.run(
        [str(installed / "bin" / "python"), "-I", "-c", script, *packages],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name, path in json.loads(result.stdout).items():
        assert Path(path).is_relative_to(installed), f"{name} came from {path}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_of_the_installed_wheel_starts(installed, tmp_path, command):
    result = subprocess.run(
        [str(installed / "bin" / command), "--help"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Usage: "), result.stdout
    assert "Traceback" not in result.stderr


def test_the_console_is_served_from_the_installed_wheel(installed, tmp_path):
    """The templates and static files are package data: a console built from the installed
    package finds its sign-in page and script."""
    script = (
        "from importlib import resources\n"
        "console = resources.files('modelforge_appliance.console')\n"
        "assert console.joinpath('static', 'console.js').is_file()\n"
        "print(sorted(p.name for p in console.joinpath('templates').iterdir()))\n"
    )
    result = subprocess.run(
        [str(installed / "bin" / "python"), "-I", "-c", script],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    templates = sorted(
        p.name for p in (ROOT / "appliance/modelforge_appliance/console/templates").iterdir()
    )
    assert json.loads(result.stdout.replace("'", '"')) == templates
