"""Checks over a whole image before it is written: what must never be inside, and that
every ELF file finds the libraries it links to (slicing a Debian package must not leave a
program without its library)."""

from __future__ import annotations

import posixpath
import struct
from collections.abc import Iterable

from .rootfs import FORBIDDEN_DIRS, FORBIDDEN_NAMES, Entry, Tree, normal_path


def merged_view(trees: Iterable[Tree]) -> dict[str, Entry]:
    """The filesystem a container sees: later layers over earlier ones."""
    view: dict[str, Entry] = {}
    for tree in trees:
        view.update(tree.entries)
    return view


def forbidden_paths(view: dict[str, Entry]) -> list[str]:
    found = []
    for path, entry in view.items():
        directory, name = posixpath.split(path)
        shell_or_packager = directory in FORBIDDEN_DIRS and name in FORBIDDEN_NAMES
        driver = name.startswith("libnvidia-ml.so")
        set_id = entry.kind == "file" and entry.mode & 0o6000
        if shell_or_packager or driver or set_id or path == "var/lib/dpkg/info":
            found.append(path)
    return sorted(found)


def resolve_in(view: dict[str, Entry], path: str, depth: int = 0) -> Entry | None:
    """The entry a path leads to, following symbolic links (also in parent directories)."""
    if depth > 40:
        return None
    parts = path.split("/")
    for index in range(1, len(parts) + 1):
        prefix = "/".join(parts[:index])
        entry = view.get(prefix)
        if entry is None:
            return None
        if entry.kind == "symlink":
            rest = parts[index:]
            if entry.target.startswith("/"):
                joined = posixpath.join(entry.target, *rest)
            else:
                joined = posixpath.join(posixpath.dirname(prefix), entry.target, *rest)
            return resolve_in(view, normal_path(joined), depth + 1)
    return view.get(path)


ELF_MAGIC = b"\x7fELF"
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 1, 5, 15, 29


def elf_dependencies(data: bytes) -> tuple[list[str], list[str]] | None:
    """(DT_NEEDED names, RPATH/RUNPATH entries) of a 64-bit little-endian ELF; None for a
    file that is not ELF at all. An ELF file it cannot read raises ``UnreadableElf``: its
    libraries are unknown, which is a finding, never a pass."""
    if not data.startswith(ELF_MAGIC):
        return None
    if len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise UnreadableElf("not a 64-bit little-endian ELF file")
    try:
        return _dynamic_section(data)
    except (struct.error, ValueError, IndexError) as exc:
        raise UnreadableElf(f"its headers are damaged ({exc})") from None


class UnreadableElf(Exception):
    """An ELF file whose dependencies cannot be read."""


def _dynamic_section(data: bytes) -> tuple[list[str], list[str]]:
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for index in range(phnum):
        base = phoff + index * phentsize
        if base + 56 > len(data):
            raise UnreadableElf("its program headers run past the end of the file")
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, base)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return [], []
    tags: list[tuple[int, int]] = []
    for offset in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, offset)
        if tag == 0:
            break
        tags.append((tag, value))
    strtab_vaddr = next((value for tag, value in tags if tag == _DT_STRTAB), None)
    if strtab_vaddr is None:
        return [], []
    strtab = next(
        (
            off + strtab_vaddr - vaddr
            for vaddr, off, size in loads
            if vaddr <= strtab_vaddr < vaddr + size
        ),
        None,
    )
    if strtab is None:
        raise UnreadableElf("its string table is outside every loaded segment")

    def string(at: int) -> str:
        end = data.index(b"\0", strtab + at)
        return data[strtab + at : end].decode("utf-8", "replace")

    needed = [string(value) for tag, value in tags if tag == _DT_NEEDED]
    paths = [
        part
        for tag, value in tags
        if tag in (_DT_RPATH, _DT_RUNPATH)
        for part in string(value).split(":")
        if part
    ]
    return needed, paths


def missing_libraries(
    view: dict[str, Entry], library_dirs: Iterable[str], allowed: Iterable[str] = ()
) -> list[str]:
    """Every ELF file's DT_NEEDED library must be found the way the dynamic loader looks:
    its RPATH/RUNPATH (with $ORIGIN), then the system library directories."""
    system = [normal_path(d) for d in library_dirs]
    allowed = set(allowed)
    problems = []
    for path, entry in sorted(view.items()):
        if entry.kind != "file" or not (entry.mode & 0o111 or ".so" in posixpath.basename(path)):
            continue
        data = entry.content()
        try:
            found = elf_dependencies(data)
        except UnreadableElf as exc:
            problems.append(f"{path} is an ELF file this check cannot read: {exc}")
            continue
        if not found:
            continue
        needed, run_paths = found
        origin = posixpath.dirname(path)
        search = [
            normal_path(p.replace("$ORIGIN", "/" + origin).replace("${ORIGIN}", "/" + origin))
            for p in run_paths
        ]
        for name in needed:
            if name in allowed:
                continue
            hit = any(
                (resolved := resolve_in(view, f"{directory}/{name}".lstrip("/"))) is not None
                and resolved.kind == "file"
                for directory in [*search, *system]
            )
            if not hit:
                problems.append(f"{path} needs {name}, which the image does not contain")
    return problems
