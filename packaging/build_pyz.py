#!/usr/bin/env python3
"""Build the ModelForge archives with shiv: one control-plane archive per machine
architecture (dist/modelforge-x86_64.pyz, dist/modelforge-aarch64.pyz) and two
architecture-free node archives: the agent's (dist/modelforge-node-agent.pyz) and the
runtime worker's (dist/modelforge-runtime-worker.pyz).

    python3 packaging/build_pyz.py                     # all four
    python3 packaging/build_pyz.py appliance           # both control-plane archives
    python3 packaging/build_pyz.py appliance-aarch64   # or: appliance-x86_64, agent, worker

Standard library only, so it runs before any virtualenv exists, on any supported
CPython of any architecture: wheels are chosen by explicit interpreter and platform
tags, never by the build host. Each pyz is made from exactly one hash-locked
requirement set (packaging/requirements-*.txt, installed with --require-hashes)
plus the first-party import packages it needs, so the dependency split is decided
here and checked before the archive is written.

One control-plane archive runs on every supported CPython: its compiled modules
carry the interpreter in their file name (``_psycopg.cpython-312-x86_64-linux-gnu.so``),
so the wheels for CPython 3.10 to 3.13 are installed one after the other and their
compiled modules put side by side. Every other file of those wheels must be
byte-identical to the one already staged, or the build stops. A wheel built for the
stable ABI (``abi3``: bcrypt's, cryptography's) loads on every CPython from its floor up,
so it is installed once, for the oldest; the newer interpreters' rounds leave it out
(cryptography publishes a cp38-abi3 and a cp311-abi3 build, which could not both be
carried under the one name ``_rust.abi3.so``). The agent and worker archives are
installed from implementation-independent wheels only (``py3-none-any``), so they hold
no compiled module at all.

Reproducible: the same commit and SOURCE_DATE_EPOCH give byte-identical files.
SOURCE_DATE_EPOCH defaults to the commit time of HEAD. The staging tree is
normalised before shiv zips it (sorted, one timestamp, fixed modes, no .pyc, no
console-script shims whose shebang would name the build interpreter), and shiv's
build id is derived from the staged content, so a changed file always gets a
fresh extraction directory under SHIV_ROOT and an unchanged one never does.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# A sibling module: this folder is on sys.path when the script runs (and for the tests).
from wheel_merge import (
    COMPILED,
    BuildError,
    add_interpreter,
    compiled_problems,
    elf_machine,
    files_of,
)

log = logging.getLogger("build_pyz")

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
# Shebang of every archive: whichever python3 the system has; the launcher
# (packaging/pyz_launcher.py) refuses one the archive cannot run on, in one line.
SHEBANG = "/usr/bin/env python3"
# The CPython versions whose compiled modules the control-plane archives carry
# (pyproject.toml requires-python and doctor.SUPPORTED_PYTHONS say the same; a test checks).
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
LAUNCHER = PACKAGING / "pyz_launcher.py"
LAUNCHER_MODULE = "modelforge_launcher"
# Published as an sdist only; built from its hash-checked sdist with the locked
# setuptools. NO_SQLITE=1 keeps it pure Python (its optional C extension would
# embed build paths and is not used by ModelForge).
SDIST_ONLY = ("peewee",)
# Import packages and their folders (pyproject.toml finds them under the same roots).
SOURCE_DIRS = {
    "modelforge_contract": ROOT / "contract" / "modelforge_contract",
    "modelforge_appliance": ROOT / "appliance" / "modelforge_appliance",
    "modelforge_node_agent": ROOT / "agent" / "modelforge_node_agent",
    "modelforge_worker": ROOT / "worker" / "modelforge_worker",
}


@dataclass(frozen=True)
class Machine:
    """A CPU architecture the control plane ships for, as `uname -m` names it."""

    name: str
    # The glibc wheels are chosen for (manylinux_<glibc>_<name> and older), and so the
    # oldest system the archive runs on. psycopg2-binary publishes x86_64 wheels for
    # glibc 2.17 and aarch64 wheels for glibc 2.28.
    glibc: str
    # ELF e_machine of its code (62 = x86-64, 183 = AArch64).
    elf_machine: int

    def wheel_platforms(self) -> list[str]:
        """Every manylinux tag a host with this glibc loads, newest first, as pip on such a
        host would list them; pip's --platform takes only the tags it is given (cffi's
        aarch64 wheels say glibc 2.17, and load on 2.28 all the same)."""
        arch = self.name
        newest = int(self.glibc.split(".")[1])
        tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 16, -1)]
        return [*tags, f"manylinux2014_{arch}"]  # the legacy name of manylinux_2_17


MACHINES = {
    "x86_64": Machine("x86_64", "2.17", 62),
    "aarch64": Machine("aarch64", "2.28", 183),
}


@dataclass(frozen=True)
class Target:
    name: str
    output: str
    entry_point: str
    requirements: str
    packages: tuple[str, ...]
    # Top-level names that must not be in the archive (docs/architecture.md §1: the split).
    forbidden: tuple[str, ...]
    # None: implementation-independent wheels only, no compiled module anywhere.
    machine: Machine | None = None


# Neither node archive carries the control plane or its web and store libraries.
NODE_FORBIDDEN = (
    "bottle",
    "peewee",
    "playhouse",
    "bcrypt",
    "waitress",
    "psycopg2",
    "modelforge_appliance",
)
APPLIANCE_FORBIDDEN = ("pynvml", "docker", "requests", "modelforge_node_agent", "modelforge_worker")


def appliance_output(machine: str) -> str:
    return f"modelforge-{machine}.pyz"


TARGETS = {
    **{
        f"appliance-{machine.name}": Target(
            name=f"appliance-{machine.name}",
            output=appliance_output(machine.name),
            entry_point="modelforge_appliance.cli.main:main",
            requirements="requirements-appliance.txt",
            packages=("modelforge_contract", "modelforge_appliance"),
            forbidden=APPLIANCE_FORBIDDEN,
            machine=machine,
        )
        for machine in MACHINES.values()
    },
    "agent": Target(
        name="agent",
        output="modelforge-node-agent.pyz",
        entry_point="modelforge_node_agent.main:main",
        requirements="requirements-agent.txt",
        packages=("modelforge_contract", "modelforge_node_agent"),
        forbidden=(*NODE_FORBIDDEN, "modelforge_worker"),
    ),
    # The runtime worker for a systemd host (systemd/modelforge-runtime-worker.service): the
    # images' lock (docker SDK, nvidia-ml-py, their pure-Python dependencies), none of the
    # CUDA runtime wheel; the smoke needs only the driver's libcuda.so.1.
    "worker": Target(
        name="worker",
        output="modelforge-runtime-worker.pyz",
        entry_point="modelforge_worker.server:main",
        requirements="requirements-worker.txt",
        packages=("modelforge_contract", "modelforge_worker"),
        forbidden=(
            *NODE_FORBIDDEN,
            "modelforge_node_agent",
            "nvidia",  # nvidia-cuda-runtime-cu12, the CUDA image's wheel
        ),
    ),
}
# Names that stand for several targets.
GROUPS = {"appliance": tuple(f"appliance-{machine}" for machine in MACHINES)}


def run(argv: list[str], **kwargs) -> None:
    log.debug("running %s", " ".join(argv))
    result = subprocess.run(argv, check=False, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"{Path(argv[0]).name} {argv[1:4]} … exited {result.returncode}")


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH, else the commit time of HEAD, else 1980-01-01 (the zip minimum)."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return int(out)
    except (OSError, subprocess.CalledProcessError, ValueError):
        log.warning("no SOURCE_DATE_EPOCH and no git commit; using 1980-01-01")
        return 315532800


def project_version() -> str:
    text = (SOURCE_DIRS["modelforge_contract"] / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if match is None:
        raise BuildError("modelforge_contract/__init__.py has no __version__")
    return match.group(1)


def pip_args(index_url: str | None, pip_cache: Path) -> list[str]:
    # --isolated: no user or site pip configuration (mirrors, find-links) changes what
    # is installed; the hashes in the lock files are PyPI's, pip's default index.
    index = ["--index-url", index_url] if index_url else []
    return [
        "-m",
        "pip",
        "--isolated",
        "--disable-pip-version-check",
        "--no-input",
        "install",
        *index,
        "--cache-dir",
        str(pip_cache),
        "--require-hashes",
        "--no-deps",
    ]


def ensure_tools(work_dir: Path, index_url: str | None, pip_cache: Path) -> Path:
    """A virtualenv with the locked shiv, pip, setuptools and wheel; reused while the lock is unchanged."""
    tools = work_dir / "tools"
    lock = PACKAGING / "requirements-build.txt"
    want = f"{sys.version_info[0]}.{sys.version_info[1]} {sha256_file(lock)}"
    stamp = tools / ".modelforge-build-tools"
    if stamp.is_file() and stamp.read_text() == want:
        return tools / "bin" / "python"
    log.info("installing the build tools (shiv) into %s", tools)
    shutil.rmtree(tools, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(tools)])
    python = tools / "bin" / "python"
    run([str(python), *pip_args(index_url, pip_cache), "--quiet", "-r", str(lock)])
    stamp.write_text(want)
    return python


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_entry_point(target: Target) -> None:
    module, _, function = target.entry_point.partition(":")
    package, _, rest = module.partition(".")
    path = SOURCE_DIRS[package].joinpath(*rest.split(".")).with_suffix(".py")
    if not path.is_file():
        raise BuildError(
            f"entry point {target.entry_point} is missing: {path.relative_to(ROOT)} does not "
            f"exist, so {target.output} cannot be built"
        )
    if not re.search(rf"^def {function}\(", path.read_text(encoding="utf-8"), re.M):
        raise BuildError(
            f"entry point {target.entry_point} is missing: {path.relative_to(ROOT)} defines "
            f"no top-level {function}()"
        )


def wheel_tags(target: Target, python: str) -> list[str]:
    """pip options that pick wheels for ``python`` on the target's platform, whatever runs pip."""
    if target.machine is None:
        # Implementation-independent wheels only: pip refuses anything compiled.
        return ["--implementation", "py", "--abi", "none", "--platform", "any",
                "--python-version", python]  # fmt: skip
    abi = "cp" + python.replace(".", "")
    platforms = [arg for tag in target.machine.wheel_platforms() for arg in ("--platform", tag)]
    return ["--implementation", "cp", "--abi", abi, *platforms,
            "--python-version", python]  # fmt: skip


def locked_blocks(requirements: Path) -> dict[str, str]:
    """name -> its requirement line with every --hash continuation, from a pip-compile lock."""
    blocks: dict[str, str] = {}
    text = requirements.read_text(encoding="utf-8").replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0].lower().replace("_", "-")
            blocks[name] = line
    return blocks


def install_dependencies(
    python: Path,
    target: Target,
    staging: Path,
    index_url: str | None,
    pip_cache: Path,
    for_python: str,
    without: tuple[str, ...] = (),
) -> None:
    """pip install the target's lock (less ``without``) for CPython ``for_python`` into staging."""
    env = {**os.environ, "NO_SQLITE": "1", "PYTHONHASHSEED": "0"}
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    requirements = PACKAGING / target.requirements
    if without:
        blocks = locked_blocks(requirements)
        filtered = staging.parent / f"{staging.name}.requirements.txt"
        filtered.write_text("".join(f"{line}\n" for name, line in sorted(blocks.items())
                                    if name not in without))  # fmt: skip
        requirements = filtered
    sdists = [name for name in SDIST_ONLY if name in locked_blocks(requirements)]
    argv = [
        str(python),
        *pip_args(index_url, pip_cache),
        "--quiet",
        "--no-compile",
        "--no-build-isolation",
        "--no-warn-script-location",
        *wheel_tags(target, for_python),
        "--only-binary",
        ":all:",
        *[arg for name in sdists for arg in ("--no-binary", name)],
        "--target",
        str(staging),
        "-r",
        str(requirements),
    ]
    run(argv, env=env)


def stable_abi_distributions(staging: Path) -> tuple[str, ...]:
    """The staged distributions whose wheel is built for the stable ABI only (every Tag line
    ``cpXY-abi3-…``): one build that every CPython from cpXY up loads."""
    names = []
    for wheel in sorted(staging.glob("*.dist-info/WHEEL")):
        tags = [
            line.split(":", 1)[1].strip()
            for line in wheel.read_text(encoding="utf-8").splitlines()
            if line.startswith("Tag:")
        ]
        if tags and all(tag.split("-")[1] == "abi3" for tag in tags):
            name = wheel.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0]
            names.append(name.lower().replace("_", "-"))
    return tuple(sorted(names))


def stage_dependencies(
    python: Path, target: Target, staging: Path, work: Path, index_url: str | None, pip_cache: Path
) -> None:
    """The locked wheels for the first supported CPython, then the compiled modules of the rest."""
    install_dependencies(python, target, staging, index_url, pip_cache, PYTHONS[0])
    if target.machine is None:
        return
    # Source-only packages are pure Python, and stable-ABI wheels load on every CPython
    # from their floor up: both are installed once, above.
    once = (*SDIST_ONLY, *stable_abi_distributions(staging))
    log.info("%s: installed once for every CPython: %s", target.output, ", ".join(once))
    for version in PYTHONS[1:]:
        other = work / f"cp{version.replace('.', '')}"
        shutil.rmtree(other, ignore_errors=True)
        other.mkdir(parents=True)
        install_dependencies(python, target, other, index_url, pip_cache, version, without=once)
        added = add_interpreter(staging, other, version, files_of(staging, once))
        log.info("%s: %d compiled module(s) for CPython %s", target.output, added, version)
        shutil.rmtree(other)


def copy_first_party(target: Target, staging: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", "*~", ".*.swp")
    for package in target.packages:
        shutil.copytree(SOURCE_DIRS[package], staging / package, ignore=ignore)


def launcher_settings(target: Target) -> dict[str, object]:
    """What packaging/pyz_launcher.py checks before the real entry point runs."""
    return {
        "name": target.output,
        "entry": target.entry_point,
        "pythons": list(PYTHONS) if target.machine else None,
        "min_python": PYTHONS[0],
        "machine": target.machine.name if target.machine else None,
        "glibc": target.machine.glibc if target.machine else None,
        "siblings": {name: appliance_output(name) for name in MACHINES} if target.machine else {},
    }


def write_launcher(target: Target, staging: Path) -> None:
    source = LAUNCHER.read_text(encoding="utf-8")
    # A Python literal (None, not null), keys in a fixed order for reproducibility.
    filled = repr(dict(sorted(launcher_settings(target).items())))
    if source.count("\nARCHIVE = {}\n") != 1:
        raise BuildError(f"{LAUNCHER.relative_to(ROOT)} lost its `ARCHIVE = {{}}` line")
    (staging / f"{LAUNCHER_MODULE}.py").write_text(
        source.replace("\nARCHIVE = {}\n", f"\nARCHIVE = {filled}\n"), encoding="utf-8"
    )


def normalise(staging: Path) -> None:
    """Remove what would differ between two builds of the same commit."""
    # Console-script shims carry the build interpreter in their shebang; shiv runs
    # the entry point itself, so they are dead weight. Their RECORD lines go too.
    shutil.rmtree(staging / "bin", ignore_errors=True)
    for record in staging.glob("*.dist-info/RECORD"):
        lines = record.read_text(encoding="utf-8").splitlines(keepends=True)
        record.write_text("".join(line for line in lines if not line.startswith("../")))
    for cache in sorted(staging.rglob("__pycache__"), reverse=True):
        shutil.rmtree(cache)
    for path in staging.rglob("*"):
        if path.is_symlink():
            raise BuildError(f"unexpected symlink in the staging tree: {path}")
        if path.is_dir():
            path.chmod(0o755)
        else:
            path.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)


def check_staging(target: Target, staging: Path, build_dirs: tuple[Path, ...]) -> None:
    """The split and the path-freedom are checked here, before anything is shipped."""
    present = {path.name for path in staging.iterdir()}
    top_level = {name.removesuffix(".py") for name in present}
    leaked = sorted(set(target.forbidden) & top_level)
    if leaked:
        raise BuildError(
            f"{target.output} would carry {', '.join(leaked)}; fix the requirement set"
        )
    machine = target.machine
    problems = compiled_problems(
        machine.name if machine else None,
        machine.elf_machine if machine else None,
        PYTHONS,
        sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()),
        read_elf=lambda name: elf_machine(staging / name),
    )
    if problems:
        raise BuildError(f"{target.output} would not run everywhere it claims: {problems[0]}")
    for path in staging.rglob("*"):
        if path.is_file() and not COMPILED.search(path.name):
            data = path.read_bytes()
            for build_dir in build_dirs:
                if str(build_dir).encode() in data:
                    raise BuildError(
                        f"{path.relative_to(staging)} names the build directory {build_dir}; "
                        "the archive would not be reproducible"
                    )


def content_id(staging: Path) -> str:
    """SHA-256 over every staged path and its bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(staging.rglob("*"), key=lambda p: p.relative_to(staging).as_posix()):
        if path.is_file():
            digest.update(path.relative_to(staging).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def build(
    target: Target, dist: Path, work_dir: Path, index_url: str | None, pip_cache: Path, epoch: int
) -> Path:
    started = time.monotonic()
    check_entry_point(target)
    python = ensure_tools(work_dir, index_url, pip_cache)
    staging = work_dir / target.name / "site-packages"
    shutil.rmtree(staging.parent, ignore_errors=True)
    staging.mkdir(parents=True)
    stage_dependencies(python, target, staging, staging.parent, index_url, pip_cache)
    copy_first_party(target, staging)
    write_launcher(target, staging)
    normalise(staging)
    check_staging(target, staging, (work_dir.resolve(), ROOT, pip_cache.resolve()))

    version = project_version()
    build_id = f"{version}-{content_id(staging)[:32]}"
    dist.mkdir(parents=True, exist_ok=True)
    output = dist / target.output
    partial = dist / f".{target.output}.partial"
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "PYTHONHASHSEED": "0"}
    argv = [
        str(python),
        "-m",
        "shiv",
        "--site-packages",
        str(staging),
        "--entry-point",
        f"{LAUNCHER_MODULE}:main",
        "--output-file",
        str(partial),
        "--python",
        SHEBANG,
        "--reproducible",
        "--compressed",
        "--build-id",
        build_id,
    ]
    # shiv warns on stderr whenever --build-id is given; ours is derived from content.
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"shiv failed for {target.output}:\n{result.stdout}{result.stderr}")
    partial.chmod(0o755)
    partial.replace(output)
    log.info(
        "built %s (%.1f MiB, sha256 %s, build id %s) in %.1fs",
        output,
        output.stat().st_size / (1 << 20),
        sha256_file(output),
        build_id,
        time.monotonic() - started,
    )
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "targets",
        nargs="*",
        help=f"{', '.join([*GROUPS, *TARGETS])} (default: every archive)",
    )
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="output directory")
    parser.add_argument(
        "--work-dir", type=Path, default=ROOT / "build" / "pyz", help="staging and tools"
    )
    parser.add_argument(
        "--pip-cache",
        type=Path,
        default=None,
        help="pip's download and wheel cache (default: WORK_DIR/pip-cache)",
    )
    parser.add_argument(
        "--index-url",
        default=None,
        help="package index holding the locked files (default: pip's default index, PyPI)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS) - set(GROUPS))
    if unknown:
        parser.error(
            f"unknown target {', '.join(unknown)}; choose from {', '.join([*GROUPS, *TARGETS])}"
        )
    names = [
        name for wanted in args.targets or list(TARGETS) for name in GROUPS.get(wanted, (wanted,))
    ]
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="build_pyz: %(message)s"
    )
    # Modes of staged and tool files feed the archive; fix them regardless of the caller.
    os.umask(0o022)
    if sys.version_info[:2] < (3, 10):  # noqa: UP036 (said plainly, not as a SyntaxError)
        log.error("run this with Python 3.10 or newer")
        return 2
    work_dir = args.work_dir.absolute()
    pip_cache = (args.pip_cache or work_dir / "pip-cache").absolute()
    epoch = source_date_epoch()
    try:
        for name in dict.fromkeys(names):
            build(TARGETS[name], args.dist.absolute(), work_dir, args.index_url, pip_cache, epoch)
    except BuildError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
