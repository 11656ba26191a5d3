"""The models wire contract (docs/architecture.md §10, docs/models.md).

A model revision is a manifest ``{name, revision, files: [{path, size, sha256}]}``; its
digest ``sha256:<hex>`` over the canonical JSON (sorted keys, no spaces) is its identity.
Both sides compute it here, and both sides check a manifest's paths here: an agent never
writes outside its model directory because of a path the control plane sent.

How a replica travels (nothing moves until an administrator asks):

1. ``POST /admin/models/{name}/replicas {node_ids}`` makes one replica row per (revision,
   node), ``pending``, and bumps the node's ``models_generation``.
2. Every heartbeat answer carries ``models_generation`` (additive). An agent that sees a
   value other than the one it last fetched calls ``GET /agent/models``: the manifests it
   should hold and the digests it should remove.
3. It pulls the missing blobs with ``GET /agent/blobs/sha256:<hex>`` (``Range``), verifies,
   links the model directory, and reports ``models`` in its inventory, at most once a
   second while bytes move (MODEL_REPORT_SECONDS) and at once when a state changes.
4. A replica is ``present`` only from such a report since the node's last enrollment or
   the last restore; a removed replica's row goes once the node no longer reports it.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from typing import Any

from . import API_PREFIX

# -- paths ---------------------------------------------------------------------

PATH_ADMIN_MODELS = f"{API_PREFIX}/admin/models"
PATH_ADMIN_MODEL = f"{API_PREFIX}/admin/models/<name>"
PATH_ADMIN_MODEL_REPLICAS = f"{PATH_ADMIN_MODEL}/replicas"
PATH_ADMIN_MODEL_REPLICA = f"{PATH_ADMIN_MODEL_REPLICAS}/<node_id>"
PATH_AGENT_MODELS = f"{API_PREFIX}/agent/models"
PATH_AGENT_BLOB = f"{API_PREFIX}/agent/blobs/<digest>"

# -- replica states ------------------------------------------------------------
# What the control plane shows. ``pending``: asked for, the node has not reported it yet;
# ``downloading`` with bytes_done/bytes_total; ``present``: verified on the node;
# ``failed`` with an error code; ``removing``: asked away, the node still reports it.

REPLICA_PENDING = "pending"
REPLICA_DOWNLOADING = "downloading"
REPLICA_PRESENT = "present"
REPLICA_FAILED = "failed"
REPLICA_REMOVING = "removing"
REPLICA_STATES = (
    REPLICA_PENDING,
    REPLICA_DOWNLOADING,
    REPLICA_PRESENT,
    REPLICA_FAILED,
    REPLICA_REMOVING,
)
# What an agent may report for a digest in its inventory's ``models`` list.
REPORTED_STATES = (REPLICA_DOWNLOADING, REPLICA_PRESENT, REPLICA_FAILED)

# The roles of an agent's storage roots in its inventory.
STORAGE_STATE = "state"
STORAGE_ARTIFACTS = "artifacts"
STORAGE_QUARANTINE = "quarantine"
STORAGE_ROLES = (STORAGE_STATE, STORAGE_ARTIFACTS, STORAGE_QUARANTINE)

# -- error codes (docs/models.md says what each means and what to do) ------------------

MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
MODEL_SOURCE_INVALID = "MODEL_SOURCE_INVALID"  # missing, unreadable, empty, not a file/dir
MODEL_SYMLINK_ESCAPES = "MODEL_SYMLINK_ESCAPES"  # a link leads out of the imported directory
MODEL_REVISION_EXISTS = "MODEL_REVISION_EXISTS"  # an explicit revision names other content
MODEL_IN_USE = "MODEL_IN_USE"  # a deployment runs it (deployments, issue 25)
MODEL_REPLICATED = "MODEL_REPLICATED"  # remove its replicas before the model
MODEL_CACHE_INVALID = "MODEL_CACHE_INVALID"  # a cache blob is missing or does not hash
NODE_NOT_ELIGIBLE = "NODE_NOT_ELIGIBLE"  # decommissioned, offline, stale or never seen
REPLICA_NOT_FOUND = "REPLICA_NOT_FOUND"
BLOB_NOT_ASSIGNED = "BLOB_NOT_ASSIGNED"  # 403: this node was never asked to hold it
RANGE_NOT_SATISFIABLE = "RANGE_NOT_SATISFIABLE"  # 416
# What a node reports in a failed replica's error.
INSUFFICIENT_SPACE = "INSUFFICIENT_SPACE"  # the preflight: nothing written
DISK_FULL = "DISK_FULL"  # ENOSPC part-way (the partial file is kept for a resume)
DIGEST_MISMATCH = "DIGEST_MISMATCH"  # the bytes did not hash: moved to quarantine
DOWNLOAD_STALLED = "DOWNLOAD_STALLED"  # no byte for STALL_SECONDS, retries exhausted
DOWNLOAD_FAILED = "DOWNLOAD_FAILED"  # the control plane refused or the link kept failing
MANIFEST_INVALID = "MANIFEST_INVALID"  # the agent refused the manifest (paths, digest)
STORAGE_FAILED = "STORAGE_FAILED"  # another OSError on the artifact or quarantine root
REPLICA_ERROR_CODES = (
    INSUFFICIENT_SPACE,
    DISK_FULL,
    DIGEST_MISMATCH,
    DOWNLOAD_STALLED,
    DOWNLOAD_FAILED,
    MANIFEST_INVALID,
    STORAGE_FAILED,
)

# -- timing the agent keeps --------------------------------------------------------------

STALL_SECONDS = 30  # no byte for this long: the transfer is stalled, retried with backoff
MODEL_REPORT_SECONDS = 1.0  # the most often progress goes up while bytes move
MODELS_REFETCH_SECONDS = 300  # the desired set is fetched at least this often anyway

# -- manifests ------------------------------------------------------------------------

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
HEX_RE = re.compile(r"[0-9a-f]{64}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,119}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MANIFEST_MAX_FILES = 10000
PATH_MAX_CHARS = 1024


class ManifestError(ValueError):
    """A manifest or one of its paths is unacceptable; the message says which."""


def manifest_digest(manifest: dict[str, Any]) -> str:
    """``sha256:<hex>`` over the canonical JSON of ``{name, revision, files}``."""
    canonical = {key: manifest[key] for key in ("name", "revision", "files")}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


# Characters no path may hold: C0 and C1 controls and DEL (Cc), format characters such as the
# bidi overrides U+202E and U+2066-2069 and zero-width ones (Cf), line and paragraph
# separators (Zl, Zp), and lone surrogates (Cs).
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def check_relative_path(path: object) -> str:
    """A manifest path: relative, '/'-separated, normalised, no '.', '..', NUL or
    backslash, and nothing a terminal acts on or shows reordered (controls, DEL, bidi and
    other format characters); what an agent may join under its model directory."""
    if not isinstance(path, str) or not path or len(path) > PATH_MAX_CHARS:
        raise ManifestError(f"path {path!r} is empty, too long or not text")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ManifestError(f"path {path!r} is absolute or holds a backslash or NUL")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ManifestError(f"path {path!r} is not normalised (empty, '.' or '..' parts)")
    unsafe = next((char for char in path if unicodedata.category(char) in _UNSAFE), None)
    if unsafe is not None:
        raise ManifestError(
            f"path {path!r} holds U+{ord(unsafe):04X}, a control, format or separator "
            "character (a terminal would act on it, or show the name reordered)"
        )
    return path


def check_manifest(manifest: object) -> dict[str, Any]:
    """The manifest, when every field is well formed and no path is another's prefix;
    raises ManifestError otherwise."""
    if not isinstance(manifest, dict):
        raise ManifestError("the manifest is not an object")
    name, revision, files = manifest.get("name"), manifest.get("revision"), manifest.get("files")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ManifestError(f"name {name!r} is not a model name")
    if not isinstance(revision, str) or not REVISION_RE.fullmatch(revision):
        raise ManifestError(f"revision {revision!r} is not a revision")
    if not isinstance(files, list) or not 1 <= len(files) <= MANIFEST_MAX_FILES:
        raise ManifestError(f"files must list 1 to {MANIFEST_MAX_FILES} entries")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ManifestError("each file is exactly {path, size, sha256}")
        path = check_relative_path(entry["path"])
        size, sha = entry["size"], entry["sha256"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ManifestError(f"{path}: size must be a whole number of bytes")
        if not isinstance(sha, str) or not HEX_RE.fullmatch(sha):
            raise ManifestError(f"{path}: sha256 must be 64 lowercase hex digits")
        if path in seen:
            raise ManifestError(f"{path} is listed twice")
        seen.add(path)
    for path in seen:  # "a" and "a/b" cannot both be files
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in seen:
                raise ManifestError(f"{path} lies under {'/'.join(parts[:depth])}, a file")
    return manifest


def blob_path(digest_hex: str) -> str:
    """The agent route for one blob."""
    return PATH_AGENT_BLOB.replace("<digest>", f"sha256:{digest_hex}")


def model_path(template: str, name: str, node_id: str | None = None) -> str:
    """An admin models path template with ``<name>`` (and ``<node_id>``) filled in."""
    path = template.replace("<name>", name)
    return path if node_id is None else path.replace("<node_id>", node_id)


__all__ = [name for name in dir() if not name.startswith("_")]
