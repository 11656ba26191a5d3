"""The seed cache: ``STATE_DIR/models/blobs/sha256/<hex>``, content-addressed.

An import reads each source file once: it copies it into ``STATE_DIR/models/tmp/`` while
hashing (1 MiB chunks), fsyncs, and renames it into place only when that blob is not there
yet (identical files are stored once). A blob already there is trusted by its name;
``modelforge models verify`` hashes them again.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelforge_contract.files import fsync_directory
from modelforge_contract.models import (
    MANIFEST_MAX_FILES,
    MODEL_CACHE_INVALID,
    MODEL_SOURCE_INVALID,
    MODEL_SYMLINK_ESCAPES,
    ManifestError,
    check_relative_path,
)

from ..core.errors import ApiError, Invalid

CHUNK = 1024 * 1024  # never more than this of a blob in memory
# A Hugging Face cache snapshot: .../models--ORG--NAME/snapshots/<commit>
_HF_SNAPSHOT = re.compile(r"(models|datasets|spaces)--[^/]+")

Progress = Callable[[int], None]


class CacheInvalid(ApiError):
    status = 500
    code = MODEL_CACHE_INVALID
    next_step = "Import the model again (modelforge models import NAME PATH) to restore its files."


def models_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "models"


def blob_file(state_dir: Path, digest_hex: str) -> Path:
    return models_dir(state_dir) / "blobs" / "sha256" / digest_hex


def shares_file_system(source: Path, state_dir: Path) -> bool:
    """Whether ``source`` lies on the seed cache's file system. An import copies even then,
    never linking: a hard link would share the file with its source, so a source edited in
    place would change the cached bytes under their digest (docs/models.md, "Importing")."""
    try:
        return os.stat(source).st_dev == os.stat(models_dir(state_dir)).st_dev
    except OSError:
        return False


@dataclass(frozen=True)
class SourceFile:
    path: str  # the manifest path
    real: Path  # the file read
    size: int


_NAME_A_SOURCE = (
    "Name a readable regular file or a non-empty directory as the control plane sees it: on "
    "its host, or inside its container when it runs in one (the Unraid template mounts a "
    "models folder at /models)."
)


def _invalid(message: str, next_step: str = _NAME_A_SOURCE) -> Invalid:
    return Invalid(message, code=MODEL_SOURCE_INVALID, next_step=next_step)


def hf_snapshot(source: Path) -> tuple[Path, str] | None:
    """``(models--ORG--NAME folder, commit)`` when source is a Hugging Face cache snapshot."""
    if source.parent.name == "snapshots" and _HF_SNAPSHOT.fullmatch(source.parent.parent.name):
        return source.parent.parent, source.name
    return None


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def scan_source(source: Path) -> list[SourceFile]:
    """The files an import of source would read, sorted by manifest path; raises
    MODEL_SOURCE_INVALID / MODEL_SYMLINK_ESCAPES before anything is written."""
    source = Path(os.path.abspath(source))
    try:
        info = os.stat(source)
    except OSError as exc:
        raise _invalid(f"{source}: {exc.strerror or 'cannot be read'}") from None
    if stat.S_ISREG(info.st_mode):
        if not os.access(source, os.R_OK):
            raise _invalid(f"{source}: not readable")
        return [SourceFile(_checked(source.name, source), source, info.st_size)]
    if not stat.S_ISDIR(info.st_mode):
        raise _invalid(f"{source} is neither a regular file nor a directory")
    real_root = Path(os.path.realpath(source))
    snapshot = hf_snapshot(source)
    allowed = Path(os.path.realpath(snapshot[0])) if snapshot else real_root
    found: list[SourceFile] = []
    seen_dirs: set[Path] = set()
    _walk(source, "", real_root, allowed, found, seen_dirs)
    if not found:
        raise _invalid(f"{source} holds no file")
    if len(found) > MANIFEST_MAX_FILES:
        raise _invalid(f"{source} holds {len(found)} files, more than {MANIFEST_MAX_FILES}")
    return sorted(found, key=lambda entry: entry.path)


def _checked(path: str, where: Path) -> str:
    try:
        return check_relative_path(path)
    except ManifestError as exc:
        raise _invalid(
            f"{where}: {exc}",
            next_step="Rename the file (or leave it out of the folder) and import again: a "
            "model's file names are shown and sent to nodes as they are.",
        ) from None


def _walk(
    directory: Path,
    prefix: str,
    real_root: Path,
    allowed: Path,
    found: list[SourceFile],
    seen_dirs: set[Path],
) -> None:
    real_dir = Path(os.path.realpath(directory))
    if real_dir in seen_dirs:  # a link loop
        raise _invalid(f"{directory}: a directory link leads back into the import")
    seen_dirs.add(real_dir)
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise _invalid(f"{directory}: {exc.strerror or 'cannot be listed'}") from None
    for name in names:
        path = directory / name
        relative = f"{prefix}{name}"
        if os.path.islink(path):
            target = Path(os.path.realpath(path))
            if not _inside(target, allowed) and not _inside(target, real_root):
                raise Invalid(
                    f"{path} links to {target}, outside the imported directory",
                    code=MODEL_SYMLINK_ESCAPES,
                    next_step="Copy the file into the directory, or import its target instead.",
                )
        try:
            info = os.stat(path)
        except OSError as exc:
            raise _invalid(f"{path}: {exc.strerror or 'cannot be read'}") from None
        if stat.S_ISDIR(info.st_mode):
            _walk(path, relative + "/", real_root, allowed, found, seen_dirs)
        elif stat.S_ISREG(info.st_mode):
            if not os.access(path, os.R_OK):
                raise _invalid(f"{path}: not readable")
            found.append(SourceFile(_checked(relative, path), path, info.st_size))
        else:
            raise _invalid(f"{path} is a special file (fifo, socket or device)")
    seen_dirs.discard(real_dir)  # the directories above this one: a loop, not a second link


def store_file(state_dir: Path, source: Path, progress: Progress | None = None) -> tuple[str, bool]:
    """Copy source into the cache while hashing it: ``(hex, whether this call added it)``."""
    tmp_dir = models_dir(state_dir) / "tmp"
    blobs = models_dir(state_dir) / "blobs" / "sha256"
    tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    blobs.mkdir(parents=True, exist_ok=True, mode=0o700)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=tmp_dir, prefix="import-")
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as handle:
            while True:
                chunk = handle.read(CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
                if progress is not None:
                    progress(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        hexdigest = digest.hexdigest()
        target = blobs / hexdigest
        if target.exists():
            os.unlink(tmp_name)
            return hexdigest, False
        os.chmod(tmp_name, 0o444)
        os.replace(tmp_name, target)
        fsync_directory(blobs)
        return hexdigest, True
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise


def adopt_blob(state_dir: Path, path: Path, hexdigest: str) -> bool:
    """Rename a file already verified to hash to hexdigest into the cache (a pull's staged
    file, on the same file system); whether this call added the blob."""
    blobs = models_dir(state_dir) / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = blobs / hexdigest
    if target.exists():
        os.unlink(path)
        return False
    os.chmod(path, 0o444)
    os.replace(path, target)
    fsync_directory(blobs)
    return True


def remove_blobs(state_dir: Path, hexes: Iterable[str]) -> int:
    """Delete these cache blobs (those no model revision references any more)."""
    removed = 0
    for hexdigest in hexes:
        try:
            os.unlink(blob_file(state_dir, hexdigest))
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def hash_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(CHUNK)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
