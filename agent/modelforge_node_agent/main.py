"""``modelforge-node-agent`` / ``python3 -m modelforge_node_agent.main``.

Exit statuses: 0 stopped by SIGTERM/SIGINT or preflight passed, 1 an unexpected
failure (a bug; the supervisor restarts the agent), 2 configuration or state volume, 3 NVIDIA preflight, 4 enrollment refused, 5 protocol
incompatible, 6 credential refused after enrollment.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any
from urllib.parse import urlsplit

import click

from modelforge_contract import (
    EXIT_AGENT_FAILED,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_ENROLLMENT_REFUSED,
    EXIT_NVIDIA_PREFLIGHT,
    EXIT_OK,
    EXIT_PROTOCOL_INCOMPATIBLE,
    EXIT_USAGE,
    PROTOCOL_VERSION,
)

from . import __version__
from .client import ControlPlaneClient
from .enroll import ensure_enrolled, load_or_create_identity
from .identity import StateError, save_state
from .logs import configure_logging
from .nvidia import PreflightFailure, PreflightResult, run_preflight
from .publisher import DEFAULT_HEARTBEAT_INTERVAL, Publisher
from .refusals import AgentExit
from .settings import SETTINGS, AgentSettings, ConfigError, load_settings
from .transport import make_session
from .work import WorkerWatch, WorkLoop

log = logging.getLogger("modelforge_node_agent")

EXIT_STATUSES = (
    (EXIT_OK, "stopped by SIGTERM or SIGINT; or --preflight passed"),
    (
        EXIT_AGENT_FAILED,
        "the agent failed unexpectedly (a bug, logged); let the supervisor restart it",
    ),
    (
        EXIT_USAGE,
        "a setting is wrong, the node is not enrolled and has no token, or the "
        "state volume / identity.json is unusable",
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
        "the control plane refused the node credential (revoked, "
        "unknown, or the node was decommissioned): re-enroll",
    ),
)


class Stopping(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT so a blocking call there ends at once."""


class AgentCommand(click.Command):
    """Adds every setting and every exit status to ``--help``."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Environment variables"):
            formatter.write_dl(
                [
                    (
                        spec.name,
                        spec.meaning + (f" [default: {spec.default}]" if spec.default else ""),
                    )
                    for spec in SETTINGS
                ]
            )
        with formatter.section("Exit statuses"):
            formatter.write_dl([(str(code), meaning) for code, meaning in EXIT_STATUSES])


def _install_signal_handlers(stop: threading.Event) -> None:
    def handle(signum: int, _frame: Any) -> None:
        first = not stop.is_set()
        stop.set()
        if first:
            log.info("stopping on %s", signal.Signals(signum).name)
            raise Stopping

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


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


def run_agent(settings: AgentSettings, stop: threading.Event) -> int:
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
    state = load_or_create_identity(settings)
    # Invariant 9: the preflight runs before enrollment; a failure exits 3.
    try:
        preflight: PreflightResult = run_preflight(settings)
    except PreflightFailure as failure:
        log.error("%s. Next step: %s", failure, failure.next_step)
        return EXIT_NVIDIA_PREFLIGHT
    log.info("preflight passed: %s", preflight.summary())
    try:
        client = ControlPlaneClient(url, make_session(settings))
        enrolled = ensure_enrolled(settings, state, client, stop)
        if enrolled is None:
            return EXIT_OK
        client.credential = enrolled.state.credential
        # The work plane (issue 13): watch the local runtime worker, claim while it can run.
        worker = WorkerWatch(settings, preflight.mode, stop)
        worker.refresh()  # the first heartbeat already tells the truth about it
        publisher = Publisher(
            settings,
            enrolled.state,
            client,
            preflight,
            stop,
            heartbeat_interval=enrolled.heartbeat_interval or DEFAULT_HEARTBEAT_INTERVAL,
            worker=worker,
        )
        worker.start()
        WorkLoop(settings, enrolled.state.node_id, client, worker, stop, publisher.refuse).start()
        outcome = publisher.run()
        if outcome is None:
            return EXIT_OK
        if publisher.refused_code:
            # Remembered so a restart without a fresh token stops without calling again.
            save_state(settings.state_volume, enrolled.state.with_refusal(publisher.refused_code))
        raise outcome
    finally:
        if preflight.nvml is not None:
            preflight.nvml.close()


@click.command(cls=AgentCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--preflight",
    is_flag=True,
    help="Run the NVIDIA preflight for MODELFORGE_AGENT_ACCELERATOR_MODE and exit: never "
    "enrolls, never reads or writes the state volume, opens no network connection.",
)
@click.version_option(
    __version__, message=f"modelforge-node-agent %(version)s (agent protocol {PROTOCOL_VERSION})"
)
def main(preflight: bool) -> None:
    """ModelForge Node Agent: enrolls this host once, then publishes heartbeat, inventory and
    NVML telemetry to the control plane. Outbound only; configured by the environment."""
    try:
        settings = load_settings()
    except ConfigError as error:
        click.echo(f"modelforge-node-agent: {error}", err=True)
        sys.exit(error.exit_code)
    configure_logging(settings.log_level)
    if preflight:
        sys.exit(preflight_only(settings))
    stop = threading.Event()
    _install_signal_handlers(stop)
    try:
        status = run_agent(settings, stop)
    except Stopping:
        status = EXIT_OK
    except (ConfigError, StateError) as error:
        log.error("%s", error)
        status = EXIT_USAGE
    except AgentExit as stopped:
        log.error("%s", stopped.message)
        status = stopped.exit_code
    if status == EXIT_OK and stop.is_set():
        log.info("stopped")
    sys.exit(status)


if __name__ == "__main__":
    main()
