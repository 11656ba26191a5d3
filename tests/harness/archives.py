"""The four archives the suite reads, built once per run.

scripts/test runs ``python -m tests.harness.archives DIR`` before pytest and exports
MF_TEST_ARCHIVES=DIR; every part, on every CPython, then reads the same files instead of
building its own. Without the variable (a single test run by hand) the packaging fixtures
build what they need, as before. The reproducibility test still makes a second build of its
own and compares it byte for byte with these.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .caches import machine_cache

ROOT = Path(__file__).resolve().parents[2]
ARCHIVES_ENV = "MF_TEST_ARCHIVES"
# Any fixed value: two builds of the same tree with the same epoch must match.
SOURCE_DATE_EPOCH = "1767225600"
OUTPUTS = {
    "appliance-x86_64": "modelforge-x86_64.pyz",
    "appliance-aarch64": "modelforge-aarch64.pyz",
    "agent": "modelforge-node-agent.pyz",
    "worker": "modelforge-runtime-worker.pyz",
}


def pip_cache() -> Path:
    """The wheels the archives are made of, kept between runs and clones."""
    return machine_cache("pyz-pip")


def run_build(
    targets: list[str], dist: Path, work_dir: Path, source_root: Path = ROOT
) -> subprocess.CompletedProcess:
    """packaging/build_pyz.py for TARGETS into DIST, with the suite's fixed epoch."""
    return subprocess.run(
        [sys.executable, str(source_root / "packaging" / "build_pyz.py"), *targets,
         "--dist", str(dist), "--work-dir", str(work_dir), "--pip-cache", str(pip_cache())],
        env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip


def prebuilt(target: str) -> Path | None:
    """The archive of TARGET that scripts/test built for this run, or None without one."""
    folder = os.environ.get(ARCHIVES_ENV)
    if not folder:
        return None
    path = Path(folder) / OUTPUTS[target]
    if not path.is_file():
        raise FileNotFoundError(f"{ARCHIVES_ENV}={folder} holds no {OUTPUTS[target]}")
    return path


def main() -> int:
    dist = Path(sys.argv[1]).resolve()
    started = time.monotonic()
    work = ROOT / "build" / f"pyz-py{sys.version_info[0]}.{sys.version_info[1]}"
    result = run_build(["appliance", "agent", "worker"], dist, work)
    if result.returncode != 0:
        print(f"building the archives failed:\n{result.stdout}{result.stderr}", file=sys.stderr)
        return 1
    names = ", ".join(sorted(OUTPUTS.values()))
    print(f"built {names} in {time.monotonic() - started:.0f} s into {dist}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
