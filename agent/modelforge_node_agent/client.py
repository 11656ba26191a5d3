"""Calls to the control plane's agent API, and what a refusal means for the agent.

Invariant 10 (DESIGN §2): a failed call is described by status or exception,
method and path only. A refusal body is read for its error *code* (and the
``compatibility`` answer), which decides what the agent does; the body itself,
its message and next step are never logged, because a body can echo what the
agent sent.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import requests

import modelforge_contract as contract
from modelforge_contract import (
    COMPATIBILITY_NEXT_STEPS,
    HEADER_AGENT_PROTOCOL,
    HEADER_AUTHORIZATION,
    PROTOCOL_VERSION,
    UNKNOWN,
)

from . import __version__
from .transport import REQUEST_TIMEOUT, exception_name, tls_cause

log = logging.getLogger(__name__)

# Only codes the contract defines are ever repeated in a log line: a code field
# that is not one of them is treated as part of the (unlogged) body.
KNOWN_CODES = frozenset(
    value
    for name, value in vars(contract).items()
    if isinstance(value, str) and name == value and name.isupper()
)
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
        self, status: int, method: str, path: str, code: str | None, compatibility: str | None
    ) -> None:
        super().__init__(status)
        self.status, self.method, self.path = status, method, path
        self.code, self.compatibility = code, compatibility

    def describe(self) -> str:
        return f"HTTP {self.status} on {self.method} {self.path}"

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT_STATUSES

    @property
    def protocol_incompatible(self) -> bool:
        return self.status == 426

    @property
    def credential_refused(self) -> bool:
        return self.status in (401, 403)


def _refusal_fields(response: requests.Response) -> tuple[str | None, str | None]:
    """The error code and compatibility answer, when they are ones the contract defines."""
    try:
        body = response.json()
    except ValueError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    compatibility = body.get("compatibility")
    return (
        code if code in KNOWN_CODES else None,
        compatibility if compatibility in KNOWN_COMPATIBILITY else None,
    )


@dataclass
class ControlPlaneClient:
    base_url: str
    session: requests.Session
    credential: str | None = None

    def call(
        self, method: str, path: str, body: dict[str, Any], authenticated: bool = True
    ) -> dict[str, Any]:
        """The JSON answer of a 2xx, or TransportFailure / Refused."""
        headers = {
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "Content-Type": "application/json",
            "User-Agent": f"modelforge-node-agent/{__version__}",
        }
        if authenticated and self.credential:
            headers[HEADER_AUTHORIZATION] = f"Bearer {self.credential}"
        try:
            response = self.session.request(
                method,
                self.base_url + path,
                data=json.dumps(body),
                headers=headers,
                timeout=REQUEST_TIMEOUT,
                allow_redirects=False,
            )
        except requests.RequestException as exc:
            raise TransportFailure(exception_name(exc), method, path, tls_cause(exc)) from None
        with response:
            if not 200 <= response.status_code < 300:
                code, compatibility = _refusal_fields(response)
                raise Refused(response.status_code, method, path, code, compatibility)
            try:
                answer = response.json()
            except ValueError:
                raise TransportFailure("BadResponse", method, path) from None
        if not isinstance(answer, dict):
            raise TransportFailure("BadResponse", method, path)
        return answer


def incompatible_message(refusal: Refused) -> str:
    answer = refusal.compatibility or UNKNOWN
    return (
        f"the control plane refused agent protocol {PROTOCOL_VERSION} as {answer}: "
        f"{COMPATIBILITY_NEXT_STEPS[answer]}"
    )
