"""Replicas: which node should hold which model revision, and what it reports it holds.

Nothing moves until an administrator asks (docs/architecture.md §10). Each request or
removal bumps the node's ``models_generation`` in its transaction; the heartbeat answer
carries it, so the agent fetches ``GET /agent/models`` when it changes. A replica shows
``present`` only from the node's verified report since its last enrollment or the last
restore (which nulls ``reported_at``): presence is measured, never assumed.
"""

from __future__ import annotations

import json
from typing import Any

from modelforge_contract import ONLINE
from modelforge_contract.models import (
    NODE_NOT_ELIGIBLE,
    REPLICA_DOWNLOADING,
    REPLICA_FAILED,
    REPLICA_NOT_FOUND,
    REPLICA_PENDING,
    REPLICA_PRESENT,
    REPLICA_REMOVING,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, NotFound
from ..core.settings import Settings
from ..fleet.nodes import liveness_of
from ..identity.credentials import Caller
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model, ModelReplica, Node
from . import catalog


def shown_state(replica: ModelReplica, node: Node) -> str:
    """``present`` only when measured since the node's enrollment (and any restore)."""
    if replica.state == REPLICA_PRESENT and (
        replica.reported_at is None or replica.reported_at < node.enrolled_at
    ):
        return REPLICA_PENDING
    return replica.state


def replica_view(replica: ModelReplica, model: Model, node: Node) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "display_name": node.display_name,
        "revision": model.revision,
        "digest": model.digest,
        "state": shown_state(replica, node),
        "bytes_done": replica.bytes_done,
        "bytes_total": replica.bytes_total,
        "error": json.loads(replica.error) if replica.error else None,
        "requested_at": isoformat(replica.requested_at),
        "updated_at": isoformat(replica.updated_at),
        "reported_at": isoformat(replica.reported_at),
    }


def _replicas_joined():
    """Replica rows with their model and node, for replica_view."""
    return (
        ModelReplica.select(ModelReplica, Model, Node).join(Model).switch(ModelReplica).join(Node)
    )


def _replicas_query(models: list[Model]):
    return (
        _replicas_joined()
        .where(ModelReplica.model.in_([m.model_id for m in models]))
        .order_by(Node.display_name, Node.node_id, Model.created_at)
    )


def replicas_on_node(store: Store, node_id: str) -> list[dict[str, Any]]:
    """The model revisions one node holds or is asked to, each with its model's name."""
    with store.connection():
        rows = list(
            _replicas_joined()
            .where(ModelReplica.node == node_id)
            .order_by(Model.name, Model.created_at)
        )
    return [{"model": r.model.name, **replica_view(r, r.model, r.node)} for r in rows]


def list_replicas(store: Store, models: list[Model]) -> list[dict[str, Any]]:
    with store.connection():
        rows = list(_replicas_query(models))
    return [replica_view(r, r.model, r.node) for r in rows]


def _eligible(node: Node | None, node_id: str, now: float, settings: Settings) -> Node:
    if node is None:
        raise NotFound(f"no node {node_id}")
    liveness = liveness_of(node, now, settings)
    if liveness != ONLINE:
        raise Conflict(
            f"node {node.display_name} ({node.node_id}) is {liveness}; only an online node "
            "takes a replica",
            code=NODE_NOT_ELIGIBLE,
            next_step="Bring the node online (its agent heartbeating), or choose another node.",
            extra={"node_id": node.node_id, "liveness": liveness},
        )
    return node


def replicate(
    store: Store,
    settings: Settings,
    name: str,
    node_ids: list[str],
    actor: str,
    revision: str | None = None,
) -> list[dict[str, Any]]:
    """Ask each node for the revision (all or nothing). An existing replica is kept as it is;
    a failed or removing one goes back to pending."""
    model = catalog.get_revision(store, name, revision)
    wanted = list(dict.fromkeys(node_ids))
    now = store.clock.now()
    total = model.size_bytes
    with store.write():
        found = {n.node_id: n for n in Node.select().where(Node.node_id.in_(wanted))}
        targets = [_eligible(found.get(node_id), node_id, now, settings) for node_id in wanted]
        for node in targets:
            ModelReplica.insert(
                model=model.model_id,
                node=node.node_id,
                state=REPLICA_PENDING,
                bytes_done=0,
                bytes_total=total,
                error=None,
                requested_by=actor,
                requested_at=now,
                updated_at=now,
                reported_at=None,
            ).on_conflict_ignore().execute()
            ModelReplica.update(
                state=REPLICA_PENDING,
                error=None,
                requested_by=actor,
                requested_at=now,
                updated_at=now,
            ).where(
                (ModelReplica.model == model.model_id)
                & (ModelReplica.node == node.node_id)
                & ModelReplica.state.in_([REPLICA_FAILED, REPLICA_REMOVING])
            ).execute()
            Node.update(models_generation=Node.models_generation + 1).where(
                Node.node_id == node.node_id
            ).execute()
        audit.record(
            store,
            actor,
            "model.replicated",
            name=model.name,
            revision=model.revision,
            digest=model.digest,
            node_ids=[n.node_id for n in targets],
        )
        rows = list(_replicas_query([model]).where(ModelReplica.node.in_(wanted)))
    order = {node_id: index for index, node_id in enumerate(wanted)}
    rows.sort(key=lambda r: order[r.node.node_id])
    return [replica_view(r, r.model, r.node) for r in rows]


def remove_replica(
    store: Store, name: str, node_id: str, actor: str, revision: str | None = None
) -> list[dict[str, Any]]:
    """Ask the node to remove its replica(s) of name: state ``removing`` until the node no
    longer reports it, then the row goes (record_report)."""
    models = (
        [catalog.get_revision(store, name, revision)]
        if revision
        else catalog.revisions_of(store, name)
    )
    now = store.clock.now()
    with store.write():
        rows = list(_replicas_query(models).where(ModelReplica.node == node_id))
        if not rows:
            raise NotFound(
                f"model {name} has no replica on node {node_id}",
                code=REPLICA_NOT_FOUND,
                next_step=f"See its replicas with `modelforge models replicas {name}`.",
            )
        in_use = list(
            Deployment.select(Deployment.name)
            .join(DeploymentServer)
            .where(
                Deployment.model.in_([r.model.model_id for r in rows])
                & (DeploymentServer.node == node_id)
            )
            .distinct()
        )
        catalog.refuse_in_use(f"{name} on node {node_id}", in_use)
        ids = [r.id for r in rows]
        ModelReplica.update(state=REPLICA_REMOVING, updated_at=now).where(
            ModelReplica.id.in_(ids)
        ).execute()
        Node.update(models_generation=Node.models_generation + 1).where(
            Node.node_id == node_id
        ).execute()
        for row in rows:
            audit.record(
                store,
                actor,
                "model.replica_removed",
                node_id=node_id,
                name=name,
                revision=row.model.revision,
                digest=row.model.digest,
            )
        rows = list(_replicas_query(models).where(ModelReplica.node == node_id))
    return [replica_view(r, r.model, r.node) for r in rows]


def _node_replicas(node_id: str):
    return (
        ModelReplica.select(ModelReplica, Model)
        .join(Model)
        .where(ModelReplica.node == node_id)
        .order_by(Model.created_at)
    )


def desired_for(store: Store, node_id: str) -> dict[str, Any]:
    """What ``GET /agent/models`` answers the node: the manifests to hold, the digests to
    remove, and its generation."""
    with store.connection():
        rows = list(_node_replicas(node_id))
        generation = Node.select(Node.models_generation).where(Node.node_id == node_id).scalar()
    held = [r for r in rows if r.state != REPLICA_REMOVING]
    return {
        "models": [
            {"digest": r.model.digest, "manifest": json.loads(r.model.manifest)} for r in held
        ],
        "remove": sorted({r.model.digest for r in rows if r.state == REPLICA_REMOVING}),
        "models_generation": generation or 0,
    }


def blob_assigned(store: Store, node_id: str, digest_hex: str) -> bool:
    """Whether a replica (not being removed) on this node lists the blob."""
    with store.connection():
        manifests = [
            row[0]
            for row in ModelReplica.select(Model.manifest)
            .join(Model)
            .where((ModelReplica.node == node_id) & (ModelReplica.state != REPLICA_REMOVING))
            .tuples()
        ]
    return any(
        entry["sha256"] == digest_hex for text in manifests for entry in json.loads(text)["files"]
    )


def record_report(
    store: Store, caller: Caller, reported: list[dict[str, Any]] | None, now: float
) -> None:
    """Apply the ``models`` list of an inventory to the node's replicas (see the module)."""
    if reported is None:  # an agent from before models: nothing changes
        return
    by_digest = {entry["digest"]: entry for entry in reported}
    node_id = caller.node_id
    with store.write():
        for replica in list(_node_replicas(node_id)):
            digest = replica.model.digest
            entry = by_digest.get(digest)
            if entry is None:
                if replica.state == REPLICA_REMOVING:
                    replica.delete_instance()
                    audit.record(
                        store,
                        f"node:{node_id}",
                        "model.replica_gone",
                        node_id=node_id,
                        name=replica.model.name,
                        revision=replica.model.revision,
                        digest=digest,
                    )
                elif replica.state in (REPLICA_PRESENT, REPLICA_DOWNLOADING):
                    ModelReplica.update(
                        state=REPLICA_PENDING, bytes_done=0, updated_at=now, reported_at=None
                    ).where(ModelReplica.id == replica.id).execute()
                continue
            if replica.state == REPLICA_REMOVING:
                continue  # still on the node: the row stays until it is gone
            state = entry["state"]
            error = entry.get("error") if state == REPLICA_FAILED else None
            changes: dict[str, Any] = {
                "state": state,
                "bytes_done": entry["bytes_done"],
                "bytes_total": entry["bytes_total"],
                "error": json.dumps(error, sort_keys=True) if error else None,
            }
            if state == REPLICA_PRESENT:
                changes["reported_at"] = now
            same = all(getattr(replica, key) == value for key, value in changes.items())
            if same and state != REPLICA_PRESENT:
                continue
            changes["updated_at"] = now
            ModelReplica.update(**changes).where(ModelReplica.id == replica.id).execute()
            if state == REPLICA_PRESENT and not (
                replica.state == REPLICA_PRESENT and replica.reported_at is not None
            ):
                # Newly present: a server waiting for this model may start now, so the
                # agent fetches its servers again (deployments/, docs/architecture.md §11).
                Node.update(servers_generation=Node.servers_generation + 1).where(
                    Node.node_id == node_id
                ).execute()


def replica_counts(store: Store) -> dict[str, int]:
    """Replicas per stored state (the metrics gauge)."""
    with store.connection():
        rows = ModelReplica.select(ModelReplica.state).tuples()
        counts: dict[str, int] = {}
        for (state,) in rows:
            counts[state] = counts.get(state, 0) + 1
    return counts
