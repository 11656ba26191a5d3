"""``modelforge-node-agent join URL --token-file -``: a node joins in one command.

In order: check the settings and that this host has not joined already (before asking for
anything); read the token (without echo on a terminal); run the NVIDIA preflight; check that
URL answers as a ModelForge control plane; make sure the env file can be written; persist the
identity; enroll (an origin mismatch names both origins); then put the env file (mode 0600,
no secret in it) where the agent reads it — under systemd, where the unit's
``EnvironmentFile=`` points. A second join of a joined host is refused and changes nothing.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import pwd
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import click
import requests

from modelforge_contract import (
    ACCELERATOR_MODES,
    AGENT_ENV_FILE,
    AGENT_SERVICE,
    AGENT_STATE_DIR,
    EXIT_NVIDIA_PREFLIGHT,
    EXIT_OK,
    EXIT_USAGE,
    PATH_HEALTHZ,
    WORKER_SERVICE,
)
from modelforge_contract.envfile import format_env_file
from modelforge_contract.files import fsync_directory

from . import runtime
from .client import ControlPlaneClient
from .enroll import ensure_enrolled, load_or_create_identity
from .identity import StateError, load_state, state_path
from .logs import configure_logging
from .nvidia import PreflightFailure, run_preflight
from .refusals import AgentExit
from .settings import ConfigError, load_settings
from .signals import Stopping, install_signal_handlers
from .transport import REQUEST_TIMEOUT, exception_name, make_session

log = logging.getLogger(__name__)

# The system user systemd/modelforge-node-agent.service runs as; join, run as root, hands the
# state directory to it (systemd would also do so at the unit's first start).
SERVICE_USER = "modelforge-agent"
# Tries of the enrollment call before join gives up (1 s, 2 s, 4 s, 8 s between them).
ENROLL_TRIES = 5


@dataclass(frozen=True)
class JoinRequest:
    url: str
    token_file: str  # a path, or "-" for stdin (a prompt without echo on a terminal)
    accelerator_mode: str
    env_file: Path
    state_dir: Path
    hostname: str | None = None
    root: Path | None = None  # install under this directory instead of /
    ca_cert: Path | None = None
    host_address: str | None = None
    tls_verify: bool = True
    worker_socket: Path | None = None  # the runtime worker's socket, when not the default

    def placed(self, path: Path) -> Path:
        """Where ``path`` really is: under --root when given, relative paths from here."""
        if self.root is not None and path.is_absolute():
            return self.root / path.relative_to("/")
        return path.absolute()


def _settings_env(request: JoinRequest, state_dir: Path) -> dict[str, str]:
    """The agent's settings as join will write them (logical paths, as the agent sees them)."""
    env = {
        "MODELFORGE_AGENT_CONTROL_PLANE_URL": request.url,
        "MODELFORGE_AGENT_ACCELERATOR_MODE": request.accelerator_mode,
    }
    if request.hostname:
        env["MODELFORGE_AGENT_HOSTNAME"] = request.hostname
    if str(state_dir) != AGENT_STATE_DIR:
        env["MODELFORGE_AGENT_STATE_VOLUME"] = str(state_dir)
    if not request.tls_verify:
        env["MODELFORGE_AGENT_TLS_VERIFY"] = "false"
    if request.ca_cert is not None:
        env["MODELFORGE_AGENT_CA_CERT_PATH"] = str(request.ca_cert.absolute())
    if request.host_address:
        env["MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS"] = request.host_address
    if request.worker_socket is not None:
        env["MODELFORGE_AGENT_WORKER_SOCKET"] = str(request.worker_socket.absolute())
    return env


def read_token(source: str) -> str:
    """The token from a file, or from stdin: a prompt without echo on a terminal."""
    if source == "-":
        if sys.stdin.isatty():
            token = getpass.getpass("Enrollment token: ")
        else:
            token = sys.stdin.readline()
    else:
        try:
            token = Path(source).read_text().splitlines()[0] if Path(source).stat().st_size else ""
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {source}: {exc.strerror}") from None
    token = token.strip()
    if not token:
        raise ConfigError("no enrollment token was given (--token-file - reads one line)")
    return token


def _already_joined(state_dir: Path, env_path: Path) -> AgentExit | None:
    state = load_state(state_dir)
    if state is None or not state.enrolled or not env_path.exists():
        # Enrolled without its env file (a join cut short after enrolling): join again
        # writes it; the enrollment goes to the same node id.
        return None
    return AgentExit(
        EXIT_USAGE,
        f"this host already joined as node {state.node_id} ({state_path(state_dir)}, settings "
        f"in {env_path}); nothing was changed. To re-enroll after its credential was refused, "
        "start the agent once (it records the refusal) and join again, or give the running "
        "agent a fresh MODELFORGE_AGENT_ENROLLMENT_TOKEN (it re-enrolls at once); to join "
        f"another control plane as a new node, delete {state_path(state_dir)} first",
    )


def _check_control_plane(url: str, session: requests.Session) -> None:
    """URL answers /healthz like a ModelForge control plane, or a clear AgentExit."""
    try:
        response = session.get(url + PATH_HEALTHZ, timeout=REQUEST_TIMEOUT, allow_redirects=False)
        with response:
            answer = response.json() if response.status_code == 200 else None
    except ValueError:
        answer = None
    except requests.RequestException as exc:
        raise AgentExit(
            EXIT_USAGE,
            f"cannot reach the control plane at {url} ({exception_name(exc)} on GET "
            f"{PATH_HEALTHZ}); check the URL (the origin shown when the token was minted) and "
            "that this host can reach it; nothing was changed",
        ) from None
    if answer != {"status": "ok"}:
        raise AgentExit(
            EXIT_USAGE,
            f"{url} does not answer {PATH_HEALTHZ} like a ModelForge control plane (HTTP "
            f"{response.status_code}); check the URL, or the control plane's store if it "
            "answered 503; nothing was changed",
        )


class _EnvFile:
    """The env file, written beside its final place first (so an unwritable place fails
    before enrolling) and moved there once the node is enrolled: ``write_atomically`` in two
    steps, with enrolling between them."""

    def __init__(self, path: Path, content: str) -> None:
        self.path = path
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        descriptor, self.temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(descriptor, "w") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())

    def commit(self) -> None:
        os.replace(self.temporary, self.path)
        self.temporary = None
        fsync_directory(self.path.parent)  # the rename survives a power loss too

    def discard(self) -> None:
        if self.temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)


def _give_to_service_user(state_dir: Path) -> None:
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam(SERVICE_USER)
    except KeyError:
        return  # systemd hands the StateDirectory= to the unit's user at its first start
    for path in (state_dir, *state_dir.iterdir()):
        os.chown(path, user.pw_uid, user.pw_gid)


def start_step(env_path: Path, request: JoinRequest) -> str:
    """How to start the joined agent, for where join put its settings."""
    if str(request.env_file) == AGENT_ENV_FILE:
        return f"sudo systemctl enable --now {WORKER_SERVICE} {AGENT_SERVICE}"
    if runtime.current() == runtime.CONTAINER:
        return (
            f"start the agent's container with --env-file {request.env_file} (on the host) and "
            "the same state volume"
        )
    return f"{runtime.agent_command()} --env-file {env_path}"


def run_join(request: JoinRequest, stop: threading.Event) -> int:
    """Join this host; the exit status (AgentExit and ConfigError propagate)."""
    state_dir, env_path = request.placed(request.state_dir), request.placed(request.env_file)
    logical_state = request.state_dir if request.root else state_dir
    env = _settings_env(request, logical_state)
    load_settings(env)  # every value checked before anything is asked or written
    refusal = _already_joined(state_dir, env_path)
    if refusal is not None:
        raise refusal
    existing = load_state(state_dir)
    # Enrolled, but the env file never got written: write it; no token is needed.
    resuming = existing is not None and existing.enrolled
    local = {**env, "MODELFORGE_AGENT_STATE_VOLUME": str(state_dir)}
    if not resuming:
        local["MODELFORGE_AGENT_ENROLLMENT_TOKEN"] = read_token(request.token_file)
    settings = load_settings(local)
    try:
        preflight = run_preflight(settings)
    except PreflightFailure as failure:
        log.error("%s. Next step: %s", failure, failure.next_step)
        return EXIT_NVIDIA_PREFLIGHT
    if preflight.nvml is not None:
        preflight.nvml.close()
    log.info("preflight passed: %s", preflight.summary())
    session = make_session(settings)
    _check_control_plane(settings.require_control_plane(), session)
    env_file = _EnvFile(
        env_path,
        format_env_file(
            env,
            f"ModelForge Node Agent settings, written by `join` (no secrets: the token was "
            f"used once).\nThe identity and credential live in {logical_state}/identity.json.",
        ),
    )
    try:
        state = load_or_create_identity(settings)
        tries = [0]

        def bounded_wait(delay: float) -> bool:
            tries[0] += 1
            return tries[0] >= ENROLL_TRIES or stop.wait(delay)

        client = ControlPlaneClient(settings.require_control_plane(), session)
        if resuming:
            log.info("already enrolled as node %s; writing the missing %s", state.node_id, env_path)
        enrolled = ensure_enrolled(
            settings, state, client, stop, wait=bounded_wait, announce_spent_token=False
        )
        if enrolled is None:
            raise AgentExit(
                EXIT_USAGE,
                f"the control plane at {request.url} did not accept the enrollment after "
                f"{tries[0]} tries (see the lines above); the token is unused: run join again",
            )
        env_file.commit()
    finally:
        env_file.discard()
    if str(request.state_dir) == AGENT_STATE_DIR:  # the systemd unit's StateDirectory=
        _give_to_service_user(state_dir)
    print(
        f"Joined {request.url} as node {enrolled.state.node_id} ({settings.hostname}, "
        f"{settings.accelerator_mode} mode).\n"
        f"  settings: {env_path} (mode 0600, no secrets)\n"
        f"  identity and credential: {state_path(state_dir)}\n"
        f"Start the agent: {start_step(env_path, request)}"
    )
    return EXIT_OK


@click.command("join")
@click.argument("url")
@click.option(
    "--token-file",
    default="-",
    show_default=True,
    metavar="PATH|-",
    help="Read the enrollment token from this file, or from stdin with '-' (a prompt without "
    "echo on a terminal). Never pass the token as an argument.",
)
@click.option(
    "--accelerator",
    "accelerator_mode",
    type=click.Choice(ACCELERATOR_MODES),
    default="nvidia",
    show_default=True,
    help="nvidia: require a working GPU (the preflight runs first); cpu: a CPU-only node; "
    "auto: nvidia when NVIDIA devices are seen.",
)
@click.option(
    "--hostname",
    help="The host name this node reports. Default: the machine's own (left out of the env file).",
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=AGENT_ENV_FILE,
    show_default=True,
    help="Where to write the agent's settings (mode 0600): where the unit's EnvironmentFile= "
    "reads them.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=AGENT_STATE_DIR,
    show_default=True,
    help="The agent's state volume: identity and credential (the unit's StateDirectory=).",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write under this directory instead of / (an image being built, a trial run).",
)
@click.option(
    "--ca-cert",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="PEM bundle of a private CA that signed the control plane's certificate.",
)
@click.option(
    "--host-address",
    help="Dial this address instead of resolving the URL's host (the URL's name is still "
    "verified).",
)
@click.option(
    "--worker-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The unix socket of the runtime worker beside the agent (its "
    "MODELFORGE_WORKER_SOCKET), when not the default /run/modelforge/worker.sock.",
)
@click.pass_obj
def join_command(
    obj: dict,
    url: str,
    token_file: str,
    accelerator_mode: str,
    hostname: str | None,
    env_file: Path,
    state_dir: Path,
    root: Path | None,
    ca_cert: Path | None,
    host_address: str | None,
    worker_socket: Path | None,
) -> None:
    """Join this host to the control plane at URL, in one step.

    Checks the settings and that this host has not joined yet, reads the token, runs the
    NVIDIA preflight, checks that URL answers, persists the identity, enrolls, and writes the
    agent's env file (mode 0600, no secrets). A second join of a joined host is refused and
    changes nothing. Exit statuses as for the agent.
    """
    configure_logging("INFO")
    request = JoinRequest(
        url=url,
        token_file=token_file,
        accelerator_mode=accelerator_mode,
        env_file=env_file,
        state_dir=state_dir,
        hostname=hostname,
        root=root,
        ca_cert=ca_cert,
        host_address=host_address,
        worker_socket=worker_socket,
    )
    stop = threading.Event()
    install_signal_handlers(stop)
    try:
        with runtime.joining():  # refusals advise running join again, not setting variables
            status = run_join(request, stop)
    except Stopping:
        log.error("interrupted: the env file was not written; run join again")
        status = EXIT_USAGE
    except (ConfigError, StateError) as error:
        log.error("%s", error)
        status = EXIT_USAGE
    except AgentExit as refused:
        log.error("%s", refused.message)
        status = refused.exit_code
    sys.exit(status)
