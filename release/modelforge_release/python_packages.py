"""Python packages for the image layers: hash-locked wheels installed with a locked pip.

The wheels are chosen for the image's interpreter and C library (CPython 3.11, glibc 2.36
on bookworm), never for whatever Python runs this tool, so any build host gives the same
files. pip itself comes from ``packaging/requirements-build.txt`` in a virtualenv of its
own, so its version (which shapes the installed metadata) is pinned too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .debian import DebianError

log = logging.getLogger(__name__)

MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
# The oldest manylinux baseline a wheel may target (manylinux1 = glibc 2.5).
_OLDEST_GLIBC_MINOR = 5


class PackagingError(DebianError):
    """Installing the locked Python packages failed."""


def manylinux_platforms(architecture: str, glibc: tuple[int, int]) -> list[str]:
    """Every platform tag a wheel may carry to run on this glibc, newest first."""
    machine = MACHINES.get(architecture)
    if machine is None:
        raise PackagingError(f"no wheel platform known for Debian architecture {architecture}")
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, _OLDEST_GLIBC_MINOR - 1, -1)]
    return [*tags, f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]


def _run(argv: list[str], what: str, **kwargs) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise PackagingError(f"{what} failed (exit {result.returncode}):\n{tail}")


def ensure_pip(work_dir: Path, build_lock: Path, cache_dir: Path) -> Path:
    """A virtualenv holding the locked pip; reused while the lock is unchanged."""
    tools = work_dir / "pip-tools"
    want = f"{sys.version_info[0]}.{sys.version_info[1]} {hashlib.sha256(build_lock.read_bytes()).hexdigest()}"
    stamp = tools / ".modelforge-pip"
    python = tools / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == want and python.exists():
        return python
    log.info("installing the locked pip into %s", tools)
    shutil.rmtree(tools, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(tools)], "creating the pip virtualenv")
    _run(
        [str(python), *_pip_options(cache_dir), "--require-hashes", "-r", str(build_lock)],
        "installing the locked build tools",
    )
    stamp.write_text(want)
    return python


def _pip_options(cache_dir: Path) -> list[str]:
    # --isolated: this machine's pip configuration (mirrors, constraints) must not change
    # what is installed; the hashes in the locks are PyPI's.
    return [
        "-m",
        "pip",
        "--isolated",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "install",
        "--cache-dir",
        str(cache_dir / "pip"),
    ]


def install_locked(
    pip_python: Path,
    requirements: Path,
    target: Path,
    *,
    cache_dir: Path,
    architecture: str,
    glibc: tuple[int, int],
    python_version: str,
) -> None:
    """Install exactly the wheels of a ``--generate-hashes`` lock into ``target``."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    platforms = [
        arg for tag in manylinux_platforms(architecture, glibc) for arg in ("--platform", tag)
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    _run(
        [
            str(pip_python),
            *_pip_options(cache_dir),
            "--require-hashes",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--no-compile",
            "--no-warn-script-location",
            "--implementation",
            "cp",
            "--python-version",
            python_version,
            *platforms,
            "--target",
            str(target),
            "-r",
            str(requirements),
        ],
        f"pip install -r {requirements.name}",
        env=env,
    )
    normalise(target)


def normalise(target: Path) -> None:
    """Drop what differs between builds or cannot run in the image: console-script shims
    (their shebang names the build interpreter) and their RECORD lines, byte code."""
    shutil.rmtree(target / "bin", ignore_errors=True)
    for record in target.glob("*.dist-info/RECORD"):
        lines = record.read_text(encoding="utf-8").splitlines(keepends=True)
        record.write_text("".join(line for line in lines if not line.startswith("../")))
    for cache in sorted(target.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache)
