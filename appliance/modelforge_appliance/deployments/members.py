"""Live membership (docs/deployments.md): nodes join and leave a deployment while it serves.

A node joins as a deploy would make its server: it must be eligible, offer the deployment's
runtime and report its model present (``replicate`` replicates first), and it gets GPUs of
its own (placement.py, servers.place_server); the call is all or nothing, and its new
server is ``pending`` (or ``idle``, as a deploy's would be, on GPUs another deployment that
unloads when idle runs on). A node leaves through reconcile.step's ``REMOVE``: a server
nobody holds goes at once, a leased one stops first (``stopping`` with goal ``remove``) and
its row goes when its agent reports it stopped, or its lease runs out (leases.py). Until
then it is still a member: it cannot be added again. The last member cannot leave;
undeploying is what ends a deployment. Clients keep calling the deployment by its name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from modelforge_contract.deployments import (
    ALREADY_A_MEMBER,
    DEPLOYMENT_NOT_FOUND,
    DEPLOYMENT_STOPPING,
    GOAL_IDLE,
    GOAL_REMOVE,
    GOAL_RUN,
    LAST_MEMBER,
    NOT_A_MEMBER,
    SERVER_IDLE,
    SPLIT_FIXED,
)

from ..core.errors import Conflict, NotFound
from ..core.settings import Settings
from ..models import replicas
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Node
from . import placement, reconcile
from .servers import (
    _bump,
    _dump,
    _get,
    _servers_of,
    apply_outcome,
    get_deployment,
    member_of,
    place_server,
)


def _refuse_stopping(deployment: Deployment) -> None:
    if deployment.stopping:
        raise Conflict(
            f"deployment {deployment.name} is being stopped",
            code=DEPLOYMENT_STOPPING,
            next_step=f"Wait for it to go (modelforge undeploy {deployment.name} --wait), then "
            "deploy it again on the nodes it should run on.",
        )


def _refuse_split(deployment: Deployment) -> None:
    if json.loads(deployment.settings).get("split"):
        raise Conflict(
            f"deployment {deployment.name} is split across nodes; its members are fixed",
            code=SPLIT_FIXED,
            next_step=f"Undeploy it (modelforge undeploy {deployment.name} --wait) and deploy "
            "it again with the --split you want.",
        )


def _refuse_members(deployment: Deployment, node_ids: list[str]) -> None:
    """409 ALREADY_A_MEMBER when one of ``node_ids`` has a server in the deployment (one
    that is leaving counts until its row has gone)."""
    rows = _servers_of([deployment.deployment_id])[deployment.deployment_id]
    already = [(s, n) for s, n in rows if n.node_id in node_ids]
    if not already:
        return
    leaving = [n for s, n in already if s.goal == GOAL_REMOVE]
    shown = ", ".join(f"{n.display_name} ({n.node_id})" for _, n in already)
    raise Conflict(
        f"{shown} {'is already a member' if len(already) == 1 else 'are already members'} of "
        f"deployment {deployment.name}; nothing was added",
        code=ALREADY_A_MEMBER,
        next_step="Wait for it to finish leaving (its agent stops its server at its next "
        "renewal), then add it again."
        if leaving
        else f"Leave it out; `modelforge deployments show {deployment.name}` lists the members.",
        extra={"node_ids": [n.node_id for _, n in already]},
    )


def _place(store: Store, deployment: Deployment, node: Node) -> tuple[list[str], str]:
    """The GPUs a new server of ``deployment`` gets on ``node`` and the state it starts in,
    as a deploy places one (409 GPUS_UNAVAILABLE)."""
    fields = {"gpu_count": deployment.gpu_count, "share_gpus": deployment.share_gpus}
    idle_capable = placement.idle_unload_seconds(deployment) is not None
    return place_server(store, node, fields, idle_capable)


def _lock(store: Store, name: str, node_ids: list[str]) -> None:
    """On PostgreSQL, the deployment's row and then the nodes' (in node_id order), so two
    membership changes of one deployment, and two placements on one node, commit one at a
    time (SQLite's write lock does that already); what is read after it is current."""
    if store.is_sqlite:
        return
    store.db.execute_sql("SELECT name FROM deployment WHERE name = %s FOR NO KEY UPDATE", (name,))
    for node_id in sorted(node_ids):
        store.db.execute_sql(
            "SELECT node_id FROM node WHERE node_id = %s FOR NO KEY UPDATE", (node_id,)
        )


def add_members(
    store: Store,
    settings: Settings,
    name: str,
    fields: dict[str, Any],
    actor: str,
    pending: Callable[[str], tuple[float, str] | None] = lambda node_id: None,
) -> dict[str, Any]:
    """A ``pending`` server on each node of ``fields["node_ids"]``, with the checks of a
    deploy (all or nothing); ``replicate`` replicates the model to those that lack it first.
    ``pending`` gives a node's newest heartbeat not yet in the store."""
    node_ids = list(dict.fromkeys(fields["node_ids"]))
    now = store.clock.now()
    with store.connection():
        deployment = _get(name)
        model = deployment.model
        _refuse_stopping(deployment)
        _refuse_split(deployment)
        _refuse_members(deployment, node_ids)
        found = {n.node_id: n for n in Node.select().where(Node.node_id.in_(node_ids))}
        joining = [
            placement.check_member(found.get(i), i, deployment.runtime, now, settings, pending(i))
            for i in node_ids
        ]
        missing = placement.missing_on(store, model, joining)
        for node in joining:  # checked before anything is replicated, and again below
            _place(store, deployment, node)
    if missing and not fields.get("replicate"):
        try:
            placement.refuse_missing(model, missing)
        except Conflict as refusal:
            refusal.next_step = (
                f"Replicate it first (modelforge models replicate {model.name} NODE…), or add "
                "the nodes with --replicate (replicate: true) to replicate and then start."
            )
            raise
    if missing:  # replicate first; each server starts once its node reports the model
        replicas.replicate(
            store, settings, model.name, [n.node_id for n in missing], actor, model.revision
        )
    with store.write():
        _lock(store, name, node_ids)
        checked, deployment = deployment, _get(name)  # undeployed, or joined, meanwhile?
        if deployment.deployment_id != checked.deployment_id:  # undeployed and made again
            raise NotFound(f"deployment {name} was made again meanwhile", code=DEPLOYMENT_NOT_FOUND)
        _refuse_stopping(deployment)
        _refuse_members(deployment, node_ids)
        placed = {node.node_id: _place(store, deployment, node) for node in joining}
        chosen = {node_id: gpus for node_id, (gpus, _) in placed.items()}
        for node in joining:
            state = placed[node.node_id][1]
            DeploymentServer.create(
                server_id=uuid.uuid4().hex,
                deployment=deployment.deployment_id,
                node=node.node_id,
                state=state,
                goal=GOAL_IDLE if state == SERVER_IDLE else GOAL_RUN,
                state_since=now,
                error=None,
                gpus=_dump(chosen[node.node_id]),
                restarts=0,
            )
        _bump(node_ids)
        audit.record(
            store,
            actor,
            "deployment.members_added",
            name=name,
            deployment_id=deployment.deployment_id,
            node_ids=node_ids,
            gpus=chosen,
            replicated=[n.node_id for n in missing],
        )
    return get_deployment(store, name)


def remove_member(store: Store, name: str, node_id: str, actor: str) -> dict[str, Any]:
    """Take ``node_id`` out of the deployment: its server stops and its row goes (at once
    when nobody holds it). 404 NOT_A_MEMBER; 409 LAST_MEMBER when no member would stay."""
    now = store.clock.now()
    with store.write():
        _lock(store, name, [])
        deployment = _get(name)
        _refuse_stopping(deployment)
        _refuse_split(deployment)
        rows = _servers_of([deployment.deployment_id])[deployment.deployment_id]
        server = next((s for s, n in rows if n.node_id == node_id), None)
        if server is None:
            raise NotFound(
                f"node {node_id} is not a member of deployment {name}",
                code=NOT_A_MEMBER,
                next_step=f"`modelforge deployments show {name}` lists its members.",
            )
        staying = [s for s, n in rows if n.node_id != node_id and s.goal != GOAL_REMOVE]
        if not staying:
            raise Conflict(
                f"node {node_id} is the last member of deployment {name}; a deployment needs one",
                code=LAST_MEMBER,
                next_step=f"Add another node first (modelforge deployments add-nodes {name} "
                f"NODE), or stop the deployment: modelforge undeploy {name}.",
            )
        outcome = reconcile.step(member_of(server, deployment), reconcile.REMOVE)
        held = DeploymentServer.server_id == server.server_id
        apply_outcome(store, server, outcome, now, held, actor=actor)
        _bump([node_id])  # its agent fetches its servers again and stops this one
        audit.record(
            store,
            actor,
            "deployment.member_removed",
            name=name,
            deployment_id=deployment.deployment_id,
            node_id=node_id,
            server_id=server.server_id,
            state="removed" if outcome.delete else outcome.state,
        )
    return get_deployment(store, name)
