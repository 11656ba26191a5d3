"""Which server a client request goes to: a running server of the deployment the request's
``model`` names, on a node whose tunnel is up here, the one with the fewest requests in
flight."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from modelforge_contract import FIELD_REQUIRED, FIELD_TYPE
from modelforge_contract.deployments import SERVER_RUNNING
from modelforge_contract.relay import MODEL_NOT_DEPLOYED, NO_RUNNING_SERVER

from ..core.errors import ApiError, Invalid, NotFound
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model
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


_SEND_A_DEPLOYMENT = 'Send "model": "<deployment>"; GET /v1/models lists them.'


def pick(store: Store, hub: Hub, model: object) -> Target:
    """The server for ``model``: 400 when the request names none, 404 MODEL_NOT_DEPLOYED,
    503 NO_RUNNING_SERVER."""
    if model is None or model == "":
        raise Invalid(
            "the request names no `model`: it must name the deployment to call",
            code=FIELD_REQUIRED,
            next_step=_SEND_A_DEPLOYMENT,
        )
    if not isinstance(model, str):
        raise Invalid(
            "`model` must be a string: the name of a deployment",
            code=FIELD_TYPE,
            next_step=_SEND_A_DEPLOYMENT,
        )
    with store.connection():
        rows = store.db.execute_sql(_PICK_SQL.replace("?", store.db.param), (model,)).fetchall()
    if not rows or any(stopping for stopping, _, _ in rows):
        raise not_deployed(store, model)
    reachable = [(sid, nid) for _, sid, nid in rows if sid is not None and hub.connected(nid)]
    if not reachable:
        raise unreachable(model)
    server_id, node_id = min(reachable, key=lambda s: (hub.in_flight(s[0]), s[0]))
    return Target(model, server_id, node_id)


def not_deployed(store: Store, name: str) -> NotFound:
    """404 MODEL_NOT_DEPLOYED, saying what the client may have meant: the deployments that
    serve a model of that name, or the deployment names closest to it (off the hot path: only
    a request that found nothing pays for these reads)."""
    with store.connection():
        live = Deployment.select(Deployment.name).where(Deployment.stopping == False)  # noqa: E712 - peewee's expression
        names = sorted(d.name for d in live)
        serving = sorted(d.name for d in live.join(Model).where(Model.name == name))
    shown = repr(name[:64])
    if serving:
        return NotFound(
            f"{shown} is a model, not a deployment: deployment(s) {', '.join(serving)} serve it",
            code=MODEL_NOT_DEPLOYED,
            next_step=f'Send "model": "{serving[0]}" (a deployment\'s name, as GET /v1/models '
            "lists them).",
        )
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return NotFound(
        f"no deployment named {shown} serves clients here{hint}",
        code=MODEL_NOT_DEPLOYED,
        next_step="Name a deployment as `model`: GET /v1/models lists them.",
    )


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
