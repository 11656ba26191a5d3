"""The appliance's import graph: no circle anywhere, lazy imports inside functions included,
and at most four loose modules beside its subpackages (docs/architecture.md §8).

import-linter (``lint-imports`` in scripts/test) checks the layer order; this test checks what
it does not: imports inside functions count, and so does a circle within one layer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "appliance" / "modelforge_appliance"
NAME = "modelforge_appliance"
LOOSE_MODULES_ALLOWED = 4


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by the name of its folder)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the package it imports, at the top or inside a function."""
    modules = module_names(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    targets.append(submodule if submodule in modules else module)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ that only names its part imports nothing; one that re-exports
    (``cli/__init__`` gives ``main``) is entered from its own modules only by Python itself."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_the_appliance_has_no_import_circle_lazy_imports_included():
    found = circles(without_package_inits(import_graph(PACKAGE)))
    assert found == [], f"import circles in the appliance: {found}"


def test_the_circle_finder_sees_a_lazy_import(tmp_path):
    """The check above could not fail if it missed imports inside functions: a package of two
    modules that import each other, one of them lazily, is a circle."""
    package = tmp_path / NAME
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpha.py").write_text("from . import beta\n")
    (package / "beta.py").write_text("def late():\n    from .alpha import x\n")
    assert circles(import_graph(package)) == [[f"{NAME}.alpha", f"{NAME}.beta"]]


def test_the_appliance_keeps_at_most_four_loose_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= LOOSE_MODULES_ALLOWED, loose


@pytest.fixture
def violating_module():
    """A module in the bottom layer that imports from the top one, removed afterwards."""
    path = PACKAGE / "core" / "_layer_violation_for_test.py"
    path.write_text(
        '"""Deliberately wrong: core may not import the CLI."""\n\nfrom ..cli import main\n'
    )
    yield path
    path.unlink()


@pytest.mark.checkout  # it writes a module into this checkout: runs once, alone
def test_lint_imports_refuses_a_module_that_breaks_the_layers(violating_module):
    """The contract in pyproject.toml is live: core importing the CLI breaks it."""
    lint = Path(sys.executable).with_name("lint-imports")
    clean = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert clean.returncode != 0, clean.stdout
    assert "_layer_violation_for_test" in clean.stdout
    assert "BROKEN" in clean.stdout.upper()
