"""The model loop (issue 24): hold the models the control plane asks of this node.

It fetches ``GET /agent/models`` at start, whenever a heartbeat answer's
``models_generation`` differs from the one last fetched, and at least every
MODELS_REFETCH_SECONDS. Each desired manifest is checked (paths, digest), the free space
checked against what is still missing (INSUFFICIENT_SPACE, nothing written), its blobs
pulled with ``Range`` resumes through the agent's own session (credential, protocol header,
TLS settings), verified, and the model directory laid out as hard links (blobs.py).
``report()`` is the inventory's ``models`` list; a state change wakes the inventory at once,
progress at most every MODEL_REPORT_SECONDS.
"""

from __future__ import annotations

import errno
import http.client
import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
import urllib3

from modelforge_contract import HEADER_AGENT_PROTOCOL, HEADER_AUTHORIZATION, PROTOCOL_VERSION
from modelforge_contract import models as contract

from . import __version__
from .backoff import BACKOFF_STEPS, Backoff, seconds
from .blobs import CHUNK, BlobStore, DigestMismatch
from .client import (
    ControlPlaneClient,
    Refused,
    TransportFailure,
    _refusal_fields,
    parse_answer,
    printable,
)
from .generation import Generation
from .settings import AgentSettings, ConfigError
from .transport import AnswerTooLarge, read_answer

log = logging.getLogger(__name__)

# A download that keeps failing without moving a byte gives up after this many tries.
MAX_TRIES_WITHOUT_PROGRESS = 8
# A blob started again from its first byte (416, an ignored range, more bytes than its size)
# this many times in a row fails: the control plane cannot serve it as its manifest says.
MAX_RESTARTS = 3
CONNECT_TIMEOUT = 5.0

# What a transfer can fail with on the network side (an OSError from the file is not one).
_NETWORK_ERRORS = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
)


def prepare_model_roots(settings: AgentSettings) -> None:
    """Create the artifact root (0750: the runtime worker reads it) and the quarantine root
    (0700) when missing; ConfigError (exit 2) when either cannot be used, as for the state
    volume."""
    store = BlobStore(settings.artifacts_dir, settings.quarantine_dir)
    try:
        store.prepare()
    except OSError as exc:
        raise ConfigError(
            f"the artifact root {store.root} or quarantine root {store.quarantine_root} cannot "
            f"be used ({exc.strerror or exc}); make it a directory this agent may write, or set "
            "MODELFORGE_AGENT_ARTIFACT_ROOT / MODELFORGE_AGENT_QUARANTINE_ROOT"
        ) from None


class ModelFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Stopped(Exception):
    """The agent is stopping (or was refused) mid-download."""


class _Retry(Exception):
    pass


# One pull at a time in the process: a loop of a run that a refusal stopped may still sit
# in a read (up to the stall timeout) while the next run's loop starts on the same files.
_ONE_AT_A_TIME = threading.Lock()


class ModelLoop:
    """One thread that keeps the node's models as the control plane asks."""

    def __init__(
        self,
        settings: AgentSettings,
        client: ControlPlaneClient,
        stop: threading.Event,
        refuse: Callable[[Refused], None],
        *,
        steps: tuple[float, ...] = BACKOFF_STEPS,
    ) -> None:
        self.settings, self.client, self.stop, self.refuse = settings, client, stop, refuse
        self.steps = steps
        self.store = BlobStore(settings.artifacts_dir, settings.quarantine_dir)
        self.wake_inventory: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}  # digest -> inventory entry
        self.generation = Generation()  # the heartbeat answer's models_generation
        self._fetch = self.generation.wanted
        self._last_progress = 0.0

    # -- what the publisher hands over and reads ------------------------------------------

    def report(self) -> list[dict[str, Any]]:
        """The inventory's ``models``: every model this agent knows, with its state."""
        with self._lock:
            return [dict(entry) for _digest, entry in sorted(self._reports.items())]

    def _set(
        self, digest: str, state: str, done: int, total: int, error: dict | None = None
    ) -> None:
        entry = {
            "digest": digest,
            "state": state,
            "bytes_done": max(0, done),
            "bytes_total": total,
            "error": error,
        }
        with self._lock:
            before = self._reports.get(digest)
            self._reports[digest] = entry
        now = time.monotonic()
        changed = before is None or before["state"] != state or before["error"] != error
        if changed or now - self._last_progress >= contract.MODEL_REPORT_SECONDS:
            self._last_progress = now
            self.wake_inventory()

    def _drop(self, digest: str) -> None:
        with self._lock:
            gone = self._reports.pop(digest, None)
        if gone is not None:
            self.wake_inventory()

    # -- the loop ---------------------------------------------------------------------

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="model-loop", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        try:
            self.store.prepare()
        except OSError as exc:
            log.error("the artifact root %s cannot be used: %s", self.store.root, exc.strerror)
            return
        for digest_hex, manifest in self.store.present_models().items():
            total = sum(entry["size"] for entry in manifest.get("files", []))
            self._set(f"sha256:{digest_hex}", contract.REPLICA_PRESENT, total, total)
        self._fetch.set()
        while not self.stop.is_set():
            self._fetch.wait(contract.MODELS_REFETCH_SECONDS)
            self._fetch.clear()
            if self.stop.is_set():
                return
            try:
                with _ONE_AT_A_TIME:
                    if self.stop.is_set():
                        return
                    self.sync_once()
            except Stopped:
                return
            except Exception as exc:  # logged by type only: its text may quote an answer
                log.error("model loop stopped by %s; again in %s", type(exc).__name__,
                          seconds(self.steps[-1]))  # fmt: skip
                if self.stop.wait(self.steps[-1]):
                    return
                self._fetch.set()

    def _fetch_desired(self) -> dict[str, Any]:
        backoff = Backoff(self.steps)
        while not self.stop.is_set():
            generation = self.generation.asking()
            try:
                answer = self.client.call("GET", contract.PATH_AGENT_MODELS, {})
            except Refused as refusal:
                if refusal.credential_refused or refusal.protocol_incompatible:
                    self.refuse(refusal)
                    raise Stopped() from None
                problem = refusal.describe()
            except TransportFailure as failure:
                problem = failure.describe()
            else:
                self.generation.fetched(answer.get("models_generation", generation))
                return answer
            step, delay = backoff.next_step()
            log.warning("%s (backoff %s): retry in %s", problem, backoff.span, seconds(step))
            if self.stop.wait(delay):
                break
        raise Stopped()

    def sync_once(self) -> None:
        """Fetch the desired set once and act on it: remove, then hold each model."""
        answer = self._fetch_desired()
        desired, remove = answer.get("models"), answer.get("remove")
        desired = desired if isinstance(desired, list) else []
        remove = remove if isinstance(remove, list) else []
        wanted: dict[str, dict[str, Any]] = {}
        for item in desired[:1000]:
            if not isinstance(item, dict) or not isinstance(item.get("digest"), str):
                continue
            digest = item["digest"]
            if not contract.DIGEST_RE.fullmatch(digest):
                continue
            try:
                manifest = contract.check_manifest(item.get("manifest"))
                if contract.manifest_digest(manifest) != digest:
                    raise contract.ManifestError("the manifest does not hash to its digest")
            except contract.ManifestError as exc:
                self._fail(digest, 0, contract.MANIFEST_INVALID, str(exc))
                continue
            wanted[digest] = manifest
        keep = {entry["sha256"] for m in wanted.values() for entry in m["files"]}
        for digest in remove[:1000]:
            valid = isinstance(digest, str) and contract.DIGEST_RE.fullmatch(digest)
            if valid and digest not in wanted:
                self._remove(digest[7:], keep)
        for digest, manifest in wanted.items():
            if self.stop.is_set():
                raise Stopped()
            if self._fetch.is_set():
                return  # the desired set moved: fetch it again first
            self._hold(digest, manifest)

    def _remove(self, digest_hex: str, keep: set[str]) -> None:
        removed = self.store.remove_model(digest_hex, keep)
        log.info("model sha256:%s removed (%d file(s) deleted)", digest_hex, removed)
        self._drop(f"sha256:{digest_hex}")

    def _fail(self, digest: str, total: int, code: str, message: str) -> None:
        log.warning("model %s failed: %s (%s)", digest, code, printable(message, 300))
        with self._lock:
            before = self._reports.get(digest)
        done = before["bytes_done"] if before is not None else 0
        self._set(digest, contract.REPLICA_FAILED, done, total,
                  {"code": code, "message": message[:1000]})  # fmt: skip

    def _hold(self, digest: str, manifest: dict[str, Any]) -> None:
        digest_hex = digest[7:]
        sizes = {entry["sha256"]: entry["size"] for entry in manifest["files"]}
        total = sum(entry["size"] for entry in manifest["files"])
        if self.store.is_present(digest_hex):
            with self._lock:
                current = self._reports.get(digest)
            if current is None or current["state"] != contract.REPLICA_PRESENT:
                self._set(digest, contract.REPLICA_PRESENT, total, total)
            return
        try:
            missing = self.store.missing_bytes(manifest)
            free = shutil.disk_usage(self.store.root).free
        except OSError as exc:
            self._fail(digest, total, contract.STORAGE_FAILED, exc.strerror or "OSError")
            return
        if missing > free:
            self._fail(digest, total, contract.INSUFFICIENT_SPACE,
                       f"{missing} bytes still to fetch, {free} free on {self.store.root}")  # fmt: skip
            return
        self._set(digest, contract.REPLICA_DOWNLOADING, total - missing, total)
        try:
            for hex_digest, size in sizes.items():
                if not self.store.has_blob(hex_digest):
                    self._pull(digest, hex_digest, size, total)
            self.store.link_model(digest_hex, manifest)
        except ModelFailed as failed:
            self._fail(digest, total, failed.code, failed.message)
            return
        except OSError as exc:
            code = contract.DISK_FULL if exc.errno == errno.ENOSPC else contract.STORAGE_FAILED
            self._fail(digest, total, code, exc.strerror or type(exc).__name__)
            return
        log.info("model %s present (%d file(s), %d bytes)", digest, len(manifest["files"]), total)
        self._set(digest, contract.REPLICA_PRESENT, total, total)

    def _progress(self, digest: str, delta: int, total: int) -> None:
        with self._lock:
            entry = self._reports.get(digest)
        done = entry["bytes_done"] if entry else 0
        self._set(digest, contract.REPLICA_DOWNLOADING, min(total, done + delta), total)

    def _headers(self, have: int) -> dict[str, str]:
        headers = {
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "User-Agent": f"modelforge-node-agent/{__version__}",
            "Accept-Encoding": "identity",
        }
        if self.client.credential:
            headers[HEADER_AUTHORIZATION] = f"Bearer {self.client.credential}"
        if have:
            headers["Range"] = f"bytes={have}-"
        return headers

    def _pull(self, digest: str, hex_digest: str, size: int, total: int) -> None:
        """Fetch one blob into partial/ (resuming), verify and commit it; ModelFailed, or
        OSError (ENOSPC) from the disk."""
        backoff = Backoff(self.steps)
        tries = restarts = 0
        while True:
            if self.stop.is_set():
                raise Stopped()
            handle, hasher, have = self.store.open_partial(hex_digest)
            try:
                if have > size:
                    handle.close()
                    self.store.discard_partial(hex_digest)
                    continue
                if have < size:
                    try:
                        self._transfer(digest, hex_digest, size, total, handle, hasher, have)
                    except _Restart as restart:
                        handle.close()
                        self.store.discard_partial(hex_digest)
                        restarts += 1
                        if restarts > MAX_RESTARTS:
                            raise ModelFailed(
                                contract.DOWNLOAD_FAILED,
                                f"blob {hex_digest}: {restart} ({restarts} times from the "
                                "start); the control plane's copy does not match its manifest: "
                                "import the model again there",
                            ) from None
                        if restarts > 1:  # the first may be a stale partial; then back off
                            step, delay = backoff.next_step()
                            log.warning("blob %s: %s; starting again in %s (backoff %s)",
                                        hex_digest, restart, seconds(step), backoff.span)  # fmt: skip
                            if self.stop.wait(delay):
                                raise Stopped() from None
                        continue
                    except (*_NETWORK_ERRORS, _Retry) as exc:
                        handle.close()
                        moved = self.store.partial_size(hex_digest) - have
                        if moved > 0:
                            backoff.reset()
                            tries = 0
                        tries += 1
                        stalled = "timed out" in str(exc)
                        if tries >= MAX_TRIES_WITHOUT_PROGRESS:
                            code = (
                                contract.DOWNLOAD_STALLED if stalled else contract.DOWNLOAD_FAILED
                            )
                            raise ModelFailed(code, f"blob {hex_digest}: {type(exc).__name__} "
                                              f"{tries} times in a row") from None  # fmt: skip
                        step, delay = backoff.next_step()
                        log.warning("blob %s %s at %d of %d bytes (backoff %s): resuming in %s",
                                    hex_digest, "stalled" if stalled else type(exc).__name__,
                                    have + max(moved, 0), size, backoff.span, seconds(step))  # fmt: skip
                        if self.stop.wait(delay):
                            raise Stopped() from None
                        continue
                try:
                    self.store.commit(hex_digest, handle, hasher)
                except DigestMismatch as mismatch:
                    raise ModelFailed(contract.DIGEST_MISMATCH, str(mismatch)) from None
                return
            finally:
                if not handle.closed:
                    handle.close()

    def _transfer(self, digest, hex_digest, size, total, handle, hasher, have) -> None:  # noqa: ANN001
        """One GET from ``have`` on, appended to the partial as it arrives."""
        path = contract.blob_path(hex_digest)
        response = self.client.session.get(
            self.client.base_url + path,
            headers=self._headers(have),
            timeout=(CONNECT_TIMEOUT, self.settings.model_stall_seconds),
            allow_redirects=False,
            stream=True,
        )
        try:
            status = response.status_code
            if status == 416:
                raise _Restart(f"HTTP 416 for bytes {have}- of {size}")
            if status in (401, 426):
                self.refuse(Refused(status, "GET", path, *_fields(response)))
                raise Stopped()
            if status in (403, 404):
                code, _ = _fields(response)
                raise ModelFailed(contract.DOWNLOAD_FAILED,
                                  f"the control plane refused the blob: HTTP {status} "
                                  f"{code or ''}".strip())  # fmt: skip
            if status == 200 and have:
                raise _Restart(f"the control plane ignored the range from byte {have}")
            if status not in (200, 206):
                raise _Retry(f"HTTP {status} on GET {path}")
            moved = 0
            for chunk in response.iter_content(CHUNK):
                if not chunk:
                    continue
                if have + moved + len(chunk) > size:
                    raise _Restart(f"the control plane sent more than the blob's {size} bytes")
                handle.write(chunk)
                hasher.update(chunk)
                moved += len(chunk)
                self._progress(digest, len(chunk), total)
                if self.stop.is_set():
                    handle.flush()
                    raise Stopped()
            handle.flush()
            if have + moved < size:
                raise _Retry("the answer ended before the blob did")
        finally:
            response.close()


class _Restart(Exception):
    """The partial cannot be resumed (416, an ignored range, too long): start from 0."""


def _fields(response: requests.Response) -> tuple[str | None, str | None]:
    """The refusal's error code and compatibility answer (a small JSON body, read capped)."""
    try:
        return _refusal_fields(parse_answer(read_answer(response, 64 * 1024)))
    except (AnswerTooLarge, *_NETWORK_ERRORS):
        return None, None


__all__ = ["ModelLoop", "prepare_model_roots"]
