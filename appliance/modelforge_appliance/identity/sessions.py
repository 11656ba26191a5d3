"""The admin password, console sessions, their CSRF tokens, and sign-in throttling.

Invariant 3: the password is kept as a bcrypt hash, a session as the SHA-256 digest of its
cookie. The CSRF token is derived from the cookie secret (never stored), so only a page
served to the holder of the cookie can know it, and it dies with the session.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

import bcrypt

from modelforge_contract import (
    ADMIN_PASSWORD_NOT_SET,
    CSRF_TOKEN_INVALID,
    KIND_SESSION,
    PASSWORD_INCORRECT,
    SESSION_EXPIRED,
    SIGN_IN_THROTTLED,
)

from ..core import tokens
from ..core.errors import ApiError, Conflict, Forbidden, Unauthorized
from ..core.settings import Settings
from ..store import audit
from ..store.database import Store
from ..store.tables import AdminPassword, ConsoleSession, SignInThrottle

PASSWORD_MIN_LENGTH = 12
# bcrypt reads at most 72 bytes; a longer password would be silently cut.
PASSWORD_MAX_BYTES = 72
BCRYPT_ROUNDS = 12
SET_PASSWORD_COMMAND = "modelforge admin-password set"

# Throttling: this many failures from one address are free; each one after that makes the
# address wait twice as long as the last, up to the cap. A quiet window forgets them.
FREE_FAILURES = 5
FIRST_WAIT_SECONDS = 30
MAX_WAIT_SECONDS = 900
FORGET_AFTER_SECONDS = 3600
# A session's last use is written at most this often: reads stay reads.
TOUCH_EVERY_SECONDS = 30


class PasswordRefused(ValueError):
    """The new password does not meet the rules; the message says which."""


def check_new_password(password: str) -> None:
    if len(password) < PASSWORD_MIN_LENGTH:
        raise PasswordRefused(f"the password must be at least {PASSWORD_MIN_LENGTH} characters")
    if len(password.encode("utf-8")) > PASSWORD_MAX_BYTES:
        raise PasswordRefused(f"the password must be at most {PASSWORD_MAX_BYTES} bytes")
    if password != password.strip() or any(ord(c) < 32 for c in password):
        raise PasswordRefused(
            "the password must not start or end with spaces or contain control characters"
        )


def set_admin_password(store: Store, password: str, actor: str) -> int:
    """Set (or replace) the admin password; every open session ends. Return how many did."""
    check_new_password(password)
    hashed = bcrypt.hashpw(password.encode("utf-8"), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
    now = store.clock.now()
    with store.write():
        replaced = AdminPassword.select().exists()
        AdminPassword.insert(id=1, password_hash=hashed, set_at=now).on_conflict(
            conflict_target=[AdminPassword.id],
            update={AdminPassword.password_hash: hashed, AdminPassword.set_at: now},
        ).execute()
        ended = (
            ConsoleSession.update(ended_at=now).where(ConsoleSession.ended_at.is_null()).execute()
        )
        audit.record(
            store,
            actor,
            "admin_password.replaced" if replaced else "admin_password.set",
            sessions_ended=ended,
        )
    return ended


def has_admin_password(store: Store) -> bool:
    with store.connection():
        return AdminPassword.select().exists()


@dataclass(frozen=True)
class Session:
    session_id: str
    csrf_token: str

    @property
    def actor(self) -> str:
        return f"console:{self.session_id}"


def csrf_token_for(cookie: str) -> str:
    """The CSRF token of the session behind this cookie (derived, never stored)."""
    return hashlib.sha256(b"modelforge-csrf\0" + cookie.encode("utf-8")).hexdigest()


def _throttled(row: SignInThrottle | None, now: float) -> ApiError | None:
    if row is None or row.blocked_until <= now:
        return None
    wait = max(1, math.ceil(row.blocked_until - now))
    return ApiError(
        f"too many failed sign-ins from this address; try again in {wait} s",
        code=SIGN_IN_THROTTLED,
        status=429,
        next_step=f"Wait {wait} seconds before the next attempt.",
        extra={"retry_after_seconds": wait},
    )


def sign_in(store: Store, settings: Settings, password: str, address: str) -> tuple[str, Session]:
    """Check the password for a client address; return (cookie value, session) or raise.

    429 while the address must wait (the password is not even checked then), 401 for a
    wrong password, 409 when no password was ever set.
    """
    now = store.clock.now()
    with store.connection():
        stored = AdminPassword.get_or_none(AdminPassword.id == 1)
        throttle = SignInThrottle.get_or_none(SignInThrottle.address == address)
    waiting = _throttled(throttle, now)
    if waiting is not None:
        raise waiting
    if stored is None:
        raise Conflict(
            "no admin password is set yet",
            code=ADMIN_PASSWORD_NOT_SET,
            next_step=f"Run `{SET_PASSWORD_COMMAND}` on the control-plane host.",
        )
    candidate = password.encode("utf-8")[:PASSWORD_MAX_BYTES]
    if not bcrypt.checkpw(candidate, stored.password_hash.encode()):
        _record_failure(store, address, now)
        raise Unauthorized(
            "wrong password",
            code=PASSWORD_INCORRECT,
            next_step=f"Try again; `{SET_PASSWORD_COMMAND}` on the control-plane host sets a "
            "new one.",
        )
    session_id, cookie = tokens.mint_secret(KIND_SESSION)
    with store.write():
        SignInThrottle.delete().where(SignInThrottle.address == address).execute()
        ConsoleSession.create(
            session_id=session_id,
            digest=tokens.digest(cookie),
            created_at=now,
            last_seen_at=now,
            expires_at=now + settings.session_max_seconds,
        )
        audit.record(store, f"console:{session_id}", "console.signed_in", address=address)
    prune_sessions(store, settings)
    return cookie, Session(session_id, csrf_token_for(cookie))


def _record_failure(store: Store, address: str, now: float) -> None:
    with store.write():
        row = SignInThrottle.get_or_none(SignInThrottle.address == address)
        if row is None or now - row.last_failure_at > FORGET_AFTER_SECONDS:
            failures = 1
        else:
            failures = row.failures + 1
        blocked_until = now
        if failures >= FREE_FAILURES:
            wait = min(MAX_WAIT_SECONDS, FIRST_WAIT_SECONDS * 2 ** (failures - FREE_FAILURES))
            blocked_until = now + wait
        SignInThrottle.insert(
            address=address, failures=failures, last_failure_at=now, blocked_until=blocked_until
        ).on_conflict(
            conflict_target=[SignInThrottle.address],
            update={
                SignInThrottle.failures: failures,
                SignInThrottle.last_failure_at: now,
                SignInThrottle.blocked_until: blocked_until,
            },
        ).execute()


def _expired() -> Unauthorized:
    return Unauthorized(
        "the console session expired or was signed out",
        code=SESSION_EXPIRED,
        next_step="Sign in to the console again.",
    )


def session_for(store: Store, settings: Settings, cookie: str | None) -> Session:
    """The live session behind a cookie, or 401 SESSION_EXPIRED; touches its last use."""
    parsed = tokens.parse(cookie, KIND_SESSION)
    if parsed is None:
        raise _expired()
    session_id, secret = parsed
    now = store.clock.now()
    with store.connection():
        row = ConsoleSession.get_or_none(ConsoleSession.session_id == session_id)
    if (
        row is None
        or not tokens.digest_matches(secret, row.digest)
        or row.ended_at is not None
        or row.expires_at <= now
        or row.last_seen_at + settings.session_idle_seconds <= now
    ):
        raise _expired()
    if now - row.last_seen_at >= TOUCH_EVERY_SECONDS:
        with store.write():
            ConsoleSession.update(last_seen_at=now).where(
                (ConsoleSession.session_id == session_id) & (ConsoleSession.last_seen_at < now)
            ).execute()
    return Session(session_id, csrf_token_for(secret))


def check_csrf(session: Session, header_value: str | None) -> None:
    """A state-changing call must carry the session's CSRF token (403 otherwise)."""
    if not header_value or not hmac.compare_digest(
        header_value.encode("utf-8", "replace"), session.csrf_token.encode()
    ):
        raise Forbidden(
            "this call changes state and needs the console's CSRF token",
            code=CSRF_TOKEN_INVALID,
            next_step="Reload the console page and try again; scripts use "
            "X-ModelForge-Admin-Token instead of a session.",
        )


def sign_out(store: Store, session: Session) -> None:
    now = store.clock.now()
    with store.write():
        ConsoleSession.update(ended_at=now).where(
            (ConsoleSession.session_id == session.session_id) & ConsoleSession.ended_at.is_null()
        ).execute()
        audit.record(store, session.actor, "console.signed_out")


def prune_sessions(store: Store, settings: Settings) -> int:
    """Forget sessions that ended or expired more than a day ago."""
    cutoff = store.clock.now() - 86400
    with store.write():
        return (
            ConsoleSession.delete()
            .where(
                (ConsoleSession.ended_at < cutoff)
                | (ConsoleSession.expires_at < cutoff)
                | (ConsoleSession.last_seen_at + settings.session_idle_seconds < cutoff)
            )
            .execute()
        )
