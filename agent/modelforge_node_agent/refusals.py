"""What the agent tells the operator when the control plane refuses it for good.

Every message is the agent's own text, chosen by the error code; the control
plane's message is never repeated (invariant 10). Each names the runbook step
in docs/node-agent.md.
"""

from __future__ import annotations

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

from .client import Refused

RUNBOOK = "docs/node-agent.md"
_MINT = (
    "mint a fresh enrollment token (`modelforge enroll --name NAME` on the control plane, or "
    "POST /api/v1/admin/node-enrollments) and set it as "
    "MODELFORGE_AGENT_ENROLLMENT_TOKEN"
)
_REENROLL = (
    f"Runbook step 'Re-enroll a node' ({RUNBOOK}): {_MINT}, then restart the agent; it keeps "
    "its identity and node id."
)
_NEW_NODE = (
    f"Runbook step 'Enroll the hardware as a new node' ({RUNBOOK}): delete identity.json from "
    f"the state volume, {_MINT} and restart the agent."
)


class AgentExit(Exception):
    """Stop the agent with this exit status and one-line message."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


ENROLLMENT_REFUSALS = {
    ENROLLMENT_TOKEN_INVALID: "the control plane does not know this enrollment token; " + _MINT,
    ENROLLMENT_TOKEN_CONSUMED: "this enrollment token was already used (tokens are single-use): "
    "by this host if an earlier attempt's answer was lost, or by another. Check the control "
    "plane's node list for this host name; " + _MINT,
    ENROLLMENT_TOKEN_EXPIRED: "this enrollment token has expired; " + _MINT,
    ENROLLMENT_TOKEN_REVOKED: "this enrollment token was revoked by an administrator; " + _MINT,
    ENROLLMENT_ORIGIN_MISMATCH: "the token is locked to another API origin; set "
    "MODELFORGE_AGENT_CONTROL_PLANE_URL to exactly the origin shown when the token was minted",
    IDENTITY_SECRET_MISMATCH: "the control plane knows this identity id with a different secret. "
    "Restore the original identity.json from the state volume, or: " + _NEW_NODE,
    NODE_DECOMMISSIONED: "this identity belongs to a decommissioned node. " + _NEW_NODE,
}


def enrollment_refused(refusal: Refused) -> AgentExit:
    what = ENROLLMENT_REFUSALS.get(refusal.code or "")
    if what is None:
        what = f"enrollment was refused ({refusal.code or 'no known error code'}); " + _MINT
    return AgentExit(EXIT_ENROLLMENT_REFUSED, f"enrollment refused: {what}")


CREDENTIAL_REFUSALS = {
    CREDENTIAL_REVOKED: "this node's credential was revoked; revoked credentials stay refused, "
    "so retrying cannot help. " + _REENROLL,
    CREDENTIAL_INVALID: "the control plane does not recognise this node's credential "
    "(a restored or replaced control plane, or an edited identity.json). " + _REENROLL,
    CREDENTIAL_MISSING: "the control plane did not receive a credential. " + _REENROLL,
    CREDENTIAL_NODE_MISMATCH: "the stored credential belongs to another node (identity.json "
    "was copied between hosts or edited). " + _REENROLL,
    NODE_DECOMMISSIONED: "this node was decommissioned by an administrator. " + _NEW_NODE,
}


def credential_refused_message(code: str | None) -> str:
    what = CREDENTIAL_REFUSALS.get(code or "")
    if what is None:
        what = "the control plane refused this node's credential. " + _REENROLL
    return f"credential refused ({code or 'no known error code'}): {what}"


def credential_refused(code: str | None) -> AgentExit:
    return AgentExit(EXIT_CREDENTIAL_REFUSED, credential_refused_message(code))
