"""The hub token: set once (``modelforge hub-token set``), kept sealed, opened only to pull.

A gated or private repository needs the user's hub token on every request to the hub, so
it cannot be kept as a digest (invariant 3 keeps those for what is only compared). It is
sealed instead, as a work item's secrets are (core/sealing.py): AES-256-GCM under the state
directory's work key, bound to the hub it belongs to, so the store and every backup of it
hold ciphertext only. It is opened in the process that pulls, sent in the ``Authorization``
header to the hub and to nothing else (never to a node: the nodes get the files by
replication), and never logged or answered: a view says only whether one is set, when and by
whom.
"""

from __future__ import annotations

from typing import Any

from modelforge_contract.hub import HUB_HUGGINGFACE, HUB_TOKEN_UNREADABLE

from ..core.clock import isoformat
from ..core.errors import ApiError, Invalid
from ..core.sealing import SealedValueUnreadable, SealingError, WorkKeys
from ..store import audit
from ..store.database import Store
from ..store.tables import HubToken

TOKEN_MAX_CHARS = 512


class TokenUnreadable(ApiError):
    status = 500
    code = HUB_TOKEN_UNREADABLE
    next_step = (
        "Set the token again (modelforge hub-token set), or put back the work key file it "
        "was sealed with (docs/work.md, 'Secrets')."
    )


def _context(hub: str) -> str:
    return f"hub-token:{hub}"


def check_token(token: str) -> str:
    token = token.strip()
    if not token or len(token) > TOKEN_MAX_CHARS or not token.isprintable() or " " in token:
        raise Invalid(
            f"a hub token is 1-{TOKEN_MAX_CHARS} printable characters without spaces",
            code="FIELD_FORMAT",
            next_step="Paste the token from the hub's settings page (hf_…) as one line.",
        )
    return token


def set_token(
    store: Store, keys: WorkKeys, token: str, actor: str, hub: str = HUB_HUGGINGFACE
) -> dict[str, Any]:
    """Seal and keep the token (replacing one set before); its view."""
    try:
        sealed = keys.seal(check_token(token), _context(hub))
    except SealingError as exc:
        raise TokenUnreadable(str(exc)) from None
    now = store.clock.now()
    with store.write():
        HubToken.insert(hub=hub, sealed=sealed, set_by=actor, set_at=now).on_conflict(
            conflict_target=[HubToken.hub],
            update={HubToken.sealed: sealed, HubToken.set_by: actor, HubToken.set_at: now},
        ).execute()
        audit.record(store, actor, "hub_token.set", hub=hub)
    return token_view(store, hub)


def clear_token(store: Store, actor: str, hub: str = HUB_HUGGINGFACE) -> bool:
    """Forget the token; whether there was one."""
    with store.write():
        removed = HubToken.delete().where(HubToken.hub == hub).execute()
        if removed:
            audit.record(store, actor, "hub_token.cleared", hub=hub)
    return bool(removed)


def token_view(store: Store, hub: str = HUB_HUGGINGFACE) -> dict[str, Any]:
    """Whether a token is set, when and by whom: never the token."""
    with store.connection():
        row = HubToken.get_or_none(HubToken.hub == hub)
    if row is None:
        return {"hub": hub, "set": False, "set_at": None, "set_by": None}
    return {"hub": hub, "set": True, "set_at": isoformat(row.set_at), "set_by": row.set_by}


def open_token(store: Store, keys: WorkKeys, hub: str = HUB_HUGGINGFACE) -> str | None:
    """The token to send to the hub, or None when none is set; TokenUnreadable when the
    sealed value does not open with this state directory's work key."""
    with store.connection():
        row = HubToken.get_or_none(HubToken.hub == hub)
    if row is None:
        return None
    try:
        return keys.open(row.sealed, _context(hub))
    except (SealedValueUnreadable, SealingError) as exc:
        raise TokenUnreadable(f"the stored hub token does not open: {exc}") from None
