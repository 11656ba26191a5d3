"""The ModelForge wire contract, shared by the control plane, the agent and the worker.

Dependency-free on purpose: the agent pyz imports it without bottle or peewee.
Paths, headers, protocol versions, error codes, exit codes and the secret
formats live here once (DESIGN §3).
"""

from __future__ import annotations

import re

__version__ = "0.1.0"

API_PREFIX = "/api/v1"

# -- protocol (DESIGN §2.8) -------------------------------------------------

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
    if header_value is None:
        return UNKNOWN
    text = header_value.strip()
    if not re.fullmatch(r"[0-9]{1,9}", text):
        return UNKNOWN
    version = int(text)
    if version in ACCEPTED_PROTOCOL_VERSIONS:
        return COMPATIBLE
    if version < min(ACCEPTED_PROTOCOL_VERSIONS):
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
PATH_ADMIN_ALERTS = f"{API_PREFIX}/admin/alerts"
PATH_ADMIN_AUDIT = f"{API_PREFIX}/admin/audit-events"
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

READINESS_CHECKS = ("connection", "inventory_age", "protocol", "agent_health", "telemetry_age")
ALERT_NODE_OFFLINE = "node_offline"
ALERT_NODE_STALE = "node_stale"
ALERT_HOSTNAME_CONFLICT = "hostname_conflict"
HEALTH_STATUSES = ("ok", "degraded", "failing")

# Agents republish an unchanged inventory this often; the control plane's
# MODELFORGE_INVENTORY_MAX_AGE_SECONDS must stay above it.
INVENTORY_REFRESH_SECONDS = 1800

ENROLLMENT_EXPIRY_MIN_SECONDS = 300
ENROLLMENT_EXPIRY_MAX_SECONDS = 86400

# -- error codes (DESIGN §2.11; documented in docs/api.md) -------------------

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
STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
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
HOST_INVALID = "HOST_INVALID"

# -- refusals the HTTP server gives before any route runs (issue 14) -----------
# waitress answers these itself; the control plane renders them in the one error shape.
REQUEST_MALFORMED = "REQUEST_MALFORMED"  # 400: not well-formed HTTP/1.1
HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"  # 431
TRANSFER_ENCODING_UNSUPPORTED = "TRANSFER_ENCODING_UNSUPPORTED"  # 501: not chunked


# -- console and telemetry history (DESIGN §7a) ----------------------------------
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


# -- exit codes (DESIGN §4) ---------------------------------------------------

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

# -- secrets ----------------------------------------------------------------
# A secret reads "<kind>_<lookup id>_<random>". The lookup id is not secret and
# indexes the stored digest; the random part carries >=256 bits.

KIND_ENROLLMENT = "mfe"
KIND_CREDENTIAL = "mfc"
KIND_ADMIN = "mfa"
KIND_IDENTITY = "mfi"
KIND_DECOMMISSION = "mfd"
KIND_SESSION = "mfs"  # a console session (cookie)

# No word boundary on the left: a secret glued to other text (``Bearer%20mfc_…``,
# ``tok_mfc_…``) is masked too; masking too much is harmless.
_SECRET_RE = re.compile(r"(mf[ecaids])_([0-9a-f]{8,32})_([A-Za-z0-9_-]{20,})")


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
