"""Which server a client request goes to: a running server of the deployment the request's
``model`` names, on a node whose tunnel is up here, the one with the fewest requests in
flight (a failover: another one than it tried)."""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from modelforge_contract import FIELD_REQUIRED, FIELD_TYPE
from modelforge_contract.deployments import ROLE_MAIN, SERVER_IDLE, SERVER_RUNNING
from modelforge_contract.relay import COLD_START_TIMEOUT, MODEL_NOT_DEPLOYED, NO_RUNNING_SERVER

from ..core.errors import ApiError, Invalid, NotFound
from ..deployments import idle
from ..deployments.idle import Usage
from ..deployments.placement import idle_unload_seconds
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model
from .hub import Hub


@dataclass(frozen=True)
class Target:
    deployment: str
    server_id: str
    node_id: str


def running_deployments(store: Store) -> list[dict[str, Any]]:
    """Deployments a client may call, for ``GET /v1/models``: those with a running server,
    and those unloaded (idle) that the next request starts."""
    with store.connection():
        rows = list(
            Deployment.select(Deployment.name, Deployment.created_at)
            .join(DeploymentServer)
            .where(
                DeploymentServer.state.in_((SERVER_RUNNING, SERVER_IDLE))
                & (DeploymentServer.role.is_null() | (DeploymentServer.role == ROLE_MAIN))
                & (Deployment.stopping == False)  # noqa: E712 - peewee's expression
            )
            .distinct()
            .order_by(Deployment.name)
        )
    return [{"name": r.name, "created_at": r.created_at} for r in rows]


# The client hot path: one prepared query, no model objects (as the heartbeat's caller read).
_PICK_SQL = (
    "SELECT d.stopping, s.server_id, s.node_id FROM deployment AS d "
    "LEFT JOIN deployment_server AS s ON s.deployment_id = d.deployment_id "
    "AND s.state = 'running' AND (s.role IS NULL OR s.role = 'main') WHERE d.name = ?"
)


_SEND_A_DEPLOYMENT = 'Send "model": "<deployment>"; GET /v1/models lists them.'


def pick(store: Store, hub: Hub, model: object, exclude: Collection[str] = frozenset()) -> Target:
    """The server for ``model``, other than the servers in ``exclude`` (those a failover
    already tried): 400 when the request names none, 404 MODEL_NOT_DEPLOYED, 503
    NO_RUNNING_SERVER."""
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
    reachable = [
        (sid, nid)
        for _, sid, nid in rows
        if sid is not None and sid not in exclude and hub.connected(nid)
    ]
    if not reachable:
        raise unreachable(model)
    # The fewest in flight; among equals, each in turn, so sequential clients spread too.
    loads = {sid: hub.in_flight(sid) for sid, _ in reachable}
    least = min(loads.values())
    ties = sorted(s for s in reachable if loads[s[0]] == least)
    server_id, node_id = ties[hub.next_turn() % len(ties)]
    return Target(model, server_id, node_id)


COLD_LOOK_SECONDS = 0.2  # how often a held cold request looks for a running server
WAKE_EVERY_SECONDS = 2.0  # and asks again for what it waits on (GPUs freed meanwhile)


def pick_or_start(
    store: Store,
    hub: Hub,
    model: object,
    usage: Usage,
    wait_seconds: float,
    on_cold_start: Callable[[str], None],
) -> Target:
    """As ``pick``, and a deployment that unloads when idle and has no running server now is
    started (idle.wake) and the request held until one runs and its tunnel is up, at most
    ``wait_seconds``: then 503 COLD_START_TIMEOUT with Retry-After (docs/deployments.md,
    "Load on demand"). ``on_cold_start`` counts each request held so."""
    try:
        target = pick(store, hub, model)
        usage.touch(target.deployment)  # only names that exist: a client cannot grow it
        return target
    except ApiError as refused:
        if refused.code != NO_RUNNING_SERVER or not _loads_on_demand(store, str(model)):
            raise
    name = str(model)
    on_cold_start(name)
    deadline = time.monotonic() + wait_seconds
    woken_at = float("-inf")
    while True:
        now = time.monotonic()
        if now - woken_at >= WAKE_EVERY_SECONDS:
            idle.wake(store, name, usage)
            woken_at = now
        try:
            return pick(store, hub, name)
        except ApiError as refused:
            if refused.code != NO_RUNNING_SERVER:
                raise
        if time.monotonic() + COLD_LOOK_SECONDS > deadline:
            raise _cold_start_timeout(name, wait_seconds)
        time.sleep(COLD_LOOK_SECONDS)


def _loads_on_demand(store: Store, name: str) -> bool:
    with store.connection():
        deployment = Deployment.get_or_none(
            (Deployment.name == name) & (Deployment.stopping == False)  # noqa: E712 - peewee's expression
        )
    return deployment is not None and idle_unload_seconds(deployment) is not None


def _cold_start_timeout(name: str, waited: float) -> ApiError:
    return ApiError(
        f"deployment {name} was unloaded and did not start within {waited:g} s",
        code=COLD_START_TIMEOUT,
        status=503,
        next_step="Send the request again: it keeps starting. `modelforge deployments show "
        f"{name}` says what its servers are doing (MODELFORGE_RELAY_COLD_START_SECONDS sets "
        "the wait).",
        extra={"retry_after_seconds": 10},
    )


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
