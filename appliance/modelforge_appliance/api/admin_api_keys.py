"""Admin routes for client API keys: create (the secret shown once, with optional limits),
list, revoke; and what the keys used (``GET /admin/usage``)."""

from __future__ import annotations

import re
from dataclasses import replace

import bottle

from modelforge_contract import (
    PATH_ADMIN_API_KEY,
    PATH_ADMIN_API_KEYS,
    PATH_ADMIN_USAGE,
    QUERY_INVALID,
    ROLE_FORBIDDEN,
)

from ..core.errors import Forbidden, Invalid
from ..core.validation import API_KEY_FIELDS
from ..identity import api_keys, users
from ..identity.users import Principal
from ..relay.limits import BY, UsageBook, usage_report
from ..web.auth import ADMIN
from ..web.http import ApiContext, json_response

_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def add_routes(app: bottle.Bottle, context: ApiContext, book: UsageBook) -> None:
    store = context.store

    @app.post(PATH_ADMIN_API_KEYS, auth=ADMIN, action="keys.write")
    def create(actor: str, principal: Principal):
        fields = context.body(API_KEY_FIELDS)
        owner = fields.get("user") or principal.user
        if owner != principal.user and not principal.at_least(users.ADMIN):
            raise others_keys(principal)
        limits = api_keys.check_limits(
            fields.get("deployments"), fields.get("rpm"), fields.get("tokens_per_day")
        )
        if fields.get("expires"):
            expires = api_keys.parse_expiry(fields["expires"], store.clock.now())
            limits = replace(limits, expires_at=expires)
        view, secret = api_keys.create_api_key(store, fields["name"], actor, limits, owner)
        return json_response({**view, "secret": secret}, 201)

    @app.get(PATH_ADMIN_USAGE, auth=ADMIN, action="usage.read")
    def usage():
        by = bottle.request.query.get("by") or "key"
        since = bottle.request.query.get("since")
        if by not in BY:
            raise Invalid(f"query parameter by must be one of {', '.join(BY)}",
                          code=QUERY_INVALID)  # fmt: skip
        if since is not None and not _DAY.fullmatch(since):
            raise Invalid("query parameter since must be a date, YYYY-MM-DD",
                          code=QUERY_INVALID)  # fmt: skip
        book.flush()  # the counts to the second
        return json_response({"by": by, "since": since, "usage": usage_report(store, by, since)})

    @app.get(PATH_ADMIN_API_KEYS, auth=ADMIN, action="keys.read")
    def list_keys():
        return json_response({"api_keys": api_keys.list_api_keys(store)})

    @app.delete(PATH_ADMIN_API_KEY, auth=ADMIN, action="keys.write")
    def revoke(key_id: str, actor: str, principal: Principal):
        owner = api_keys.owner_of(store, key_id)
        if owner is not None and owner != principal.user and not principal.at_least(users.ADMIN):
            raise others_keys(principal)
        return json_response(api_keys.revoke_api_key(store, key_id, actor))


def others_keys(principal: Principal) -> Forbidden:
    """An operator minting or revoking another user's key."""
    return Forbidden(
        f"an operator mints and revokes only its own API keys; {principal.user} is "
        f"{principal.role}",
        code=ROLE_FORBIDDEN,
        next_step="Leave out `user`, or ask an admin.",
        extra={"action": "keys.write", "role_needed": users.ADMIN, "role": principal.role},
    )
