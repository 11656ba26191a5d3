"""The pyz builds: reproducible, hash-locked, and split by part (DESIGN §1)."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from modelforge_contract import PROTOCOL_VERSION, __version__
from tests.support import tomllib

from .conftest import ROOT, build_pyz, clean_env, pyz_command, require_agent

APPLIANCE_NEEDS = {
    "modelforge_contract",
    "modelforge_appliance",
    "bottle",
    "waitress",
    "peewee",
    "psycopg2",
    "bcrypt",
    "click",
}
APPLIANCE_MUST_NOT = {"pynvml", "docker", "requests", "urllib3", "modelforge_node_agent"}
AGENT_NEEDS = {
    "modelforge_contract",
    "modelforge_node_agent",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset_normalizer",
    "pynvml",
    "click",
}
AGENT_MUST_NOT = {
    "bottle",
    "peewee",
    "playhouse",
    "bcrypt",
    "waitress",
    "psycopg2",
    "modelforge_appliance",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def top_level(pyz: Path) -> set[str]:
    """Import names at the top of the archive's site-packages (dist-info excluded)."""
    names = set()
    with zipfile.ZipFile(pyz) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if parts[0] == "site-packages" and len(parts) > 1:
                head = parts[1]
                if not head.endswith((".dist-info", ".libs")):
                    names.add(head.removesuffix(".py"))
    return names


def copy_source_tree(destination: Path) -> Path:
    """The working tree as a fresh clone would have it (tracked and unignored files), elsewhere."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    return destination


@pytest.mark.slow
@pytest.mark.parametrize("target", ["appliance", "agent"])
def test_rebuild_elsewhere_is_byte_identical(target, request, tmp_path):
    """Same tree and SOURCE_DATE_EPOCH, another path, fresh build tools: the same bytes."""
    if target == "agent":
        require_agent()
    first = request.getfixturevalue(f"{target}_pyz")
    tree = copy_source_tree(tmp_path / "checkout")
    second = build_pyz(target, tmp_path / "dist", tmp_path / "work", source_root=tree)
    assert sha256(second) == sha256(first)


def test_appliance_pyz_carries_the_control_plane_and_nothing_for_nodes(appliance_pyz):
    names = top_level(appliance_pyz)
    assert names >= APPLIANCE_NEEDS, f"missing: {APPLIANCE_NEEDS - names}"
    assert not APPLIANCE_MUST_NOT & names, f"must not carry: {APPLIANCE_MUST_NOT & names}"


def test_agent_pyz_carries_no_control_plane_dependencies(agent_pyz):
    names = top_level(agent_pyz)
    assert names >= AGENT_NEEDS, f"missing: {AGENT_NEEDS - names}"
    assert not AGENT_MUST_NOT & names, f"must not carry: {AGENT_MUST_NOT & names}"


@pytest.mark.parametrize("target", ["appliance", "agent"])
def test_archive_entries_are_normalised(target, request):
    """One timestamp, no bytecode, no console-script shims naming the build interpreter."""
    if target == "agent":
        require_agent()
    pyz = request.getfixturevalue(f"{target}_pyz")
    with zipfile.ZipFile(pyz) as archive:
        infos = archive.infolist()
        environment = archive.read("environment.json").decode()
    assert {info.date_time for info in infos} == {(2026, 1, 1, 0, 0, 0)}
    assert not [info.filename for info in infos if info.filename.endswith(".pyc")]
    assert not [info.filename for info in infos if info.filename.startswith("site-packages/bin/")]
    assert f'"build_id": "{__version__}-' in environment
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3.11\n")


@pytest.mark.parametrize("target", ["appliance", "agent"])
def test_pyz_prints_version_and_protocol(target, request, tmp_path):
    if target == "agent":
        require_agent()
    pyz = request.getfixturevalue(f"{target}_pyz")
    result = subprocess.run(
        pyz_command(pyz, "--version"),
        env=clean_env(SHIV_ROOT=str(tmp_path / "shiv")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout
    assert re.search(rf"protocol {PROTOCOL_VERSION}\b", result.stdout), result.stdout


def locked_pins(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of --hash options) from a pip-compile --generate-hashes file."""
    pins: dict[str, tuple[str, int]] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, _, version = requirement.partition("==")
        pins[name.lower()] = (
            version,
            sum(option.startswith("--hash=sha256:") for option in options),
        )
    return pins


@pytest.mark.parametrize(
    ("extra", "lock"),
    [("appliance", "requirements-appliance.txt"), ("agent", "requirements-agent.txt")],
)
def test_lock_files_pin_what_pyproject_pins_with_hashes(extra, lock):
    """The pyz ships exactly the versions the tests ran against, each hash-checked."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"][extra]
    pins = locked_pins(ROOT / "packaging" / lock)
    for requirement in wanted:
        name, _, version = requirement.partition("==")
        assert name.lower() in pins, f"{lock} lacks {name}; run packaging/lock.sh"
        assert pins[name.lower()][0] == version, f"{lock} pins {name} {pins[name.lower()][0]}"
    for name, (version, hashes) in pins.items():
        assert version, f"{lock}: {name} is not pinned with =="
        assert hashes >= 1, f"{lock}: {name} has no --hash"
