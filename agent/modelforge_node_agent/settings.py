"""Node Agent settings: the only agent module that reads ``os.environ``.

Every variable is declared once in ``SETTINGS`` with its default and meaning, against the
toolkit in ``modelforge_contract.settings`` (the unknown-name check, the parsers, the one rule
for blank values); ``--help`` prints them and ``docs/node-agent.md`` must list each (a test checks).
A bad value raises ``ConfigError`` naming the variable; the CLI exits 2.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from modelforge_contract import (
    ACCELERATOR_MODES,
    EXIT_USAGE,
    KIND_ENROLLMENT,
    WORK_SLOTS_MAX,
    split_secret,
)
from modelforge_contract.envfile import read_env_file
from modelforge_contract.settings import SettingSpec, SettingTable

PREFIX = "MODELFORGE_AGENT_"
# The host name the documentation uses in examples; an agent pointed at it was copied
# from the docs without being edited, and would only ever log DNS failures.
PLACEHOLDER_HOST = "modelforge.example.internal"
DEFAULT_STATE_VOLUME = "/var/lib/modelforge-node-agent"
DEFAULT_WORKER_SOCKET = "/run/modelforge/worker.sock"
TUNNEL_TRANSPORTS = ("auto", "websocket", "http")


SETTINGS: tuple[SettingSpec, ...] = (
    SettingSpec(
        "MODELFORGE_AGENT_CONTROL_PLANE_URL",
        None,
        "scheme://host[:port] of the control plane API, exactly the origin the enrollment "
        "token was minted for. Required to run; not needed for --preflight.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_ENROLLMENT_TOKEN",
        None,
        "Single-use enrollment token (mfe_…), needed only until the node is enrolled. Once "
        "a credential is stored the agent ignores it and says it can be removed.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_HOSTNAME",
        None,
        "Host name this node reports. Defaults to the machine's host name.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_ACCELERATOR_MODE",
        "nvidia",
        "nvidia: require NVML, at least one GPU and matching telemetry (exit 3 otherwise). "
        "cpu: a CPU-only node; NVML is never loaded. auto: behave as nvidia when /dev/nvidia* "
        "or NVIDIA_VISIBLE_DEVICES is seen, as cpu otherwise.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_TLS_VERIFY",
        "true",
        "Verify the control plane's TLS certificate. false is allowed but logs a warning on "
        "every start; fix the certificate (MODELFORGE_AGENT_CA_CERT_PATH) instead.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_STATE_VOLUME",
        DEFAULT_STATE_VOLUME,
        "Durable directory holding identity.json (identity, node id, credential; mode 0600). "
        "Losing it makes the host enroll as a new node.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_IDENTITY_MODE",
        "persisted",
        "persisted: keep the node identity in the state volume (the only mode).",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_CA_CERT_PATH",
        None,
        "PEM bundle of a private certificate authority to trust for the control plane. The "
        "certificate's host name is still verified.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS",
        None,
        "Connect to this IP address or host name instead of resolving the URL's host, while "
        "still sending and verifying the URL's host name (split DNS, /etc/hosts-free setups).",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_TELEMETRY_INTERVAL_SECONDS",
        "15",
        "How often NVML telemetry is sampled and published (nvidia mode).",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_INVENTORY_INTERVAL_SECONDS",
        "300",
        "How often the inventory is re-read; it is published at start and when it changes.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_DEVICE_DIR",
        "/dev",
        "Where auto mode looks for nvidia* device nodes.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_WORKER_SOCKET",
        DEFAULT_WORKER_SOCKET,
        "Unix socket of the runtime worker beside the agent (its MODELFORGE_WORKER_SOCKET). "
        "The agent claims work only while the worker there answers compatibly.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_WORK_SLOTS",
        "1",
        "How many work items this node runs at once; it tells the control plane, which "
        "leases it no more than that and the administrator's maximum for the node.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_WORK_POLL_SECONDS",
        "5",
        "How long a free slot waits before asking again after a claim found nothing.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_WORKER_CHECK_SECONDS",
        "10",
        "How often the agent asks its worker for /v1/info (and reports it in the heartbeat).",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_ARTIFACT_ROOT",
        None,
        "Directory holding the models replicated to this node (blobs/, partial/, models/). "
        "Defaults to <state volume>/artifacts; created 0700 when missing.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_QUARANTINE_ROOT",
        None,
        "Where a downloaded blob that does not hash is moved, for inspection. Defaults to "
        "<state volume>/quarantine; created 0700 when missing.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_MODEL_STALL_SECONDS",
        "30",
        "A model download that receives no byte for this long is stalled, and resumed after "
        "a backoff. Lower it only for tests.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_SERVE_READY_SECONDS",
        "600",
        "How long a launched runtime has to answer its readiness check (llama.cpp /health, "
        "vLLM /v1/models) before it is stopped and started again after a backoff (RUNTIME_NOT_READY).",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_RPC_STALL_SECONDS",
        "60",
        "A model split across nodes: a link to a helper that sends nothing back this long "
        "after the main server asked it something is ended (LINK_STALLED), so llama-server "
        "exits and the serve loop starts the group again instead of hanging.",
    ),
    SettingSpec(
        "MODELFORGE_AGENT_TUNNEL_TRANSPORT",
        "auto",
        "How the relay tunnel reaches the control plane. auto: WebSocket, and the HTTP "
        "fallback (a streamed GET plus POSTed uploads) once a proxy refuses the upgrade. "
        "websocket or http: that one only.",
    ),
    SettingSpec("MODELFORGE_AGENT_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR."),
)


class ConfigError(Exception):
    """A setting is wrong; the CLI prints the one-line message and exits 2."""

    exit_code = EXIT_USAGE


TABLE = SettingTable(
    SETTINGS,
    prefixes=(PREFIX,),
    error=ConfigError,
    unknown_hint="see --help for the known names",
    retired={
        "MODELFORGE_AGENT_SERVE_MAX_RESTARTS": "a runtime that exits is started again with "
        "backoff (5 s, 10 s, 20 s … at most 5 min) for as long as its deployment asks, so it "
        "never needs a person to come back",
    },
)


@dataclass(frozen=True)
class AgentSettings:
    control_plane_url: str | None
    enrollment_token: str | None
    hostname: str
    accelerator_mode: str
    tls_verify: bool
    state_volume: Path
    identity_mode: str
    ca_cert_path: Path | None
    control_plane_host_address: str | None
    telemetry_interval_seconds: int
    inventory_interval_seconds: int
    device_dir: Path
    log_level: str
    worker_socket: Path = Path(DEFAULT_WORKER_SOCKET)
    work_slots: int = 1
    work_poll_seconds: float = 5.0
    worker_check_seconds: float = 10.0
    # Models (issue 24): None means under the state volume.
    artifact_root: Path | None = None
    quarantine_root: Path | None = None
    model_stall_seconds: float = 30.0
    serve_ready_seconds: float = 600.0
    rpc_stall_seconds: float = 60.0
    tunnel_transport: str = "auto"
    # Observed, not ours: the NVIDIA container toolkit sets it when GPUs are requested.
    nvidia_visible_devices: str | None = None

    def __repr__(self) -> str:
        # The token is a secret; keep it out of any repr that reaches a log or traceback.
        token = "set" if self.enrollment_token else "unset"
        return f"AgentSettings(control_plane_url={self.control_plane_url!r}, token={token})"

    @property
    def artifacts_dir(self) -> Path:
        return self.artifact_root or self.state_volume / "artifacts"

    @property
    def quarantine_dir(self) -> Path:
        return self.quarantine_root or self.state_volume / "quarantine"

    @property
    def tls_verify_value(self) -> bool | str:
        """What requests takes as ``verify``: a CA bundle path, or on/off."""
        if not self.tls_verify:
            return False
        return str(self.ca_cert_path) if self.ca_cert_path else True

    def require_control_plane(self) -> str:
        if not self.control_plane_url:
            raise ConfigError(
                "MODELFORGE_AGENT_CONTROL_PLANE_URL is not set; set it to the control plane's "
                "API origin (shown when the enrollment token was minted)"
            )
        return self.control_plane_url


_value, _int, _float, _bool = TABLE.value, TABLE.integer, TABLE.number, TABLE.boolean


def parse_control_plane_url(raw: str) -> str:
    """The URL without a trailing slash, or ConfigError naming what is wrong."""
    name = "MODELFORGE_AGENT_CONTROL_PLANE_URL"
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name}={raw!r} is not http(s)://host[:port]")
    try:
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except ValueError:
        raise ConfigError(f"{name}={raw!r} has an invalid port") from None
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"{name}={raw!r} must not carry a user, query or fragment")
    if parts.path not in ("", "/"):
        raise ConfigError(f"{name}={raw!r} must be the origin only, without a path")
    host = parts.hostname.lower().rstrip(".")
    if host == PLACEHOLDER_HOST or host.endswith("." + PLACEHOLDER_HOST):
        raise ConfigError(
            f"{name} points at {PLACEHOLDER_HOST}, the placeholder from the documentation; "
            "set it to the real address of your control plane (the API origin shown when "
            "the enrollment token was minted)"
        )
    return raw.rstrip("/")


def _host_address(raw: str | None) -> str | None:
    if raw is None:
        return None
    name = "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS"
    address = raw.strip("[]")
    if not address or any(ch in address for ch in "/@?# ") or "://" in raw:
        raise ConfigError(f"{name}={raw!r} must be a bare IP address or host name")
    return address


def _token(raw: str | None) -> str | None:
    if raw is None:
        return None
    # Never echo the value: a mistyped token is still mostly a secret.
    if split_secret(raw, KIND_ENROLLMENT) is None:
        raise ConfigError(
            "MODELFORGE_AGENT_ENROLLMENT_TOKEN is not an enrollment token (expected "
            f"{KIND_ENROLLMENT}_…); paste the token exactly as the console showed it"
        )
    return raw.strip()


def _hostname(raw: str | None) -> str:
    hostname = raw or socket.gethostname()
    if not 1 <= len(hostname) <= 253 or any(ord(ch) < 33 for ch in hostname):
        raise ConfigError(
            f"MODELFORGE_AGENT_HOSTNAME={hostname!r} must be 1-253 characters without spaces"
        )
    return hostname


TOKEN_VARIABLE = "MODELFORGE_AGENT_ENROLLMENT_TOKEN"


def load_settings(
    env: Mapping[str, str] | None = None, env_file: Path | None = None
) -> AgentSettings:
    """Parse and validate every MODELFORGE_AGENT_* variable once; raise ConfigError.

    Values from ``env_file`` apply unless the environment sets the same name.

    Reading the process environment also removes the enrollment token from it: the
    settings keep the value for the one enrollment (and for re-enrolling at once when the
    credential is refused later), and nothing this process starts inherits it. (The
    kernel's copy, /proc/<pid>/environ, cannot be changed from inside; docs/node-agent.md
    says what remains.)
    """
    if env is None:
        env = dict(os.environ)
        os.environ.pop(TOKEN_VARIABLE, None)
    env = dict(env)
    if env_file is not None:
        env = {**read_env_file(env_file, ConfigError), **env}
    TABLE.check_names(env)

    url = _value(env, "MODELFORGE_AGENT_CONTROL_PLANE_URL")
    mode = (_value(env, "MODELFORGE_AGENT_ACCELERATOR_MODE") or "").lower()
    if mode not in ACCELERATOR_MODES:
        raise ConfigError(
            f"MODELFORGE_AGENT_ACCELERATOR_MODE={mode!r} is not one of "
            f"{', '.join(ACCELERATOR_MODES)}"
        )
    identity_mode = (_value(env, "MODELFORGE_AGENT_IDENTITY_MODE") or "").lower()
    if identity_mode != "persisted":
        raise ConfigError(
            f"MODELFORGE_AGENT_IDENTITY_MODE={identity_mode!r} is not supported; use persisted"
        )
    tls_verify = _bool(env, "MODELFORGE_AGENT_TLS_VERIFY")
    ca_raw = _value(env, "MODELFORGE_AGENT_CA_CERT_PATH")
    ca_cert_path = Path(ca_raw).expanduser() if ca_raw else None
    if ca_cert_path is not None:
        if not ca_cert_path.is_file() or not os.access(ca_cert_path, os.R_OK):
            raise ConfigError(
                f"MODELFORGE_AGENT_CA_CERT_PATH={ca_raw!r} is not a readable file; mount the "
                "private CA's PEM bundle there"
            )
        if not tls_verify:
            raise ConfigError(
                "MODELFORGE_AGENT_CA_CERT_PATH is set but MODELFORGE_AGENT_TLS_VERIFY=false "
                "would ignore it; set MODELFORGE_AGENT_TLS_VERIFY=true"
            )
    log_level = TABLE.log_level(env, "MODELFORGE_AGENT_LOG_LEVEL")
    transport = (_value(env, "MODELFORGE_AGENT_TUNNEL_TRANSPORT") or "").lower()
    if transport not in TUNNEL_TRANSPORTS:
        raise ConfigError(
            f"MODELFORGE_AGENT_TUNNEL_TRANSPORT={transport!r} is not one of "
            f"{', '.join(TUNNEL_TRANSPORTS)}"
        )
    state_raw = _value(env, "MODELFORGE_AGENT_STATE_VOLUME") or DEFAULT_STATE_VOLUME
    return AgentSettings(
        control_plane_url=parse_control_plane_url(url) if url else None,
        enrollment_token=_token(_value(env, "MODELFORGE_AGENT_ENROLLMENT_TOKEN")),
        hostname=_hostname(_value(env, "MODELFORGE_AGENT_HOSTNAME")),
        accelerator_mode=mode,
        tls_verify=tls_verify,
        state_volume=Path(state_raw).expanduser().absolute(),
        identity_mode=identity_mode,
        ca_cert_path=ca_cert_path,
        control_plane_host_address=_host_address(
            _value(env, "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS")
        ),
        telemetry_interval_seconds=_int(
            env, "MODELFORGE_AGENT_TELEMETRY_INTERVAL_SECONDS", 1, 3600
        ),
        inventory_interval_seconds=_int(
            env, "MODELFORGE_AGENT_INVENTORY_INTERVAL_SECONDS", 1, 86400
        ),
        device_dir=Path(_value(env, "MODELFORGE_AGENT_DEVICE_DIR") or "/dev"),
        log_level=log_level,
        worker_socket=Path(_value(env, "MODELFORGE_AGENT_WORKER_SOCKET") or DEFAULT_WORKER_SOCKET),
        work_slots=_int(env, "MODELFORGE_AGENT_WORK_SLOTS", 1, WORK_SLOTS_MAX),
        work_poll_seconds=_float(env, "MODELFORGE_AGENT_WORK_POLL_SECONDS", 0.01, 3600),
        worker_check_seconds=_float(env, "MODELFORGE_AGENT_WORKER_CHECK_SECONDS", 0.1, 3600),
        nvidia_visible_devices=env.get("NVIDIA_VISIBLE_DEVICES"),
        artifact_root=_path(env, "MODELFORGE_AGENT_ARTIFACT_ROOT"),
        quarantine_root=_path(env, "MODELFORGE_AGENT_QUARANTINE_ROOT"),
        model_stall_seconds=_float(env, "MODELFORGE_AGENT_MODEL_STALL_SECONDS", 0.1, 3600),
        serve_ready_seconds=_float(env, "MODELFORGE_AGENT_SERVE_READY_SECONDS", 1, 86400),
        rpc_stall_seconds=_float(env, "MODELFORGE_AGENT_RPC_STALL_SECONDS", 0.1, 86400),
        tunnel_transport=transport,
    )


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = _value(env, name)
    return Path(raw).expanduser().absolute() if raw else None
