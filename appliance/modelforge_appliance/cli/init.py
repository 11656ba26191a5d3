"""``modelforge init``: create the store and print the first admin token once."""

from __future__ import annotations

import click

from ..identity import admin_tokens
from ..store import audit
from .support import Context, emit

FIRST_TOKEN_NAME = "first admin"


@click.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"admin_token": …} as JSON.')
@click.pass_obj
def init(obj: Context, as_json: bool) -> None:
    """Create the state directory and store; print the first admin token once."""
    store = obj.store(create=True)
    if admin_tokens.has_admin_tokens(store):
        emit(
            as_json,
            {"admin_token": None, "already_initialised": True},
            f"ModelForge is already initialised in {obj.settings.state_dir}.\n"
            "The first admin token was shown when it was created and cannot be shown again;\n"
            "create another with: modelforge admin-token create --name NAME",
        )
        return
    row, secret = admin_tokens.create_admin_token(store, FIRST_TOKEN_NAME, audit.CLI_ACTOR)
    emit(
        as_json,
        {"admin_token": secret, "token_id": row.token_id},
        f"Initialised ModelForge in {obj.settings.state_dir}.\n\n"
        f"First admin token (shown once, store it now):\n\n    {secret}\n\n"
        "Send it as the X-ModelForge-Admin-Token header.",
    )
