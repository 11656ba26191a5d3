"""``modelforge serve``: run the control plane (``init`` is cli/init.py: it needs no server)."""

from __future__ import annotations

import logging
import signal
import threading

import click

from modelforge_contract import instance

from ..core.sealing import SealingError, WorkKeys
from ..core.settings import Settings, is_unspecified, parse_listen
from ..identity import admin_tokens
from ..runtime import serving
from ..runtime.server import create_server, run_until
from ..store.database import Store
from ..work import sealed_input
from .support import Context, fail


@click.command()
@click.option("--listen", help="HOST:PORT to serve on (overrides MODELFORGE_LISTEN).")
@click.pass_obj
def serve(obj: Context, listen: str | None) -> None:
    """Serve the control plane (default 127.0.0.1:8000, SQLite under the state directory)."""
    settings = obj.settings
    host, port = (
        parse_listen(listen, "--listen") if listen else (settings.listen_host, settings.listen_port)
    )
    _one_serve_per_state_directory(settings)
    store = obj.store(create=True)  # takes the state lock before it migrates; held until we stop
    _seal_what_an_earlier_release_left_in_clear(settings, store)
    if not admin_tokens.has_admin_tokens(store):
        click.echo("modelforge: no admin token exists yet; run `modelforge init` first.", err=True)
    try:
        server = create_server(settings, store, host, port)
    except OSError as exc:
        fail(
            f"cannot listen on {host}:{port}: {exc.strerror}. Another program (or a control "
            "plane with another state directory) may listen there: choose another address "
            "with --listen HOST:PORT or MODELFORGE_LISTEN, or stop that program"
        )
    log = logging.getLogger("modelforge")
    listening = f"{host}:{server.effective_port}"
    log.info("serving on %s", listening)
    for tunnel_server in server.tunnel_servers:  # MODELFORGE_TUNNEL_LISTEN
        log.info(
            "agent tunnels on %s:%s", tunnel_server.effective_host, tunnel_server.effective_port
        )
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


SERVE_LOCK_NAME = "serve.lock"


def _seal_what_an_earlier_release_left_in_clear(settings: Settings, store: Store) -> None:
    """Work secrets stored by a release before sealing are sealed now (docs/work.md)."""
    try:
        count = sealed_input.seal_stored_in_clear(store, WorkKeys.of(settings.state_dir))
    except SealingError as exc:
        fail(f"cannot seal the work items' secrets: {exc}")
    if count:
        logging.getLogger("modelforge").warning(
            "sealed the env values of %d work item(s) an earlier release stored in clear; "
            "copies made before now (backups) still hold them: rotate those secrets",
            count,
        )


def _one_serve_per_state_directory(settings: Settings) -> None:
    """A second serve on one state directory would share its SQLite store, and clear the
    first one's serving record when it stopped: refuse it (exit 2), naming the first."""
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        instance.hold(settings.state_dir / SERVE_LOCK_NAME)  # held until this process ends
    except instance.AlreadyRunning as running:
        who = f"pid {running.pid}" if running.pid else "another process"
        fail(
            f"`modelforge serve` already runs on the state directory {settings.state_dir} "
            f"({who}); stop it first, or give this one its own MODELFORGE_STATE_DIR"
        )


def _banner(settings: Settings, store: Store, host: str, port: int) -> str:
    kind = "SQLite" if store.is_sqlite else "PostgreSQL"
    if settings.public_api_origin:
        url, origin = settings.public_api_origin, settings.public_api_origin
    elif is_unspecified(host):
        url, origin = f"http://<this host's address>:{port}", None
    else:
        url = origin = serving.origin_for(host, port)
    shown = f"listening on {host}:{port}" + (f", agents use {origin}" if origin else "")
    return (
        f"ModelForge control plane {shown} (store: {kind})\n"
        f"Console: {url}/console/ (its password: modelforge admin-password set)\n"
        "Enroll a node: modelforge enroll --name NAME --expires 15m, or\n"
        f'  curl -s -X POST -H "X-ModelForge-Admin-Token: $KEY" -H "Content-Type: application/json" \\\n'
        f'    -d \'{{"display_name":"GPU Node","expires_in_seconds":900}}\' \\\n'
        f"    {url}/api/v1/admin/node-enrollments"
    )
