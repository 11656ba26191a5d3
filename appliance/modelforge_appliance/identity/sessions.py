"""Console sign-in (a user's name and password), sessions, their CSRF tokens, and sign-in
throttling. ``modelforge admin-password set`` sets the password of the user ``admin``
(identity/users.py).

Invariant 3: the password is kept as a bcrypt hash, a session as the SHA-256 digest of its
cookie. The CSRF token is derived from the cookie secret (never stored), so only a page
served to the holder of the cookie can know it, and it dies with the session.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
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
from ..store.tables import ConsoleSession, SignInThrottle, User
from .users import (  # noqa: F401 - PasswordRefused and check_new_password are used from here
    ADMIN,
    FIRST_USER,
    PASSWORD_MAX_BYTES,
    PasswordRefused,
    check_new_password,
    mirror_admin_password,
)

log = logging.getLogger(__name__)

BCRYPT_ROUNDS = 12
SET_PASSWORD_COMMAND = "modelforge admin-password set"

# Throttling: this many failures from one address are free; each one after that makes the
# address wait twice as long as the last, up to the cap. A quiet window forgets them.
FREE_FAILURES = 5
FIRST_WAIT_SECONDS = 30
MAX_WAIT_SECONDS = 900
FORGET_AFTER_SECONDS = 3600
# Beside the per-address buckets, one for all addresses together, so guesses spread over
# many addresses stay bounded too. It engages late and waits briefly (the admin is slowed,
# never locked out), it is logged and audited when it engages, and setting the password
# clears every bucket.
GLOBAL_BUCKET = "*"  # no client address is written so
GLOBAL_FREE_FAILURES = 50
GLOBAL_FIRST_WAIT_SECONDS = 5
GLOBAL_MAX_WAIT_SECONDS = 300
# A session's last use is written at most this often: reads stay reads.
TOUCH_EVERY_SECONDS = 30


def set_admin_password(store: Store, password: str, actor: str) -> int:
    """Set (or replace) the password of the user ``admin`` (made again, as an admin, if it
    is gone); every open session ends, and every sign-in wait is cleared. How many ended."""
    check_new_password(password)
    hashed = bcrypt.hashpw(password.encode("utf-8"), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
    now = store.clock.now()
    with store.write():
        row = User.get_or_none(User.name == FIRST_USER)
        replaced = row is not None and row.password_hash is not None
        if row is None:
            row = User.create(name=FIRST_USER, role=ADMIN, created_at=now, created_by=actor)
        row.password_hash = hashed
        row.save()
        mirror_admin_password(hashed, now)
        ended = (
            ConsoleSession.update(ended_at=now).where(ConsoleSession.ended_at.is_null()).execute()
        )
        SignInThrottle.delete().execute()  # guesses at the old password no longer count
        audit.record(
            store,
            actor,
            "admin_password.replaced" if replaced else "admin_password.set",
            sessions_ended=ended,
        )
    return ended


def has_admin_password(store: Store) -> bool:
    """Whether anyone can sign in: some user has a password."""
    with store.connection():
        return User.select().where(User.password_hash.is_null(False)).exists()


@dataclass(frozen=True)
class Session:
    session_id: str
    csrf_token: str
    user: str = FIRST_USER

    @property
    def actor(self) -> str:
        return f"console:{self.session_id} ({self.user})"


def csrf_token_for(cookie: str) -> str:
    """The CSRF token of the session behind this cookie (derived, never stored)."""
    return hashlib.sha256(b"modelforge-csrf\0" + cookie.encode("utf-8")).hexdigest()


def _throttled(row: SignInThrottle | None, now: float) -> ApiError | None:
    if row is None or row.blocked_until <= now:
        return None
    wait = max(1, math.ceil(row.blocked_until - now))
    everyone = row.address == GLOBAL_BUCKET
    return ApiError(
        (
            f"too many failed sign-ins from many addresses; every sign-in waits {wait} s"
            if everyone
            else f"too many failed sign-ins from this address; try again in {wait} s"
        ),
        code=SIGN_IN_THROTTLED,
        status=429,
        next_step=f"Wait {wait} seconds before the next attempt."
        + (
            f" Someone is guessing the password; `{SET_PASSWORD_COMMAND}` on the "
            "control-plane host sets a new one and clears the wait."
            if everyone
            else ""
        ),
        extra={"retry_after_seconds": wait},
    )


@functools.cache
def _no_hash() -> str:
    """Checked against when the user name is unknown, disabled or has no password, so such a
    name takes the time of a wrong password and says nothing more (made once, when first
    needed: a bcrypt hash takes a quarter of a second)."""
    return bcrypt.hashpw(b"modelforge-no-such-user", bcrypt.gensalt(BCRYPT_ROUNDS)).decode()


def sign_in(
    store: Store, settings: Settings, password: str, address: str, user: str = FIRST_USER
) -> tuple[str, Session]:
    """Check a user's password for a client address; return (cookie value, session) or
    raise.

    429 while the address, or every address, must wait (the password is not even checked
    then), 401 for a wrong user name or password (the same answer, in the same time, for a
    user that does not exist, is disabled or has no password), 409 when nobody has a
    password yet. Each attempt is counted as a failure before the password is checked (and
    forgiven when it was right), so guesses sent in parallel meet the same limit as guesses
    sent one by one.
    """
    now = store.clock.now()
    if not has_admin_password(store):
        raise Conflict(
            "no admin password is set yet",
            code=ADMIN_PASSWORD_NOT_SET,
            next_step=f"Run `{SET_PASSWORD_COMMAND}` on the control-plane host.",
        )
    with store.connection():
        stored = User.get_or_none(User.name == user[:64])
    usable = stored is not None and stored.password_hash and stored.disabled_at is None
    _count_attempt(store, address, now)
    candidate = password.encode("utf-8")[:PASSWORD_MAX_BYTES]
    matches = bcrypt.checkpw(candidate, (stored.password_hash if usable else _no_hash()).encode())
    if not (usable and matches):
        raise Unauthorized(
            "wrong user name or password",
            code=PASSWORD_INCORRECT,
            next_step=f"Try again; `{SET_PASSWORD_COMMAND}` on the control-plane host sets a "
            "new password for admin, and an admin resets another user's.",
        )
    session_id, cookie = tokens.mint_secret(KIND_SESSION)
    with store.write():
        SignInThrottle.delete().where(
            SignInThrottle.address.in_([address, GLOBAL_BUCKET])
        ).execute()
        ConsoleSession.create(
            session_id=session_id,
            digest=tokens.digest(cookie),
            created_at=now,
            last_seen_at=now,
            expires_at=now + settings.session_max_seconds,
            user_name=stored.name,
        )
        session = Session(session_id, csrf_token_for(cookie), stored.name)
        audit.record(store, session.actor, "console.signed_in", address=address)
    prune_sessions(store, settings)
    return cookie, session


def _limits(bucket: str) -> tuple[int, int, int]:
    """(free failures, first wait, longest wait) of a bucket."""
    if bucket == GLOBAL_BUCKET:
        return GLOBAL_FREE_FAILURES, GLOBAL_FIRST_WAIT_SECONDS, GLOBAL_MAX_WAIT_SECONDS
    return FREE_FAILURES, FIRST_WAIT_SECONDS, MAX_WAIT_SECONDS


def _count_attempt(store: Store, address: str, now: float) -> None:
    """In one write: refuse (429) while the address or every address must wait; otherwise
    count this attempt in both buckets, setting the next wait once one is past its free
    failures."""
    with store.write():
        # Read the clock once the write is ours: an attempt that read it earlier but wrote
        # later would see a free attempt's stamp (blocked_until = its now) in its future,
        # and be refused 429 before five failures were counted.
        now = max(now, store.clock.now())
        rows = {
            row.address: row
            for row in SignInThrottle.select().where(
                SignInThrottle.address.in_([address, GLOBAL_BUCKET])
            )
        }
        for key in (GLOBAL_BUCKET, address):
            waiting = _throttled(rows.get(key), now)
            if waiting is not None:
                raise waiting
        for key in (address, GLOBAL_BUCKET):
            free, first, longest = _limits(key)
            row = rows.get(key)
            if row is None or now - row.last_failure_at > FORGET_AFTER_SECONDS:
                failures = 1
            else:
                failures = row.failures + 1
            blocked_until = now
            if failures >= free:
                blocked_until = now + min(longest, first * 2 ** (failures - free))
            if key == GLOBAL_BUCKET and failures == free:
                log.warning(
                    "%d failed console sign-ins from all addresses within the hour: every "
                    "sign-in now waits",
                    failures,
                )
                audit.record(store, "control-plane", "console.sign_in_slowed", failures=failures)
            SignInThrottle.insert(
                address=key, failures=failures, last_failure_at=now, blocked_until=blocked_until
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

    def lookup(session_id: str) -> ConsoleSession | None:
        with store.connection():
            return ConsoleSession.get_or_none(ConsoleSession.session_id == session_id)

    now = store.clock.now()
    row = tokens.verified(cookie, KIND_SESSION, lookup, lambda found: found.digest)
    if (
        row is None
        or row.ended_at is not None
        or row.expires_at <= now
        or row.last_seen_at + settings.session_idle_seconds <= now
    ):
        raise _expired()
    if now - row.last_seen_at >= TOUCH_EVERY_SECONDS:
        with store.write():
            ConsoleSession.update(last_seen_at=now).where(
                (ConsoleSession.session_id == row.session_id) & (ConsoleSession.last_seen_at < now)
            ).execute()
    return Session(row.session_id, csrf_token_for(str(cookie)), row.user_name)


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
