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
    KIND_ENROLLMENT,
    PATH_AGENT_ENROLL,
    split_secret,
)

from . import __version__, runtime
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
from .refusals import (
    SECTION_ENROLLING,
    SECTION_REMOVE_TOKEN,
    AgentExit,
    credential_refused,
    enrollment_refused,
    see,
)
from .settings import AgentSettings

log = logging.getLogger(__name__)


def token_id(token: str | None) -> str | None:
    """The enrollment token's lookup id (not secret), or None."""
    parsed = split_secret(token, KIND_ENROLLMENT) if token else None
    return parsed[0] if parsed else None


def token_is_spent(settings: AgentSettings, state: NodeState) -> bool:
    """The configured token is the one this node already enrolled with."""
    spent = state.enrollment_id
    return spent is not None and token_id(settings.enrollment_token) == spent


def token_removable(subject: str = "it") -> str:
    """'SUBJECT is used up and can be removed: <how>' (said once, whoever says it)."""
    return (
        f"{subject} is used up and can be removed: "
        f"{runtime.remove_token_step()} {see(SECTION_REMOVE_TOKEN)}"
    )


def explain_unused_token(settings: AgentSettings, state: NodeState) -> str:
    """What the agent does with a token set while it holds a credential."""
    if state.enrollment_id is not None and not token_is_spent(settings, state):
        return (
            "MODELFORGE_AGENT_ENROLLMENT_TOKEN holds a token this node has not used; it is kept "
            "in reserve and sent only if the control plane refuses this node's credential "
            "(the agent then re-enrolls with it at once)"
        )
    return f"MODELFORGE_AGENT_ENROLLMENT_TOKEN is not sent again; {token_removable()}"


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
    announce_spent_token: bool = True,
) -> Enrolled | None:
    """Enrolled state (claiming the token if needed); None when stopped; AgentExit when refused.

    A token this node already enrolled with is never sent again: with a refused credential
    that ends in exit 6 at once, not in a refusal from the control plane.
    """
    if state.enrolled:
        if settings.enrollment_token and announce_spent_token:
            # A spent token is never sent again once a credential exists (invariant 2).
            log.info(
                "already enrolled as node %s; %s",
                state.node_id,
                explain_unused_token(settings, state),
            )
        return Enrolled(state, None)
    if not settings.enrollment_token or (
        state.credential_refused and token_is_spent(settings, state)
    ):
        if state.credential_refused:
            raise credential_refused(state.credential_refused)
        raise AgentExit(
            EXIT_USAGE,
            "this node is not enrolled yet: join it with `modelforge-node-agent join URL "
            "--token-file -`, or set MODELFORGE_AGENT_ENROLLMENT_TOKEN to a token minted on "
            f"the control plane {see(SECTION_ENROLLING)}",
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
        raise enrollment_refused(refusal, client.base_url) from None
    if answer is None:
        return None
    node_id, credential = checked_node_id(answer.get("node_id")), answer.get("credential")
    if node_id is None or not isinstance(credential, str):
        raise AgentExit(EXIT_ENROLLMENT_REFUSED, "the enrollment answer carried no usable node id")
    if split_secret(credential, KIND_CREDENTIAL) is None:
        raise AgentExit(EXIT_ENROLLMENT_REFUSED, "the enrollment answer carried no credential")
    state = state.with_enrollment(node_id, credential, token_id(settings.enrollment_token))
    save_state(settings.state_volume, state)
    how = "re-enrolled (same identity; the previous credential is revoked)"
    log.info("%s as node %s", how if answer.get("reenrolled") else "enrolled", node_id)
    if announce_spent_token:
        log.info("%s", token_removable("the enrollment token"))
    return Enrolled(state, checked_interval(answer.get("heartbeat_interval_seconds")))
