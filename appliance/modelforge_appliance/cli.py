"""The ``modelforge`` command line (click). Exit codes: 0 ok, 2 usage or configuration."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import click

from modelforge_contract import (
    ENROLLMENT_EXPIRY_MAX_SECONDS,
    ENROLLMENT_EXPIRY_MIN_SECONDS,
    PROTOCOL_VERSION,
    __version__,
)

from . import admin_tokens, audit, enrollment
from .backup import RestoreRefused, state_lock
from .cli_support import Context, emit, fail
from .doctor import doctor
from .settings import ConfigError, parse_listen
from .store import StoreVersionError

FIRST_TOKEN_NAME = "first admin"


class Group(click.Group):
    """Turns configuration and store-version problems into exit 2 with one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigError, StoreVersionError, RestoreRefused) as exc:
            fail(str(exc))


@click.group(cls=Group)
@click.version_option(
    __version__, message=f"modelforge %(version)s (agent protocol {PROTOCOL_VERSION})"
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read MODELFORGE_* settings from this KEY=VALUE file; the environment wins on conflicts.",
)
@click.pass_context
def main(ctx: click.Context, env_file: Path | None) -> None:
    """ModelForge control plane: enrollment, node credentials, liveness and the console.

    Settings come from MODELFORGE_* environment variables (docs/configuration.md).
    """
    # Everything this program writes (store, WAL, backups, lock) is for its own user only.
    os.umask(0o077)
    ctx.obj = Context(env_file)


@main.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"admin_token": …} as JSON.')
@click.pass_obj
def init(obj: Context, as_json: bool) -> None:
    """Create the state directory and store; print the first admin token once."""
    store = obj.store()
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


@main.command()
@click.option("--listen", help="HOST:PORT to serve on (overrides MODELFORGE_LISTEN).")
@click.pass_obj
def serve(obj: Context, listen: str | None) -> None:
    """Serve the control plane (default 127.0.0.1:8000, SQLite under the state directory)."""
    import logging

    from .server import create_server, run_until

    settings = obj.settings
    host, port = (
        parse_listen(listen, "--listen") if listen else (settings.listen_host, settings.listen_port)
    )
    store = obj.store()
    if not admin_tokens.has_admin_tokens(store):
        click.echo("modelforge: no admin token exists yet; run `modelforge init` first.", err=True)
    try:
        server = create_server(settings, store, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror}")
    bound = f"http://{host}:{server.effective_port}"
    logging.getLogger("modelforge").info("serving on %s", bound)
    click.echo(
        f"ModelForge control plane on {bound} (store: {'SQLite' if store.is_sqlite else 'PostgreSQL'})\n"
        "Enroll a node: modelforge enroll --name NAME --expires 15m, or\n"
        f'  curl -s -X POST -H "X-ModelForge-Admin-Token: $KEY" -H "Content-Type: application/json" \\\n'
        f'    -d \'{{"display_name":"GPU Node","expires_in_seconds":900}}\' \\\n'
        f"    {bound}/api/v1/admin/node-enrollments",
        err=True,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with state_lock(settings, exclusive=False):  # `modelforge restore` waits for us to stop
        run_until(server, stop)
    logging.getLogger("modelforge").info("stopped")


@main.group("admin-token")
def admin_token() -> None:
    """Create, list and revoke admin tokens (shown once, stored as digests)."""


@admin_token.command("create")
@click.option("--name", required=True, help="What the token is for, e.g. 'backup script'.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_create(obj: Context, name: str, as_json: bool) -> None:
    """Mint an admin token and print it once."""
    row, secret = admin_tokens.create_admin_token(obj.store(), name, audit.CLI_ACTOR)
    emit(
        as_json,
        {"token_id": row.token_id, "admin_token": secret},
        f"Admin token {row.token_id} (shown once):\n\n    {secret}\n",
    )


@admin_token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_list(obj: Context, as_json: bool) -> None:
    """List admin tokens (never the secrets)."""
    rows = admin_tokens.list_admin_tokens(obj.store())
    lines = [f"{'TOKEN ID':18} {'NAME':24} {'CREATED':26} STATE"]
    for row in rows:
        state = f"revoked {row['revoked_at']}" if row["revoked_at"] else "active"
        lines.append(f"{row['token_id']:18} {row['name'][:24]:24} {row['created_at']:26} {state}")
    emit(as_json, {"admin_tokens": rows}, "\n".join(lines))


@admin_token.command("revoke")
@click.argument("token_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def admin_token_revoke(obj: Context, token_id: str, as_json: bool) -> None:
    """Revoke an admin token by its id (see `admin-token list`)."""
    from .errors import NotFound

    try:
        row = admin_tokens.revoke_admin_token(obj.store(), token_id, audit.CLI_ACTOR)
    except NotFound as exc:
        fail(exc.message)
    emit(as_json, admin_tokens.admin_token_view(row), f"Revoked admin token {token_id}.")


_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise click.BadParameter("use a duration such as 5m, 15m, 1h or 24h")
    seconds = int(match.group(1)) * _UNIT[match.group(2)]
    if not ENROLLMENT_EXPIRY_MIN_SECONDS <= seconds <= ENROLLMENT_EXPIRY_MAX_SECONDS:
        raise click.BadParameter("must be between 5m and 24h")
    return seconds


@main.command()
@click.option("--name", required=True, help="Display name of the node to be.")
@click.option("--expires", default="15m", show_default=True, help="Token lifetime, 5m to 24h.")
@click.option("--json", "as_json", is_flag=True, help="Print the mint response as JSON.")
@click.pass_obj
def enroll(obj: Context, name: str, expires: str, as_json: bool) -> None:
    """Mint a single-use enrollment token locked to the public API origin."""
    seconds = parse_duration(expires)
    if not 1 <= len(name) <= 120:
        raise click.BadParameter("must be 1 to 120 characters", param_hint="--name")
    store = obj.store()
    minted = enrollment.mint_enrollment_token(
        store,
        display_name=name,
        expires_in_seconds=seconds,
        api_origin=obj.settings.default_api_origin,
        actor=audit.CLI_ACTOR,
    )
    response = minted.response(store.clock.now())
    emit(
        as_json,
        response,
        f"Enrollment {response['enrollment_id']} for {name!r}, locked to {response['api_origin']},"
        f" expires {response['expires_at']}.\n\nToken (single use, shown once):\n\n"
        f"    {minted.token}\n\nSave as modelforge-node.env on the node:\n\n{response['env_file']}\n"
        f"Then start the agent (asks for the token without echo):\n\n    {response['start_command']}",
    )


from .cli_nodes import alerts_command, backup_command, nodes_group, restore_command  # noqa: E402

for command in (nodes_group, alerts_command, backup_command, restore_command, doctor):
    main.add_command(command)

if __name__ == "__main__":
    main()
