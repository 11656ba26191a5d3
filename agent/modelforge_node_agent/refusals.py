"""What the agent tells the operator when the control plane refuses it for good.

Every message is the agent's own text, chosen by the error code; the control plane's
message is never repeated (invariant 10). The only values taken from a refusal are the two
origins of an origin mismatch, and only when they parse as origins. Each message names the
section of docs/node-agent.md that explains it, and what to do the way this agent runs
(``runtime.py``): systemd, a container, or a plain process.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from modelforge_contract import (
    CREDENTIAL_INVALID,
    CREDENTIAL_MISSING,
    CREDENTIAL_NODE_MISMATCH,
    CREDENTIAL_REVOKED,
    ENROLLMENT_ORIGIN_MISMATCH,
    ENROLLMENT_TOKEN_CONSUMED,
    ENROLLMENT_TOKEN_EXPIRED,
    ENROLLMENT_TOKEN_INVALID,
    ENROLLMENT_TOKEN_REVOKED,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_ENROLLMENT_REFUSED,
    IDENTITY_SECRET_MISMATCH,
    NODE_DECOMMISSIONED,
)

from . import runtime

if TYPE_CHECKING:
    from .client import Refused

DOC = "docs/node-agent.md"
# The sections of DOC the messages name (a test checks each is a heading there).
SECTION_ENROLLING = "Enrolling"
SECTION_REMOVE_TOKEN = "Remove the enrollment token"
SECTION_REENROLL = "Re-enroll a node"
SECTION_NEW_NODE = "Enroll the hardware as a new node"
SECTIONS = (SECTION_ENROLLING, SECTION_REMOVE_TOKEN, SECTION_REENROLL, SECTION_NEW_NODE)

_ORIGIN = re.compile(r"https?://[a-z0-9.\-\[\]:]{1,290}")


def see(section: str) -> str:
    return f"({DOC}, '{section}')"


def _reenroll() -> str:
    return (
        f"{runtime.fresh_token_step()}; the agent keeps its identity and node id "
        f"{see(SECTION_REENROLL)}."
    )


def _new_node() -> str:
    return (
        f"Delete identity.json from the state volume, then {runtime.fresh_token_step()} "
        f"{see(SECTION_NEW_NODE)}."
    )


class AgentExit(Exception):
    """Stop the agent with this exit status and one-line message."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


def _origin(value: object) -> str | None:
    """An origin from a refusal body, only when it is plainly one (it reaches a log line)."""
    return value if isinstance(value, str) and _ORIGIN.fullmatch(value) else None


def origin_mismatch(refusal: Refused | None, agent_url: str | None) -> str:
    """Both origins: the one the token is locked to, and the one this agent called."""
    details = getattr(refusal, "details", None) or {}
    locked = _origin(details.get("api_origin"))
    called = _origin(details.get("request_origin")) or agent_url or "this agent's URL"
    if runtime.is_joining():
        use = f"join {locked}" if locked else "join exactly the origin shown when it was minted"
        return (
            f"the token is locked to {locked or 'another API origin'}, but this join called "
            f"{called}; {use} (the URL is join's first argument), or mint a token for {called}"
        )
    if locked is None:
        return (
            f"the token is locked to another API origin than {called}; set "
            "MODELFORGE_AGENT_CONTROL_PLANE_URL to exactly the origin shown when the token "
            "was minted"
        )
    return (
        f"the token is locked to {locked}, but this agent called {called}; use "
        f"{locked} as the control plane URL (MODELFORGE_AGENT_CONTROL_PLANE_URL, or join "
        f"{locked}), or mint a token for {called}"
    )


def _enrollment_reason(code: str) -> str | None:
    mint = runtime.fresh_token_step()
    return {
        ENROLLMENT_TOKEN_INVALID: f"the control plane does not know this enrollment token; {mint}",
        ENROLLMENT_TOKEN_CONSUMED: "this enrollment token was already used (tokens are "
        "single-use): by this host if an earlier attempt's answer was lost, or by another. "
        f"Check the control plane's node list for this host name; {mint}",
        ENROLLMENT_TOKEN_EXPIRED: f"this enrollment token has expired; {mint}",
        ENROLLMENT_TOKEN_REVOKED: f"this enrollment token was revoked by an administrator; {mint}",
        IDENTITY_SECRET_MISMATCH: "the control plane knows this identity id with a different "
        "secret. Restore the original identity.json from the state volume, or: " + _new_node(),
        NODE_DECOMMISSIONED: "this identity belongs to a decommissioned node. " + _new_node(),
    }.get(code)


def enrollment_refused(refusal: Refused, agent_url: str | None = None) -> AgentExit:
    if refusal.code == ENROLLMENT_ORIGIN_MISMATCH:
        what = origin_mismatch(refusal, agent_url)
    else:
        what = _enrollment_reason(refusal.code or "") or (
            f"enrollment was refused ({refusal.code or 'no known error code'}); "
            + runtime.fresh_token_step()
        )
    return AgentExit(EXIT_ENROLLMENT_REFUSED, f"enrollment refused: {what}")


def credential_refused_message(code: str | None) -> str:
    what = {
        CREDENTIAL_REVOKED: "this node's credential was revoked; revoked credentials stay "
        "refused, so retrying cannot help. " + _reenroll(),
        CREDENTIAL_INVALID: "the control plane does not recognise this node's credential "
        "(a restored or replaced control plane, or an edited identity.json). " + _reenroll(),
        CREDENTIAL_MISSING: "the control plane did not receive a credential. " + _reenroll(),
        CREDENTIAL_NODE_MISMATCH: "the stored credential belongs to another node "
        "(identity.json was copied between hosts or edited). " + _reenroll(),
        NODE_DECOMMISSIONED: "this node was decommissioned by an administrator. " + _new_node(),
    }.get(code or "")
    if what is None:
        what = "the control plane refused this node's credential. " + _reenroll()
    return f"credential refused ({code or 'no known error code'}): {what}"


def credential_refused(code: str | None) -> AgentExit:
    return AgentExit(EXIT_CREDENTIAL_REFUSED, credential_refused_message(code))
