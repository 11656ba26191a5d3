"""``modelforge api-keys create|list|revoke``: keys for clients of the OpenAI-compatible API."""

from __future__ import annotations

import click

from ..core.errors import ApiError
from ..identity import api_keys
from ..store import audit
from .errors import refused
from .support import JSON_OPTION, Context, emit


@click.group("api-keys")
def api_keys_group() -> None:
    """Create, list and revoke client API keys (mfk_…; shown once, stored as digests)."""


@api_keys_group.command("create")
@click.option("--name", required=True, help="Who or what the key is for, e.g. 'chat frontend'.")
@JSON_OPTION
@click.pass_obj
def api_keys_create(obj: Context, name: str, as_json: bool) -> None:
    """Mint an API key and print its secret once."""
    try:
        view, secret = api_keys.create_api_key(obj.store(), name, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    if as_json:
        emit(True, {**view, "secret": secret}, "")
        return
    click.echo(
        f"API key {view['key_id']} ({view['name']}):\n\n    {secret}\n\n"
        "Store it now: it is not shown again. Clients send it as "
        "'Authorization: Bearer <key>'."
    )


@api_keys_group.command("list")
@JSON_OPTION
@click.pass_obj
def api_keys_list(obj: Context, as_json: bool) -> None:
    """List API keys with their last use (never the secrets)."""
    rows = api_keys.list_api_keys(obj.store())
    lines = [f"{'KEY ID':18} {'NAME':24} {'CREATED':26} {'LAST USED':26} STATE"]
    for row in rows:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "active"
        used = row["last_used_at"] or "never"
        lines.append(
            f"{row['key_id']:18} {row['name'][:24]:24} {row['created_at']:26} {used:26} {state}"
        )
    emit(as_json, {"api_keys": rows}, "\n".join(lines))


@api_keys_group.command("revoke")
@click.argument("key_id")
@JSON_OPTION
@click.pass_obj
def api_keys_revoke(obj: Context, key_id: str, as_json: bool) -> None:
    """Revoke an API key by its id (see `api-keys list`), for good."""
    try:
        view = api_keys.revoke_api_key(obj.store(), key_id, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, view, f"Revoked API key {key_id} ({view['name']}); it stays refused.")
