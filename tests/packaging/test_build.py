"""The pyz builds: reproducible, hash-locked, and split by part (docs/architecture.md §1)."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from modelforge_appliance.runtime import doctor
from modelforge_contract import PROTOCOL_VERSION, WORKER_PROTOCOL_VERSION, __version__
from tests.harness.archives import OUTPUTS, run_build
from tests.harness.control_plane import clean_env, tomllib

from .conftest import (
    HOST_MACHINE,
    OTHER_MACHINE,
    ROOT,
    load_packaging_module,
    pyz_command,
    require_agent,
    shebang_env,
)

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

APPLIANCE_NEEDS = {
    "modelforge_contract",
    "modelforge_appliance",
    "bottle",
    "waitress",
    "peewee",
    "psycopg2",
    "bcrypt",
    "click",
    # Work secrets are sealed with its AEAD; cffi and the rest are what it needs.
    "cryptography",
    "cffi",
    "pycparser",
    "typing_extensions",
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
WORKER_NEEDS = {
    "modelforge_contract",
    "modelforge_worker",
    "docker",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset_normalizer",
    "pynvml",
    "click",
}
# Nor the CUDA runtime wheel (`nvidia`): the image carries it, the host's driver is enough.
WORKER_MUST_NOT = {*AGENT_MUST_NOT, "modelforge_node_agent", "nvidia"}


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


FIXTURES = {
    f"appliance-{HOST_MACHINE}": "appliance_pyz",
    f"appliance-{OTHER_MACHINE}": "foreign_appliance_pyz",
    "agent": "agent_pyz",
    "worker": "worker_pyz",
}
ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
# Anything built for one CPython carries its tag in the name: cpython-312.
VERSION_TIED = re.compile(r"\.cpython-(\d)(\d+)[-.]")


def supported_pythons() -> list[str]:
    """CPython minor versions pyproject.toml's requires-python admits (">=3.10,<3.14")."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", requires).groups()
    return [f"3.{minor}" for minor in range(int(low), int(high))]


def archive_files(pyz: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(pyz) as archive:
        return {
            info.filename: archive.read(info)
            for info in archive.infolist()
            if not info.is_dir() and info.filename.startswith("site-packages/")
        }


def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    """A second build of all four archives from a copy of the tree elsewhere, with fresh build
    tools and the same SOURCE_DATE_EPOCH: the folder they are in."""
    work = tmp_path_factory.mktemp("rebuild")
    tree = copy_source_tree(work / "checkout")
    result = run_build(["appliance", "agent", "worker"], work / "dist", work / "tools", tree)
    if result.returncode != 0:
        pytest.fail(f"the second build failed:\n{result.stdout}{result.stderr}")
    return work / "dist"


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(FIXTURES))
def test_rebuild_elsewhere_is_byte_identical(target, request, rebuilt):
    """Same tree and SOURCE_DATE_EPOCH, another path, fresh build tools: the same bytes."""
    if target == "agent":
        require_agent()
    first = request.getfixturevalue(FIXTURES[target])
    assert sha256(rebuilt / OUTPUTS[target]) == sha256(first)


def test_one_list_of_supported_pythons():
    """requires-python, the build and the doctor name the same CPython versions."""
    build = load_packaging_module("build_pyz")
    assert list(build.PYTHONS) == supported_pythons() == ["3.10", "3.11", "3.12", "3.13"]
    assert [f"{major}.{minor}" for major, minor in doctor.SUPPORTED_PYTHONS] == list(build.PYTHONS)


@pytest.mark.parametrize("fixture", ["appliance_pyz", "foreign_appliance_pyz"])
def test_control_plane_archive_carries_every_compiled_module_for_every_python(fixture, request):
    """Nothing in it is tied to one CPython without its siblings for the others."""
    pyz = request.getfixturevalue(fixture)
    families: dict[str, set[str]] = {}
    for name in archive_files(pyz):
        tied = VERSION_TIED.search(name)
        if tied:
            family = (
                name[: tied.start()]
                + "*"
                + name[tied.end() - 1 :].replace(f"cpython-{tied.group(1)}{tied.group(2)}", "*")
            )
            families.setdefault(family, set()).add(f"{tied.group(1)}.{tied.group(2)}")
    assert families, "no CPython-specific module at all: is psycopg2 still in the archive?"
    for family, versions in families.items():
        assert sorted(versions) == supported_pythons(), family


@pytest.mark.parametrize("fixture", ["appliance_pyz", "foreign_appliance_pyz"])
def test_every_compiled_file_is_built_for_the_archives_machine(fixture, request):
    pyz = request.getfixturevalue(fixture)
    machine = re.fullmatch(r"modelforge-(\w+)\.pyz", pyz.name).group(1)
    compiled = {name: data for name, data in archive_files(pyz).items() if is_elf(data)}
    assert any(
        name.endswith("_psycopg.cpython-313-" + machine + "-linux-gnu.so") for name in compiled
    )
    wrong = {
        name: int.from_bytes(data[18:20], "little")
        for name, data in compiled.items()
        if int.from_bytes(data[18:20], "little") != ELF_MACHINES[machine]
    }
    assert wrong == {}


@pytest.mark.parametrize("fixture", ["agent_pyz", "worker_pyz"])
def test_node_archives_hold_no_compiled_module(fixture, request):
    if fixture == "agent_pyz":
        require_agent()
    files = archive_files(request.getfixturevalue(fixture))
    assert [name for name, data in files.items() if is_elf(data)] == []
    assert [name for name in files if re.search(r"\.(so|pyd)(\.|$)", name)] == []
    assert [name for name in files if VERSION_TIED.search(name)] == []
    # charset_normalizer's compiled speed-ups are not there; its pure-Python twins are.
    assert "site-packages/charset_normalizer/md.py" in files


def test_wrong_machine_archive_says_which_one_to_use(foreign_appliance_pyz, tmp_path):
    result = subprocess.run(
        pyz_command(foreign_appliance_pyz, "--help"),
        env=clean_env(SHIV_ROOT=str(tmp_path / "shiv")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"{foreign_appliance_pyz.name} is built for {OTHER_MACHINE} Linux (glibc); this Python "
        f"is for {HOST_MACHINE}-linux-gnu: use modelforge-{HOST_MACHINE}.pyz instead"
    )


def test_appliance_pyz_carries_the_control_plane_and_nothing_for_nodes(appliance_pyz):
    names = top_level(appliance_pyz)
    assert names >= APPLIANCE_NEEDS, f"missing: {APPLIANCE_NEEDS - names}"
    assert not APPLIANCE_MUST_NOT & names, f"must not carry: {APPLIANCE_MUST_NOT & names}"


@pytest.mark.parametrize("fixture", ["appliance_pyz", "foreign_appliance_pyz"])
def test_control_plane_archive_carries_one_stable_abi_cryptography_for_every_python(
    fixture, request
):
    """cryptography publishes a cp38-abi3 and a cp311-abi3 build under one module name; the
    archive carries one, and it is the one CPython 3.10 loads too."""
    files = archive_files(request.getfixturevalue(fixture))
    rust = [name for name in files if re.search(r"/_rust[.][^/]*so$", name)]
    assert rust == ["site-packages/cryptography/hazmat/bindings/_rust.abi3.so"]
    (wheel,) = [n for n in files if re.fullmatch(r"site-packages/cryptography-[^/]+/WHEEL", n)]
    tags = [
        line.split()[1] for line in files[wheel].decode().splitlines() if line.startswith("Tag:")
    ]
    floors = {tag.split("-")[0] for tag in tags}
    assert tags and all(tag.split("-")[1] == "abi3" for tag in tags), tags
    assert all(int(floor.removeprefix("cp3")) <= 10 for floor in floors), floors


def test_agent_pyz_carries_no_control_plane_dependencies(agent_pyz):
    names = top_level(agent_pyz)
    assert names >= AGENT_NEEDS, f"missing: {AGENT_NEEDS - names}"
    assert not AGENT_MUST_NOT & names, f"must not carry: {AGENT_MUST_NOT & names}"


def test_worker_pyz_carries_neither_the_control_plane_nor_the_agent(worker_pyz):
    names = top_level(worker_pyz)
    assert names >= WORKER_NEEDS, f"missing: {WORKER_NEEDS - names}"
    assert not WORKER_MUST_NOT & names, f"must not carry: {WORKER_MUST_NOT & names}"


@pytest.mark.parametrize("fixture", sorted(FIXTURES.values()))
def test_archive_entries_are_normalised(fixture, request):
    """One timestamp, no bytecode, no console-script shims naming the build interpreter."""
    if fixture == "agent_pyz":
        require_agent()
    pyz = request.getfixturevalue(fixture)
    with zipfile.ZipFile(pyz) as archive:
        infos = archive.infolist()
        environment = archive.read("environment.json").decode()
    assert {info.date_time for info in infos} == {(2026, 1, 1, 0, 0, 0)}
    assert not [info.filename for info in infos if info.filename.endswith(".pyc")]
    assert not [info.filename for info in infos if info.filename.startswith("site-packages/bin/")]
    assert f'"build_id": "{__version__}-' in environment
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")


@pytest.mark.parametrize("target", ["appliance", "agent", "worker"])
def test_pyz_prints_version_and_protocol(target, request, tmp_path):
    """Started as ./archive.pyz: the shebang finds python3, whichever supported one it is."""
    if target == "agent":
        require_agent()
    pyz = request.getfixturevalue(f"{target}_pyz")
    result = subprocess.run(
        [str(pyz), "--version"],
        env=shebang_env(SHIV_ROOT=str(tmp_path / "shiv")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout
    protocol = WORKER_PROTOCOL_VERSION if target == "worker" else PROTOCOL_VERSION
    assert re.search(rf"protocol {protocol}\b", result.stdout), result.stdout


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
    [
        ("appliance", "requirements-appliance.txt"),
        ("agent", "requirements-agent.txt"),
        ("worker", "requirements-worker.txt"),
    ],
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
