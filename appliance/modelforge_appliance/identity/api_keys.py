"""Client API keys (``mfk_…``): minted by an administrator, shown once, stored as digests.

A key may carry limits (docs/clients.md): the deployments it may call, an expiry, requests
per minute and tokens per day. Authentication refuses an expired key (401
API_KEY_EXPIRED); the others are the relay's to hold (relay/limits.py).

A client of the OpenAI-compatible API sends ``Authorization: Bearer mfk_<key id>_<secret>``
on every call (docs/clients.md). Only the SHA-256 digest is kept, found by the non-secret
key id and compared in constant time (invariant 3). Revoking a key is final, also across a
restore: migration 13's trigger adds it to the finality record (invariant 5).

Authentication is the client's hot path: one indexed read, no model objects, and the key's
``last_used_at`` is written at most once a minute per key (a flush-free write), never once
per request.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

import peewee as pw

from modelforge_contract import (
    API_KEY_EXPIRED,
    API_KEY_INVALID,
    API_KEY_MISSING,
    API_KEY_REVOKED,
    FIELD_FORMAT,
    KIND_API_KEY,
)

from ..core import tokens
from ..core.clock import isoformat
from ..core.errors import Invalid, NotFound, Unauthorized
from ..core.validation import Field, check_value
from ..store import audit
from ..store.database import Store
from ..store.tables import ApiKey, User

log = logging.getLogger(__name__)

# last_used_at is kept to this resolution: a busy client costs one write a minute per key.
LAST_USED_RESOLUTION_SECONDS = 60

NAME_FIELD = Field(str, low=1, high=120, name=True)
# What tokens.new_lookup_id makes; any other id names no key (and never reaches the store).
_KEY_ID = re.compile(r"[0-9a-f]{16}")

_NEXT_STEP = (
    "Send 'Authorization: Bearer mfk_…' with a key from `modelforge api-keys create`; "
    "an administrator lists the keys with `modelforge api-keys list`."
)
_REVOKED_NEXT_STEP = (
    "Revoked keys stay refused; ask an administrator for a new one "
    "(`modelforge api-keys create --name NAME`)."
)


_CALLER_SQL = (
    "SELECT key_id, digest, revoked_at, last_used_at, name, deployments, expires_at, rpm, "
    "tokens_per_day FROM api_key WHERE key_id = ?"
)
# The most deployments one key may be limited to, and the bounds of its rates.
MAX_KEY_DEPLOYMENTS = 64
MAX_RPM = 1_000_000
MAX_TOKENS_PER_DAY = 10**12
_DURATION = re.compile(r"([1-9][0-9]{0,5})([mhdw])")
_DURATION_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MARK_USED_SQL = (
    "UPDATE api_key SET last_used_at = ? WHERE key_id = ? "
    "AND (last_used_at IS NULL OR last_used_at <= ?)"
)


@dataclass(frozen=True)
class ApiKeyCaller:
    """A client request's key that authenticated: known, its secret matching, not revoked,
    not expired; with the limits the relay holds it to (None: no such limit)."""

    key_id: str
    name: str
    deployments: frozenset[str] | None = None
    rpm: int | None = None
    tokens_per_day: int | None = None

    def may_call(self, deployment: str) -> bool:
        return self.deployments is None or deployment in self.deployments


@dataclass(frozen=True)
class KeyLimits:
    """What a new key is limited to (None: not limited that way)."""

    deployments: tuple[str, ...] | None = None
    expires_at: float | None = None
    rpm: int | None = None
    tokens_per_day: int | None = None


def parse_expiry(text: str, now: float) -> float:
    """When a key given ``--expires TEXT`` expires: a duration from now (``90m``, ``12h``,
    ``30d``, ``2w``) or a UTC date or time (``2027-01-31``, ``2027-01-31T18:00``). 400
    FIELD_FORMAT for anything else, or a time already past."""
    text = text.strip()
    matched = _DURATION.fullmatch(text)
    if matched:
        return now + int(matched[1]) * _DURATION_SECONDS[matched[2]]
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise Invalid(
            f"expires: {text[:40]!r} is neither a duration nor a date",
            code=FIELD_FORMAT,
            next_step="Give a duration such as 30d, 12h or 90m, or a UTC date such as 2027-01-31.",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    at = when.timestamp()
    if at <= now:
        raise Invalid(
            f"expires: {text[:40]!r} is already past",
            code=FIELD_FORMAT,
            next_step="Give a time in the future.",
        )
    return at


def check_limits(
    deployments: list[str] | None, rpm: int | None, tokens_per_day: int | None
) -> KeyLimits:
    """The limits of a new key, each checked (400 FIELD_* naming the field)."""
    names = None
    if deployments is not None:
        spec = Field(list, low=1, high=MAX_KEY_DEPLOYMENTS, items=Field(str, low=1, high=120,
                     name=True))  # fmt: skip
        names = tuple(dict.fromkeys(check_value(deployments, spec, "deployments")))
    if rpm is not None:
        rpm = check_value(rpm, Field(int, low=1, high=MAX_RPM), "rpm")
    if tokens_per_day is not None:
        tokens_per_day = check_value(
            tokens_per_day, Field(int, low=1, high=MAX_TOKENS_PER_DAY), "tokens_per_day"
        )
    return KeyLimits(names, None, rpm, tokens_per_day)


def create_api_key(
    store: Store, name: str, actor: str, limits: KeyLimits = KeyLimits(), owner: str = "admin"
) -> tuple[dict[str, Any], str]:
    """Mint a key named ``name`` for the user ``owner``, with ``limits``: its view and its
    secret, which is never stored or shown again. The name is checked like every name people
    read (400 FIELD_*); the owner must be a user (404)."""
    name = check_value(name, NAME_FIELD, "name")
    key_id, secret = tokens.mint_secret(KIND_API_KEY)
    with store.write():
        if User.get_or_none(User.name == owner) is None:
            raise NotFound(f"no user {owner[:70]!r}",
                           next_step="See the users with `modelforge users list`.")  # fmt: skip
        row = ApiKey.create(
            owner=owner,
            key_id=key_id,
            name=name,
            digest=tokens.digest(secret),
            created_by=actor,
            created_at=store.clock.now(),
            deployments=None if limits.deployments is None else json.dumps(limits.deployments),
            expires_at=limits.expires_at,
            rpm=limits.rpm,
            tokens_per_day=limits.tokens_per_day,
        )
        set_limits = {k: v for k, v in _limits_of(row).items() if v is not None}
        audit.record(store, actor, "api_key.created", key_id=key_id, name=name, **set_limits)
    return api_key_view(row), secret


def _limits_of(row: ApiKey) -> dict[str, Any]:
    return {
        "deployments": None if row.deployments is None else json.loads(row.deployments),
        "expires_at": isoformat(row.expires_at),
        "rpm": row.rpm,
        "tokens_per_day": row.tokens_per_day,
    }


def list_api_keys(store: Store) -> list[dict[str, Any]]:
    """Every key, oldest first, active and revoked alike; never a secret or a digest."""
    with store.connection():
        rows = list(ApiKey.select().order_by(ApiKey.created_at, ApiKey.key_id))
    return [api_key_view(row) for row in rows]


def api_key_view(row: ApiKey) -> dict[str, Any]:
    return {
        "key_id": row.key_id,
        "name": row.name,
        "owner": row.owner,
        "state": "revoked" if row.revoked_at is not None else "active",
        "created_by": row.created_by,
        "created_at": isoformat(row.created_at),
        "last_used_at": isoformat(row.last_used_at),
        "revoked_at": isoformat(row.revoked_at),
        "revoked_by": row.revoked_by,
        **_limits_of(row),
    }


def owner_of(store: Store, key_id: str) -> str | None:
    """The user a key belongs to (None: no such key)."""
    if not _KEY_ID.fullmatch(key_id):
        return None
    with store.connection():
        row = ApiKey.get_or_none(ApiKey.key_id == key_id)
    return None if row is None else row.owner


def revoke_api_key(store: Store, key_id: str, actor: str) -> dict[str, Any]:
    """Revoke a key for good (404 when there is none). Revoking it again changes nothing."""
    missing = NotFound(
        f"no API key {key_id[:40]!r}",
        next_step="See the keys with `modelforge api-keys list` (GET /api/v1/admin/api-keys).",
    )
    if not _KEY_ID.fullmatch(key_id):
        raise missing
    now = store.clock.now()
    with store.write():
        # Conditional: of two revocations at once, one writes and is audited.
        revoked = (
            ApiKey.update(revoked_at=now, revoked_by=actor)
            .where((ApiKey.key_id == key_id) & ApiKey.revoked_at.is_null())
            .execute()
        )
        row = ApiKey.get_or_none(ApiKey.key_id == key_id)
        if row is None:
            raise missing
        if revoked:
            audit.record(store, actor, "api_key.revoked", key_id=key_id, name=row.name)
    return api_key_view(row)


def authenticate_api_key(store: Store, authorization: str | None) -> ApiKeyCaller:
    """The key an ``Authorization`` header carries, or Unauthorized (401).

    ``API_KEY_MISSING`` without the header; ``API_KEY_INVALID`` when it is not
    ``Bearer mfk_…``, names no key, or its secret does not match; ``API_KEY_REVOKED`` for a
    revoked key, said only to a caller that holds its secret.
    """
    if not authorization:
        raise Unauthorized(
            "this call needs an API key as 'Authorization: Bearer mfk_…'",
            code=API_KEY_MISSING,
            next_step=_NEXT_STEP,
        )
    invalid = Unauthorized(
        "the API key is malformed, unknown or does not match",
        code=API_KEY_INVALID,
        next_step=_NEXT_STEP,
    )
    scheme, _, value = authorization.strip().partition(" ")

    def lookup(key_id: str) -> tuple | None:
        with store.connection():
            return store.db.execute_sql(
                _CALLER_SQL.replace("?", store.db.param), (key_id,)
            ).fetchone()

    row = tokens.verified(value if scheme.lower() == "bearer" else None, KIND_API_KEY, lookup,
                          lambda found: found[1])  # fmt: skip
    if row is None:
        raise invalid
    key_id, _, revoked_at, last_used_at, name, deployments, expires_at, rpm, tokens_per_day = row
    if revoked_at is not None:
        raise Unauthorized(
            "the API key has been revoked; revoked keys stay refused",
            code=API_KEY_REVOKED,
            next_step=_REVOKED_NEXT_STEP,
        )
    if expires_at is not None and store.clock.now() >= expires_at:
        raise Unauthorized(
            f"the API key expired at {isoformat(expires_at)}",
            code=API_KEY_EXPIRED,
            next_step="Ask an administrator for a new key (`modelforge api-keys create "
            "--name NAME [--expires 30d]`).",
        )
    _last_use.mark(store, key_id, last_used_at)
    scope = None if deployments is None else frozenset(json.loads(deployments))
    return ApiKeyCaller(key_id, name, scope, rpm, tokens_per_day)


class _LastUse:
    """Writes each key's ``last_used_at`` at most once per resolution.

    The stored time decides across processes (the conditional UPDATE); the time this
    process last wrote decides among its own threads, so the many requests of one busy
    client that arrive together as the minute turns make one write, not one each. One
    entry per key that authenticated here: administrators mint keys, so they are few.
    """

    def __init__(self) -> None:
        self._written: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, store: Store, key_id: str, stored: float | None) -> None:
        now = store.clock.now()
        with self._lock:
            written = self._written.get(key_id, -math.inf)
            last = max(written, -math.inf if stored is None else stored)
            if now - last < LAST_USED_RESOLUTION_SECONDS:
                return
            self._written[key_id] = now
        try:
            # A timestamp, safe to lose in a power cut: no flush of its own.
            with store.write(flushed=False):
                store.db.execute_sql(
                    _MARK_USED_SQL.replace("?", store.db.param),
                    (now, key_id, now - LAST_USED_RESOLUTION_SECONDS),
                )
        except (pw.OperationalError, pw.InterfaceError) as exc:
            # The call itself authenticated; only its bookkeeping waits for the next minute.
            log.warning("last use of API key %s not recorded: %s", key_id, type(exc).__name__)


_last_use = _LastUse()
