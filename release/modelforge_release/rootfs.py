"""Root filesystem trees and the deterministic layer tar written from them.

A ``Tree`` is one image layer in memory: paths (relative, without a leading ``/``) mapped
to directories, files and symbolic links. Files from Debian packages are chiselled on the
way in (no documentation, manual pages, translations or init scripts; /usr merged as in
Debian bookworm); files from Python packages come from a staged directory.

``write_layer`` makes the tar the same byte for byte on every build of the same inputs,
wherever the checkout lives: entries sorted by path (parents first), every mtime the
``SOURCE_DATE_EPOCH``, owner 0:0 unless a state directory is handed to the service user,
modes fixed (0755 for directories and executables, 0644 for other files, no set-id bits),
no user or group names, PAX format. Its SHA-256 is the layer's diff id.
"""

from __future__ import annotations

import hashlib
import posixpath
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .debian import DebianError, PinnedPackage
from .debs import DebContents

# Debian bookworm merges /bin, /sbin and /lib* into /usr; packages still ship the old paths.
MERGED_USR = ("bin", "sbin", "lib", "lib64")

# Paths never taken from a Debian package: documentation, translations, service wiring
# that has no init system to talk to, and glibc's iconv modules (Python has its own codecs).
DROPPED_PREFIXES = (
    "usr/share/man/",
    "usr/share/info/",
    "usr/share/locale/",
    "usr/share/lintian/",
    "usr/share/bug/",
    "usr/share/menu/",
    "usr/share/doc-base/",
    "usr/share/gdb/",
    "usr/share/bash-completion/",
    "usr/share/pixmaps/",
    "usr/share/applications/",
    "usr/lib/x86_64-linux-gnu/gconv/",
    "usr/lib/aarch64-linux-gnu/gconv/",
    "usr/lib/systemd/",
    "etc/systemd/",
    "etc/init.d/",
    "etc/cron.d/",
    "etc/cron.daily/",
    "etc/logrotate.d/",
    "etc/profile.d/",
    "var/lib/dpkg/",
)
# What no image may contain: a shell, a package manager or its script directory, or a
# userspace NVIDIA driver library (the NVIDIA Container Toolkit injects the host's).
FORBIDDEN_NAMES = ("sh", "dash", "bash", "apt", "apt-get", "dpkg", "dpkg-deb")
FORBIDDEN_DIRS = ("usr/bin", "usr/sbin", "usr/local/bin")


@dataclass
class Entry:
    kind: str  # "dir", "file" or "symlink"
    mode: int = 0o755
    data: bytes | Path | None = None  # file content, or the staged file to read it from
    target: str = ""  # symbolic link target
    uid: int = 0
    gid: int = 0
    origin: str = ""  # the package or step that put it here, for error messages

    def content(self) -> bytes:
        if isinstance(self.data, Path):
            return self.data.read_bytes()
        return self.data or b""


class TreeConflict(DebianError):
    """Two sources put different things at one path."""


class Tree:
    """One layer's files, in memory until written."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: dict[str, Entry] = {}

    # -- adding -----------------------------------------------------------------------

    def _parents(self, path: str, origin: str) -> None:
        parent = posixpath.dirname(path)
        while parent and parent not in self.entries:
            self.entries[parent] = Entry("dir", 0o755, origin=origin)
            parent = posixpath.dirname(parent)

    def _put(self, path: str, entry: Entry) -> None:
        path = normal_path(path)
        existing = self.entries.get(path)
        if existing is not None:
            if existing.kind == entry.kind == "dir":
                if entry.uid or entry.mode != 0o755:  # an explicit owner or mode wins
                    self.entries[path] = entry
                return
            same = existing.kind == entry.kind and (
                existing.target == entry.target
                if entry.kind == "symlink"
                else existing.content() == entry.content()
            )
            if same:
                return
            raise TreeConflict(
                f"layer {self.name}: {path} comes from both {existing.origin} and "
                f"{entry.origin}, with different content"
            )
        self._parents(path, entry.origin)
        self.entries[path] = entry

    def add_dir(
        self, path: str, mode: int = 0o755, uid: int = 0, gid: int = 0, origin: str = ""
    ) -> None:
        self._put(path, Entry("dir", mode, uid=uid, gid=gid, origin=origin or self.name))

    def add_file(
        self, path: str, data: bytes | Path, executable: bool = False, origin: str = ""
    ) -> None:
        mode = 0o755 if executable else 0o644
        self._put(path, Entry("file", mode, data=data, origin=origin or self.name))

    def add_symlink(self, path: str, target: str, origin: str = "") -> None:
        self._put(path, Entry("symlink", 0o777, target=target, origin=origin or self.name))

    def add_staged(self, source: Path, prefix: str, origin: str) -> None:
        """A directory tree from disk (pip's --target, first-party packages) under prefix."""
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source).as_posix()
            if "__pycache__" in relative.split("/") or path.suffix == ".pyc":
                continue
            target = f"{prefix}/{relative}"
            if path.is_symlink():
                self.add_symlink(target, str(path.readlink()), origin)
            elif path.is_dir():
                self.add_dir(target, origin=origin)
            elif path.is_file():
                executable = bool(path.stat().st_mode & 0o111)
                self.add_file(target, path, executable=executable, origin=origin)

    def add_deb(
        self, pkg: PinnedPackage, deb: DebContents, only: Iterable[str] | None = None
    ) -> int:
        """The package's files, chiselled; ``only`` limits it to those paths (and the
        package's copyright file). Returns how many entries were added."""
        wanted = {normal_path(p) for p in only} if only is not None else None
        licence = f"usr/share/doc/{pkg.name}/copyright"
        members = {}
        for member in deb.members():
            path = merged_usr(normal_path(member.name))
            if path:
                members.setdefault(path, member)
        added = 0
        for path, member in members.items():
            if wanted is not None and path not in wanted and path != licence:
                continue
            if wanted is None and not kept(path):
                continue
            origin = f"{pkg.name} {pkg.version}"
            if member.isdir():
                self.add_dir(path, origin=origin)
            elif member.issym():
                self.add_symlink(path, member.linkname, origin)
            elif member.islnk():
                # A hard link inside the package: store a copy (order-independent).
                source = members.get(merged_usr(normal_path(member.linkname)))
                if source is None or not source.isfile():
                    raise DebianError(f"{pkg.name}: hard link {path} to a missing file")
                self.add_file(path, deb.read(source), bool(source.mode & 0o111), origin)
            elif member.isfile():
                self.add_file(path, deb.read(member), bool(member.mode & 0o111), origin)
            else:
                continue  # device nodes and fifos have no place in an image
            added += 1
        if wanted is not None:
            missing = sorted(wanted - set(members))
            if missing:
                raise DebianError(f"{pkg.name} {pkg.version} has no {', '.join(missing)}")
        return added

    # -- reading back -----------------------------------------------------------------

    def files(self) -> Iterator[tuple[str, Entry]]:
        for path in sorted(self.entries):
            entry = self.entries[path]
            if entry.kind == "file":
                yield path, entry

    def size(self) -> int:
        return sum(len(entry.content()) for _, entry in self.files())


def normal_path(name: str) -> str:
    path = posixpath.normpath("/" + name.strip()).lstrip("/")
    return "" if path == "." else path


def merged_usr(path: str) -> str:
    head, _, rest = path.partition("/")
    if head in MERGED_USR:
        return f"usr/{head}/{rest}".rstrip("/") if rest else f"usr/{head}"
    return path


def kept(path: str) -> bool:
    """Whether a path from a Debian package stays in the chiselled tree."""
    probe = path + "/"
    if any(probe.startswith(prefix) for prefix in DROPPED_PREFIXES):
        return False
    if path.startswith("usr/share/doc/"):
        # Keep each package's copyright file: it is the licence of what is shipped.
        parts = path.split("/")
        return len(parts) == 4 or (len(parts) == 5 and parts[4] == "copyright")
    return True


# -- the layer tar ----------------------------------------------------------------------


class HashingWriter:
    """A write-only file object that hashes and counts what passes through."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.size


@dataclass(frozen=True)
class Layer:
    name: str
    path: Path  # the layer tar on disk
    diff_id: str  # sha256:<hex> of the tar
    size: int
    files: int


def _sort_key(path: str) -> list[str]:
    return path.split("/")


def write_layer(tree: Tree, target: Path, epoch: int) -> Layer:
    """Write the tree as a tar to ``target``; the same tree always gives the same bytes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("wb") as raw:
        writer = HashingWriter(raw)
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for path in sorted(tree.entries, key=_sort_key):
                entry = tree.entries[path]
                info = tarfile.TarInfo(path)
                info.mtime = epoch
                info.uid, info.gid = entry.uid, entry.gid
                info.uname = info.gname = ""
                data = None
                if entry.kind == "dir":
                    info.type = tarfile.DIRTYPE
                    info.mode = entry.mode & 0o7777 & ~0o6000
                elif entry.kind == "symlink":
                    info.type = tarfile.SYMTYPE
                    info.linkname = entry.target
                    info.mode = 0o777
                else:
                    data = entry.content()
                    info.size = len(data)
                    info.mode = 0o755 if entry.mode & 0o111 else 0o644
                tar.addfile(info, _Bytes(data) if data is not None else None)
    return Layer(
        tree.name,
        target,
        "sha256:" + writer.digest.hexdigest(),
        writer.size,
        sum(1 for _ in tree.files()),
    )


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.view = memoryview(data)
        self.offset = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.view) if size < 0 else self.offset + size
        chunk = self.view[self.offset : end].tobytes()
        self.offset += len(chunk)
        return chunk
