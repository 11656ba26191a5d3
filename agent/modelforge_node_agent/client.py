"""Calls to the control plane's agent API, and what a refusal means for the agent.

Invariant 10: a failed call is described by status or exception,
method and path only. A refusal body is read for its error *code* (and the
``compatibility`` answer), which decides what the agent does; the body itself,
its message and next step are never logged, because a body can echo what the
agent sent.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

import modelforge_contract as contract
import modelforge_contract.deployments as deployments_contract
from modelforge_contract import (
    COMPATIBILITY_NEXT_STEPS,
    HEADER_AGENT_PROTOCOL,
    HEADER_AUTHORIZATION,
    PROTOCOL_VERSION,
    UNKNOWN,
)

from . import __version__
from .transport import (
    CALL_DEADLINE_SECONDS,
    MAX_ANSWER_BYTES,
    REQUEST_TIMEOUT,
    AnswerTooLarge,
    Deadline,
    exception_name,
    read_answer,
    tls_cause,
)

log = logging.getLogger(__name__)

# Only codes the contract defines are ever repeated in a log line: a code field
# that is not one of them is treated as part of the (unlogged) body.
KNOWN_CODES = frozenset(
    value
    for module in (contract, deployments_contract)
    for name, value in vars(module).items()
    if isinstance(value, str) and name == value and name.isupper()
)
# 409s that are an answer, not a race: the lease ended, the server is not this node's to
# start. Retrying one would repeat the same refusal forever (issue 34).
FINAL_CONFLICTS = frozenset({contract.LEASE_LOST, deployments_contract.SERVER_NOT_CLAIMABLE})
KNOWN_COMPATIBILITY = frozenset(COMPATIBILITY_NEXT_STEPS)

# Status codes worth retrying: the control plane or a proxy in front of it is
# restarting or overloaded, or a request raced with something.
TRANSIENT_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class CallFailed(Exception):
    """A call did not succeed; ``describe()`` is the log line's head."""

    method: str
    path: str

    def describe(self) -> str:
        raise NotImplementedError


class TransportFailure(CallFailed):
    """No HTTP answer: connection refused, DNS, TLS, timeout, or a garbled response."""

    def __init__(self, name: str, method: str, path: str, hint: str | None = None) -> None:
        super().__init__(name)
        self.name, self.method, self.path, self.hint = name, method, path, hint

    def describe(self) -> str:
        head = f"{self.name} on {self.method} {self.path}"
        return f"{head}: {self.hint}" if self.hint else head


class Refused(CallFailed):
    """An HTTP answer outside 2xx."""

    def __init__(
        self,
        status: int,
        method: str,
        path: str,
        code: str | None,
        compatibility: str | None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(status)
        self.status, self.method, self.path = status, method, path
        self.code, self.compatibility = code, compatibility
        # Named extra fields of the refusal (ENROLLMENT_ORIGIN_MISMATCH: both origins);
        # whoever shows one checks its shape first (refusals.py).
        self.details = details or {}

    def describe(self) -> str:
        return f"HTTP {self.status} on {self.method} {self.path}"

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT_STATUSES and self.code not in FINAL_CONFLICTS

    @property
    def protocol_incompatible(self) -> bool:
        return self.status == 426

    @property
    def credential_refused(self) -> bool:
        return self.status in (401, 403)


# What the agent accepts from the control plane as a heartbeat interval; anything else
# (negative, tiny, huge, NaN, infinite, not a number) is ignored and the current one kept.
HEARTBEAT_INTERVAL_RANGE = (1.0, 3600.0)
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def parse_answer(raw: bytes) -> Any:
    """The JSON document of an answer, or None when it is not JSON this agent can hold:
    invalid, not UTF-8, NaN/Infinity, or nested too deep to parse."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(name)


def printable(value: object, limit: int = 64) -> str:
    """A value from the control plane, fit for a log line: printable ASCII only, bounded,
    so no answer can forge or break a line (control characters, ANSI escapes, newlines)."""
    text = value if isinstance(value, str) else repr(value)
    text = _UNPRINTABLE.sub("?", text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "…"


def checked_node_id(value: object) -> str | None:
    """A node id as the control plane issues them (a UUID); None for anything else."""
    if isinstance(value, str) and _NODE_ID.fullmatch(value):
        return value
    return None


def checked_interval(value: object) -> float | None:
    """A heartbeat interval within HEARTBEAT_INTERVAL_RANGE, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    low, high = HEARTBEAT_INTERVAL_RANGE
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return float(value)


def _refusal_fields(body: Any) -> tuple[str | None, str | None]:
    """The error code and compatibility answer, when they are ones the contract defines."""
    if not isinstance(body, dict):
        return None, None
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    compatibility = body.get("compatibility")
    return (
        code if isinstance(code, str) and code in KNOWN_CODES else None,
        compatibility
        if isinstance(compatibility, str) and compatibility in KNOWN_COMPATIBILITY
        else None,
    )


# LEASE_LOST: how the lease ended ("cancelled" makes the agent stop the item's run).
REFUSAL_DETAILS = ("api_origin", "request_origin", "lease_end")


def _refusal_details(body: Any) -> dict[str, Any]:
    """The refusal's named extra fields, strings only (never the message or next step)."""
    if not isinstance(body, dict):
        return {}
    return {key: body[key] for key in REFUSAL_DETAILS if isinstance(body.get(key), str)}


# What a call can fail with once requests has handed over the open response.
_READ_ERRORS = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


@dataclass
class ControlPlaneClient:
    base_url: str
    session: requests.Session
    credential: str | None = None
    deadline_seconds: float = CALL_DEADLINE_SECONDS
    max_answer_bytes: int = MAX_ANSWER_BYTES

    def call(
        self, method: str, path: str, body: dict[str, Any], authenticated: bool = True
    ) -> dict[str, Any]:
        """The JSON answer of a 2xx, or TransportFailure / Refused.

        Bounded whatever the control plane does: the call ends within
        ``deadline_seconds``, and no more than ``max_answer_bytes`` of the answer are read.
        """
        headers = {
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "Content-Type": "application/json",
            "User-Agent": f"modelforge-node-agent/{__version__}",
        }
        if authenticated and self.credential:
            headers[HEADER_AUTHORIZATION] = f"Bearer {self.credential}"
        response: requests.Response | None = None
        deadline = Deadline(self.deadline_seconds)
        try:
            with deadline:
                response = self.session.request(
                    method,
                    self.base_url + path,
                    data=json.dumps(body),
                    headers=headers,
                    timeout=REQUEST_TIMEOUT,
                    allow_redirects=False,
                    stream=True,
                )
                raw = read_answer(response, self.max_answer_bytes)
        except AnswerTooLarge:
            raise TransportFailure("AnswerTooLarge", method, path) from None
        except _READ_ERRORS as exc:
            name = "DeadlineExceeded" if deadline.expired else exception_name(exc)
            raise TransportFailure(name, method, path, tls_cause(exc)) from None
        finally:
            if response is not None:
                response.close()  # only now: the deadline can no longer touch the connection
        if response.status_code == 204:
            # No content (a claim that found no work): only our own headers say why.
            ours = {k.lower(): v for k, v in response.headers.items()}
            return {"headers": {k: v for k, v in ours.items() if k.startswith("x-modelforge-")}}
        answer = parse_answer(raw)
        if not 200 <= response.status_code < 300:
            code, compatibility = _refusal_fields(answer)
            details = _refusal_details(answer) if code else None
            raise Refused(response.status_code, method, path, code, compatibility, details)
        if not isinstance(answer, dict):
            raise TransportFailure("BadResponse", method, path)
        return answer


def incompatible_message(refusal: Refused) -> str:
    answer = refusal.compatibility or UNKNOWN
    return (
        f"the control plane refused agent protocol {PROTOCOL_VERSION} as {answer}: "
        f"{COMPATIBILITY_NEXT_STEPS[answer]}"
    )
