"""One streaming pass over a tarball: its own SHA-256, and each regular file's SHA-256
(and, for a gzip stream, the SHA-256 of what it decompresses to), in constant memory.

Every regular file is hashed as it streams past, straight from the chunks read, through
``memoryview`` slices; only small JSON documents are kept. The tarball's digest runs in a
thread of its own. Links, repeated names and names outside the archive are refused.
"""

from __future__ import annotations

import hashlib
import posixpath
import queue
import tarfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .digest import CHUNK_BYTES, Progress, wants_progress

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# JSON documents (manifests, configurations, indexes) are kept in memory up to this size.
MAX_JSON_BYTES = 4 << 20
MAX_KEPT_BYTES = 64 << 20


class ArchiveError(Exception):
    """The tarball cannot be read as an image archive at all."""


@dataclass
class Member:
    """One regular file of the tarball, as it streamed past."""

    name: str
    size: int
    sha256: str  # sha256:<hex> of the bytes as stored
    compression: str  # "none", "gzip" or "zstd"
    content_sha256: str | None  # sha256:<hex> of the decompressed stream (gzip), else = sha256
    data: bytes | None = None  # kept for small JSON documents
    error: str | None = None  # a stream that does not decompress


class HashingReader:
    """Wraps a binary file: what is read through it is hashed and counted.

    The whole-file SHA-256 runs in a thread of its own while the caller hashes the
    members: hashlib releases the GIL, so on two cores the tarball costs about one hash
    of time, not two. The queue is short, so memory stays a few MiB.
    """

    def __init__(self, file: BinaryIO, meter: Progress | None = None) -> None:
        self.file = file
        self.size = 0
        self.meter = meter
        self._digest = hashlib.sha256()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self._thread = threading.Thread(target=self._hash, name="tarball-sha256", daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._digest.update(chunk)

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        if data:
            self._queue.put(data)
            self.size += len(data)
            if self.meter:
                self.meter.update(self.size)
        return data

    def drain(self) -> None:
        while self.read(CHUNK_BYTES):
            pass

    def hexdigest(self) -> str:
        """The digest of everything read; call once, when reading is done."""
        self._queue.put(None)
        self._thread.join()
        return self._digest.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class _Gunzip:
    """Streaming gzip decompression and hashing, concatenated members included."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        if self.error:
            return
        try:
            while data:
                # Bounded output per call: a highly compressed stream cannot balloon memory.
                out = self.inflate.decompress(data, CHUNK_BYTES)
                self.digest.update(out)
                data = self.inflate.unconsumed_tail
                if self.inflate.eof:
                    data = self.inflate.unused_data + bytes(data)
                    self.inflate = zlib.decompressobj(zlib.MAX_WBITS | 16)
        except zlib.error as exc:
            self.error = f"gzip stream is corrupt ({exc})"

    def finish(self) -> str | None:
        if not self.error:
            try:
                while True:
                    out = self.inflate.flush()
                    if not out:
                        break
                    self.digest.update(out)
            except zlib.error as exc:
                self.error = f"gzip stream is corrupt ({exc})"
        return self.error


class _MemberHash:
    """What one regular file is, built from its bytes as they stream past."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.digest = hashlib.sha256()
        self.compression: str | None = None
        self.gunzip: _Gunzip | None = None
        self.kept: list[bytes] | None = None

    def update(self, view: memoryview) -> None:
        if self.compression is None:  # the first bytes decide
            head = bytes(view[:4])
            self.compression = (
                "gzip" if head.startswith(GZIP_MAGIC) else "zstd" if head == ZSTD_MAGIC else "none"
            )
            self.gunzip = _Gunzip() if self.compression == "gzip" else None
            if self.size <= MAX_JSON_BYTES and head[:1] in (b"{", b"["):
                self.kept = []
        self.digest.update(view)
        if self.gunzip:
            self.gunzip.feed(view)
        if self.kept is not None:
            self.kept.append(bytes(view))

    def member(self) -> Member:
        sha256 = "sha256:" + self.digest.hexdigest()
        error = self.gunzip.finish() if self.gunzip else None
        content = ("sha256:" + self.gunzip.digest.hexdigest()) if self.gunzip else sha256
        compression = self.compression or "none"
        return Member(
            name=self.name,
            size=self.size,
            sha256=sha256,
            compression=compression,
            content_sha256=None if compression == "zstd" or error else content,
            data=b"".join(self.kept) if self.kept is not None else None,
            error=error,
        )


class _Blocks:
    """Reads a tar stream through the hashing reader: small exact reads for headers, and
    zero-copy views of each chunk for file contents."""

    def __init__(self, reader: HashingReader) -> None:
        self.reader = reader
        self.view = memoryview(b"")
        self.pos = 0

    def _chunk(self) -> bool:
        chunk = self.reader.read(CHUNK_BYTES)
        self.view, self.pos = memoryview(chunk), 0
        return bool(chunk)

    def at_end(self) -> bool:
        return self.pos == len(self.view) and not self._chunk()

    def feed(self, count: int, sink: Any = None) -> None:
        """Pass the next ``count`` bytes to ``sink(view)`` (or skip them)."""
        while count:
            if self.pos == len(self.view) and not self._chunk():
                raise ArchiveError("the tar archive ends in the middle of a file")
            take = min(count, len(self.view) - self.pos)
            if sink is not None:
                sink(self.view[self.pos : self.pos + take])
            self.pos += take
            count -= take

    def read(self, count: int) -> bytes:
        parts: list[bytes] = []
        self.feed(count, lambda view: parts.append(bytes(view)))
        return b"".join(parts)


_BLOCK = 512
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)


def _padded(size: int) -> int:
    return (size + _BLOCK - 1) // _BLOCK * _BLOCK


def _pax_records(data: bytes) -> dict[str, str]:
    """``<length> <key>=<value>\n`` records of a POSIX extended header."""
    records, at = {}, 0
    while at < len(data):
        space = data.index(b" ", at)
        length = int(data[at:space])
        key, _, value = data[space + 1 : at + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


def _walk(blocks: _Blocks) -> Iterator[tuple[tarfile.TarInfo, _MemberHash | None]]:
    """Each entry of the archive; a regular file's contents are hashed on the way."""
    pending: dict[str, str] = {}
    while True:
        if blocks.at_end():
            return  # no end-of-archive marker: some writers leave it out
        header = blocks.read(_BLOCK)
        if header == bytes(_BLOCK):
            return  # the end-of-archive marker (what follows is padding)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise ArchiveError(f"not a tar archive, or a damaged header ({exc})") from None
        if info.type in (
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.GNUTYPE_LONGNAME,
            tarfile.GNUTYPE_LONGLINK,
        ):
            data = blocks.read(_padded(info.size))[: info.size]
            if info.type == tarfile.XHDTYPE:
                pending.update(_pax_records(data))
            elif info.type == tarfile.GNUTYPE_LONGNAME:
                pending["path"] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                pending["linkpath"] = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue  # global headers carry nothing this reader needs
        info.name = pending.get("path", info.name)
        info.linkname = pending.get("linkpath", info.linkname)
        if "size" in pending:
            info.size = int(pending["size"])
        pending = {}
        if info.type in _REGULAR:
            hashed = _MemberHash(_normal(info.name), info.size)
            blocks.feed(info.size, hashed.update)
            blocks.feed(_padded(info.size) - info.size)
            yield info, hashed
        else:
            blocks.feed(
                _padded(info.size) if info.type not in (tarfile.SYMTYPE, tarfile.LNKTYPE) else 0
            )
            yield info, None


def _refusal(info: tarfile.TarInfo, seen: set[str]) -> str | None:
    """Why an entry is refused, or None. Only regular files and directories under plain
    relative names, each name once: then every reader, ``docker load`` included, sees the
    same files, whatever order or link rules it follows."""
    raw = info.name
    shown = repr(raw)
    parts = raw.rstrip("/").split("/")
    if raw.startswith("/"):
        return f"entry {shown} has an absolute name"
    if ".." in parts:
        return f"entry {shown} leaves the archive ('..')"
    if any(part in ("", ".") for part in parts[1:]) or "\0" in raw:
        return f"entry {shown} is not a plain relative name"
    if info.issym():
        return f"entry {shown} is a symbolic link (to {info.linkname!r}); links are refused"
    if info.islnk():
        return f"entry {shown} is a hard link (to {info.linkname!r}); links are refused"
    if info.type not in _REGULAR and not info.isdir():
        return f"entry {shown} is neither a regular file nor a directory"
    name = _normal(raw)
    if name in seen:
        return f"{name} appears twice in the archive; the first and the last would differ"
    seen.add(name)
    return None


def scan(path: Path, progress: Any = None) -> tuple[str, int, dict[str, Member], list[str]]:
    """Stream the tarball once: (its sha256 hex, its size, every regular file by name, every
    directory name).

    Links, devices, names that repeat, and absolute or ``..`` names are refused
    (``ArchiveError``): with them two readers can see two different archives (``docker load``
    unpacks in order, a later entry replacing an earlier one).
    """
    members: dict[str, Member] = {}
    directories: list[str] = []
    seen: set[str] = set()
    kept = 0
    with path.open("rb", buffering=0) as raw:
        size = path.stat().st_size
        meter = Progress(progress, path.name, size) if wants_progress(progress, size) else None
        reader = HashingReader(raw, meter)  # type: ignore[arg-type]
        try:
            for info, hashed in _walk(_Blocks(reader)):
                refused = _refusal(info, seen)
                if refused:
                    raise ArchiveError(refused)
                name = _normal(info.name)
                if hashed is None:
                    directories.append(name)
                    continue
                member = hashed.member()
                if member.data is not None:
                    kept += len(member.data)
                    if kept > MAX_KEPT_BYTES:
                        raise ArchiveError(
                            f"{path.name}: too many JSON documents to be an image archive"
                        )
                members[name] = member
            reader.drain()  # the end-of-archive padding counts for the file's checksum
            file_digest = reader.hexdigest()
        except ArchiveError as exc:
            raise ArchiveError(f"{path.name}: {exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ArchiveError(f"{path.name} is not a readable tar archive ({exc})") from None
        finally:
            reader.close()
            if meter:
                meter.close()
    return file_digest, reader.size, members, directories


def _normal(name: str) -> str:
    return posixpath.normpath("/" + name).lstrip("/")
