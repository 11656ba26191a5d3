"""The ``modelforge`` command line (click). Exit codes: see cli/errors.py and README.md."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import click

from modelforge_contract import PROTOCOL_VERSION, __version__

from .. import admin_tokens, audit, serving
from ..backup import RestoreRefused
from ..doctor import doctor
from ..settings import ConfigError, Settings, parse_listen
from ..statelock import StateBusy
from ..store import Store, StoreVersionError
from .errors import report
from .support import Context, emit, fail

FIRST_TOKEN_NAME = "first admin"


class Group(click.Group):
    """The one error handler: every failure is one line with a next step and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigError, StoreVersionError, RestoreRefused, StateBusy) as exc:
            fail(str(exc))
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # everything else: one line, the trace only with --debug
            obj = ctx.obj if isinstance(ctx.obj, Context) else None
            report(
                exc,
                debug=bool(obj and obj.debug),
                database_url=obj.database_url if obj else None,
            )


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__, message=f"modelforge %(version)s (agent protocol {PROTOCOL_VERSION})"
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read MODELFORGE_* settings from this KEY=VALUE file; the environment wins on "
    "conflicts. Default: the settings scripts/run left in this virtualenv, if any.",
)
@click.option("--debug", is_flag=True, help="On failure, show the Python traceback too.")
@click.pass_context
def main(ctx: click.Context, env_file: Path | None, debug: bool) -> None:
    """ModelForge control plane: enrollment, node credentials, liveness and the console.

    Settings come from MODELFORGE_* environment variables (docs/configuration.md).
    Exit codes: 0 ok, 1 the answer is no (not ready, a check failed, alerts, declined),
    2 usage or configuration, 7 not found, 8 store unreachable, 9 the system refused
    (disk full, I/O error), 70 internal error.
    """
    # Everything this program writes (store, WAL, backups, lock) is for its own user only.
    os.umask(0o077)
    ctx.obj = Context(env_file, debug)
    ctx.call_on_close(ctx.obj.close)  # the state lock is held until the command ends


@main.command()
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
    store = obj.store(create=True)  # takes the state lock before it migrates; held until we stop
    if not admin_tokens.has_admin_tokens(store):
        click.echo("modelforge: no admin token exists yet; run `modelforge init` first.", err=True)
    try:
        server = create_server(settings, store, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror}")
    log = logging.getLogger("modelforge")
    listening = f"{host}:{server.effective_port}"
    log.info("serving on %s", listening)
    warning = serving.wildcard_warning(settings, host)
    if warning:
        log.warning("%s", warning)
    click.echo(_banner(settings, store, host, server.effective_port), err=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # What the CLI on this host reads to lock tokens to the origin really served. The state
    # lock (obj.store) is held until we stop, so `modelforge restore` waits for us.
    record = serving.record_serving(settings, host, server.effective_port)
    try:
        run_until(server, stop)
    finally:
        serving.clear_serving(settings, record)
    log.info("stopped")


def _banner(settings: Settings, store: Store, host: str, port: int) -> str:
    kind = "SQLite" if store.is_sqlite else "PostgreSQL"
    if settings.public_api_origin:
        url, origin = settings.public_api_origin, settings.public_api_origin
    elif serving.is_unspecified(host):
        url, origin = f"http://<this host's address>:{port}", None
    else:
        url = origin = serving.origin_for(host, port)
    shown = f"listening on {host}:{port}" + (f", agents use {origin}" if origin else "")
    return (
        f"ModelForge control plane {shown} (store: {kind})\n"
        "Enroll a node: modelforge enroll --name NAME --expires 15m, or\n"
        f'  curl -s -X POST -H "X-ModelForge-Admin-Token: $KEY" -H "Content-Type: application/json" \\\n'
        f'    -d \'{{"display_name":"GPU Node","expires_in_seconds":900}}\' \\\n'
        f"    {url}/api/v1/admin/node-enrollments"
    )


from .admin_password import admin_password  # noqa: E402
from .admin_tokens import admin_token  # noqa: E402
from .audit import audit_command  # noqa: E402
from .completion import completion  # noqa: E402
from .enrollments import enroll, enrollments_group  # noqa: E402
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
    enrollments_group,
    nodes_group,
    alerts_command,
    audit_command,
    backup_command,
    restore_command,
    save_finality_command,
    restore_finality_command,
    doctor,
    completion,
    work_group,
):
    main.add_command(command)

if __name__ == "__main__":
    main()
