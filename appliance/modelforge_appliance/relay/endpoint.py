"""The control plane's end of agents' tunnels: who may open one, and serving it.

A tunnel is authenticated before the WebSocket upgrade completes, exactly as every agent
call is (invariant 4 and invariant 8): the node credential in ``Authorization`` and an
accepted agent protocol, else a plain HTTP refusal in the one error shape (401, 403, 426).
Once up, the node's tunnel carries only streams for servers placed on that node (the hub
opens streams by node), and a frame that breaks the contract closes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelforge_contract import (
    COMPATIBILITY_NEXT_STEPS,
    COMPATIBLE,
    HEADER_AGENT_PROTOCOL,
    TOO_MANY_TUNNELS,
    compatibility_of,
)

from ..core.errors import ApiError, UpgradeRequired
from ..identity import credentials
from ..store.database import Store
from .hub import Hub

# A node's tunnels at once: its live one and those still closing (a replaced tunnel closes
# within the WebSocket close timeout). A node reconnecting faster than they close is refused
# rather than holding a connection per attempt.
MAX_TUNNELS_PER_NODE = 3
RETRY_AFTER_SECONDS = 5


def too_many_tunnels(protocol: str | None) -> ApiError:
    return ApiError(
        "this node holds as many tunnels as it may (its live one, the others still closing)",
        code=TOO_MANY_TUNNELS,
        status=503,
        next_step="Retry after the time Retry-After gives; the node agent does so by itself.",
        extra={
            "retry_after_seconds": RETRY_AFTER_SECONDS,
            "compatibility": compatibility_of(protocol),
        },
    )


@dataclass(frozen=True)
class Admitted:
    """A tunnel ``accept`` let through: the node it is and the credential that opened it."""

    node_id: str
    credential_id: str | None


class TunnelEndpoint:
    """``accept`` (on a store thread) and ``serve`` (on the relay's loop) for the front's
    WebSocket handler (runtime/tunnel_websocket.py)."""

    def __init__(self, store: Store, hub: Hub) -> None:
        self.store, self.hub = store, hub

    def accept(self, headers: Any) -> Admitted:
        answer = compatibility_of(headers.get(HEADER_AGENT_PROTOCOL))
        if answer != COMPATIBLE:
            raise UpgradeRequired(
                f"agent protocol {str(headers.get(HEADER_AGENT_PROTOCOL))[:32]!r} is not "
                f"accepted ({answer})",
                next_step=COMPATIBILITY_NEXT_STEPS[answer],
                extra={"compatibility": answer},
            )
        credential = credentials.authenticate_credential(self.store, headers.get("Authorization"))
        if self.hub.tunnels_held(credential.owner) >= MAX_TUNNELS_PER_NODE:
            raise too_many_tunnels(headers.get(HEADER_AGENT_PROTOCOL))
        return Admitted(credential.owner, credential.credential_id)

    def serve(self, link: Any, admitted: Admitted) -> None:
        """The node's tunnel from now on (never waits: the link pushes its frames)."""
        self.hub.register(admitted.node_id, link, admitted.credential_id).start()
