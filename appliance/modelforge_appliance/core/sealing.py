"""Sealed values: secrets the control plane must hand on later, kept encrypted at rest.

A work item's ``env`` values are delivered to the node that leases the item, so unlike the
credentials of invariant 3 they cannot be kept as digests. They are sealed instead, with
AES-256-GCM (the ``cryptography`` package's AEAD; nothing here is hand-made) under a key of
the state directory's **work key file**, and the associated data names where the value
belongs (the work item's id and the field): a sealed value copied into another item, or
under another name, fails to open instead of opening as something else.

The key file (``STATE_DIR/work-secrets.key``, mode 0600) lives outside the store, so the
store, its WAL and every backup of it hold only ciphertext; ``modelforge backup
--include-work-key`` is the one way a copy of the key leaves it. It is made on first need
(the first value sealed), written with ``write_atomically`` and linked into place so that
two processes sealing their first values at once agree on one key. It may hold several
keys: a key lost and made again gets a new id, and a restore adds a backup's keys to the
ones there are; the newest seals, every one opens.

A sealed value reads ``mfsealed:1:<key id>:<base64url of nonce, ciphertext and tag>``;
the key id (16 hex digits of a digest of the key) says which key it needs, so a missing
key is named in the error, never guessed at.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from modelforge_contract.files import fsync_directory, write_atomically

log = logging.getLogger(__name__)

WORK_KEY_FILE = "work-secrets.key"
_FORMAT = "modelforge-work-keys"
_VERSION = 1
_PREFIX = "mfsealed:1:"
_NONCE_BYTES = 12  # GCM's 96-bit nonce, random for each value
_SEALED = re.compile(r"mfsealed:1:([0-9a-f]{16}):([A-Za-z0-9_-]+)")


class SealingError(Exception):
    """The work key file cannot be read or written; the message names it and what to do."""


class SealedValueUnreadable(Exception):
    """A sealed value does not open here: its key is missing, or it was sealed for another
    place (another item or field) or changed since. ``key_id`` is the key it asks for."""

    def __init__(self, message: str, key_id: str | None) -> None:
        super().__init__(message)
        self.key_id = key_id


@dataclass(frozen=True)
class Key:
    key_id: str
    secret: bytes
    created_at: str


def key_id_of(secret: bytes) -> str:
    """The key's public name: 64 bits of a digest, enough to tell keys apart, no more."""
    return hashlib.sha256(b"modelforge-work-key:" + secret).hexdigest()[:16]


def is_sealed(value: object) -> bool:
    return isinstance(value, str) and _SEALED.fullmatch(value) is not None


def key_ids_in(text: str) -> set[str]:
    """The ids of the keys every sealed value in ``text`` (a stored input, say) needs."""
    return {match.group(1) for match in _SEALED.finditer(text)}


def work_key_path(state_dir: Path) -> Path:
    return Path(state_dir) / WORK_KEY_FILE


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def render_keys(keys: list[Key]) -> str:
    """The key file's text: JSON, one entry per key, oldest first."""
    entries = [
        {"key_id": k.key_id, "key": _b64(k.secret), "created_at": k.created_at} for k in keys
    ]
    return json.dumps({"format": _FORMAT, "version": _VERSION, "keys": entries}, indent=2) + "\n"


def parse_keys(text: str, shown: Path) -> list[Key]:
    """The keys of a key file's text, or SealingError naming the file."""
    try:
        data = json.loads(text)
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ValueError("not a ModelForge work key file")
        keys = []
        for entry in data["keys"]:
            secret = _unb64(entry["key"])
            if len(secret) != 32 or key_id_of(secret) != entry["key_id"]:
                raise ValueError(f"key {entry.get('key_id')!r} is damaged")
            keys.append(Key(entry["key_id"], secret, str(entry["created_at"])))
        if not keys:
            raise ValueError("it holds no key")
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise SealingError(
            f"{shown} is not a usable work key file ({exc}); put back the copy you keep "
            "(docs/work.md, 'Secrets')"
        ) from None
    return keys


class WorkKeys:
    """The work key file of one state directory: seals with its newest key, opens with any.

    The file is looked at on every use (a stat), so a key put back while the program runs
    is used at once and a removed one is not kept alive in memory.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._keys: list[Key] = []

    @classmethod
    def of(cls, state_dir: Path) -> WorkKeys:
        """The state directory's key file, one reader per file in this process."""
        path = work_key_path(state_dir)
        with _READERS_LOCK:
            return _READERS.setdefault(path, cls(path))

    def keys(self) -> list[Key]:
        """The keys the file holds now; none when there is no file. Never creates one."""
        with self._lock:
            return list(self._load())

    def key_ids(self) -> list[str]:
        return [key.key_id for key in self.keys()]

    def seal(self, value: str, context: str) -> str:
        """``value`` sealed for ``context`` (where it belongs), with the newest key."""
        with self._lock:
            keys = self._load() or self._create()
        key = keys[-1]
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = AESGCM(key.secret).encrypt(nonce, value.encode("utf-8"), _aad(context))
        return f"{_PREFIX}{key.key_id}:{_b64(nonce + sealed)}"

    def open(self, sealed: str, context: str) -> str:
        """The value sealed for ``context``, or SealedValueUnreadable saying why not."""
        match = _SEALED.fullmatch(sealed) if isinstance(sealed, str) else None
        if match is None:
            raise SealedValueUnreadable("it is not a sealed value", None)
        key_id = match.group(1)
        with self._lock:
            key = next((k for k in self._load() if k.key_id == key_id), None)
        if key is None:
            held = ", ".join(k.key_id for k in self.keys()) or "none"
            raise SealedValueUnreadable(
                f"it was sealed with work key {key_id}, which {self.path} does not hold "
                f"(it holds: {held})",
                key_id,
            )
        try:
            raw = _unb64(match.group(2))
            opened = AESGCM(key.secret).decrypt(
                raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _aad(context)
            )
        except (InvalidTag, ValueError, binascii.Error):
            raise SealedValueUnreadable(
                f"it does not open with work key {key_id}: it was sealed for another item or "
                "field, or changed since",
                key_id,
            ) from None
        return opened.decode("utf-8")

    def add(self, keys: list[Key]) -> list[str]:
        """Add keys (a backup's) to the file, keeping every key it holds; the ids added.

        Called holding the state lock alone (a restore), so nothing seals meanwhile.
        """
        with self._lock:
            current = self._load()
            known = {k.key_id for k in current}
            new = [k for k in keys if k.key_id not in known]
            if new:
                # The added (older) keys go first: the key that sealed until now still seals.
                self._write(new + current)
                self._seen = None
            return [k.key_id for k in new]

    # -- the file ------------------------------------------------------------------------

    def _load(self) -> list[Key]:
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._keys = None, []
            return []
        except OSError as exc:
            raise SealingError(f"cannot read {self.path}: {exc.strerror}") from None
        seen = (status.st_ino, status.st_mtime_ns, status.st_size)
        if seen == self._seen:
            return self._keys
        if stat.S_IMODE(status.st_mode) & 0o077:
            # A copy put back with cp(1) may be readable by others; a key must not be.
            log.warning(
                "%s could be read by other users (mode %04o); making it 0600",
                self.path,
                stat.S_IMODE(status.st_mode),
            )
            try:
                os.chmod(self.path, 0o600)
            except OSError as exc:
                raise SealingError(
                    f"{self.path} can be read by other users and cannot be made 0600 "
                    f"({exc.strerror}); run: chmod 600 {self.path}"
                ) from None
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SealingError(f"cannot read {self.path}: {exc}") from None
        self._keys, self._seen = parse_keys(text, self.path), seen
        return self._keys

    def _write(self, keys: list[Key]) -> None:
        try:
            write_atomically(self.path, render_keys(keys), mode=0o600)
        except OSError as exc:
            raise SealingError(
                f"cannot write the work key file {self.path}: {exc.strerror}; the state "
                "directory must be writable by the user the control plane runs as"
            ) from None

    def _create(self) -> list[Key]:
        """The first key: made whole beside the file, then linked into place, so a key
        another process made meanwhile is never replaced (both then use that one)."""
        secret = AESGCM.generate_key(bit_length=256)
        made = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
        key = Key(key_id_of(secret), secret, made)
        staged = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.new")
        try:
            write_atomically(staged, render_keys([key]), mode=0o600)
            try:
                os.link(staged, self.path)
                log.info("made the work key %s in %s", key.key_id, self.path)
            except FileExistsError:
                pass  # another process made the first key: use that one
            fsync_directory(self.path.parent)
        except OSError as exc:
            raise SealingError(
                f"cannot make the work key file {self.path}: {exc.strerror}; the state "
                "directory must be writable by the user the control plane runs as"
            ) from None
        finally:
            staged.unlink(missing_ok=True)
        return self._load()


_READERS: dict[Path, WorkKeys] = {}
_READERS_LOCK = threading.Lock()


def _aad(context: str) -> bytes:
    return b"modelforge-sealed-value:1:" + context.encode("utf-8")


def read_key_file(path: Path) -> list[Key]:
    """The keys of a key file elsewhere (a backup's copy), or SealingError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SealingError(f"cannot read the work key file {path}: {exc}") from None
    return parse_keys(text, Path(path))
