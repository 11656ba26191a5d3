"""``modelforge admin-token create|list|revoke``: tokens for API automation."""

from __future__ import annotations

import click

from modelforge_contract import EXIT_NOT_FOUND

from ..core.errors import NotFound
from ..identity import admin_tokens
from ..store import audit
from .errors import CliError
from .support import Context, emit


@click.group("admin-token")
def admin_token() -> None:
    """Create, list and revoke admin tokens (shown once, stored as digests)."""


@admin_token.command("create")
@click.option("--name", required=True, help="What the token is for, e.g. 'backup script'.")
@click.option(
    "--user",
    default="admin",
    show_default=True,
    help="The user the token belongs to: it carries that user's role, and stops when the "
    "user is disabled.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_create(obj: Context, name: str, user: str, as_json: bool) -> None:
    """Mint an admin token and print it once."""
    try:
        row, secret = admin_tokens.create_admin_token(obj.store(), name, audit.CLI_ACTOR, user)
    except NotFound as exc:
        raise CliError(exc.message, "see `modelforge users list`", EXIT_NOT_FOUND) from None
    emit(
        as_json,
        {"token_id": row.token_id, "user": row.user_name, "admin_token": secret},
        f"Admin token {row.token_id} of {row.user_name} (shown once):\n\n    {secret}\n",
    )


@admin_token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_list(obj: Context, as_json: bool) -> None:
    """List admin tokens (never the secrets)."""
    rows = admin_tokens.list_admin_tokens(obj.store())
    lines = [f"{'TOKEN ID':18} {'NAME':24} {'USER':12} {'CREATED':26} STATE"]
    for row in rows:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "active"
        lines.append(
            f"{row['token_id']:18} {row['name'][:24]:24} {row['user'][:12]:12} "
            f"{row['created_at']:26} {state}"
        )
    emit(as_json, {"admin_tokens": rows}, "\n".join(lines))


@admin_token.command("revoke")
@click.argument("token_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_revoke(obj: Context, token_id: str, as_json: bool) -> None:
    """Revoke an admin token by its id (see `admin-token list`)."""
    try:
        row = admin_tokens.revoke_admin_token(obj.store(), token_id, audit.CLI_ACTOR)
    except NotFound as exc:
        raise CliError(exc.message, "see `modelforge admin-token list`", EXIT_NOT_FOUND) from None
    emit(as_json, admin_tokens.admin_token_view(row), f"Revoked admin token {token_id}.")
