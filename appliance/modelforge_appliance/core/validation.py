"""Request bodies: read within the size limit, parse as a JSON object, check field by field.

Every refusal names the field (``identity.identity_secret``) and carries a
``FIELD_*`` code; unknown fields are refused, never ignored.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from modelforge_contract import (
    ACCELERATOR_MODES,
    BODY_NOT_JSON,
    CAPABILITIES,
    FIELD_CHOICE,
    FIELD_RANGE,
    FIELD_REQUIRED,
    FIELD_TYPE,
    FIELD_UNKNOWN,
    HEALTH_STATUSES,
    UNSUPPORTED_MEDIA_TYPE,
    WORK_ERROR_MAX_CHARS,
    WORK_OUTCOMES,
    WORK_SLOTS_MAX,
    WORK_TIMEOUT_MAX_SECONDS,
)
from modelforge_contract import containers as fence
from modelforge_contract import deployments as deploy_contract
from modelforge_contract import hub as hub_contract
from modelforge_contract import models as models_contract

from .errors import ApiError, Invalid, TooLarge
from .lookalike import first_refused_in_name

# Refused in every string field: C0 controls but tab, DEL and the C1 controls
# (U+007F-U+009F), and the invisible bidirectional marks, embeddings, overrides and
# isolates that make a value display as something else (a host name that reads
# backwards in the console, a forged line in a log). Multi-line fields (a log tail)
# also allow \n and \r.
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\\x00-\\x08\\x0a-\\x1f\\x7f-\\x9f{_BIDI}]")
_CONTROL_MULTILINE = re.compile(f"[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f{_BIDI}]")
_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    dict: "an object",
    list: "an array",
}


@dataclass(frozen=True)
class Field:
    """One field of a JSON object. ``low``/``high`` bound numbers, or lengths of strings/arrays."""

    kind: type
    required: bool = True
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    fields: dict[str, Field] | None = None  # for objects: the closed set of keys
    items: Field | None = None  # for arrays
    multiline: bool = False  # for strings: allow newlines (log text)
    # For strings: a name people read (hostname, display name), which also refuses every
    # format character (zero-width, soft hyphen, byte order mark) and line separator.
    name: bool = False


def _fail(code: str, path: str, message: str) -> Invalid:
    return Invalid(f"{path}: {message}", code=code, next_step=f"Fix the field {path!r} and retry.")


def _check_type(value: Any, spec: Field, path: str) -> None:
    kind = spec.kind
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise _fail(FIELD_TYPE, path, f"must be {_TYPE_NAMES[kind]}")


def _check_bounds(value: Any, spec: Field, path: str) -> None:
    measured = len(value) if isinstance(value, str | list) else value
    what = "length" if isinstance(value, str | list) else "value"
    if spec.low is not None and measured < spec.low:
        raise _fail(FIELD_RANGE, path, f"{what} must be at least {spec.low:g}")
    if spec.high is not None and measured > spec.high:
        raise _fail(FIELD_RANGE, path, f"{what} must be at most {spec.high:g}")


def _code_point(char: str) -> str:
    """'U+200B ZERO WIDTH SPACE': a character named without writing it."""
    return f"U+{ord(char):04X} {unicodedata.name(char, '(unnamed)')}".rstrip()


def check_value(value: Any, spec: Field, path: str) -> Any:
    if value is None:
        if spec.nullable:
            return None
        raise _fail(FIELD_TYPE, path, "must not be null")
    _check_type(value, spec, path)
    if isinstance(value, str):
        control = (_CONTROL_MULTILINE if spec.multiline else _CONTROL).search(value)
        if control:
            raise _fail(
                FIELD_TYPE,
                path,
                "must not contain control characters or bidirectional marks "
                f"({_code_point(control.group())})",
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \udxxx escape
            raise _fail(FIELD_TYPE, path, "must be valid Unicode text") from None
        refused = first_refused_in_name(value) if spec.name else None
        if refused is not None:
            raise _fail(
                FIELD_TYPE,
                path,
                f"must not contain invisible format characters ({_code_point(refused)})",
            )
    if spec.choices is not None and value not in spec.choices:
        raise _fail(FIELD_CHOICE, path, f"must be one of {', '.join(map(str, spec.choices))}")
    _check_bounds(value, spec, path)
    if spec.kind is dict and spec.fields is not None:
        return check_object(value, spec.fields, path)
    if spec.kind is list and spec.items is not None:
        return [check_value(item, spec.items, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


def check_object(body: dict[str, Any], fields: dict[str, Field], path: str = "") -> dict:
    prefix = f"{path}." if path else ""
    for name in body:
        if name not in fields:
            raise _fail(FIELD_UNKNOWN, f"{prefix}{name}", "is not a known field")
    checked = {}
    for name, spec in fields.items():
        if name not in body:
            if spec.required:
                raise _fail(FIELD_REQUIRED, f"{prefix}{name}", "is required")
            continue
        checked[name] = check_value(body[name], spec, f"{prefix}{name}")
    return checked


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_json_object(environ: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object, or an ApiError (400, 413, 415)."""
    return read_json_bytes(environ, max_bytes)[1]


def read_json_bytes(environ: dict[str, Any], max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The request body as its bytes and as a JSON object, or an ApiError (400, 413, 415)."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise Invalid("Content-Length is not a number", code=BODY_NOT_JSON) from None
    if length > max_bytes:
        raise TooLarge(
            f"the body is {length} bytes; the limit is {max_bytes}",
            next_step="Send a smaller body (MODELFORGE_MAX_BODY_BYTES sets the limit).",
        )
    media_type = (environ.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()
    if length and media_type != "application/json":
        raise ApiError(
            "the body must be sent as Content-Type: application/json",
            code=UNSUPPORTED_MEDIA_TYPE,
            status=415,
        )
    raw = environ["wsgi.input"].read(length) if length else b""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Invalid(
            "the body is not valid UTF-8 JSON", code=BODY_NOT_JSON, next_step="Send a JSON object."
        ) from None
    if not isinstance(body, dict):
        raise Invalid(
            "the body must be a JSON object", code=BODY_NOT_JSON, next_step="Send a JSON object."
        )
    return raw, body


def parse_body(environ: dict[str, Any], max_bytes: int, fields: dict[str, Field]) -> dict:
    return check_object(read_json_object(environ, max_bytes), fields)


# -- the request shapes (docs/architecture.md §3) -----------------------------

_NAME = DISPLAY_NAME = Field(str, low=1, high=120, name=True)
_VERSION = Field(str, low=1, high=64)
_ID = Field(str, low=1, high=64)

MINT_FIELDS = {
    "display_name": _NAME,
    "expires_in_seconds": Field(int, low=300, high=86400),
    # Only shapes the env file and join commands of the answer; the node reports its own.
    "accelerator_mode": Field(str, required=False, choices=ACCELERATOR_MODES),
}

EXECUTE_FIELDS = {"confirmation": Field(str, low=1, high=256)}

# POST /admin/api-keys (identity/api_keys.py): a name, and optional limits.
API_KEY_FIELDS = {
    "name": _NAME,
    "deployments": Field(
        list,
        required=False,
        nullable=True,
        low=1,
        high=64,
        items=Field(str, low=1, high=120, name=True),
    ),  # fmt: skip
    "expires": Field(str, required=False, nullable=True, low=1, high=40),
    "rpm": Field(int, required=False, nullable=True, low=1, high=1_000_000),
    "tokens_per_day": Field(int, required=False, nullable=True, low=1, high=10**12),
    "user": Field(str, required=False, nullable=True, low=1, high=64),  # whose key (admins)
}

ENROLL_FIELDS = {
    "token": Field(str, low=1, high=256),
    "hostname": Field(str, low=1, high=253, name=True),
    "agent_version": _VERSION,
    "accelerator_mode": Field(str, choices=ACCELERATOR_MODES),
    "identity": Field(
        dict,
        required=False,
        nullable=True,
        fields={"identity_id": Field(str, low=8, high=32), "identity_secret": Field(str, high=256)},
    ),
}

# What the agent says about its runtime worker (issue 13); older agents leave it out.
WORKER_HEALTH_FIELDS = {
    "reachable": Field(bool),
    "protocol": Field(int, required=False, nullable=True, low=0, high=10**9),
    "version": Field(str, required=False, nullable=True, high=64),
    "capabilities": Field(list, required=False, high=32, items=Field(str, low=1, high=64)),
    # Additive (issue 25): the model runtimes its ``serve`` capability can launch.
    "runtimes": Field(list, required=False, high=16, items=Field(str, low=1, high=32)),
    "accelerator_mode": Field(str, required=False, nullable=True, high=16),
    "message": Field(str, required=False, nullable=True, high=500),
}
HEALTH_FIELDS = {
    "status": Field(str, choices=HEALTH_STATUSES),
    "gpu_probe": Field(str, choices=("ok", "failed", "not_applicable")),
    "preflight": Field(str, required=False, high=64),
    "message": Field(str, required=False, nullable=True, high=500),
    "uptime_seconds": Field(float, required=False, low=0, high=10**10),
    "worker": Field(dict, required=False, nullable=True, fields=WORKER_HEALTH_FIELDS),
    # Additive (issue 26): whether the agent's tunnel is up; older agents leave it out.
    "tunnel": Field(str, required=False, nullable=True, choices=("up", "down")),
}

HEARTBEAT_FIELDS = {
    "node_id": _ID,
    "agent_version": _VERSION,
    "health": Field(dict, fields=HEALTH_FIELDS),
}

_BYTES = Field(int, low=0, high=2**63 - 1)
_OPT_BYTES = Field(int, required=False, nullable=True, low=0, high=2**63 - 1)

ACCELERATOR_FIELDS = {
    "index": Field(int, low=0, high=1023),
    "name": Field(str, low=1, high=120),
    "uuid": Field(str, low=1, high=96),
    "memory_total_bytes": _BYTES,
    "driver_version": Field(str, low=1, high=64),
    "cuda_version": Field(str, required=False, nullable=True, high=32),
    "pci_bus_id": Field(str, low=1, high=64),
    "mig_mode": Field(str, required=False, nullable=True, choices=("enabled", "disabled")),
}

STORAGE_ROOT_FIELDS = {
    "path": Field(str, low=1, high=4096),
    "role": Field(str, required=False, choices=models_contract.STORAGE_ROLES),
    "total_bytes": _BYTES,
    "free_bytes": _BYTES,
}

HOST_FIELDS = {
    # Additive (issue 37): the host's name as its agent sees it; the node's recorded
    # hostname follows it. Sent only to a control plane whose heartbeat answer says it
    # accepts it ("accepts": ["host.hostname"]).
    "hostname": Field(str, required=False, low=1, high=253, name=True),
    "os": Field(str, required=False, high=200),
    "kernel": Field(str, required=False, high=200),
    "cpu_count": Field(int, required=False, low=1, high=100000),
    "memory_total_bytes": _OPT_BYTES,
}

MODEL_REPORT_ERROR_FIELDS = {
    "code": Field(str, low=1, high=64),
    "message": Field(str, high=1000),
}

MODEL_REPORT_FIELDS = {
    "digest": Field(str, low=71, high=71),
    "state": Field(str, choices=models_contract.REPORTED_STATES),
    "bytes_done": _BYTES,
    "bytes_total": _BYTES,
    "error": Field(dict, required=False, nullable=True, fields=MODEL_REPORT_ERROR_FIELDS),
}

INVENTORY_FIELDS = {
    "node_id": _ID,
    "agent_version": _VERSION,
    "worker_version": Field(str, required=False, nullable=True, high=64),
    "host": Field(dict, required=False, fields=HOST_FIELDS),
    "accelerators": Field(list, high=64, items=Field(dict, fields=ACCELERATOR_FIELDS)),
    "storage_roots": Field(
        list, required=False, high=32, items=Field(dict, fields=STORAGE_ROOT_FIELDS)
    ),
    # Additive (issue 24): what the node holds of the models asked of it; an older agent
    # sends no such field, and nothing about its replicas changes then.
    "models": Field(list, required=False, high=1000, items=Field(dict, fields=MODEL_REPORT_FIELDS)),
}

_OPT_INT = Field(int, required=False, nullable=True, low=0, high=10**9)
_OPT_NUM = Field(float, required=False, nullable=True, low=0, high=10**9)

SAMPLE_FIELDS = {
    "uuid": Field(str, low=1, high=96),
    "index": Field(int, low=0, high=1023),
    # NVML reports no whole-GPU utilisation while MIG is enabled: null then.
    "utilization_gpu_percent": Field(int, nullable=True, low=0, high=100),
    "utilization_memory_percent": Field(int, required=False, nullable=True, low=0, high=100),
    "memory_used_bytes": _BYTES,
    "memory_total_bytes": _OPT_BYTES,
    "temperature_c": Field(int, nullable=True, low=0, high=200),
    "power_w": Field(float, nullable=True, low=0, high=10000),
    "power_limit_w": _OPT_NUM,
    "clock_sm_mhz": _OPT_INT,
    "clock_memory_mhz": _OPT_INT,
}

TELEMETRY_FIELDS = {
    "node_id": _ID,
    "samples": Field(list, low=1, high=64, items=Field(dict, fields=SAMPLE_FIELDS)),
}

# The Enroll node wizard's image step: a pasted manifest entry, or a registry reference, and
# the accelerator mode the enrollment was minted with (the worker image, GPUs or not).
IMAGE_CHECK_FIELDS = {
    "entry": Field(dict, required=False),
    "registry_image": Field(str, required=False, low=1, high=500),
    "accelerator_mode": Field(str, required=False, choices=ACCELERATOR_MODES),
}

# -- the work plane (docs/architecture.md §5) ----------------------------------

_WORK_ID = Field(str, low=1, high=40)

WORK_CONSTRAINT_FIELDS = {
    "gpu_count": Field(int, required=False, low=0, high=64),
    "min_gpu_memory_bytes": Field(int, required=False, nullable=True, low=1, high=2**62),
    "gpu_name": Field(str, required=False, nullable=True, low=1, high=120),
    "node_ids": Field(list, required=False, nullable=True, low=1, high=100, items=_ID),
}

SUBMIT_WORK_FIELDS = {
    "capability": Field(str, choices=CAPABILITIES),
    "input": Field(dict, required=False, nullable=True),
    "constraints": Field(dict, required=False, nullable=True, fields=WORK_CONSTRAINT_FIELDS),
    "timeout_seconds": Field(int, required=False, low=1, high=WORK_TIMEOUT_MAX_SECONDS),
    "max_attempts": Field(int, required=False, low=1, high=20),
    "idempotency_key": Field(str, required=False, nullable=True, low=1, high=200),
}

# What each capability takes as input; the worker checks the same again.
CAPABILITY_INPUT_FIELDS = {
    "smoke": {"matrix_size": Field(int, required=False, low=2, high=512)},
    "container": {
        "image": Field(str, low=1, high=255),
        "image_id": Field(str, low=71, high=71),
        "command": Field(list, required=False, high=256, items=Field(str, high=4096)),
        "env": Field(dict, required=False),
        "network": Field(bool, required=False),
        "memory_bytes": Field(int, required=False, low=fence.MEMORY_MIN_BYTES, high=2**50),
        "gpus": Field(int, required=False, nullable=True, low=0, high=64),
        # The fence (docs/work.md, "Limits"); the admin's maxima are checked in work/items.py.
        "swap_bytes": Field(int, required=False, low=0, high=2**50),
        "cpus": Field(float, required=False, low=fence.CPUS_MIN, high=4096),
        "pids_limit": Field(int, required=False, low=fence.PIDS_MIN, high=4_194_304),
        "tmp_bytes": Field(int, required=False, low=fence.TMP_MIN_BYTES, high=2**50),
        "log_bytes": Field(int, required=False, low=fence.LOG_MIN_BYTES, high=2**40),
        "run_as_root": Field(bool, required=False),
        "capabilities": Field(
            list,
            required=False,
            high=len(fence.LINUX_CAPABILITIES),
            items=Field(str, choices=fence.LINUX_CAPABILITIES),
        ),
    },
}

CLAIM_FIELDS = {
    "node_id": _ID,
    "capabilities": Field(list, high=32, items=Field(str, low=1, high=64)),
    # The slots the agent runs; agents that predate it send none and count as one.
    "work_slots": Field(int, required=False, low=1, high=WORK_SLOTS_MAX),
}

# PUT …/work-slots: the node's own maximum, or null for MODELFORGE_WORK_SLOTS_PER_NODE.
WORK_SLOTS_FIELDS = {
    "work_slots_max": Field(int, nullable=True, low=1, high=WORK_SLOTS_MAX),
}

# POST …/accept-hardware: optionally the digest of the pending accelerators that were shown.
ACCEPT_HARDWARE_FIELDS = {
    "digest": Field(str, required=False, nullable=True, low=16, high=16),
}

_HUB_PATTERNS = Field(
    list,
    required=False,
    nullable=True,
    high=hub_contract.PATTERNS_MAX,
    items=Field(str, low=1, high=hub_contract.PATTERN_MAX_CHARS),
)

# A source is a path on the control-plane host, or a hub repository (models/pulls.py
# says which fields go together).
IMPORT_MODEL_FIELDS = {
    "name": Field(str, low=1, high=120),
    "revision": Field(str, required=False, nullable=True, low=1, high=64),
    "source": Field(
        dict,
        fields={
            "path": Field(str, required=False, low=1, high=4096),
            "hub": Field(str, required=False, choices=hub_contract.HUBS),
            "repo": Field(str, required=False, low=3, high=200),
            "revision": Field(str, required=False, nullable=True, low=1, high=200),
            "include": _HUB_PATTERNS,
            "exclude": _HUB_PATTERNS,
        },
    ),
}

HUB_TOKEN_FIELDS = {"token": Field(str, low=1, high=512)}

REPLICATE_FIELDS = {
    "node_ids": Field(list, low=1, high=1000, items=_ID),
    "revision": Field(str, required=False, nullable=True, low=1, high=64),
}

RENEW_FIELDS = {"node_id": _ID, "lease_id": _WORK_ID}

COMPLETE_FIELDS = {
    "node_id": _ID,
    "lease_id": _WORK_ID,
    "outcome": Field(str, choices=WORK_OUTCOMES),
    "result": Field(dict, required=False, nullable=True),
    # Trimmed to its last WORK_LOG_TAIL_MAX_CHARS characters rather than refused: a long log
    # must never cost the outcome.
    "log_tail": Field(str, required=False, nullable=True, multiline=True),
    "error": Field(
        dict,
        required=False,
        nullable=True,
        fields={
            "code": Field(str, low=1, high=64),
            "message": Field(str, high=WORK_ERROR_MAX_CHARS, multiline=True),
        },
    ),
}

# -- deployments (docs/architecture.md §11) -----------------------------------------------

DEPLOYMENT_SETTINGS_FIELDS = {
    "context_length": Field(
        int, required=False, nullable=True, low=1, high=deploy_contract.CONTEXT_LENGTH_MAX
    ),
    "args": Field(
        list,
        required=False,
        nullable=True,
        high=deploy_contract.ARGS_MAX,
        items=Field(str, low=1, high=deploy_contract.ARG_MAX_CHARS),
    ),
    "image_id": Field(str, required=False, nullable=True, low=71, high=71),
    "model_file": Field(str, required=False, nullable=True, low=1, high=1024),
    # A model split across nodes (deployments/split.py): the main node, then its helpers.
    "split": Field(
        list, required=False, nullable=True, low=2, high=deploy_contract.SPLIT_MAX, items=_ID
    ),
    # Load on demand (deployments/idle.py): unloaded after this long without a request.
    "idle_unload_seconds": Field(
        int, required=False, nullable=True, low=1, high=deploy_contract.IDLE_UNLOAD_MAX
    ),
}

DEPLOY_FIELDS = {
    "name": Field(str, low=1, high=63),
    "model": Field(str, low=1, high=120),
    "revision": Field(str, required=False, nullable=True, low=1, high=64),
    "runtime": Field(str, choices=deploy_contract.RUNTIMES),
    "node_ids": Field(list, low=1, high=256, items=_ID),
    "gpu_count": Field(int, required=False, nullable=True, low=0, high=64),
    "share_gpus": Field(bool, required=False),
    "settings": Field(dict, required=False, nullable=True, fields=DEPLOYMENT_SETTINGS_FIELDS),
    "replicate": Field(bool, required=False),
}

# PATCH /admin/deployments/{name}: the runtime settings `deployments set` may change
# (deployments/servers.py CHANGEABLE_SETTINGS); every other field is refused.
DEPLOYMENT_CHANGE_FIELDS = {
    "settings": Field(
        dict,
        fields={
            "args": DEPLOYMENT_SETTINGS_FIELDS["args"],
            "context_length": DEPLOYMENT_SETTINGS_FIELDS["context_length"],
        },
    ),
}

# POST /admin/deployments/{name}/servers: nodes that join a running deployment.
DEPLOYMENT_MEMBERS_FIELDS = {
    "node_ids": DEPLOY_FIELDS["node_ids"],
    "replicate": Field(bool, required=False),
}

SERVER_CLAIM_FIELDS = {"node_id": _ID}

SERVER_RENEW_FIELDS = {
    "node_id": _ID,
    "lease_id": _WORK_ID,
    "state": Field(str, choices=deploy_contract.SERVER_REPORTED_STATES),
    "restarts": Field(int, required=False, low=0, high=10**6),
    "error": Field(dict, required=False, nullable=True, fields=MODEL_REPORT_ERROR_FIELDS),
    # backoff: seconds until the agent starts the runtime again
    "next_attempt_in": Field(float, required=False, nullable=True, low=0, high=86400),
}
