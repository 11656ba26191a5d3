"""Admin tokens for API automation: shown once at creation, stored as digests."""

from __future__ import annotations

from typing import Any

from modelforge_contract import ADMIN_TOKEN_INVALID, ADMIN_TOKEN_REQUIRED, KIND_ADMIN

from ..core import tokens
from ..core.clock import isoformat
from ..core.errors import NotFound, Unauthorized
from ..store import audit
from ..store.database import Store
from ..store.tables import AdminToken, User

# last_used_at is kept to this resolution, so a busy script costs one write a minute,
# not one per request.
LAST_USED_RESOLUTION_SECONDS = 60

_NEXT_STEP = (
    "Send X-ModelForge-Admin-Token with a token from `modelforge init` or "
    "`modelforge admin-token create`."
)


def create_admin_token(
    store: Store, name: str, actor: str, user: str = "admin"
) -> tuple[AdminToken, str]:
    """Mint an admin token of ``user`` (it carries that user's role); the returned secret is
    never stored or shown again. 404 when there is no such user."""
    token_id, secret = tokens.mint_secret(KIND_ADMIN)
    with store.write():
        if User.get_or_none(User.name == user) is None:
            raise NotFound(f"no user {user[:70]!r}",
                           next_step="See the users with `modelforge users list`.")  # fmt: skip
        row = AdminToken.create(
            token_id=token_id,
            name=name,
            digest=tokens.digest(secret),
            created_at=store.clock.now(),
            user_name=user,
        )
        audit.record(store, actor, "admin_token.created", token_id=token_id, name=name, user=user)
    return row, secret


def has_admin_tokens(store: Store) -> bool:
    with store.connection():
        return AdminToken.select().exists()


def list_admin_tokens(store: Store) -> list[dict[str, Any]]:
    with store.connection():
        rows = list(AdminToken.select().order_by(AdminToken.created_at))
    return [admin_token_view(row) for row in rows]


def admin_token_view(row: AdminToken) -> dict[str, Any]:
    return {
        "token_id": row.token_id,
        "name": row.name,
        "user": row.user_name,
        "created_at": isoformat(row.created_at),
        "last_used_at": isoformat(row.last_used_at),
        "revoked_at": isoformat(row.revoked_at),
    }


def revoke_admin_token(store: Store, token_id: str, actor: str) -> AdminToken:
    with store.write():
        row = AdminToken.get_or_none(AdminToken.token_id == token_id)
        if row is None:
            raise NotFound(f"no admin token {token_id}")
        if row.revoked_at is None:
            row.revoked_at = store.clock.now()
            row.save()
            audit.record(store, actor, "admin_token.revoked", token_id=token_id)
    return row


def authenticate_admin(store: Store, header_value: str | None) -> AdminToken:
    """The admin token behind the header, or Unauthorized (401)."""
    if not header_value:
        raise Unauthorized(
            "this call needs an admin token", code=ADMIN_TOKEN_REQUIRED, next_step=_NEXT_STEP
        )

    def lookup(token_id: str) -> AdminToken | None:
        with store.connection():
            return AdminToken.get_or_none(AdminToken.token_id == token_id)

    row = tokens.verified(header_value, KIND_ADMIN, lookup, lambda found: found.digest)
    if row is None or row.revoked_at is not None:
        raise Unauthorized(
            "the admin token is unknown, malformed or revoked",
            code=ADMIN_TOKEN_INVALID,
            next_step=_NEXT_STEP,
        )
    _mark_used(store, row)
    return row


def _mark_used(store: Store, row: AdminToken) -> None:
    """Move last_used_at when it is older than the resolution (after authentication only)."""
    now = store.clock.now()
    if row.last_used_at is not None and now - row.last_used_at < LAST_USED_RESOLUTION_SECONDS:
        return
    with store.write():
        AdminToken.update(last_used_at=now).where(
            (AdminToken.token_id == row.token_id)
            & (AdminToken.last_used_at.is_null() | (AdminToken.last_used_at < now))
        ).execute()
    row.last_used_at = now
