"""``modelforge-node-agent`` / ``python3 -m modelforge_node_agent.main``.

Without a command it runs the agent; ``join`` enrolls a new node in one step and ``status``
reports on the running one. Exit statuses (EXIT_STATUSES, docs/node-agent.md): 0 stopped by
SIGTERM/SIGINT or preflight passed, 1 a publication loop failed unexpectedly (a bug; the
supervisor restarts the agent) or ``status``: not healthy, 2 configuration or state volume,
3 NVIDIA preflight, 4 enrollment refused, 5 protocol incompatible, 6 credential refused
after enrollment, 70 internal error.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from modelforge_contract import (
    EXIT_AGENT_FAILED,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_ENROLLMENT_REFUSED,
    EXIT_INTERNAL,
    EXIT_NVIDIA_PREFLIGHT,
    EXIT_OK,
    EXIT_PROTOCOL_INCOMPATIBLE,
    EXIT_USAGE,
    PROTOCOL_VERSION,
    instance,
    mask_secrets,
)

from . import __version__
from .enroll import ensure_enrolled, load_or_create_identity, token_is_spent
from .identity import NodeState, StateError, save_state
from .join import join_command
from .logs import configure_logging
from .models import ModelLoop, prepare_model_roots
from .nvidia import PreflightFailure, PreflightResult, run_preflight
from .publisher import DEFAULT_HEARTBEAT_INTERVAL, Publisher
from .refusals import AgentExit
from .serve import ServeLoop
from .settings import TABLE, AgentSettings, ConfigError, load_settings
from .signals import Stopping, install_signal_handlers
from .status import RecordingClient, StatusRecorder, status_command
from .transport import make_session
from .tunnel import TunnelClient
from .work import WorkerWatch, WorkLoop

log = logging.getLogger("modelforge_node_agent")

EXIT_STATUSES = (
    (EXIT_OK, "stopped by SIGTERM or SIGINT; --preflight passed; join done; status: healthy"),
    # One status, two commands: the running agent and `status` (EXIT_CHECK_FAILED).
    (
        EXIT_AGENT_FAILED,
        "a publication loop failed unexpectedly (a bug, logged): the agent exits so that its "
        "supervisor restarts it; status: the agent is not running, or its last heartbeat failed",
    ),
    (
        EXIT_USAGE,
        "a setting is wrong, the node is not enrolled and has no token, the state volume / "
        "identity.json is unusable, or join was refused (already joined, URL unreachable)",
    ),
    (
        EXIT_NVIDIA_PREFLIGHT,
        "NVIDIA preflight failed: NVIDIA_NVML_UNAVAILABLE, "
        "NVIDIA_DEVICE_NOT_FOUND or NVIDIA_TELEMETRY_UNAVAILABLE",
    ),
    (EXIT_ENROLLMENT_REFUSED, "the control plane refused the enrollment token"),
    (
        EXIT_PROTOCOL_INCOMPATIBLE,
        "the control plane does not accept this agent's protocol (TOO_OLD, TOO_NEW or UNKNOWN)",
    ),
    (
        EXIT_CREDENTIAL_REFUSED,
        "the control plane refused the node credential (revoked, unknown, or the node was "
        "decommissioned) and no unused token is set: re-enroll",
    ),
    (EXIT_INTERNAL, "an internal error (a bug): one line says so; --debug shows the traceback"),
)


# How long a stopping agent waits for its tunnel to say it is going and close.
TUNNEL_CLOSE_SECONDS = 5.0

# An OSError about a path the operator gave or configured is theirs to fix (exit 2).
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS}


class AgentGroup(click.Group):
    """Adds every setting and exit status to ``--help``; turns any failure into one line."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        TABLE.write_help(formatter)
        with formatter.section("Exit statuses"):
            formatter.write_dl([(str(code), meaning) for code, meaning in EXIT_STATUSES])

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            debug = bool(isinstance(ctx.obj, dict) and ctx.obj.get("debug"))
            if debug:
                trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                click.echo(mask_secrets(trace), err=True, nl=False)
            if isinstance(exc, OSError):
                where = f" {exc.filename}" if exc.filename else ""
                code = EXIT_USAGE if exc.errno in _PATH_ERRNOS else EXIT_INTERNAL
                line = f"cannot use{where}: {exc.strerror or type(exc).__name__}"
                if exc.errno in (errno.EACCES, errno.EPERM):
                    line += "; run as the user the agent runs as (or root), or choose another path"
            else:
                code = EXIT_INTERNAL
                line = (
                    f"internal error: {type(exc).__name__}; this is a bug: rerun with --debug "
                    "for the traceback and report it"
                )
            click.echo(f"modelforge-node-agent: {mask_secrets(line)}", err=True)
            sys.exit(code)


def _warn_about_transport(settings: AgentSettings, url: str) -> None:
    if not settings.tls_verify:
        log.warning(
            "MODELFORGE_AGENT_TLS_VERIFY=false: the control plane's certificate is NOT "
            "verified, so anyone on the network path can impersonate it and take this node's "
            "credential. Trust a private CA with MODELFORGE_AGENT_CA_CERT_PATH instead"
        )
    host = urlsplit(url).hostname or ""
    if url.startswith("http://") and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("%s is plain HTTP: the node credential crosses the network unencrypted", url)


def preflight_only(settings: AgentSettings) -> int:
    """The bounded NVIDIA diagnostic: no state, no enrollment, no network connection."""
    try:
        result = run_preflight(settings)
    except PreflightFailure as failure:
        log.error("%s. Next step: %s", failure, failure.next_step)
        return EXIT_NVIDIA_PREFLIGHT
    if result.nvml is not None:
        result.nvml.close()
    log.info("preflight passed (%s mode): %s", settings.accelerator_mode, result.summary())
    return EXIT_OK


def _can_reenroll(settings: AgentSettings, state: NodeState) -> bool:
    """A refused credential and a token in the settings that this node has not used."""
    return bool(settings.enrollment_token) and not token_is_spent(settings, state)


def run_agent(
    settings: AgentSettings, stop: threading.Event, recorder: StatusRecorder | None = None
) -> int:
    url = settings.require_control_plane()
    log.info(
        "ModelForge Node Agent %s (agent protocol %s): control plane %s, mode %s, state %s",
        __version__,
        PROTOCOL_VERSION,
        url,
        settings.accelerator_mode,
        settings.state_volume,
    )
    _warn_about_transport(settings, url)
    # Invariant 9: the preflight runs before anything is written or enrolled; a failure exits 3.
    try:
        preflight: PreflightResult = run_preflight(settings)
    except PreflightFailure as failure:
        log.error("%s. Next step: %s", failure, failure.next_step)
        return EXIT_NVIDIA_PREFLIGHT
    log.info("preflight passed: %s", preflight.summary())
    try:
        state = load_or_create_identity(settings)
        prepare_model_roots(settings)
        client = RecordingClient(url, make_session(settings), recorder=recorder)
        enrolled = ensure_enrolled(settings, state, client, stop)
        if enrolled is None:
            return EXIT_OK
        # The work plane (issue 13): watch the local runtime worker, claim while it can run.
        # The watch outlives a re-enrollment; it stops with the agent.
        worker = WorkerWatch(
            settings, preflight.mode, stop, on_change=recorder.worker if recorder else None
        )
        worker.refresh()  # the first heartbeat already tells the truth about it
        worker.start()
        while True:
            if enrolled is None:
                return EXIT_OK
            client.credential = enrolled.state.credential
            if recorder is not None:
                recorder.enrolled(enrolled.state)
            # Each run of the publications and the work loop has its own stop flag: a refusal
            # stops them, not the agent (Publisher.run sets it however it ends). SIGTERM
            # still ends everything (Stopping in this thread).
            run_stop = threading.Event()
            publisher = Publisher(
                settings,
                enrolled.state,
                client,
                preflight,
                run_stop,
                heartbeat_interval=enrolled.heartbeat_interval or DEFAULT_HEARTBEAT_INTERVAL,
                worker=worker,
            )
            node_id = enrolled.state.node_id
            WorkLoop(settings, node_id, client, worker, run_stop, publisher.refuse).start()
            # Models (issue 24): the same stop and refusal as the work loop.
            models = ModelLoop(settings, client, run_stop, publisher.refuse)
            models.wake_inventory = publisher.wake_inventory
            publisher.models_report = models.report
            publisher.models_generation = models.generation.seen
            models.start()
            # Deployments (issue 25): the servers placed on this node, the same stop and
            # refusal again. Their runtimes belong to the worker and outlive this loop.
            serve = ServeLoop(settings, node_id, client, worker, run_stop, publisher.refuse)
            publisher.servers_generation = serve.generation.seen
            serve.start()
            # The tunnel (issue 26): client requests for those servers, over one outbound
            # connection; the same stop. It reaches only the servers the serve loop runs.
            tunnel = TunnelClient(settings, lambda: client.credential, serve.server_of, run_stop)
            serve.open_link = tunnel.open_link  # a split's main server reaches its helpers
            publisher.health.tunnel = lambda tunnel=tunnel: tunnel.state
            tunnel_thread = tunnel.start()
            try:
                outcome = publisher.run()
            finally:
                # Stopping (SIGTERM too): an up tunnel says so before it closes, so the
                # control plane ends this node's streams at once; it is a daemon thread, so
                # the agent waits for that (bounded), not for a connection still being made.
                run_stop.set()
                if tunnel.up():
                    tunnel_thread.join(TUNNEL_CLOSE_SECONDS)
            if outcome is None:
                return EXIT_OK
            if not publisher.refused_code:
                raise outcome
            # Remembered so a restart without a fresh token stops without calling again.
            refused = enrolled.state.with_refusal(publisher.refused_code)
            save_state(settings.state_volume, refused)
            if not _can_reenroll(settings, refused):
                raise outcome
            # A fresh token is at hand: re-enroll now, not after an exit and a restart
            # (under systemd exit 6 would leave the unit stopped).
            log.warning(
                "the control plane refused this node's credential (%s); re-enrolling at once "
                "with the unused token in MODELFORGE_AGENT_ENROLLMENT_TOKEN",
                publisher.refused_code,
            )
            enrolled = ensure_enrolled(settings, refused, client, stop)
    finally:
        if preflight.nvml is not None:
            preflight.nvml.close()


def _load_settings(env_file: Path | None) -> AgentSettings:
    try:
        return load_settings(env_file=env_file)
    except ConfigError as error:
        click.echo(f"modelforge-node-agent: {error}", err=True)
        sys.exit(error.exit_code)


# One agent per state volume: two would speak for one node with one identity.
AGENT_LOCK_NAME = "agent.lock"


def run(settings: AgentSettings) -> int:
    """Run the agent until stopped or refused; the exit status, also in status.json."""
    lock = None
    try:
        # A volume not made yet holds no identity to share (and an enrollment token is
        # single-use); it is locked from the next start on.
        if settings.state_volume.is_dir():
            lock = instance.hold(settings.state_volume / AGENT_LOCK_NAME)
    except instance.AlreadyRunning as running:
        who = f"pid {running.pid}" if running.pid else "another process"
        log.error(
            "another node agent (%s) already runs on the state volume %s, with this node's "
            "identity; stop it first, or give this one its own MODELFORGE_AGENT_STATE_VOLUME",
            who,
            settings.state_volume,
        )
        return EXIT_USAGE  # status.json stays the running agent's
    except OSError:
        pass  # an unusable state volume: run_agent says so, with what to do
    try:
        return _run_holding_the_volume(settings)
    finally:
        if lock is not None:
            os.close(lock)


def _run_holding_the_volume(settings: AgentSettings) -> int:
    stop = threading.Event()
    install_signal_handlers(stop)
    recorder = StatusRecorder(
        settings.state_volume, settings.control_plane_url or "", settings.accelerator_mode
    )
    message = None
    try:
        status = run_agent(settings, stop, recorder)
    except Stopping:
        status = EXIT_OK
    except (ConfigError, StateError) as error:
        message = str(error)
        log.error("%s", error)
        status = EXIT_USAGE
    except AgentExit as stopped:
        message = stopped.message
        log.error("%s", stopped.message)
        status = stopped.exit_code
    if status == EXIT_OK and stop.is_set():
        log.info("stopped")
    if settings.state_volume.is_dir():
        recorder.stopped(status, message)
    return status


@click.group(
    cls=AgentGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--preflight",
    is_flag=True,
    help="Run the NVIDIA preflight for MODELFORGE_AGENT_ACCELERATOR_MODE and exit: never "
    "enrolls, never reads or writes the state volume, opens no network connection.",
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read MODELFORGE_AGENT_* settings from this KEY=VALUE file (what `join` wrote); the "
    "environment wins on conflicts.",
)
@click.option("--debug", is_flag=True, help="On an unexpected failure, show the traceback too.")
@click.version_option(
    __version__, message=f"modelforge-node-agent %(version)s (agent protocol {PROTOCOL_VERSION})"
)
@click.pass_context
def main(ctx: click.Context, preflight: bool, env_file: Path | None, debug: bool) -> None:
    """ModelForge Node Agent: enrolls this host once, then publishes heartbeat, inventory and
    NVML telemetry to the control plane. Outbound only; configured by the environment.

    Without a command it runs the agent. `join` enrolls a new node in one step; `status`
    says how the running agent is doing.
    """
    ctx.obj = {"debug": debug, "env_file": env_file}
    if ctx.invoked_subcommand is not None:
        if preflight:
            raise click.UsageError("--preflight runs on its own, without a command")
        return
    settings = _load_settings(env_file)
    configure_logging(settings.log_level)
    if preflight:
        sys.exit(preflight_only(settings))
    sys.exit(run(settings))


# `join` and `status` live with what they do; `python3 -m modelforge_node_agent.main` has both.
main.add_command(join_command)
main.add_command(status_command)


if __name__ == "__main__":
    main()
