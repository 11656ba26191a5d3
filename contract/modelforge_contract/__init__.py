"""The ModelForge wire contract, shared by the control plane, the agent and the worker.

Dependency-free on purpose: the agent pyz imports it without bottle or peewee.
Paths, headers, protocol versions, error codes, exit codes and the secret
formats live here once (docs/architecture.md §3).
"""

from __future__ import annotations

import re

__version__ = "0.1.0"

API_PREFIX = "/api/v1"

# -- protocol (invariant 8) -------------------------------------------------

PROTOCOL_VERSION = 1
ACCEPTED_PROTOCOL_VERSIONS = frozenset({1})

COMPATIBLE = "COMPATIBLE"
TOO_OLD = "TOO_OLD"
TOO_NEW = "TOO_NEW"
UNKNOWN = "UNKNOWN"

COMPATIBILITY_NEXT_STEPS = {
    COMPATIBLE: "Nothing to do.",
    TOO_OLD: f"Upgrade the node agent to a release that speaks agent protocol {PROTOCOL_VERSION}.",
    TOO_NEW: "Upgrade the control plane, or run a node agent release that speaks agent "
    f"protocol {PROTOCOL_VERSION}.",
    UNKNOWN: "Send the header X-ModelForge-Agent-Protocol with an integer protocol "
    "version; a node agent release from this project does so.",
}


def compatibility_of(header_value: str | None) -> str:
    """Answer COMPATIBLE, TOO_OLD, TOO_NEW or UNKNOWN for a protocol header value."""
    return _compatibility_in(header_value, ACCEPTED_PROTOCOL_VERSIONS)


def _compatibility_in(value: str | None, accepted: frozenset[int]) -> str:
    if value is None:
        return UNKNOWN
    text = value.strip()
    if not re.fullmatch(r"[0-9]{1,9}", text):
        return UNKNOWN
    version = int(text)
    if version in accepted:
        return COMPATIBLE
    if version < min(accepted):
        return TOO_OLD
    return TOO_NEW


# -- headers ----------------------------------------------------------------

HEADER_ADMIN_TOKEN = "X-ModelForge-Admin-Token"
HEADER_AGENT_PROTOCOL = "X-ModelForge-Agent-Protocol"
HEADER_AUTHORIZATION = "Authorization"

# -- paths ------------------------------------------------------------------

PATH_HEALTHZ = "/healthz"
PATH_METRICS = "/metrics"
PATH_ADMIN_ENROLLMENTS = f"{API_PREFIX}/admin/node-enrollments"
PATH_ADMIN_ENROLLMENT = f"{API_PREFIX}/admin/node-enrollments/<enrollment_id>"
PATH_ADMIN_NODES = f"{API_PREFIX}/admin/hardware/nodes"
PATH_ADMIN_NODE = f"{API_PREFIX}/admin/hardware/nodes/<node_id>"
PATH_ADMIN_NODE_READINESS = f"{PATH_ADMIN_NODE}/readiness"
PATH_ADMIN_NODE_CREDENTIALS = f"{PATH_ADMIN_NODE}/credentials"
PATH_ADMIN_NODE_CREDENTIAL = f"{PATH_ADMIN_NODE}/credential"
PATH_ADMIN_NODE_DECOMMISSION_PREVIEW = f"{PATH_ADMIN_NODE}/decommission/preview"
PATH_ADMIN_NODE_DECOMMISSION_EXECUTE = f"{PATH_ADMIN_NODE}/decommission/execute"
PATH_ADMIN_NODE_CORDON = f"{PATH_ADMIN_NODE}/cordon"
PATH_ADMIN_NODE_UNCORDON = f"{PATH_ADMIN_NODE}/uncordon"
PATH_ADMIN_NODE_WORK_SLOTS = f"{PATH_ADMIN_NODE}/work-slots"
# An administrator accepts the node's changed accelerators as its new baseline.
PATH_ADMIN_NODE_ACCEPT_HARDWARE = f"{PATH_ADMIN_NODE}/accept-hardware"
PATH_ADMIN_ALERTS = f"{API_PREFIX}/admin/alerts"
PATH_ADMIN_AUDIT = f"{API_PREFIX}/admin/audit-events"
# Client API keys (mfk_…): minted, listed and revoked by an administrator.
PATH_ADMIN_API_KEYS = f"{API_PREFIX}/admin/api-keys"
PATH_ADMIN_USAGE = f"{API_PREFIX}/admin/usage"
PATH_ADMIN_USERS = f"{API_PREFIX}/admin/users"
PATH_ADMIN_USER = f"{API_PREFIX}/admin/users/<name>"
PATH_ADMIN_API_KEY = f"{API_PREFIX}/admin/api-keys/<key_id>"
PATH_AGENT_ENROLL = f"{API_PREFIX}/agent/enroll"
PATH_AGENT_HEARTBEAT = f"{API_PREFIX}/agent/heartbeat"
PATH_AGENT_INVENTORY = f"{API_PREFIX}/agent/inventory"
PATH_AGENT_TELEMETRY = f"{API_PREFIX}/agent/telemetry"

# -- liveness ---------------------------------------------------------------

PENDING = "pending"
ONLINE = "online"
STALE = "stale"
OFFLINE = "offline"
DECOMMISSIONED = "decommissioned"
LIVENESS_STATES = (PENDING, ONLINE, STALE, OFFLINE, DECOMMISSIONED)

ACCELERATOR_MODES = ("nvidia", "cpu", "auto")

READINESS_CHECKS = (
    "connection",
    "inventory_age",
    "hardware",
    "protocol",
    "agent_health",
    "telemetry_age",
    "worker",
    "tunnel",
    "cordoned",
)
ALERT_NODE_OFFLINE = "node_offline"
ALERT_NODE_STALE = "node_stale"
ALERT_HOSTNAME_CONFLICT = "hostname_conflict"
# A node published accelerators other than its accepted baseline (trust on first use).
ALERT_HARDWARE_CHANGED = "hardware_changed"
# A node published telemetry faster than the control plane keeps it (the surplus is dropped).
ALERT_TELEMETRY_FLOOD = "telemetry_flood"
HEALTH_STATUSES = ("ok", "degraded", "failing")

# Agents republish an unchanged inventory this often; the control plane's
# MODELFORGE_INVENTORY_MAX_AGE_SECONDS must stay above it.
INVENTORY_REFRESH_SECONDS = 1800

ENROLLMENT_EXPIRY_MIN_SECONDS = 300
ENROLLMENT_EXPIRY_MAX_SECONDS = 86400

# -- error codes (invariant 11; documented in docs/api.md) -------------------

ENROLLMENT_TOKEN_INVALID = "ENROLLMENT_TOKEN_INVALID"
ENROLLMENT_TOKEN_CONSUMED = "ENROLLMENT_TOKEN_CONSUMED"
ENROLLMENT_TOKEN_EXPIRED = "ENROLLMENT_TOKEN_EXPIRED"
ENROLLMENT_TOKEN_REVOKED = "ENROLLMENT_TOKEN_REVOKED"
ENROLLMENT_ORIGIN_MISMATCH = "ENROLLMENT_ORIGIN_MISMATCH"
IDENTITY_SECRET_MISMATCH = "IDENTITY_SECRET_MISMATCH"
CREDENTIAL_MISSING = "CREDENTIAL_MISSING"
CREDENTIAL_INVALID = "CREDENTIAL_INVALID"
CREDENTIAL_REVOKED = "CREDENTIAL_REVOKED"
CREDENTIAL_NODE_MISMATCH = "CREDENTIAL_NODE_MISMATCH"
NODE_DECOMMISSIONED = "NODE_DECOMMISSIONED"
PROTOCOL_INCOMPATIBLE = "PROTOCOL_INCOMPATIBLE"
ADMIN_TOKEN_REQUIRED = "ADMIN_TOKEN_REQUIRED"
ADMIN_TOKEN_INVALID = "ADMIN_TOKEN_INVALID"
# A client call (/v1/…) without "Authorization: Bearer mfk_…", with a key that is malformed,
# unknown or whose secret does not match, or with a revoked key (401 each).
API_KEY_MISSING = "API_KEY_MISSING"
API_KEY_INVALID = "API_KEY_INVALID"
API_KEY_REVOKED = "API_KEY_REVOKED"
# 429: too many wrong keys from one address (appliance identity/key_guesses.py).
API_KEY_THROTTLED = "API_KEY_THROTTLED"
# A key's limits (docs/clients.md): past its expiry (401), a deployment it is not for
# (403), past its requests per minute or its tokens per day (429, with Retry-After).
API_KEY_EXPIRED = "API_KEY_EXPIRED"
API_KEY_SCOPE = "API_KEY_SCOPE"
RATE_LIMITED = "RATE_LIMITED"
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
# Users and roles (docs/console.md, "Users and roles"): a call the caller's role may not make
# (403), a change that would leave no enabled admin (409), a disabled user's token or
# session (401).
ROLE_FORBIDDEN = "ROLE_FORBIDDEN"
LAST_ADMIN = "LAST_ADMIN"
USER_DISABLED = "USER_DISABLED"
ROLES = ("viewer", "operator", "admin")
NOT_FOUND = "NOT_FOUND"
METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
BODY_TOO_LARGE = "BODY_TOO_LARGE"
BODY_NOT_JSON = "BODY_NOT_JSON"
UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
ENROLLMENT_NOT_REVOCABLE = "ENROLLMENT_NOT_REVOCABLE"
IDENTITY_CONFLICT = "IDENTITY_CONFLICT"
CONFIRMATION_INVALID = "CONFIRMATION_INVALID"
CONFIRMATION_USED = "CONFIRMATION_USED"
CONFIRMATION_STALE = "CONFIRMATION_STALE"
INVENTORY_EMPTY = "INVENTORY_EMPTY"
# A cpu node publishes no accelerator; an inventory names each GPU UUID once.
INVENTORY_ACCELERATORS_ON_CPU = "INVENTORY_ACCELERATORS_ON_CPU"
INVENTORY_GPU_DUPLICATE = "INVENTORY_GPU_DUPLICATE"
# Accepting hardware: nothing is pending, or it changed since the administrator looked.
HARDWARE_NOT_PENDING = "HARDWARE_NOT_PENDING"
HARDWARE_PENDING_CHANGED = "HARDWARE_PENDING_CHANGED"
# Telemetry must name the GPUs of the node's accepted inventory, each once.
TELEMETRY_GPU_UNKNOWN = "TELEMETRY_GPU_UNKNOWN"
TELEMETRY_GPU_DUPLICATE = "TELEMETRY_GPU_DUPLICATE"
STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
# The connection front's own refusals (503 with Retry-After).
SERVER_BUSY = "SERVER_BUSY"
TOO_MANY_CONNECTIONS = "TOO_MANY_CONNECTIONS"
# The tunnel's front: a GET of the tunnel path that is no WebSocket upgrade (426), and
# more tunnels open at once than the front holds (503 with Retry-After).
TUNNEL_UPGRADE_REQUIRED = "TUNNEL_UPGRADE_REQUIRED"
TOO_MANY_TUNNELS = "TOO_MANY_TUNNELS"
INTERNAL_ERROR = "INTERNAL_ERROR"
# Field errors are "FIELD_<REASON>" with the field path in the message,
# e.g. FIELD_REQUIRED, FIELD_TYPE, FIELD_UNKNOWN, FIELD_RANGE, FIELD_CHOICE.
FIELD_REQUIRED = "FIELD_REQUIRED"
FIELD_TYPE = "FIELD_TYPE"
FIELD_UNKNOWN = "FIELD_UNKNOWN"
FIELD_RANGE = "FIELD_RANGE"
FIELD_CHOICE = "FIELD_CHOICE"
FIELD_FORMAT = "FIELD_FORMAT"
QUERY_INVALID = "QUERY_INVALID"
# work plane (issue 13)
LEASE_LOST = "LEASE_LOST"
WORK_FINISHED = "WORK_FINISHED"
WORK_INPUT_INVALID = "WORK_INPUT_INVALID"
WORKER_PROTOCOL_INCOMPATIBLE = "WORKER_PROTOCOL_INCOMPATIBLE"
CAPABILITY_UNKNOWN = "CAPABILITY_UNKNOWN"
IMAGE_NOT_FOUND = "IMAGE_NOT_FOUND"
IMAGE_ID_MISMATCH = "IMAGE_ID_MISMATCH"
WORK_TIMED_OUT = "WORK_TIMED_OUT"
SMOKE_FAILED = "SMOKE_FAILED"
CONTAINER_FAILED = "CONTAINER_FAILED"
GPUS_ON_CPU_NODE = "GPUS_ON_CPU_NODE"  # an item asking GPUs reached a CPU-mode worker
LEASE_EXPIRED = "LEASE_EXPIRED"
# Sealed work secrets (docs/work.md): a submission's env cannot be sealed (503, nothing
# queued), or an item's sealed env does not open for the node leasing it (the item fails).
WORK_KEY_UNAVAILABLE = "WORK_KEY_UNAVAILABLE"
WORK_SECRET_UNREADABLE = "WORK_SECRET_UNREADABLE"
WORKER_ERROR = "WORKER_ERROR"
# 429 with Retry-After: a node claimed faster than MODELFORGE_WORK_CLAIMS_PER_SECOND.
CLAIM_RATE_LIMITED = "CLAIM_RATE_LIMITED"
RUN_CANCELLED = "RUN_CANCELLED"  # the worker stopped a run its agent was told is cancelled
HOST_INVALID = "HOST_INVALID"

# -- refusals the HTTP server gives before any route runs (issue 14) -----------
# waitress answers these itself; the control plane renders them in the one error shape.
REQUEST_MALFORMED = "REQUEST_MALFORMED"  # 400: not well-formed HTTP/1.1
HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"  # 431
TRANSFER_ENCODING_UNSUPPORTED = "TRANSFER_ENCODING_UNSUPPORTED"  # 501: not chunked


# -- console and telemetry history (docs/architecture.md §7a) --------------------
# The console signs in with the admin password and then calls the same admin API with
# its session cookie plus the CSRF token in a header; admin tokens keep working.

HEADER_CSRF_TOKEN = "X-CSRF-Token"
SESSION_COOKIE = "modelforge_session"
PATH_ADMIN_NODE_TELEMETRY = f"{PATH_ADMIN_NODE}/telemetry"
PATH_ADMIN_NODE_AGENT_IMAGE_CHECK = f"{API_PREFIX}/admin/node-agent-image/check"
SESSION_EXPIRED = "SESSION_EXPIRED"
CSRF_TOKEN_INVALID = "CSRF_TOKEN_INVALID"
ADMIN_PASSWORD_NOT_SET = "ADMIN_PASSWORD_NOT_SET"
PASSWORD_INCORRECT = "PASSWORD_INCORRECT"
SIGN_IN_THROTTLED = "SIGN_IN_THROTTLED"
IMAGE_ENTRY_REJECTED = "IMAGE_ENTRY_REJECTED"
RELEASE_MANIFEST_UNREADABLE = "RELEASE_MANIFEST_UNREADABLE"


# -- work plane (docs/architecture.md §5; issue 13) ----------------------------
# Additive: agents that predate the work plane keep heartbeating and publishing; they
# simply never claim, and readiness shows their worker check as not reported.

PATH_ADMIN_WORK = f"{API_PREFIX}/admin/work"
PATH_ADMIN_WORK_ITEM = f"{API_PREFIX}/admin/work/<work_id>"
PATH_ADMIN_WORK_CANCEL = f"{PATH_ADMIN_WORK_ITEM}/cancel"
PATH_AGENT_WORK_CLAIM = f"{API_PREFIX}/agent/work/claim"
PATH_AGENT_WORK_RENEW = f"{API_PREFIX}/agent/work/<work_id>/renew"
PATH_AGENT_WORK_COMPLETE = f"{API_PREFIX}/agent/work/<work_id>/complete"

WORK_QUEUED = "queued"
WORK_LEASED = "leased"
WORK_SUCCEEDED = "succeeded"
WORK_FAILED = "failed"
WORK_CANCELLED = "cancelled"
WORK_STATES = (WORK_QUEUED, WORK_LEASED, WORK_SUCCEEDED, WORK_FAILED, WORK_CANCELLED)
WORK_OUTCOMES = (WORK_SUCCEEDED, WORK_FAILED)

CAPABILITY_SMOKE = "smoke"
CAPABILITY_CONTAINER = "container"
CAPABILITIES = (CAPABILITY_SMOKE, CAPABILITY_CONTAINER)

# Bounds both sides apply: the worker trims, the control plane refuses or trims.
WORK_LOG_TAIL_MAX_CHARS = 16384
WORK_RESULT_MAX_BYTES = 65536
WORK_ERROR_MAX_CHARS = 1000
WORK_TIMEOUT_MAX_SECONDS = 86400
# The most work slots an agent runs (MODELFORGE_AGENT_WORK_SLOTS) and reports in its claim
# (``work_slots``), and the most an administrator may allow one node.
WORK_SLOTS_MAX = 64

# A 204 answer to a claim says why nothing was leased in this header (one word).
HEADER_CLAIM_REASON = "X-ModelForge-Claim-Reason"
CLAIM_REASONS = (
    "no_fitting_item",
    "not_online",
    "cordoned",
    "protocol",
    "agent_health",
    "worker",
    "inventory_age",
    "hardware",
    "slots_full",
)


def work_path(template: str, work_id: str) -> str:
    """A work path template with its ``<work_id>`` filled in."""
    return template.replace("<work_id>", work_id)


# -- runtime worker protocol (agent <-> worker over a unix socket) ------------

WORKER_PROTOCOL_VERSION = 1
ACCEPTED_WORKER_PROTOCOL_VERSIONS = frozenset({1})
HEADER_WORKER_PROTOCOL = "X-ModelForge-Worker-Protocol"
WORKER_PATH_INFO = "/v1/info"
WORKER_PATH_RUN = "/v1/run"
WORKER_PATH_CANCEL = "/v1/cancel"

WORKER_COMPATIBILITY_NEXT_STEPS = {
    COMPATIBLE: "Nothing to do.",
    TOO_OLD: "Upgrade the runtime worker to a release that speaks worker protocol "
    f"{WORKER_PROTOCOL_VERSION}.",
    TOO_NEW: "Upgrade the node agent (and the control plane), or run a runtime worker release "
    f"that speaks worker protocol {WORKER_PROTOCOL_VERSION}.",
    UNKNOWN: "Start modelforge-runtime-worker beside the agent on the socket named by "
    "MODELFORGE_AGENT_WORKER_SOCKET, and run a node agent release that reports its worker.",
}


def worker_compatibility_of(protocol: object) -> str:
    """COMPATIBLE, TOO_OLD, TOO_NEW or UNKNOWN for a worker protocol version."""
    if isinstance(protocol, bool) or not isinstance(protocol, int | str):
        return UNKNOWN
    return _compatibility_in(str(protocol), ACCEPTED_WORKER_PROTOCOL_VERSIONS)


# -- exit codes (docs/architecture.md §4) -------------------------------------

EXIT_OK = 0
# The node agent stops here when one of its own loops fails unexpectedly (a bug): better
# restarted by its supervisor than up and silent (issue 14).
EXIT_AGENT_FAILED = 1
EXIT_USAGE = 2
EXIT_NVIDIA_PREFLIGHT = 3
EXIT_ENROLLMENT_REFUSED = 4
EXIT_PROTOCOL_INCOMPATIBLE = 5
# The node agent stops here when the control plane refuses its credential (401/403 after
# enrollment): retrying cannot help, re-enrolling does.
EXIT_CREDENTIAL_REFUSED = 6

# -- the first hour (issue 15): exit codes of the CLIs, republish requests, join ------
# `modelforge` (the control-plane CLI) adds these to the shared codes above; the agent
# uses EXIT_INTERNAL too. Every code is listed in README.md and docs/ (a test checks).
EXIT_CHECK_FAILED = 1  # the answer is "no": not ready, a doctor check failed, alerts, declined
EXIT_NOT_FOUND = 7  # no such node, enrollment or admin token
EXIT_STORE_UNREACHABLE = 8  # PostgreSQL does not answer, or the SQLite file cannot be used
EXIT_SYSTEM = 9  # the operating system refused: disk full, I/O error, out of memory
EXIT_INTERNAL = 70  # a bug: one line says so; --debug shows the trace

# The heartbeat answer's additive "republish" list asks the agent to publish these again
# now (after a restore the control plane holds no fresh measurement); older agents ignore it.
REPUBLISH_INVENTORY = "inventory"
REPUBLISH_TELEMETRY = "telemetry"

# Where `modelforge-node-agent join` puts things on a systemd host (systemd/, docs/).
AGENT_ENV_FILE = "/etc/modelforge/modelforge-node-agent.env"
AGENT_STATE_DIR = "/var/lib/modelforge-node-agent"
AGENT_PYZ_PATH = "/opt/modelforge/modelforge-node-agent.pyz"
AGENT_SERVICE = "modelforge-node-agent"
# The runtime worker beside it (systemd/modelforge-runtime-worker.service).
WORKER_SERVICE = "modelforge-runtime-worker"

# -- secrets ----------------------------------------------------------------
# A secret reads "<kind>_<lookup id>_<random>". The lookup id is not secret and
# indexes the stored digest; the random part carries >=256 bits.

KIND_ENROLLMENT = "mfe"
KIND_CREDENTIAL = "mfc"
KIND_ADMIN = "mfa"
KIND_IDENTITY = "mfi"
KIND_DECOMMISSION = "mfd"
KIND_SESSION = "mfs"  # a console session (cookie)
KIND_API_KEY = "mfk"  # a client's API key (Authorization: Bearer mfk_…)

# No word boundary on the left: a secret glued to other text (``Bearer%20mfc_…``,
# ``tok_mfc_…``) is masked too; masking too much is harmless.
_SECRET_RE = re.compile(r"(mf[ecaidsk])_([0-9a-f]{8,32})_([A-Za-z0-9_-]{20,})")


def split_secret(value: str, kind: str) -> tuple[str, str] | None:
    """Return (lookup_id, whole_value) when value is a well-formed secret of kind."""
    match = _SECRET_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None or match.group(1) != kind:
        return None
    return match.group(2), match.group(0)


def mask_secrets(text: str) -> str:
    """Replace every secret in text by its non-secret prefix (``mfc_3f9a…``)."""
    return _SECRET_RE.sub(lambda m: f"{m.group(1)}_{m.group(2)[:4]}…", text)


__all__ = [name for name in dir() if not name.startswith("_")]
