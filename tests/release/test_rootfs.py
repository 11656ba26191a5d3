"""Layers, chiselling, the Debian lock and the ELF check, without dockerd."""

from __future__ import annotations

import hashlib
import re
import tarfile
from pathlib import Path

import pytest

from modelforge_release.debian import (
    DebianError,
    dependency_groups,
    dump_lock,
    load_lock,
    parse_spec,
    resolve,
)
from modelforge_release.dockerfiles import dockerfile
from modelforge_release.image_checks import elf_dependencies, forbidden_paths, missing_libraries
from modelforge_release.images import IMAGES, LICENSES
from modelforge_release.names import TEMPLATE_NAMES
from modelforge_release.rootfs import Entry, Tree, kept, merged_usr, write_layer
from tests.harness.control_plane import tomllib
from tests.harness.release_images import ROOT

EPOCH = 1767225600
LOCK = ROOT / "packaging" / "images" / "debian-packages.lock"
SPEC = ROOT / "packaging" / "images" / "debian-packages.in"


def sample_tree(order: list[str]) -> Tree:
    tree = Tree("sample")
    contents = {
        "usr/bin/tool": (b"#!/usr/bin/python3\n", True),
        "etc/config": (b"a=1\n", False),
        "usr/lib/x/libz.so.1": (b"\x7fELF-not-really", False),
    }
    for path in order:
        data, executable = contents[path]
        tree.add_file(path, data, executable=executable)
    tree.add_symlink("bin", "usr/bin")
    tree.add_dir("var/lib/state", mode=0o700, uid=65532, gid=65532)
    tree.add_dir("tmp", mode=0o1777)
    return tree


def test_a_layer_is_the_same_bytes_whatever_the_order_files_were_added(tmp_path):
    one = write_layer(
        sample_tree(["usr/bin/tool", "etc/config", "usr/lib/x/libz.so.1"]),
        tmp_path / "1.tar",
        EPOCH,
    )
    two = write_layer(
        sample_tree(["usr/lib/x/libz.so.1", "etc/config", "usr/bin/tool"]),
        tmp_path / "2.tar",
        EPOCH,
    )
    assert one.path.read_bytes() == two.path.read_bytes()
    assert one.diff_id == "sha256:" + hashlib.sha256(one.path.read_bytes()).hexdigest()
    other_epoch = write_layer(
        sample_tree(["usr/bin/tool", "etc/config", "usr/lib/x/libz.so.1"]),
        tmp_path / "3.tar",
        EPOCH + 1,
    )
    assert other_epoch.diff_id != one.diff_id


def test_layer_entries_are_sorted_parents_first_with_fixed_owner_mtime_and_modes(tmp_path):
    layer = write_layer(
        sample_tree(["usr/bin/tool", "etc/config", "usr/lib/x/libz.so.1"]),
        tmp_path / "l.tar",
        EPOCH,
    )
    with tarfile.open(layer.path) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.split("/"))
    for index, member in enumerate(members):
        parent = member.name.rpartition("/")[0]
        assert not parent or parent in names[:index], member.name
        assert member.mtime == EPOCH and member.uname == "" and member.gname == ""
    by_name = {m.name: m for m in members}
    assert (by_name["usr/bin/tool"].mode, by_name["etc/config"].mode) == (0o755, 0o644)
    assert by_name["bin"].issym() and by_name["bin"].linkname == "usr/bin"
    assert (by_name["var/lib/state"].uid, by_name["var/lib/state"].mode) == (65532, 0o700)
    assert by_name["tmp"].mode == 0o1777
    assert all(m.uid == 0 for m in members if m.name != "var/lib/state")


def test_two_sources_with_different_content_at_one_path_are_refused():
    tree = Tree("t")
    tree.add_file("etc/x", b"one", origin="pkg-a")
    tree.add_file("etc/x", b"one", origin="pkg-b")  # identical: fine
    with pytest.raises(DebianError, match="etc/x comes from both pkg-a and pkg-c"):
        tree.add_file("etc/x", b"two", origin="pkg-c")


@pytest.mark.parametrize(
    ("path", "wanted"),
    [
        ("usr/share/doc/libc6/copyright", True),
        ("usr/share/doc/libc6", True),
        ("usr/share/doc/libc6/changelog.Debian.gz", False),
        ("usr/share/man/man1/python3.1.gz", False),
        ("usr/share/locale/de/LC_MESSAGES/libc.mo", False),
        ("usr/lib/x86_64-linux-gnu/gconv/UTF-16.so", False),
        ("etc/init.d/foo", False),
        ("usr/lib/python3.11/json/__init__.py", True),
        ("etc/ld.so.conf.d/x86_64-linux-gnu.conf", True),
    ],
)
def test_chiselling_keeps_programs_libraries_and_licences_only(path, wanted):
    assert kept(path) is wanted


def test_debian_paths_land_in_merged_usr():
    assert merged_usr("bin/ls") == "usr/bin/ls"
    assert merged_usr("lib64/ld-linux-x86-64.so.2") == "usr/lib64/ld-linux-x86-64.so.2"
    assert merged_usr("lib") == "usr/lib"
    assert merged_usr("usr/bin/python3") == "usr/bin/python3"


def test_forbidden_paths_names_shells_package_managers_driver_libraries_and_set_id_files():
    tree = Tree("t")
    for path in ("usr/bin/sh", "usr/bin/dpkg", "usr/bin/apt", "usr/lib/x/libnvidia-ml.so.1"):
        tree.add_file(path, b"x", executable=True)
    tree.add_file("usr/bin/python3.11", b"x", executable=True)
    tree.entries["usr/bin/su"] = Entry("file", 0o4755, b"x")
    assert forbidden_paths(tree.entries) == [
        "usr/bin/apt",
        "usr/bin/dpkg",
        "usr/bin/sh",
        "usr/bin/su",
        "usr/lib/x/libnvidia-ml.so.1",
    ]


def test_elf_dependencies_are_read_from_a_real_binary():
    python = Path("/usr/bin/env")  # an ELF program on every Debian host
    needed, _ = elf_dependencies(python.read_bytes())
    assert "libc.so.6" in needed
    assert elf_dependencies(b"#!/bin/sh\n") is None


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda elf: elf[:200], "program headers run past the end"),
        (lambda elf: elf[:4] + b"\x01" + elf[5:], "not a 64-bit little-endian ELF"),
        (lambda elf: elf[:40], "not a 64-bit little-endian ELF"),
    ],
    ids=["truncated", "32-bit", "too-short"],
)
def test_an_elf_file_the_check_cannot_read_is_a_finding_not_a_pass(damage, reason):
    """It was skipped silently: a library whose dependencies nobody read passed."""
    tree = Tree("t")
    tree.add_file("usr/bin/env", damage(Path("/usr/bin/env").read_bytes()), executable=True)
    missing = missing_libraries(tree.entries, ["usr/lib/x86_64-linux-gnu"])
    assert len(missing) == 1 and missing[0].startswith("usr/bin/env is an ELF file this check")
    assert reason in missing[0]


def test_a_library_nobody_ships_is_named():
    python = Path("/usr/bin/env")  # an ELF program on every Debian host
    tree = Tree("t")
    tree.add_file("usr/bin/env", python.read_bytes(), executable=True)
    missing = missing_libraries(tree.entries, ["usr/lib/x86_64-linux-gnu"])
    assert any("usr/bin/env needs libc.so.6" in line for line in missing)
    # Found through a symbolic link (as Debian ships most sonames), the complaint goes.
    tree.add_file("usr/lib/x86_64-linux-gnu/libc-2.36.so", b"\x7fELF", executable=False)
    tree.add_symlink("usr/lib/x86_64-linux-gnu/libc.so.6", "libc-2.36.so")
    assert not any(
        "libc.so.6" in line
        for line in missing_libraries(tree.entries, ["usr/lib/x86_64-linux-gnu"])
    )


# -- the Debian lock ----------------------------------------------------------------------


FAKE_APT = {
    "app": {"Depends": "libfoo (>= 1) | libfoo-alt, dpkg", "Pre-Depends": "libc6"},
    "libfoo": {"Depends": "libc6 (>= 2.34)"},
    "libfoo-alt": {},
    "libc6": {"Depends": "libgcc-s1"},
    "libgcc-s1": {"Depends": "libc6"},
    "tool": {"Depends": "libbig"},
}


def fake_show(name: str) -> dict[str, str] | None:
    if name not in FAKE_APT:
        return None
    return {
        "Package": name,
        "Version": "1.0-1",
        "Architecture": "amd64",
        "SHA256": hashlib.sha256(name.encode()).hexdigest(),
        "Size": "100",
        "Filename": f"pool/main/{name}.deb",
        **FAKE_APT[name],
    }


def test_resolving_takes_first_alternatives_skips_and_slices():
    spec = parse_spec(
        "layer base: app\nlayer extra: tool\nslice tool: usr/bin/tool\nskip dpkg: scripts only\n"
    )
    lock = resolve(spec, "bookworm", "amd64", fake_show)
    assert lock.layers == {"base": ["app", "libc6", "libfoo", "libgcc-s1"], "extra": ["tool"]}
    assert "libbig" not in lock.packages  # a slice's dependencies are not followed
    assert lock.slices == {"tool": ["usr/bin/tool"]}


def test_an_unresolvable_dependency_is_named():
    with pytest.raises(DebianError, match="app depends on dpkg"):
        resolve(parse_spec("layer base: app\n"), "bookworm", "amd64", fake_show)


def test_spec_errors_name_the_line():
    with pytest.raises(DebianError, match="line 2"):
        parse_spec("layer a: app\nthis is not a rule\n")
    with pytest.raises(DebianError, match="relative"):
        parse_spec("layer a: app\nslice app: /usr/bin/x\n")


def test_dependency_groups_drop_versions_and_arch_qualifiers():
    fields = {"Depends": "libc6 (>= 2.34), media-types | mime-support, python3:any"}
    assert dependency_groups(fields) == [["libc6"], ["media-types", "mime-support"], ["python3"]]


def test_the_committed_lock_pins_every_package_of_the_spec_with_a_sha256():
    spec = parse_spec(SPEC.read_text())
    lock = load_lock(LOCK)
    assert LOCK.read_text() == dump_lock(lock), "run packaging/lock-debian.sh"
    assert set(lock.layers) == set(spec.layers)
    for layer, roots in spec.layers.items():
        assert set(roots) - set(spec.skips) <= set(lock.layers[layer]), (
            f"{layer}: run packaging/lock-debian.sh"
        )
    assert lock.slices == {name: paths for name, paths in spec.slices.items()}
    assert not set(spec.skips) & set(lock.packages)
    for package in lock.packages.values():
        assert re.fullmatch(r"[0-9a-f]{64}", package.sha256)
        assert package.version and package.filename.endswith(".deb")


# -- files the code mirrors ------------------------------------------------------------------


def test_the_verifier_knows_the_release_files_of_sha256sums_template():
    lines = [
        line.strip()
        for line in (ROOT / "SHA256SUMS.template").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert tuple(lines) == TEMPLATE_NAMES


def test_the_licence_label_is_the_project_licence():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == LICENSES


@pytest.mark.parametrize("spec", IMAGES, ids=lambda spec: spec.name)
def test_compose_source_build_dockerfiles_are_generated_from_the_image_specs(spec):
    path = ROOT / "packaging" / "images" / f"{spec.name}.Dockerfile"
    assert path.read_text() == dockerfile(spec), (
        "run PYTHONPATH=release:contract python3 -m modelforge_release.dockerfiles"
    )


def test_worker_lock_pins_what_pyproject_pins_with_hashes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["worker"]
    text = (ROOT / "packaging" / "requirements-worker.txt").read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement, *options = line.split()
            name, _, version = requirement.partition("==")
            pins[name.lower()] = (version, sum(o.startswith("--hash=sha256:") for o in options))
    for requirement in wanted:
        name, _, version = requirement.partition("==")
        assert pins[name.lower()][0] == version, f"requirements-worker.txt pins {name} differently"
    assert all(hashes for _, hashes in pins.values())
    cuda = (ROOT / "packaging" / "requirements-worker-cuda.txt").read_text()
    assert "nvidia-cuda-runtime-cu12==" in cuda and "--hash=sha256:" in cuda


def test_the_unraid_template_runs_this_release_s_control_plane_image():
    import xml.etree.ElementTree as ET

    from modelforge_contract import __version__
    from modelforge_contract.manifest import CONTROL_PLANE_IMAGE

    template = ROOT / "packaging" / "unraid" / "modelforge-control-plane.xml"
    root = ET.parse(template).getroot()  # noqa: S314 - our own file
    assert root.findtext("Repository") == f"{CONTROL_PLANE_IMAGE}:{__version__}"
