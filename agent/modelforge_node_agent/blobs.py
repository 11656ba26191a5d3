"""The node's model store on its artifact root (docs/node-agent.md, Model storage).

Layout under the artifact root::

    blobs/sha256/<hex>      verified blobs, read-only (0444), renamed in only after a match
    partial/<hex>           a download in progress; its size is the resume point
    models/<digest hex>/    the model directory a runtime opens: hard links into blobs/
    manifests/<digest hex>.json   the manifest of each laid-out model (written atomically)

The runtime worker opens a model directory at the same path, possibly as another user in the
agent's group (systemd nodes, docs/install-systemd.md): the root, blobs/, models/ (and every
directory in a model) and manifests/ are 0750 (SHARED_DIR_MODE), chmod-ed explicitly so the
umask (0077 under the unit) does not decide; partial/ and the quarantine root stay 0700
(PRIVATE_DIR_MODE). A blob that does not hash goes to ``<quarantine root>/<hex>.<timestamp>``.
Nothing here reads a whole blob into memory: hashing and copying go in CHUNK-sized pieces.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from modelforge_contract.files import fsync_directory, write_atomically
from modelforge_contract.models import HEX_RE, check_relative_path

CHUNK = 1024 * 1024  # the largest piece read, hashed or written at once
SHARED_DIR_MODE = 0o750  # what the runtime worker reads: the agent's group may enter and list
PRIVATE_DIR_MODE = 0o700  # downloads in progress and quarantined bytes: the agent alone


class DigestMismatch(Exception):
    """The downloaded bytes did not hash to the blob's name; ``quarantined`` is where they went."""

    def __init__(self, hex_digest: str, actual: str, quarantined: Path) -> None:
        super().__init__(f"blob {hex_digest} hashed to {actual}; moved to {quarantined}")
        self.quarantined = quarantined


def prepare_root(path: Path, mode: int = PRIVATE_DIR_MODE) -> None:
    """Create ``path`` when missing and give it ``mode`` when this process owns it (a root
    someone else owns keeps the mode they gave it); OSError when it cannot be used (not a
    directory, not writable)."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not a writable directory")
    _set_mode(path, mode)


def _set_mode(path: Path, mode: int) -> None:
    """chmod ``path`` to ``mode`` if it differs and this process owns it."""
    info = path.stat()
    if info.st_uid == os.geteuid() and info.st_mode & 0o7777 != mode:
        os.chmod(path, mode)


def _make_dir(path: Path, mode: int) -> None:
    """mkdir -p ``path``, every directory it creates given ``mode`` whatever the umask."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    for created in missing:
        os.chmod(created, mode)


def _check_hex(hex_digest: str) -> str:
    if not isinstance(hex_digest, str) or not HEX_RE.fullmatch(hex_digest):
        raise ValueError("not a sha256 hex digest")
    return hex_digest


class BlobStore:
    """The artifact root's blobs, partial downloads, model directories and quarantine."""

    def __init__(self, artifact_root: Path, quarantine_root: Path) -> None:
        self.root, self.quarantine_root = Path(artifact_root), Path(quarantine_root)
        self.blobs = self.root / "blobs" / "sha256"
        self.partial = self.root / "partial"
        self.models = self.root / "models"
        self.manifests = self.root / "manifests"

    def prepare(self) -> None:
        prepare_root(self.root, SHARED_DIR_MODE)
        prepare_root(self.quarantine_root, PRIVATE_DIR_MODE)
        for path, mode in (
            (self.blobs.parent, SHARED_DIR_MODE),
            (self.blobs, SHARED_DIR_MODE),
            (self.models, SHARED_DIR_MODE),
            (self.manifests, SHARED_DIR_MODE),
            (self.partial, PRIVATE_DIR_MODE),
        ):
            path.mkdir(mode=mode, exist_ok=True)
            _set_mode(path, mode)

    # -- blobs ------------------------------------------------------------------------

    def blob_path(self, hex_digest: str) -> Path:
        return self.blobs / _check_hex(hex_digest)

    def partial_path(self, hex_digest: str) -> Path:
        return self.partial / _check_hex(hex_digest)

    def has_blob(self, hex_digest: str) -> bool:
        return self.blob_path(hex_digest).is_file()

    def partial_size(self, hex_digest: str) -> int:
        try:
            return self.partial_path(hex_digest).stat().st_size
        except FileNotFoundError:
            return 0

    def open_partial(self, hex_digest: str) -> tuple[IO[bytes], Any, int]:
        """(file opened for append, sha256 over what it already holds, its size): a resume
        hashes the bytes on disk first."""
        path = self.partial_path(hex_digest)
        handle = open(path, "a+b")  # noqa: SIM115 - the caller closes it
        try:
            os.chmod(path, 0o600)
            hasher = hashlib.sha256()
            handle.seek(0)
            while chunk := handle.read(CHUNK):
                hasher.update(chunk)
            have = handle.tell()
        except BaseException:
            handle.close()
            raise
        return handle, hasher, have

    def discard_partial(self, hex_digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.partial_path(hex_digest).unlink()

    def commit(self, hex_digest: str, handle: IO[bytes], hasher: Any) -> Path:
        """fsync the partial, and rename it into blobs/ (0444) when it hashes to its name;
        otherwise move it to quarantine and raise DigestMismatch."""
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        partial = self.partial_path(hex_digest)
        actual = hasher.hexdigest()
        if actual != hex_digest:
            target = self.quarantine_root / f"{hex_digest}.{time.time_ns()}"
            try:
                os.replace(partial, target)
            except OSError:  # another filesystem: copy, then drop the partial
                shutil.copyfile(partial, target)
                partial.unlink()
            fsync_directory(self.quarantine_root)
            raise DigestMismatch(hex_digest, actual, target)
        os.chmod(partial, 0o444)
        final = self.blob_path(hex_digest)
        os.replace(partial, final)
        fsync_directory(self.blobs)
        fsync_directory(self.partial)
        return final

    def write_blob(self, hex_digest: str, chunks: Any) -> Path:
        """Append ``chunks`` to the partial and commit it (tests and local imports)."""
        handle, hasher, _have = self.open_partial(hex_digest)
        try:
            for chunk in chunks:
                handle.write(chunk)
                hasher.update(chunk)
        except BaseException:
            handle.close()
            raise
        return self.commit(hex_digest, handle, hasher)

    # -- models -----------------------------------------------------------------------

    def model_dir(self, digest_hex: str) -> Path:
        return self.models / _check_hex(digest_hex)

    def is_present(self, digest_hex: str) -> bool:
        return (self.manifests / f"{_check_hex(digest_hex)}.json").is_file() and self.model_dir(
            digest_hex
        ).is_dir()

    def missing_bytes(self, manifest: dict[str, Any]) -> int:
        """Bytes still to fetch for ``manifest``: blobs not held, less partial bytes on disk
        (each distinct blob counted once)."""
        sizes = {entry["sha256"]: entry["size"] for entry in manifest["files"]}
        total = 0
        for hex_digest, size in sizes.items():
            if not self.has_blob(hex_digest):
                total += max(0, size - self.partial_size(hex_digest))
        return total

    def link_model(self, digest_hex: str, manifest: dict[str, Any]) -> Path:
        """Lay out models/<digest hex>/ as hard links into blobs/ (built in a temp directory,
        renamed into place), then record the manifest."""
        target = self.model_dir(digest_hex)
        temp = self.models / f".{digest_hex}.{os.getpid()}.tmp"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(mode=SHARED_DIR_MODE)
        os.chmod(temp, SHARED_DIR_MODE)
        for entry in manifest["files"]:
            relative = check_relative_path(entry["path"])
            link = temp.joinpath(*relative.split("/"))
            _make_dir(link.parent, SHARED_DIR_MODE)
            os.link(self.blob_path(entry["sha256"]), link)
        if target.exists():
            shutil.rmtree(target)
        os.replace(temp, target)
        fsync_directory(self.models)
        self._write_manifest(digest_hex, manifest)
        return target

    def _write_manifest(self, digest_hex: str, manifest: dict[str, Any]) -> None:
        final = self.manifests / f"{digest_hex}.json"
        write_atomically(final, json.dumps(manifest, sort_keys=True), mode=0o644)

    def present_models(self) -> dict[str, dict[str, Any]]:
        """{digest hex: manifest} of every model laid out on disk (trusted after a restart:
        its blobs were renamed in only after they matched)."""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted(self.manifests.glob("*.json")):
            digest_hex = path.stem
            if not HEX_RE.fullmatch(digest_hex) or not self.model_dir(digest_hex).is_dir():
                continue
            try:
                manifest = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            found[digest_hex] = manifest
        return found

    def remove_model(self, digest_hex: str, keep_blobs: Iterable[str] = ()) -> int:
        """Delete models/<hex>/ and its manifest, then every blob (and partial) of it that no
        other laid-out model and nothing in ``keep_blobs`` references; the blobs deleted."""
        manifest_file = self.manifests / f"{_check_hex(digest_hex)}.json"
        manifest = None
        with contextlib.suppress(OSError, ValueError):
            manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        shutil.rmtree(self.model_dir(digest_hex), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            manifest_file.unlink()
        if not isinstance(manifest, dict):
            return 0
        still = set(keep_blobs)
        for other in self.present_models().values():
            still.update(entry.get("sha256") for entry in other.get("files", []))
        removed = 0
        for hex_digest in {entry["sha256"] for entry in manifest.get("files", [])} - still:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.blob_path(hex_digest).unlink()
                removed += 1
            with contextlib.suppress(ValueError):
                self.discard_partial(hex_digest)
        return removed


__all__ = [
    "CHUNK",
    "PRIVATE_DIR_MODE",
    "SHARED_DIR_MODE",
    "BlobStore",
    "DigestMismatch",
    "prepare_root",
]
