"""How one control-plane archive serves every supported CPython: the build merges the wheels
of each interpreter and refuses anything but compiled modules that differ, and the launcher
turns a wrong interpreter or machine into one line that says what to run instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import load_packaging_module

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

build = load_packaging_module("build_pyz")
merge = load_packaging_module("wheel_merge")
launcher = load_packaging_module("pyz_launcher")

X86_SUFFIXES = [".cpython-312-x86_64-linux-gnu.so", ".abi3.so", ".so"]
ARM_SUFFIXES = [".cpython-313-aarch64-linux-gnu.so", ".abi3.so", ".so"]
MUSL_SUFFIXES = [".cpython-312-x86_64-linux-musl.so", ".abi3.so", ".so"]
GLIBC = ("glibc", "2.36")


def archive(machine: str | None = "x86_64") -> dict:
    target = build.TARGETS[f"appliance-{machine}"] if machine else build.TARGETS["agent"]
    return build.launcher_settings(target)


def test_launcher_runs_a_supported_python_on_the_right_machine():
    assert launcher.problem(archive(), (3, 12, 1), X86_SUFFIXES, GLIBC) is None
    assert launcher.problem(archive("aarch64"), (3, 13, 0), ARM_SUFFIXES, GLIBC) is None
    assert launcher.problem(archive(None), (3, 14, 0), MUSL_SUFFIXES, ("", "")) is None


def test_launcher_refuses_an_unsupported_python():
    old = launcher.problem(archive(), (3, 9, 2), X86_SUFFIXES, GLIBC)
    assert old.startswith(
        "modelforge-x86_64.pyz runs on CPython 3.10 to 3.13; this is Python 3.9.2"
    )
    newer = launcher.problem(archive(), (3, 14, 0), X86_SUFFIXES, GLIBC)
    assert "this is Python 3.14.0" in newer
    agent = launcher.problem(archive(None), (3, 8, 10), X86_SUFFIXES, GLIBC)
    assert agent.startswith("modelforge-node-agent.pyz needs Python 3.10 or newer")


def test_launcher_names_the_archive_for_this_machine():
    on_arm = launcher.problem(archive("x86_64"), (3, 13, 0), ARM_SUFFIXES, GLIBC)
    assert on_arm == (
        "modelforge-x86_64.pyz is built for x86_64 Linux (glibc); this Python is for "
        "aarch64-linux-gnu: use modelforge-aarch64.pyz instead"
    )
    # Alpine (musl) and 32-bit Raspberry Pi OS have no archive: say which systems do.
    musl = launcher.problem(archive("x86_64"), (3, 12, 1), MUSL_SUFFIXES, ("", ""))
    assert "this Python is for x86_64-linux-musl" in musl
    assert "archives exist for aarch64 and x86_64 Linux with glibc" in musl
    armhf = [".cpython-311-arm-linux-gnueabihf.so", ".abi3.so", ".so"]
    assert "use" not in launcher.problem(archive("aarch64"), (3, 11, 2), armhf, GLIBC)


def test_launcher_refuses_a_glibc_older_than_the_wheels():
    reason = launcher.problem(archive("aarch64"), (3, 10, 12), ARM_SUFFIXES, ("glibc", "2.27"))
    assert reason.startswith("modelforge-aarch64.pyz needs glibc 2.28 or newer")
    assert launcher.problem(archive("x86_64"), (3, 10, 12), X86_SUFFIXES, ("glibc", "2.17")) is None


def wheel_tree(root: Path, python: str, extra: dict[str, bytes] | None = None) -> Path:
    """What pip leaves for one CPython: a compiled module, a pure file, a bundled library."""
    tag = python.replace(".", "")
    files = {
        f"psycopg2/_psycopg.cpython-{tag}-x86_64-linux-gnu.so": b"\x7fELF" + tag.encode(),
        "psycopg2/extras.py": b"# pure\n",
        "psycopg2_binary.libs/libpq-a17e3caa.so.5.17": b"\x7fELF libpq",
        "psycopg2_binary-2.9.13.dist-info/METADATA": b"Name: psycopg2-binary\n",
        "psycopg2_binary-2.9.13.dist-info/WHEEL": (
            f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp{tag}-cp{tag}-manylinux_2_17_x86_64\n"
        ).encode(),
        "psycopg2_binary-2.9.13.dist-info/sboms/auditwheel.cdx.json": f'{{"cp": "{tag}"}}'.encode(),
        **(extra or {}),
    }
    record = [f"{name},sha256=x,1" for name in sorted(files) if not name.endswith("WHEEL")]
    record += ["psycopg2_binary-2.9.13.dist-info/WHEEL,sha256=w" + tag + ",1"]
    record += ["psycopg2_binary-2.9.13.dist-info/RECORD,,"]
    files["psycopg2_binary-2.9.13.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_merge_puts_compiled_modules_side_by_side_and_keeps_metadata_true(tmp_path):
    staging = wheel_tree(tmp_path / "staging", "3.10")
    other = wheel_tree(tmp_path / "cp311", "3.11")
    assert merge.add_interpreter(staging, other, "3.11", set()) == 1
    assert (staging / "psycopg2/_psycopg.cpython-310-x86_64-linux-gnu.so").is_file()
    assert (staging / "psycopg2/_psycopg.cpython-311-x86_64-linux-gnu.so").is_file()
    dist_info = staging / "psycopg2_binary-2.9.13.dist-info"
    wheel = (dist_info / "WHEEL").read_text()
    assert "Tag: cp310-cp310-manylinux_2_17_x86_64" in wheel
    assert "Tag: cp311-cp311-manylinux_2_17_x86_64" in wheel
    assert (dist_info / "sboms/cp311-auditwheel.cdx.json").read_text() == '{"cp": "311"}'
    record = (dist_info / "RECORD").read_text().splitlines()
    paths = [line.split(",")[0] for line in record]
    assert len(paths) == len(set(paths))
    assert "psycopg2/_psycopg.cpython-311-x86_64-linux-gnu.so" in paths
    assert "psycopg2_binary-2.9.13.dist-info/sboms/cp311-auditwheel.cdx.json" in paths
    # RECORD's hash of the merged WHEEL file is that of the merged bytes.
    wheel_line = next(line for line in record if line.startswith(f"{dist_info.name}/WHEEL,"))
    assert wheel_line.endswith(f",{len(wheel.encode())}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"psycopg2/extras.py": b"# not the same\n"}, "psycopg2/extras.py differs between"),
        ({"psycopg2/only_here.py": b""}, "is in the CPython 3.11 wheels only"),
        (
            {"psycopg2_binary.libs/libpq-a17e3caa.so.5.17": b"\x7fELF other libpq"},
            "libpq-a17e3caa.so.5.17 differs between",
        ),
    ],
)
def test_merge_refuses_wheels_that_differ_beyond_compiled_modules(tmp_path, change, message):
    staging = wheel_tree(tmp_path / "staging", "3.10")
    other = wheel_tree(tmp_path / "cp311", "3.11", change)
    with pytest.raises(merge.BuildError, match=message):
        merge.add_interpreter(staging, other, "3.11", set())


def test_merge_refuses_wheels_lacking_a_file(tmp_path):
    staging = wheel_tree(tmp_path / "staging", "3.10")
    other = wheel_tree(tmp_path / "cp311", "3.11")
    (other / "psycopg2/extras.py").unlink()
    with pytest.raises(merge.BuildError, match="the CPython 3.11 wheels lack psycopg2/extras.py"):
        merge.add_interpreter(staging, other, "3.11", set())


def test_staging_check_refuses_a_lone_cpython_module_and_any_compiled_agent_file():
    def problems(machine, names):
        return merge.compiled_problems(machine, 62, build.PYTHONS, names)

    lone = ["charset_normalizer/md.cpython-311-x86_64-linux-gnu.so", "bcrypt/_bcrypt.abi3.so"]
    assert problems("x86_64", lone) == [
        "charset_normalizer/md: no build for CPython 3.10, 3.12, 3.13"
    ]
    complete = [
        f"psycopg2/_psycopg.cpython-3{minor}-x86_64-linux-gnu.so" for minor in (10, 11, 12, 13)
    ]
    assert problems("x86_64", complete) == []
    agent = problems(None, ["charset_normalizer/md.cpython-311-x86_64-linux-gnu.so"])
    assert agent and "the agent archive must hold none" in agent[0]


def test_wheels_are_chosen_for_every_glibc_the_machine_loads():
    """pip's --platform takes only the tags it is given: an aarch64 archive for glibc 2.28
    must also accept wheels that say 2.17 (cffi's do)."""
    arm = build.MACHINES["aarch64"].wheel_platforms()
    assert arm[0] == "manylinux_2_28_aarch64" and arm[-2:] == [
        "manylinux_2_17_aarch64",
        "manylinux2014_aarch64",
    ]
    assert len(arm) == len(set(arm)) == 13
    x86 = build.MACHINES["x86_64"].wheel_platforms()
    assert x86 == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def test_stable_abi_wheels_are_found_by_their_tags(tmp_path):
    for name, tags in (
        ("cryptography-46.0.3", ["cp38-abi3-manylinux_2_28_aarch64"]),
        ("psycopg2_binary-2.9.13", ["cp310-cp310-manylinux_2_28_aarch64"]),
        ("Some_Thing-1.0", ["cp39-abi3-manylinux_2_17_x86_64", "cp39-abi3-manylinux2014_x86_64"]),
    ):
        (tmp_path / f"{name}.dist-info").mkdir()
        lines = ["Wheel-Version: 1.0", *[f"Tag: {tag}" for tag in tags]]
        (tmp_path / f"{name}.dist-info" / "WHEEL").write_text("\n".join(lines) + "\n")
    assert build.stable_abi_distributions(tmp_path) == ("cryptography", "some-thing")


def test_staging_check_refuses_code_for_another_machine():
    names = [
        f"psycopg2/_psycopg.cpython-3{minor}-aarch64-linux-gnu.so" for minor in (10, 11, 12, 13)
    ]
    machine = build.MACHINES["aarch64"]
    problems = merge.compiled_problems(
        machine.name, machine.elf_machine, build.PYTHONS, names, read_elf=lambda name: 62
    )
    assert problems and "built for ELF machine 62, not aarch64" in problems[0]
