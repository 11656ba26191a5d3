"""Every module compiles and imports on this CPython (scripts/test runs this file on each
supported one): the syntax, the standard library and the pinned wheels each interpreter gets."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("contract", "appliance", "agent", "worker", "release")
# Python outside the import packages: build and release scripts, tests, benchmarks.
SCRIPTS = ("packaging", "tests", "bench", "scripts")


def our_modules() -> list[str]:
    """Every module of every import package, by dotted name (``__main__`` runs; left out)."""
    names = []
    for part in PARTS:
        for path in sorted((ROOT / part).glob("modelforge_*/**/*.py")):
            dotted = path.relative_to(ROOT / part).with_suffix("").parts
            if dotted[-1] == "__main__":
                continue
            names.append(".".join(dotted[:-1] if dotted[-1] == "__init__" else dotted))
    return names


def test_every_python_file_of_the_tree_compiles():
    files = [p for part in PARTS + SCRIPTS for p in sorted((ROOT / part).rglob("*.py"))]
    files += [p for p in (ROOT / "scripts").rglob("*") if p.is_file() and _is_python_script(p)]
    assert len(files) > 300
    for path in files:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)


def _is_python_script(path: Path) -> bool:
    """An executable script without .py whose #! line names python (scripts/*-build…)."""
    first = path.read_bytes().split(b"\n", 1)[0]
    return path.suffix != ".py" and first.startswith(b"#!") and b"python" in first


@pytest.mark.parametrize("part", PARTS)
def test_every_module_imports(part):
    names = [n for n in our_modules() if n.split(".")[0] == _package_of(part)]
    assert names
    for name in names:
        importlib.import_module(name)


def _package_of(part: str) -> str:
    (package,) = (ROOT / part).glob("modelforge_*")
    return package.name
