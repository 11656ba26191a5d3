"""The ``modelforge`` command line (click). Exit codes: 0 ok, 2 usage or configuration."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import click

from modelforge_contract import PROTOCOL_VERSION, __version__

from .. import admin_tokens, audit
from ..backup import RestoreRefused
from ..doctor import doctor
from ..settings import ConfigError, parse_listen
from ..statelock import StateBusy
from ..store import StoreVersionError
from .support import Context, emit, fail

FIRST_TOKEN_NAME = "first admin"


class Group(click.Group):
    """Turns configuration and store-version problems into exit 2 with one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigError, StoreVersionError, RestoreRefused, StateBusy) as exc:
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
    ctx.call_on_close(ctx.obj.close)  # the state lock is held until the command ends


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

    from ..server import create_server, run_until

    settings = obj.settings
    host, port = (
        parse_listen(listen, "--listen") if listen else (settings.listen_host, settings.listen_port)
    )
    store = obj.store()  # takes the state lock before it migrates; held until we stop
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
    run_until(server, stop)
    logging.getLogger("modelforge").info("stopped")


from .admin_password import admin_password  # noqa: E402
from .admin_tokens import admin_token  # noqa: E402
from .enrollments import enroll  # noqa: E402
from .nodes import alerts_command, nodes_group  # noqa: E402
from .store import (  # noqa: E402
    backup_command,
    restore_command,
    restore_finality_command,
    save_finality_command,
)
from .work import work_group  # noqa: E402

for command in (
    admin_password,
    admin_token,
    enroll,
    nodes_group,
    alerts_command,
    backup_command,
    restore_command,
    save_finality_command,
    restore_finality_command,
    doctor,
    work_group,
):
    main.add_command(command)

if __name__ == "__main__":
    main()
