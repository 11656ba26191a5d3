"""Control-plane settings: the only module that reads ``os.environ``.

Every setting is declared once in ``SETTINGS`` with its default and meaning, against the
toolkit in ``modelforge_contract.settings`` (the unknown-name check, the parsers, the one
rule for blank values); ``docs/configuration.md`` must list each of them (a test checks).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from modelforge_contract import EXIT_USAGE, INVENTORY_REFRESH_SECONDS, WORK_SLOTS_MAX
from modelforge_contract import containers as fence
from modelforge_contract.envfile import read_env_file
from modelforge_contract.settings import SettingSpec, SettingTable

from .errors import OperatorError

# Prefixes that belong to other ModelForge programs (the agent, the worker,
# compose files); the control plane leaves them alone.
FOREIGN_PREFIXES = (
    "MODELFORGE_AGENT_",
    "MODELFORGE_NODE_AGENT_",
    "MODELFORGE_RUNTIME_WORKER_",
    "MODELFORGE_RELEASE_",
    "MODELFORGE_WORKER_",
)
# Variables of docker-compose.yml (not read by the control plane itself).
FOREIGN_NAMES = frozenset({"MODELFORGE_CONTROL_PLANE_IMAGE", "MODELFORGE_CONTROL_PLANE_PUBLISH"})
# Client requests the relay carries at once (MODELFORGE_RELAY_STREAMS).
RELAY_STREAMS_DEFAULT = 4096


SETTINGS: tuple[SettingSpec, ...] = (
    SettingSpec(
        "MODELFORGE_STATE_DIR",
        None,
        "Directory for the SQLite store and other state. Defaults to $STATE_DIRECTORY "
        "(systemd StateDirectory=) or /var/lib/modelforge; scripts/run uses ./var.",
    ),
    SettingSpec(
        "MODELFORGE_DATABASE_URL",
        None,
        "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DB. Defaults to "
        "sqlite:///$MODELFORGE_STATE_DIR/modelforge.sqlite3.",
    ),
    SettingSpec("MODELFORGE_LISTEN", "127.0.0.1:8000", "HOST:PORT the control plane serves on."),
    SettingSpec(
        "MODELFORGE_TUNNEL_LISTEN",
        None,
        "HOST:PORT of a separate port for the agents' tunnels (GET /api/v1/agent/tunnel, a "
        "WebSocket upgrade); everything else there is answered 404. Unset: the tunnels share "
        "the control plane's one port (MODELFORGE_LISTEN).",
    ),
    SettingSpec(
        "MODELFORGE_PUBLIC_API_ORIGIN",
        None,
        "scheme://host[:port] agents use to reach the API. Enrollment tokens are locked to "
        "it; when unset, a token is locked to the origin the minting request used, or, from "
        "the CLI, the address the running server bound (never a wildcard address).",
    ),
    SettingSpec(
        "MODELFORGE_TRUSTED_PROXY",
        None,
        "IP address of a TLS-terminating reverse proxy in front of the control plane (e.g. "
        "127.0.0.1), or several separated by commas. Only from them are X-Forwarded-Proto and "
        "X-Forwarded-Host believed, so requests keep the origin the agents addressed; from "
        "anyone else they are dropped. Host names, networks and * are refused.",
    ),
    SettingSpec(
        "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS",
        "10",
        "Interval the control plane tells agents to heartbeat at.",
    ),
    SettingSpec(
        "MODELFORGE_NODE_STALE_AFTER_SECONDS",
        "30",
        "A node without a heartbeat for this long is stale. Must exceed the heartbeat interval.",
    ),
    SettingSpec(
        "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS",
        "90",
        "A node without a heartbeat for this long is offline. Must exceed the stale threshold.",
    ),
    SettingSpec(
        "MODELFORGE_INVENTORY_MAX_AGE_SECONDS",
        "3600",
        "Readiness and placement treat an inventory older than this as stale; agents "
        "republish theirs well within it.",
    ),
    SettingSpec(
        "MODELFORGE_TELEMETRY_MAX_AGE_SECONDS",
        "120",
        "Readiness of an NVIDIA node needs telemetry younger than this.",
    ),
    SettingSpec(
        "MODELFORGE_MAX_BODY_BYTES",
        "1048576",
        "Largest request body accepted; larger bodies are refused with 413 BODY_TOO_LARGE.",
    ),
    SettingSpec(
        "MODELFORGE_TELEMETRY_RETENTION_SECONDS",
        "86400",
        "How long per-GPU telemetry samples are kept for the console's charts; older ones "
        "are pruned in bounded batches.",
    ),
    SettingSpec(
        "MODELFORGE_TELEMETRY_MAX_SAMPLES_PER_NODE",
        "100000",
        "The most telemetry samples (one per GPU per publication) kept for one node, whatever "
        "their age; past it the node's oldest are deleted first.",
    ),
    SettingSpec(
        "MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS",
        "5",
        "A node's telemetry is kept at most once per this many seconds (with a burst of 3); "
        "faster publications are answered but dropped, counted, and raise a telemetry_flood "
        "alert. Must be less than MODELFORGE_TELEMETRY_MAX_AGE_SECONDS.",
    ),
    SettingSpec(
        "MODELFORGE_CONSOLE_SESSION_IDLE_SECONDS",
        "1800",
        "A console session unused for this long is signed out.",
    ),
    SettingSpec(
        "MODELFORGE_CONSOLE_SESSION_MAX_SECONDS",
        "43200",
        "A console session ends this long after sign-in, however busy. Must be at least the "
        "idle limit.",
    ),
    SettingSpec(
        "MODELFORGE_RELEASE_MANIFEST",
        None,
        "Path of the release manifest (modelforge-VERSION-manifest.json). When set, the Enroll "
        "node wizard accepts only a node-agent image entry equal to that release's entry.",
    ),
    SettingSpec(
        "MODELFORGE_WORK_LEASE_SECONDS",
        "60",
        "How long a claimed work item stays leased to its node without a renewal; agents "
        "renew at a third of it, and at least every 5 s. An expired lease returns the item to "
        "the queue.",
    ),
    SettingSpec(
        "MODELFORGE_SERVE_LEASE_SECONDS",
        "30",
        "How long a deployment's server stays leased to its node's agent without a renewal; "
        "agents renew at a third of it, and at least every 5 s. An expired serve lease marks "
        "the server failed (SERVER_LEASE_LOST).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_INPUT_MAX_BYTES",
        "65536",
        "Largest work item input accepted, measured as compact JSON.",
    ),
    # The fence of container work items (docs/work.md, "Limits"): an item may name each limit
    # up to these maxima; one that names none gets modelforge_contract.containers' default
    # (or the maximum, when that is lower).
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_PIDS",
        "4096",
        "Most processes a container work item may ask for (pids_limit; 512 when it names none).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_CPUS",
        "64",
        "Most CPUs a container work item may ask for (cpus, a CPU quota; 2 when it names none).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_MEMORY_BYTES",
        "68719476736",
        "Most memory a container work item may ask for (memory_bytes; 512 MiB when it names "
        "none; at least 6 MiB, docker's floor).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_SWAP_BYTES",
        "0",
        "Most swap beyond its memory a container work item may ask for (swap_bytes); 0: none.",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_TMP_BYTES",
        "1073741824",
        "Largest /tmp (a tmpfs, counted as memory) a container work item may ask for "
        "(tmp_bytes; 64 MiB when it names none). The rest of its root is read-only.",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_MAX_LOG_BYTES",
        "67108864",
        "Most container log the node's dockerd keeps for one work item (log_bytes; 8 MiB when "
        "it names none).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_ALLOW_ROOT",
        "false",
        "Whether a container work item may ask to run as root (run_as_root); otherwise every "
        "container runs as 65534:65534.",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CONTAINER_CAPABILITIES",
        "CHOWN,FOWNER,KILL,NET_BIND_SERVICE,SETGID,SETUID",
        "Linux capabilities a container work item may ask for (capabilities), separated by "
        "commas, or none; every other one is dropped.",
    ),
    SettingSpec(
        "MODELFORGE_WORK_SLOTS_PER_NODE",
        "2",
        "The most work items one node holds leased at once, unless `modelforge nodes "
        "set-work-slots` sets another maximum for it; a node also never holds more than the "
        "work slots its agent reports. A claim beyond it is answered 204 (slots_full).",
    ),
    SettingSpec(
        "MODELFORGE_WORK_CLAIMS_PER_SECOND",
        "50",
        "Work claims one node may make a second (with bursts of as many); faster claims are "
        "answered 429 with Retry-After before anything is read or written for them.",
    ),
    SettingSpec("MODELFORGE_THREADS", "8", "Worker threads of the waitress server."),
    SettingSpec(
        "MODELFORGE_RELAY_STREAMS",
        str(RELAY_STREAMS_DEFAULT),
        "Client requests the relay carries at once (open on a node's tunnel, or waiting for a "
        "slot there); they wait on the relay's event loop and hold no thread. Beyond it a "
        "client gets 503 STREAM_LIMIT with Retry-After. 0 means the default.",
    ),
    SettingSpec(
        "MODELFORGE_RELAY_STREAMS_PER_KEY",
        None,
        "Of those, what one API key may have at once (503 STREAM_LIMIT past it). Unset: a "
        "quarter of MODELFORGE_RELAY_STREAMS.",
    ),
    SettingSpec(
        "MODELFORGE_RELAY_STREAMS_PER_DEPLOYMENT",
        None,
        "Of those, what one deployment may have at once (503 STREAM_LIMIT past it). Unset: "
        "half of MODELFORGE_RELAY_STREAMS.",
    ),
    SettingSpec(
        "MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS",
        "300",
        "How long a relayed request waits for the runtime to begin its answer (a slot on "
        "the node's tunnel included); then 504 HEAD_TIMEOUT, and the node's stream is reset.",
    ),
    SettingSpec(
        "MODELFORGE_RELAY_IDLE_TIMEOUT_SECONDS",
        "120",
        "A relayed answer that is not an event stream and sends no byte for this long is "
        "cut, and its stream reset on the node (event streams get keep-alive comments "
        "instead).",
    ),
    SettingSpec(
        "MODELFORGE_RELAY_COLD_START_SECONDS",
        "120",
        "How long a client request for an unloaded (idle) deployment waits for its first "
        "server to start and be ready before it is relayed; past it the client gets 503 "
        "COLD_START_TIMEOUT with Retry-After (1-3600).",
    ),
    SettingSpec(
        "MODELFORGE_CONNECTION_LIMIT",
        "10000",
        "Client connections held open at once (every agent keeps one). Beyond it new "
        "connections wait in the listen backlog. The process needs this many file descriptors "
        "plus a margin; serve raises its own soft limit or refuses to start.",
    ),
    SettingSpec(
        "MODELFORGE_CONNECTIONS_PER_ADDRESS",
        None,
        "Connections one client address may hold at once (a trusted proxy's are not counted); "
        "past it a new connection is answered 503 with Retry-After. Unset: a quarter of "
        "MODELFORGE_CONNECTION_LIMIT.",
    ),
    SettingSpec(
        "MODELFORGE_MAX_BUFFERED_BYTES",
        "67108864",
        "Request bytes held in memory across all unfinished requests at once (64 MiB). Past "
        "it, a request still sending a body is answered 503 with Retry-After; at least "
        "MODELFORGE_MAX_BODY_BYTES.",
    ),
    SettingSpec(
        "MODELFORGE_IDLE_TIMEOUT_SECONDS",
        "60",
        "A keep-alive connection with no request for this long is closed. Must exceed the "
        "heartbeat interval, so agents keep their connection between heartbeats.",
    ),
    SettingSpec(
        "MODELFORGE_REQUEST_TIMEOUT_SECONDS",
        "30",
        "Time a client gets to send a whole request, headers and body, counted from its first "
        "byte (or from the connection's opening, for its first request); a slower client is "
        "disconnected.",
    ),
    SettingSpec("MODELFORGE_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR."),
)


DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


class ConfigError(OperatorError):
    """A setting is wrong; the CLI prints the one-line message and exits 2."""

    exit_code = EXIT_USAGE


TABLE = SettingTable(
    SETTINGS,
    prefixes=("MODELFORGE_",),
    foreign_prefixes=FOREIGN_PREFIXES,
    foreign_names=FOREIGN_NAMES,
    error=ConfigError,
    unknown_hint="see docs/configuration.md",
)
KNOWN_NAMES = TABLE.names


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    database_url: str
    listen_host: str
    listen_port: int
    public_api_origin: str | None
    trusted_proxies: tuple[str, ...]
    heartbeat_interval_seconds: int
    stale_after_seconds: int
    offline_after_seconds: int
    inventory_max_age_seconds: int
    telemetry_max_age_seconds: int
    max_body_bytes: int
    work_lease_seconds: int
    serve_lease_seconds: int
    work_input_max_bytes: int
    threads: int
    relay_streams: int
    log_level: str
    connection_limit: int
    connections_per_address: int
    max_buffered_bytes: int
    idle_timeout_seconds: int
    request_timeout_seconds: int
    telemetry_retention_seconds: int = 86400
    telemetry_max_samples_per_node: int = 100_000
    telemetry_min_interval_seconds: int = 5
    session_idle_seconds: int = 1800
    session_max_seconds: int = 43200
    release_manifest: Path | None = None
    relay_cold_start_seconds: int = 120
    relay_streams_per_key: int = 1024
    relay_streams_per_deployment: int = 2048
    relay_head_timeout_seconds: int = 300
    relay_idle_timeout_seconds: int = 120
    work_container_max_pids: int = 4096
    work_container_max_cpus: float = 64.0
    work_container_max_memory_bytes: int = 64 * 2**30
    work_container_max_swap_bytes: int = 0
    work_container_max_tmp_bytes: int = 2**30
    work_container_max_log_bytes: int = 64 * 2**20
    work_container_allow_root: bool = False
    work_container_capabilities: tuple[str, ...] = (
        "CHOWN",
        "FOWNER",
        "KILL",
        "NET_BIND_SERVICE",
        "SETGID",
        "SETUID",
    )
    work_slots_per_node: int = 2
    work_claims_per_second: int = 50
    # MODELFORGE_TUNNEL_LISTEN as (host, port); None: the tunnels share the one port.
    tunnel_listen: tuple[str, int] | None = None
    # Where `models pull` reaches the hub: HF_ENDPOINT, the name huggingface_hub reads, so a
    # mirror set for it is set for this too.
    hub_endpoint: str = DEFAULT_HUB_ENDPOINT

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"


_HOSTNAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*")
_IPV6 = re.compile(r"[0-9a-f:.]+")


def is_unspecified(host: str) -> bool:
    """0.0.0.0, ::, an empty host: "every address", which no agent can dial."""
    host = host.strip().strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def normalize_origin(value: str) -> str:
    """Lower-case scheme://host[:port], dropping the scheme's default port."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected scheme://host[:port] with scheme http or https")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError("an origin has no path, query, fragment or user")
    host = parts.hostname.lower()
    if ":" in host:
        if not _IPV6.fullmatch(host):
            raise ValueError(f"{host!r} is not an IPv6 address")
        host = f"[{host}]"
    elif not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{host!r} is not a host name or address")
    port = parts.port
    if port is None or (parts.scheme, port) in (("http", 80), ("https", 443)):
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


def parse_listen(value: str, name: str = "MODELFORGE_LISTEN") -> tuple[str, int]:
    host, sep, port_text = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{name}={value!r} is not HOST:PORT (for example 127.0.0.1:8000)")
    return host, int(port_text)


def parse_hub_endpoint(raw: str | None) -> str:
    """HF_ENDPOINT: the hub (or a mirror of it) as scheme://host[:port][/path], no slash at
    the end; the Hugging Face Hub when unset."""
    text = (raw or "").strip().rstrip("/")
    if not text:
        return DEFAULT_HUB_ENDPOINT
    parts = urlsplit(text)
    bad = parts.query or parts.fragment or parts.username
    if parts.scheme not in ("http", "https") or not parts.hostname or bad:
        raise ConfigError(
            f"HF_ENDPOINT={raw!r} is not a hub address: give http(s)://HOST[:PORT] of the hub "
            "or of a mirror of it, without a user, a query or a fragment"
        )
    return text


def parse_trusted_proxies(raw: str | None) -> tuple[str, ...]:
    """MODELFORGE_TRUSTED_PROXY: IP addresses separated by commas, each in canonical form.

    waitress compares a request's peer address with these exactly, so only literal
    addresses make sense: a name, a network or ``*`` would trust anyone (or no one).
    """
    name = "MODELFORGE_TRUSTED_PROXY"
    if raw is None or not raw.strip():
        return ()
    addresses = []
    for part in raw.split(","):
        text = part.strip()
        try:
            addresses.append(str(ipaddress.ip_address(text)))
        except ValueError:
            raise ConfigError(
                f"{name}={raw!r}: {text!r} is not an IP address; list the proxy's own "
                "address(es), separated by commas (e.g. 127.0.0.1); names, networks and * "
                "are refused"
            ) from None
    return tuple(dict.fromkeys(addresses))


def parse_capabilities(raw: str | None) -> tuple[str, ...]:
    """MODELFORGE_WORK_CONTAINER_CAPABILITIES: Linux capability names separated by commas
    (CAP_ prefix optional, any case), or ``none``."""
    name = "MODELFORGE_WORK_CONTAINER_CAPABILITIES"
    text = (raw or "").strip()
    if text.lower() == "none":
        return ()
    names = []
    for part in text.split(","):
        cap = part.strip().upper().removeprefix("CAP_")
        if cap not in fence.LINUX_CAPABILITIES:
            raise ConfigError(
                f"{name}={raw!r}: {part.strip()!r} is not a Linux capability docker knows; list "
                "names such as NET_BIND_SERVICE,CHOWN separated by commas, or none"
            )
        names.append(cap)
    return tuple(sorted(set(names)))


def load_settings(env: Mapping[str, str] | None = None, env_file: Path | None = None) -> Settings:
    """Parse and validate every MODELFORGE_* variable once; raise ConfigError.

    Values from ``env_file`` apply unless the environment sets the same name.
    """
    env = dict(os.environ if env is None else env)
    if env_file is not None:
        env = {**read_env_file(env_file, ConfigError), **env}
    TABLE.check_names(env)
    value, integer = TABLE.value, TABLE.integer

    state_raw = (
        value(env, "MODELFORGE_STATE_DIR")
        or (env.get("STATE_DIRECTORY") or "").strip()
        or "/var/lib/modelforge"
    )
    state_dir = Path(state_raw.split(":")[0]).expanduser().absolute()

    database_url = (
        value(env, "MODELFORGE_DATABASE_URL") or f"sqlite:///{state_dir}/modelforge.sqlite3"
    )
    scheme = urlsplit(database_url).scheme
    if scheme not in ("sqlite", "postgresql", "postgres"):
        raise ConfigError(
            "MODELFORGE_DATABASE_URL must start with sqlite:/// or postgresql:// "
            f"(got scheme {scheme or 'none'!r})"
        )

    host, port = parse_listen(value(env, "MODELFORGE_LISTEN") or "")
    tunnel_raw = value(env, "MODELFORGE_TUNNEL_LISTEN")
    tunnel_listen = parse_listen(tunnel_raw, "MODELFORGE_TUNNEL_LISTEN") if tunnel_raw else None
    if tunnel_listen is not None and tunnel_listen == (host, port) and port != 0:
        raise ConfigError(
            f"MODELFORGE_TUNNEL_LISTEN={tunnel_raw!r} is MODELFORGE_LISTEN itself; leave it "
            "unset to share the one port, or give the tunnels a port of their own"
        )

    origin = value(env, "MODELFORGE_PUBLIC_API_ORIGIN")
    if origin is not None:
        try:
            origin = normalize_origin(origin)
        except ValueError as exc:
            raise ConfigError(f"MODELFORGE_PUBLIC_API_ORIGIN={origin!r}: {exc}") from None

    interval = integer(env, "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS", 1, 3600)
    stale = integer(env, "MODELFORGE_NODE_STALE_AFTER_SECONDS", 1, 86400)
    offline = integer(env, "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", 1, 7 * 86400)
    # Invariant 7: offline must exceed stale, and stale must exceed the interval.
    if offline <= stale:
        raise ConfigError(
            f"MODELFORGE_NODE_OFFLINE_AFTER_SECONDS ({offline}) must be greater than "
            f"MODELFORGE_NODE_STALE_AFTER_SECONDS ({stale})"
        )
    if stale <= interval:
        raise ConfigError(
            f"MODELFORGE_NODE_STALE_AFTER_SECONDS ({stale}) must be greater than "
            f"MODELFORGE_HEARTBEAT_INTERVAL_SECONDS ({interval})"
        )

    connection_limit = integer(env, "MODELFORGE_CONNECTION_LIMIT", 10, 1_000_000)
    per_address = (
        integer(env, "MODELFORGE_CONNECTIONS_PER_ADDRESS", 1, 1_000_000)
        if value(env, "MODELFORGE_CONNECTIONS_PER_ADDRESS")
        else max(1, connection_limit // 4)
    )
    relay_streams = integer(env, "MODELFORGE_RELAY_STREAMS", 0, 65536) or RELAY_STREAMS_DEFAULT

    def share(name: str, fraction: int) -> int:
        """A relay share: its setting (at most the whole), or ``1/fraction`` of it."""
        if value(env, name):
            return integer(env, name, 1, relay_streams)
        return max(1, relay_streams // fraction)

    max_body = integer(env, "MODELFORGE_MAX_BODY_BYTES", 1024, 64 * 1024 * 1024)
    max_buffered = integer(env, "MODELFORGE_MAX_BUFFERED_BYTES", 1024, 1 << 40)
    if max_buffered < max_body:
        raise ConfigError(
            f"MODELFORGE_MAX_BUFFERED_BYTES ({max_buffered}) must be at least "
            f"MODELFORGE_MAX_BODY_BYTES ({max_body}): one whole body must fit"
        )

    idle_timeout = integer(env, "MODELFORGE_IDLE_TIMEOUT_SECONDS", 2, 86400)
    if idle_timeout <= interval:
        raise ConfigError(
            f"MODELFORGE_IDLE_TIMEOUT_SECONDS ({idle_timeout}) must be greater than "
            f"MODELFORGE_HEARTBEAT_INTERVAL_SECONDS ({interval}), or every heartbeat reconnects"
        )

    log_level = TABLE.log_level(env, "MODELFORGE_LOG_LEVEL")

    session_idle = integer(env, "MODELFORGE_CONSOLE_SESSION_IDLE_SECONDS", 60, 86400)
    session_max = integer(env, "MODELFORGE_CONSOLE_SESSION_MAX_SECONDS", 300, 30 * 86400)
    if session_max < session_idle:
        raise ConfigError(
            f"MODELFORGE_CONSOLE_SESSION_MAX_SECONDS ({session_max}) must be at least "
            f"MODELFORGE_CONSOLE_SESSION_IDLE_SECONDS ({session_idle})"
        )
    manifest = value(env, "MODELFORGE_RELEASE_MANIFEST")

    telemetry_max_age = integer(env, "MODELFORGE_TELEMETRY_MAX_AGE_SECONDS", 10, 86400)
    telemetry_min_interval = integer(env, "MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS", 1, 3600)
    if telemetry_min_interval >= telemetry_max_age:
        raise ConfigError(
            f"MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS ({telemetry_min_interval}) must be less "
            f"than MODELFORGE_TELEMETRY_MAX_AGE_SECONDS ({telemetry_max_age}), or a node "
            "publishing as often as it is kept could never be ready"
        )
    container_max = {
        "pids": integer(env, "MODELFORGE_WORK_CONTAINER_MAX_PIDS", fence.PIDS_MIN, 4_194_304),
        "memory": integer(
            env, "MODELFORGE_WORK_CONTAINER_MAX_MEMORY_BYTES", fence.MEMORY_MIN_BYTES, 2**50
        ),
        "swap": integer(env, "MODELFORGE_WORK_CONTAINER_MAX_SWAP_BYTES", 0, 2**50),
        "tmp": integer(env, "MODELFORGE_WORK_CONTAINER_MAX_TMP_BYTES", fence.TMP_MIN_BYTES, 2**50),
        "log": integer(env, "MODELFORGE_WORK_CONTAINER_MAX_LOG_BYTES", fence.LOG_MIN_BYTES, 2**40),
    }

    return Settings(
        state_dir=state_dir,
        database_url=database_url,
        listen_host=host,
        listen_port=port,
        tunnel_listen=tunnel_listen,
        public_api_origin=origin,
        trusted_proxies=parse_trusted_proxies(value(env, "MODELFORGE_TRUSTED_PROXY")),
        heartbeat_interval_seconds=interval,
        stale_after_seconds=stale,
        offline_after_seconds=offline,
        inventory_max_age_seconds=integer(
            env, "MODELFORGE_INVENTORY_MAX_AGE_SECONDS", INVENTORY_REFRESH_SECONDS + 1, 7 * 86400
        ),
        telemetry_max_age_seconds=telemetry_max_age,
        max_body_bytes=max_body,
        work_lease_seconds=integer(env, "MODELFORGE_WORK_LEASE_SECONDS", 5, 3600),
        serve_lease_seconds=integer(env, "MODELFORGE_SERVE_LEASE_SECONDS", 3, 3600),
        work_input_max_bytes=integer(env, "MODELFORGE_WORK_INPUT_MAX_BYTES", 256, 1024 * 1024),
        work_slots_per_node=integer(env, "MODELFORGE_WORK_SLOTS_PER_NODE", 1, WORK_SLOTS_MAX),
        work_claims_per_second=integer(env, "MODELFORGE_WORK_CLAIMS_PER_SECOND", 1, 10_000),
        threads=integer(env, "MODELFORGE_THREADS", 1, 256),
        relay_streams=relay_streams,
        relay_streams_per_key=share("MODELFORGE_RELAY_STREAMS_PER_KEY", 4),
        relay_streams_per_deployment=share("MODELFORGE_RELAY_STREAMS_PER_DEPLOYMENT", 2),
        relay_head_timeout_seconds=integer(env, "MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS", 1, 86400),
        relay_idle_timeout_seconds=integer(env, "MODELFORGE_RELAY_IDLE_TIMEOUT_SECONDS", 1, 86400),
        relay_cold_start_seconds=integer(env, "MODELFORGE_RELAY_COLD_START_SECONDS", 1, 3600),
        log_level=log_level,
        connection_limit=connection_limit,
        connections_per_address=per_address,
        max_buffered_bytes=max_buffered,
        idle_timeout_seconds=idle_timeout,
        request_timeout_seconds=integer(env, "MODELFORGE_REQUEST_TIMEOUT_SECONDS", 1, 3600),
        telemetry_retention_seconds=integer(
            env, "MODELFORGE_TELEMETRY_RETENTION_SECONDS", 300, 90 * 86400
        ),
        telemetry_max_samples_per_node=integer(
            env, "MODELFORGE_TELEMETRY_MAX_SAMPLES_PER_NODE", 1000, 10**9
        ),
        telemetry_min_interval_seconds=telemetry_min_interval,
        session_idle_seconds=session_idle,
        session_max_seconds=session_max,
        release_manifest=Path(manifest).expanduser().absolute() if manifest else None,
        work_container_max_pids=container_max["pids"],
        work_container_max_cpus=TABLE.number(
            env, "MODELFORGE_WORK_CONTAINER_MAX_CPUS", fence.CPUS_MIN, 4096
        ),
        work_container_max_memory_bytes=container_max["memory"],
        work_container_max_swap_bytes=container_max["swap"],
        work_container_max_tmp_bytes=container_max["tmp"],
        work_container_max_log_bytes=container_max["log"],
        work_container_allow_root=TABLE.boolean(env, "MODELFORGE_WORK_CONTAINER_ALLOW_ROOT"),
        work_container_capabilities=parse_capabilities(
            value(env, "MODELFORGE_WORK_CONTAINER_CAPABILITIES")
        ),
        hub_endpoint=parse_hub_endpoint(env.get("HF_ENDPOINT")),
    )
