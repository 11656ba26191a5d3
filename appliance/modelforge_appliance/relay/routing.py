"""Which server a client request goes to: a running server of the deployment the request's
``model`` names, on a node whose tunnel is up here, the one with the fewest requests in
flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelforge_contract.deployments import SERVER_RUNNING
from modelforge_contract.relay import MODEL_NOT_DEPLOYED, NO_RUNNING_SERVER

from ..core.errors import ApiError, NotFound
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer
from .hub import Hub


@dataclass(frozen=True)
class Target:
    deployment: str
    server_id: str
    node_id: str


def running_deployments(store: Store) -> list[dict[str, Any]]:
    """Deployments with at least one running server, for ``GET /v1/models``."""
    with store.connection():
        rows = list(
            Deployment.select(Deployment.name, Deployment.created_at)
            .join(DeploymentServer)
            .where(
                (DeploymentServer.state == SERVER_RUNNING) & (Deployment.stopping == False)  # noqa: E712 - peewee's expression
            )
            .distinct()
            .order_by(Deployment.name)
        )
    return [{"name": r.name, "created_at": r.created_at} for r in rows]


# The client hot path: one prepared query, no model objects (as the heartbeat's caller read).
_PICK_SQL = (
    "SELECT d.stopping, s.server_id, s.node_id FROM deployment AS d "
    "LEFT JOIN deployment_server AS s ON s.deployment_id = d.deployment_id "
    "AND s.state = 'running' WHERE d.name = ?"
)


def pick(store: Store, hub: Hub, model: object) -> Target:
    """The server for ``model``: 404 MODEL_NOT_DEPLOYED, 503 NO_RUNNING_SERVER."""
    name = model if isinstance(model, str) else ""
    with store.connection():
        rows = store.db.execute_sql(_PICK_SQL.replace("?", store.db.param), (name,)).fetchall()
    if not rows or any(stopping for stopping, _, _ in rows):
        raise NotFound(
            f"no deployment named {name[:64]!r} serves clients here",
            code=MODEL_NOT_DEPLOYED,
            next_step="Name a deployment as `model`: GET /v1/models lists them.",
        )
    reachable = [(sid, nid) for _, sid, nid in rows if sid is not None and hub.connected(nid)]
    if not reachable:
        raise unreachable(name)
    server_id, node_id = min(reachable, key=lambda s: (hub.in_flight(s[0]), s[0]))
    return Target(name, server_id, node_id)


def unreachable(name: str) -> ApiError:
    """503 NO_RUNNING_SERVER: none runs, or none is reachable (tunnel down, at its cap)."""
    return ApiError(
        f"deployment {name} has no running server reachable now",
        code=NO_RUNNING_SERVER,
        status=503,
        next_step="Try again shortly; `modelforge deployments show NAME` says what its "
        "servers are doing.",
        extra={"retry_after_seconds": 5},
    )
