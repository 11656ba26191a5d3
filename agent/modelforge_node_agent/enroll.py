"""First start and re-enrollment: generate and persist the identity, then claim the token once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from modelforge_contract import (
    EXIT_ENROLLMENT_REFUSED,
    EXIT_PROTOCOL_INCOMPATIBLE,
    EXIT_USAGE,
    KIND_CREDENTIAL,
    PATH_AGENT_ENROLL,
    split_secret,
)

from . import __version__
from .backoff import BACKOFF_STEPS
from .client import (
    ControlPlaneClient,
    Refused,
    checked_interval,
    checked_node_id,
    incompatible_message,
)
from .identity import NodeState, load_state, new_identity, save_state, state_path
from .publisher import Wait, call_with_backoff
from .refusals import RUNBOOK, AgentExit, credential_refused, enrollment_refused
from .settings import AgentSettings

log = logging.getLogger(__name__)

TOKEN_REMOVABLE = (
    "MODELFORGE_AGENT_ENROLLMENT_TOKEN is no longer needed and can be removed: recreate the "
    f"agent container without it, keeping the state volume (runbook step 'Remove the "
    f"enrollment token', {RUNBOOK})"
)


@dataclass(frozen=True)
class Enrolled:
    state: NodeState
    heartbeat_interval: float | None  # from the enrollment answer, when this run enrolled


def load_or_create_identity(settings: AgentSettings) -> NodeState:
    """The stored state, or a new identity written to the state volume before any enrollment."""
    state = load_state(settings.state_volume)
    if state is None:
        state = new_identity()
        save_state(settings.state_volume, state)
        log.info(
            "generated node identity %s and saved it to %s",
            state.identity_id,
            state_path(settings.state_volume),
        )
    return state


def ensure_enrolled(
    settings: AgentSettings,
    state: NodeState,
    client: ControlPlaneClient,
    stop: threading.Event,
    *,
    wait: Wait | None = None,
    steps: Sequence[float] = BACKOFF_STEPS,
) -> Enrolled | None:
    """Enrolled state (claiming the token if needed); None when stopped; AgentExit when refused."""
    if state.enrolled:
        if settings.enrollment_token:
            # The token is never sent again once a credential exists (invariant 2).
            log.info("already enrolled as node %s; %s", state.node_id, TOKEN_REMOVABLE)
        return Enrolled(state, None)
    if not settings.enrollment_token:
        if state.credential_refused:
            raise credential_refused(state.credential_refused)
        raise AgentExit(
            EXIT_USAGE,
            "this node is not enrolled yet: set MODELFORGE_AGENT_ENROLLMENT_TOKEN to a token "
            f"minted on the control plane (runbook step 'Enrolling', {RUNBOOK})",
        )
    body = {
        "token": settings.enrollment_token,
        "hostname": settings.hostname,
        "agent_version": __version__,
        "accelerator_mode": settings.accelerator_mode,
        "identity": state.identity(),
    }
    log.info("enrolling identity %s as %s", state.identity_id, settings.hostname)
    try:
        answer = call_with_backoff(
            client,
            "POST",
            PATH_AGENT_ENROLL,
            lambda: body,
            stop=stop,
            wait=wait or stop.wait,
            steps=steps,
            retry_refusal=lambda refusal: refusal.transient,
            authenticated=False,
        )
    except Refused as refusal:
        log.error("%s", refusal.describe())
        if refusal.protocol_incompatible:
            raise AgentExit(EXIT_PROTOCOL_INCOMPATIBLE, incompatible_message(refusal)) from None
        raise enrollment_refused(refusal) from None
    if answer is None:
        return None
    node_id, credential = checked_node_id(answer.get("node_id")), answer.get("credential")
    if node_id is None or not isinstance(credential, str):
        raise AgentExit(EXIT_ENROLLMENT_REFUSED, "the enrollment answer carried no usable node id")
    if split_secret(credential, KIND_CREDENTIAL) is None:
        raise AgentExit(EXIT_ENROLLMENT_REFUSED, "the enrollment answer carried no credential")
    state = state.with_enrollment(node_id, credential)
    save_state(settings.state_volume, state)
    how = "re-enrolled (same identity; the previous credential is revoked)"
    log.info("%s as node %s", how if answer.get("reenrolled") else "enrolled", node_id)
    log.info("the enrollment token is used up; %s", TOKEN_REMOVABLE)
    return Enrolled(state, checked_interval(answer.get("heartbeat_interval_seconds")))
