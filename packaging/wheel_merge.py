"""One archive for several CPythons: merge the wheels installed for each, and check that no
file ties the result to one interpreter or to another machine. Used by build_pyz.py.

Compiled modules carry the interpreter in their file name
(``_psycopg.cpython-312-x86_64-linux-gnu.so``), so the builds for several CPythons can sit
side by side. Everything else a wheel holds must be the same for every interpreter, byte for
byte, or one archive cannot carry it: the merge refuses. The wheels' own metadata that names
their tags (WHEEL, RECORD) is merged, and each wheel's bill of materials is kept apart.
Standard library only.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path


class BuildError(Exception):
    """The build cannot go on; the message says why and what to do."""


# A compiled module tied to one CPython: name.cpython-312-x86_64-linux-gnu.so
VERSION_TIED = re.compile(r"\.cpython-(\d)(\d+)-[^/]+\.so$")
# Every compiled file: extension modules and the shared libraries wheels bundle.
COMPILED = re.compile(r"\.(so|pyd|dylib)(\.[\d.]+)?$")
# Per-file dist-info metadata that names the wheel's tags; merged, not compared.
MERGED_METADATA = ("WHEEL", "RECORD")
# Software bills of materials (auditwheel's) describe one wheel file each: every
# interpreter's is kept, under its own name.
PER_WHEEL = re.compile(r"^([^/]+\.dist-info/sboms)/([^/]+)$")


def per_wheel_name(relative: str, python: str) -> str | None:
    """Where the file of one interpreter's wheel is kept beside the others', if it is one."""
    match = PER_WHEEL.match(relative)
    if match is None:
        return None
    return f"{match.group(1)}/cp{python.replace('.', '')}-{match.group(2)}"


def merge_metadata(name: str, staged: bytes, other: bytes, python: str) -> bytes:
    """WHEEL: the union of the Tag lines (all else equal); RECORD: the union of its lines."""
    old, new = staged.decode().splitlines(), other.decode().splitlines()
    if name == "RECORD":
        renamed = []
        for line in new:
            path, _, rest = line.partition(",")
            renamed.append(f"{per_wheel_name(path, python) or path},{rest}")
        new = renamed
    if name == "WHEEL":
        if [line for line in old if not line.startswith("Tag:")] != [
            line for line in new if not line.startswith("Tag:")
        ]:
            raise ValueError("WHEEL differs beyond its Tag lines")
    else:
        # RECORD lines of the same path must agree, except WHEEL and RECORD themselves.
        by_path = {line.split(",", 1)[0]: line for line in old}
        for line in new:
            path = line.split(",", 1)[0]
            if path in by_path and by_path[path] != line and not path.endswith(MERGED_METADATA):
                raise ValueError(f"RECORD disagrees about {path}")
    merged = old + [line for line in new if line not in old]
    return ("\n".join(merged) + "\n").encode()


def refresh_record(dist_info: Path) -> None:
    """After a merge: one RECORD line per path, the WHEEL line naming the merged bytes."""
    record, wheel = dist_info / "RECORD", dist_info / "WHEEL"
    if not record.is_file() or not wheel.is_file():
        return
    data = wheel.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    wheel_path = f"{dist_info.name}/WHEEL"
    lines: dict[str, str] = {}
    for line in record.read_text(encoding="utf-8").splitlines():
        path = line.split(",", 1)[0]
        lines.setdefault(path, line)
    lines[wheel_path] = f"{wheel_path},sha256={digest},{len(data)}"
    record.write_text("".join(f"{line}\n" for line in lines.values()), encoding="utf-8")


def files_of(staging: Path, names: tuple[str, ...]) -> set[str]:
    """Every path the RECORD files of the named distributions list (and their dist-info)."""
    paths: set[str] = set()
    for dist_info in staging.glob("*.dist-info"):
        name = dist_info.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        name = name.lower().replace("_", "-")
        if name in names:
            for line in (dist_info / "RECORD").read_text(encoding="utf-8").splitlines():
                paths.add(line.split(",", 1)[0])
            paths.update(p.relative_to(staging).as_posix() for p in dist_info.rglob("*"))
    return paths


def add_interpreter(staging: Path, other: Path, python: str, installed_once: set[str]) -> int:
    """Move the compiled modules of ``other`` (installed for ``python``) into ``staging``.

    Every file that is not tied to one CPython must already be staged, byte for byte;
    the wheels' WHEEL and RECORD files are merged. Returns how many modules were added.
    """
    tag = python.replace(".", "")
    added = 0
    # bin/ holds console-script shims, which normalise() drops from the archive; each
    # wheel's bill of materials is kept apart.
    staged_untied = {
        relative
        for relative in (
            p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()
        )
        if not VERSION_TIED.search(relative)
        and not relative.startswith("bin/")
        and not PER_WHEEL.match(relative)
    }
    other_untied: set[str] = set()
    for path in sorted(other.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(other).as_posix()
        if relative.startswith("bin/"):
            continue
        destination = staging / relative
        tied = VERSION_TIED.search(path.name)
        if tied:
            if tied.group(1) + tied.group(2) != tag:
                raise BuildError(f"{relative} came with the CPython {python} wheels")
            if destination.exists():
                raise BuildError(f"{relative} is staged twice")
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
            added += 1
            continue
        kept_apart = per_wheel_name(relative, python)
        if kept_apart is not None:
            shutil.copyfile(path, staging / kept_apart)
            continue
        other_untied.add(relative)
        if not destination.is_file():
            raise BuildError(
                f"{relative} is in the CPython {python} wheels only; one archive cannot carry "
                "files that differ by interpreter: refusing to build"
            )
        if path.parent.name.endswith(".dist-info") and path.name in MERGED_METADATA:
            try:
                merged = merge_metadata(
                    path.name, destination.read_bytes(), path.read_bytes(), python
                )
            except ValueError as exc:
                raise BuildError(f"{relative}: {exc} in the CPython {python} wheels") from None
            destination.write_bytes(merged)
            continue
        if path.read_bytes() != destination.read_bytes():
            raise BuildError(
                f"{relative} differs between the staged and the CPython {python} wheels; one "
                "archive cannot carry both: refusing to build"
            )
    missing = sorted(staged_untied - other_untied - installed_once)
    if missing:
        raise BuildError(
            f"the CPython {python} wheels lack {', '.join(missing[:5])}: refusing to build"
        )
    for dist_info in staging.glob("*.dist-info"):
        refresh_record(dist_info)
    return added


def elf_machine(path: Path) -> int | None:
    """e_machine of an ELF file (little-endian, as on both supported machines), else None."""
    with path.open("rb") as fh:
        header = fh.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    return int.from_bytes(header[18:20], "little")


def compiled_problems(
    machine: str | None,
    elf_id: int | None,
    pythons: tuple[str, ...],
    names: list[str],
    read_elf: Callable[[str], int | None] | None = None,
) -> list[str]:
    """Files that would tie an archive to one CPython or to the wrong machine.

    names: archive-relative paths. An archive for ``machine`` must carry each
    CPython-specific module for every one of ``pythons``, each compiled file built for
    ELF machine ``elf_id``; an archive for no machine (None) must hold no compiled file.
    """
    problems = []
    compiled = [name for name in names if COMPILED.search(name)]
    if machine is None:
        return [f"{name} is compiled; the agent archive must hold none" for name in compiled]
    wanted = {version.replace(".", "") for version in pythons}
    families: dict[str, set[str]] = {}
    for name in compiled:
        tied = VERSION_TIED.search(name)
        if tied:
            stem = name[: tied.start()] + "|" + name[tied.end() :]
            families.setdefault(stem, set()).add(tied.group(1) + tied.group(2))
    for stem, versions in sorted(families.items()):
        if versions != wanted:
            lacking = ", ".join(f"{v[0]}.{v[1:]}" for v in sorted(wanted - versions))
            extra = ", ".join(f"{v[0]}.{v[1:]}" for v in sorted(versions - wanted))
            problems.append(
                f"{stem.split('|')[0]}: "
                + (f"no build for CPython {lacking}" if lacking else "")
                + (
                    f"{'; ' if lacking else ''}a build for unsupported CPython {extra}"
                    if extra
                    else ""
                )
            )
    if read_elf is not None:
        for name in compiled:
            found = read_elf(name)
            if found is not None and found != elf_id:
                problems.append(f"{name} is built for ELF machine {found}, not {machine}")
    return problems
