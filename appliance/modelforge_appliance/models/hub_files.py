"""A pull's files on the control plane: free space checked first, each download resumed
from what is on disk, every byte hashed and checked against the hub's hashes before it
counts, a file that does not match moved to quarantine (docs/models.md, "Pulling").

Under ``STATE_DIR/models/`` (the same file system as the seed cache, so every step is a
rename):

- ``hub/partial/<key>``: a download in progress, named for what the hub says it is
  (``sha256-<hex>`` for an LFS file, ``git-<blob id>`` for one kept in git). A pull killed
  or cut off leaves it, and the next pull of that file continues from its last byte
  (``Range``) after hashing what it holds. An exclusive ``flock`` on it keeps two pulls
  (in any process) from writing one file.
- ``hub/verified/<sha256 hex>``: a file whose bytes matched; it waits there until every
  file of the pull has, and only then does the revision enter the cache (catalog), so a
  failed pull leaves nothing half-imported and its next try fetches only what failed.
- ``quarantine/<key>.<unix time>``: a download that did not hash (``DIGEST_MISMATCH``);
  nothing reads it again.

The bytes come through ``huggingface_hub.file_download.http_get``, the client's own
download loop (its retries, its resumption within one run, its redirects, which drop the
token when they leave the hub's origin); it writes into a file object of ours that hashes
as it goes. That client keeps no partial file across runs since 1.x, so the partial file
and its resumption are this module's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelforge_contract.files import fsync_directory
from modelforge_contract.hub import HUB_DOWNLOAD_FAILED, PULL_IN_PROGRESS
from modelforge_contract.models import DIGEST_MISMATCH, DISK_FULL, INSUFFICIENT_SPACE

from ..core.errors import ApiError, Conflict
from . import cache, hub
from .hub import HubError, HubFile, PullPlan, client

log = logging.getLogger(__name__)

CHUNK = cache.CHUNK


class SpaceError(ApiError):
    status = 507
    code = INSUFFICIENT_SPACE


@dataclass(frozen=True)
class Staged:
    """A file of the pull, verified: its manifest entry and where its bytes wait."""

    path: str
    size: int
    sha256: str
    staged: Path | None  # None: the seed cache already holds the blob


class Progress:
    """What a pull tells as it goes; this one tells nothing."""

    def started(self, plan: PullPlan, here: dict[str, int]) -> None:
        """The pull begins: ``here`` maps each file's path to the bytes of it already here."""

    def file_started(self, file: HubFile, done: int) -> None:
        """file begins downloading with ``done`` of its bytes already on disk."""

    def advanced(self, count: int) -> None:
        """count more bytes arrived (negative: the hub ignored a Range, so they went)."""

    def file_finished(self, file: HubFile) -> None:
        """file is verified (or was already here)."""


def hub_dir(state_dir: Path) -> Path:
    return cache.models_dir(state_dir) / "hub"


def partial_file(state_dir: Path, file: HubFile) -> Path:
    return hub_dir(state_dir) / "partial" / file.key


def verified_file(state_dir: Path, hexdigest: str) -> Path:
    return hub_dir(state_dir) / "verified" / hexdigest


def quarantine_dir(state_dir: Path) -> Path:
    return cache.models_dir(state_dir) / "quarantine"


def _already_here(state_dir: Path, file: HubFile) -> Path | None:
    """Where an LFS file's verified bytes already are (the seed cache, or staged), if so."""
    if not file.sha256:
        return None
    for place in (cache.blob_file(state_dir, file.sha256), verified_file(state_dir, file.sha256)):
        if place.exists():
            return place
    return None


def _on_disk(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


# -- free space ---------------------------------------------------------------------------


class Reservations:
    """Bytes the pulls running in this process still have to write, so two pulls started
    together cannot both count on the same free space."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}

    def reserve(self, state_dir: Path, plan: PullPlan) -> int:
        """Reserve what plan still needs, or SpaceError (nothing written); a ticket."""
        needed = missing_bytes(state_dir, plan)
        where = cache.models_dir(state_dir)
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock:
            free = shutil.disk_usage(where).free
            others = sum(self._held.values())
            if needed + others > free:
                raise SpaceError(
                    f"{plan.url}: {needed:,} bytes still to download, but {where} has "
                    f"{free:,} bytes free{f' ({others:,} held by other pulls)' if others else ''}",
                    next_step=f"Free space on the file system of {where} (remove models no "
                    "longer needed: modelforge models remove NAME), or choose fewer files with "
                    "--include, then pull again.",
                )
            ticket = id(object())
            self._held[ticket] = needed
            return ticket

    def release(self, ticket: int) -> None:
        with self._lock:
            self._held.pop(ticket, None)


RESERVATIONS = Reservations()


def bytes_here(state_dir: Path, plan: PullPlan) -> dict[str, int]:
    """Per file, the bytes already here: all of a verified one, else its partial file's."""
    here = {}
    for file in plan.files:
        if _already_here(state_dir, file) is not None:
            here[file.path] = file.size
        else:
            here[file.path] = min(_on_disk(partial_file(state_dir, file)), file.size)
    return here


def missing_bytes(state_dir: Path, plan: PullPlan) -> int:
    """What is still to download: every file not already here, less its partial file."""
    return plan.bytes_total - sum(bytes_here(state_dir, plan).values())


# -- downloading and verifying ---------------------------------------------------------------


class _HashingFile:
    """The file object ``http_get`` writes into: each write is hashed as it lands. A
    truncate (the hub ignored our Range and sends the file whole) hashes again what stays."""

    def __init__(self, handle: Any, file: HubFile, done: int) -> None:
        self.handle = handle
        self.file = file
        self.hashers = _hashers_over(handle.fileno(), done, file)

    def write(self, data: bytes) -> int:
        written = self.handle.write(data)
        for hasher in self.hashers:
            hasher.update(data)
        return written

    def tell(self) -> int:
        return self.handle.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.handle.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        size = self.handle.tell() if size is None else size
        self.handle.truncate(size)
        self.handle.flush()
        self.hashers = _hashers_over(self.handle.fileno(), size, self.file)
        self.handle.seek(size)
        return size


def _new_hashers(file: HubFile) -> list[Any]:
    hashers = [hashlib.sha256()]
    if file.git_oid and not file.sha256:
        # A file kept in git is named by its blob id: sha1 of "blob <size>\0" and the bytes.
        git = hashlib.sha1(usedforsecurity=False)
        git.update(b"blob %d\0" % file.size)
        hashers.append(git)
    return hashers


def _hashers_over(fd: int, size: int, file: HubFile) -> list[Any]:
    """Hashers fed with the first ``size`` bytes of fd (a partial file being resumed)."""
    hashers = _new_hashers(file)
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(CHUNK, size - offset), offset)
        if not chunk:
            break
        for hasher in hashers:
            hasher.update(chunk)
        offset += len(chunk)
    return hashers


def fetch(
    state_dir: Path,
    plan: PullPlan,
    token: str | None,
    progress: Progress,
    now: Callable[[], float],
) -> list[Staged]:
    """Every file of plan, downloaded (or found here) and verified, in plan order."""
    staged = []
    for file in plan.files:
        here = _already_here(state_dir, file)
        if here is not None:
            progress.file_finished(file)
            in_cache = here == cache.blob_file(state_dir, file.sha256 or "")
            staged.append(
                Staged(file.path, file.size, file.sha256 or "", None if in_cache else here)
            )
            continue
        staged.append(_fetch_one(state_dir, plan, file, token, progress, now))
        progress.file_finished(file)
    return staged


def _fetch_one(
    state_dir: Path,
    plan: PullPlan,
    file: HubFile,
    token: str | None,
    progress: Progress,
    now: Callable[[], float],
) -> Staged:
    partial = partial_file(state_dir, file)
    for folder in (partial.parent, verified_file(state_dir, "x").parent):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(
                f"another pull is downloading {file.path} of {plan.source.repo}",
                code=PULL_IN_PROGRESS,
                next_step="Wait for it to finish (modelforge models list, or the console's "
                "Models page), then pull again.",
            ) from None
        done = os.fstat(handle.fileno()).st_size
        if done > file.size:  # longer than the file: it cannot be a prefix of it
            handle.truncate(0)
            done = 0
        writer = _HashingFile(handle, file, done)
        handle.seek(done)
        progress.file_started(file, done)
        log.info("downloading %s of %s from byte %d of %d", file.path, plan.url, done, file.size)
        _download(plan, file, token, writer, done, progress)
        handle.flush()
        os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
        return _verified(state_dir, plan, file, partial, size, writer.hashers, now)


def _download(
    plan: PullPlan,
    file: HubFile,
    token: str | None,
    writer: _HashingFile,
    done: int,
    progress: Progress,
) -> None:
    try:
        client().http_get(
            plan.file_url(file),
            writer,  # type: ignore[arg-type]
            resume_size=done,
            headers=hub.request_headers(token),
            expected_size=file.size,
            displayed_filename=file.path,
            tqdm_class=lambda **_: _Bar(progress),  # type: ignore[arg-type]
        )
    except client().errors.HfHubHTTPError as exc:
        hub.refuse(exc, plan.source, plan.endpoint, token, plan.gated)
    except (client().transport_error, ConnectionError) as exc:
        raise HubError(
            f"the connection to {plan.endpoint} broke while downloading {file.path} "
            f"({type(exc).__name__})",
            code=HUB_DOWNLOAD_FAILED,
            next_step="Pull again: it continues from the bytes already downloaded.",
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SpaceError(
                f"the disk filled while downloading {file.path}",
                code=DISK_FULL,
                next_step="Free space on the control plane's state directory, then pull again "
                "(it continues from the bytes already downloaded).",
            ) from None
        if exc.errno is not None:
            raise
        # http_get's own size check ("Consistency check failed"): the verification below
        # names the file and quarantines it.


class _Bar:
    """What ``http_get`` takes for its progress bar: it only counts bytes into ours."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, count: int) -> None:
        self.progress.advanced(count)

    def close(self) -> None:
        return None


def _verified(
    state_dir: Path,
    plan: PullPlan,
    file: HubFile,
    partial: Path,
    size: int,
    hashers: list[Any],
    now: Callable[[], float],
) -> Staged:
    sha256 = hashers[0].hexdigest()
    if size != file.size:
        problem = f"{size:,} bytes where the hub lists {file.size:,}"
    elif file.sha256 and sha256 != file.sha256:
        problem = f"sha256 {sha256} where the hub lists {file.sha256}"
    elif not file.sha256 and file.git_oid and hashers[1].hexdigest() != file.git_oid:
        problem = f"git blob {hashers[1].hexdigest()} where the hub lists {file.git_oid}"
    else:
        target = verified_file(state_dir, sha256)
        os.chmod(partial, 0o444)
        os.replace(partial, target)
        fsync_directory(target.parent)
        return Staged(file.path, file.size, sha256, target)
    quarantine = quarantine_dir(state_dir)
    quarantine.mkdir(parents=True, exist_ok=True, mode=0o700)
    kept = quarantine / f"{file.key}.{int(now())}"
    os.replace(partial, kept)
    log.warning("%s of %s did not verify (%s); moved to %s", file.path, plan.url, problem, kept)
    raise HubError(
        f"{file.path} of {plan.url} did not verify: {problem}; it was moved to {kept} and "
        "nothing was imported",
        code=DIGEST_MISMATCH,
        next_step="Pull again: the file is downloaded anew. If it fails again, the hub or "
        "the mirror in HF_ENDPOINT serves other bytes than it lists: report it there.",
    )
