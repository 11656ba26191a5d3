"""Minting, digesting and checking secrets (invariant 3).

Every secret is ``<kind>_<lookup id>_<256-bit random>``; only the SHA-256
digest of the whole value is stored and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import TypeVar

from modelforge_contract import split_secret


def new_lookup_id() -> str:
    return secrets.token_hex(8)


def mint_secret(kind: str) -> tuple[str, str]:
    """Return (lookup_id, secret) for a new secret of kind (mfe, mfc, mfa)."""
    lookup_id = new_lookup_id()
    return lookup_id, f"{kind}_{lookup_id}_{secrets.token_urlsafe(32)}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def digest_matches(secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(secret), stored_digest)


def parse(value: object, kind: str) -> tuple[str, str] | None:
    """(lookup_id, secret) for a well-formed secret of kind, else None."""
    if not isinstance(value, str):
        return None
    return split_secret(value, kind)


Row = TypeVar("Row")
# Compared against when an id names nothing, so an unknown id takes the time of a wrong
# secret and tells a guesser nothing more.
_NO_DIGEST = digest("mf_0000000000000000_no-such-secret")


def verified(
    value: object, kind: str, lookup: Callable[[str], Row | None], digest_of: Callable[[Row], str]
) -> Row | None:
    """The stored row of the secret ``value`` of ``kind``, or None: parsed, looked up by its
    id (``lookup``), its digest (``digest_of(row)``) compared in constant time. The one
    check every kind of secret goes through; whether the row is revoked, expired or ended is
    each kind's own question, asked of the row it returns."""
    parsed = parse(value, kind)
    if parsed is None:
        return None
    lookup_id, secret = parsed
    row = lookup(lookup_id)
    stored = digest_of(row) if row is not None else _NO_DIGEST
    return row if digest_matches(secret, stored) and row is not None else None
