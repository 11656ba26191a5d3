"""Minting, digesting and checking secrets (invariant 3).

Every secret is ``<kind>_<lookup id>_<256-bit random>``; only the SHA-256
digest of the whole value is stored and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

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
