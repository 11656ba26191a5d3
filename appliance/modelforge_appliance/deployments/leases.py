"""Serve leases: what a node's agent should run, its claims and renewals, and expiry.

A server is started by its node's agent under a long-lived lease it renews while the
server runs (docs/architecture.md §11). Each renewal carries the state the agent sees
(starting, running, backoff, stopped, failed) and answers whether the server should keep
running. What each event makes of a server is reconcile.step's to say; this module reads the
row, asks it, and writes the answer with a conditional ``UPDATE`` whose row count decides,
as for work leases: a renewal racing an expiry or a restart changes the row once, and the
loser is told how its lease ended (409 LEASE_LOST with ``lease_end``).

A lease that runs out (the agent or its node went away) leaves the server ``waiting``,
still listed to its node, so the agent claims it again when it is back (docs/deployments.md).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from modelforge_contract import LEASE_LOST
from modelforge_contract.deployments import (
    GOAL_RUN,
    LEASE_END_REPLACED,
    NODE_OFFLINE,
    NODE_STOPPING,
    ROLE_HELPER,
    SERVER_BACKOFF,
    SERVER_FAILED,
    SERVER_LEASE_LOST,
    SERVER_NOT_CLAIMABLE,
    SERVER_RUNNING,
    SERVER_STARTING,
    SERVER_STOPPED,
    SERVER_WAITING,
)

from ..core.clock import isoformat
from ..core.errors import Conflict
from ..core.settings import Settings
from ..identity.credentials import Caller
from ..models.replicas import shown_state
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model, ModelReplica, Node
from . import placement, reconcile, split
from .servers import apply_outcome, member_of

log = logging.getLogger(__name__)


def _actor(node_id: str) -> str:
    return f"node:{node_id}"


def desired_for(store: Store, node_id: str) -> dict[str, Any]:
    """What ``GET /agent/servers`` answers: the servers this node should run now (those
    whose model it reports present), and its generation."""
    with store.connection():
        rows = list(
            DeploymentServer.select(DeploymentServer, Deployment, Model)
            .join(Deployment)
            .join(Model)
            .where(
                (DeploymentServer.node == node_id)
                & DeploymentServer.state.in_(reconcile.CLAIMABLE)
                & (DeploymentServer.goal == GOAL_RUN)
                & (Deployment.stopping == False)  # noqa: E712 - peewee's expression
            )
            .order_by(DeploymentServer.server_id)
        )
        node = Node.get_by_id(node_id)
        replicas = {
            r.model_id: r
            for r in ModelReplica.select().where(
                (ModelReplica.node == node_id)
                & ModelReplica.model.in_([row.deployment.model_id for row in rows])
            )
        }
        servers = []
        for row in rows:
            deployment, model = row.deployment, row.deployment.model
            replica = replicas.get(model.model_id)
            present = replica is not None and shown_state(replica, node) == "present"
            if not present and row.role != ROLE_HELPER:  # a helper loads no file itself
                continue  # waiting for the model: listed once the node reports it present
            settings = json.loads(deployment.settings)
            listed, member = split.agent_entry(row, settings)
            if not listed:
                continue  # a split's main server: listed once its helpers run
            entry = {
                "server_id": row.server_id,
                "deployment": deployment.name,
                "model": {"name": model.name, "revision": model.revision, "digest": model.digest},
                "runtime": deployment.runtime,
                "settings": settings,
                "gpus": json.loads(row.gpus),
                "state": row.state,
                "restarts": row.restarts,
            }
            if member is not None:
                entry["split"] = member
            servers.append(entry)
    return {"servers": servers, "servers_generation": node.servers_generation}


@dataclass(frozen=True)
class ServeLease:
    server_id: str
    lease_id: str
    expires_at: float
    lease_seconds: int

    def view(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "lease_id": self.lease_id,
            "expires_at": isoformat(self.expires_at),
            "lease_seconds": self.lease_seconds,
        }


def _not_claimable(server_id: str) -> Conflict:
    return Conflict(
        f"server {server_id} is not one this node may start now: it is another node's, was "
        "stopped, unloaded, failed or removed",
        code=SERVER_NOT_CLAIMABLE,
        next_step="Stop any runtime of this server and fetch GET /agent/servers again.",
    )


def claim(store: Store, settings: Settings, caller: Caller, server_id: str) -> ServeLease:
    """A serve lease on one of this node's runnable servers. The same node claiming a
    server it already holds (its agent restarted) gets a new lease, and the old one ends
    ``replaced``; a starting or running server keeps its state, so a runtime still running
    is adopted; a pending, waiting or backing-off one is ``starting``."""
    now = store.clock.now()
    lease_id = uuid.uuid4().hex
    expires_at = now + settings.serve_lease_seconds
    with store.write(flushed=False):
        server = (
            DeploymentServer.select(DeploymentServer, Deployment)
            .join(Deployment)
            .where(
                (DeploymentServer.server_id == server_id)
                & (DeploymentServer.node == caller.node_id)
            )
            .first()
        )
        if (
            server is None
            or server.deployment.stopping
            or server.goal != GOAL_RUN
            or server.state not in reconcile.CLAIMABLE
        ):
            raise _not_claimable(server_id)
        outcome = reconcile.step(member_of(server, server.deployment), reconcile.CLAIM)
        changes: dict[str, Any] = {
            "lease_id": lease_id,
            "lease_expires_at": expires_at,
            "lease_credential_id": caller.credential_id,
        }
        if server.lease_id is not None:
            changes.update(previous_lease_id=server.lease_id, previous_lease_end=LEASE_END_REPLACED)
        if outcome.state != server.state:
            changes.update(state=outcome.state, state_since=now)
            if server.state == SERVER_WAITING:
                changes["error"] = None  # the node is back: why it waited is over
        held = (
            (DeploymentServer.server_id == server_id)
            & (DeploymentServer.state == server.state)
            & (
                DeploymentServer.lease_id.is_null()
                if server.lease_id is None
                else (DeploymentServer.lease_id == server.lease_id)
            )
        )
        if DeploymentServer.update(**changes).where(held).execute() != 1:
            raise _not_claimable(server_id)
        audit.record(
            store,
            _actor(caller.node_id),
            "server.leased",
            node_id=caller.node_id,
            credential_id=caller.credential_id,
            server_id=server_id,
            deployment=server.deployment.name,
            lease_id=lease_id,
            adopted=server.state in (SERVER_STARTING, SERVER_RUNNING),
            was=server.state,
        )
    return ServeLease(server_id, lease_id, expires_at, settings.serve_lease_seconds)


def _lease_lost(server_id: str, ended: str | None) -> Conflict:
    return Conflict(
        f"the serve lease on server {server_id} is no longer held by this node",
        code=LEASE_LOST,
        next_step="Stop the server's runtime (claim it again only if GET /agent/servers still "
        "lists it); nothing was changed.",
        extra={"lease_end": ended} if ended else None,
    )


def renew(
    store: Store,
    settings: Settings,
    caller: Caller,
    server_id: str,
    fields: dict[str, Any],
) -> dict[str, Any]:
    """Record the state the agent sees and extend the lease; answers ``{expires_at,
    desired: run | stop}``, or 409 LEASE_LOST (with how it ended) when it is not held."""
    now = store.clock.now()
    lease_id, reported = fields["lease_id"], fields["state"]
    expires_at = now + settings.serve_lease_seconds
    with store.write(flushed=reported in (SERVER_STOPPED, SERVER_FAILED)):
        server = (
            DeploymentServer.select(DeploymentServer, Deployment)
            .join(Deployment)
            .where(
                (DeploymentServer.server_id == server_id)
                & (DeploymentServer.node == caller.node_id)
            )
            .first()
        )
        live = (
            server is not None
            and server.lease_id == lease_id
            and server.lease_expires_at is not None
            and server.lease_expires_at > now
        )
        if not live:
            ended = (
                server.previous_lease_end
                if server is not None and server.previous_lease_id == lease_id
                else None
            )
            raise _lease_lost(server_id, ended)
        deployment = server.deployment
        outcome = reconcile.step(member_of(server, deployment), reconcile.REPORT, reported)
        extra = _reported(server, reported, fields, now)
        if outcome.end_lease is None:
            extra["lease_expires_at"] = expires_at
        if reported == SERVER_STOPPED and outcome.state == SERVER_WAITING:
            extra["error"] = json.dumps(
                {"code": NODE_STOPPING, "message": "the node's agent stopped it to go; it "
                 "starts again when the agent is back"}, sort_keys=True)  # fmt: skip
        held = (DeploymentServer.server_id == server_id) & (DeploymentServer.lease_id == lease_id)
        gone = apply_outcome(store, server, outcome, now, held, **extra)
        if gone is None:
            raise _lease_lost(server_id, None)
        if outcome.state != server.state:
            audit.record(
                store,
                _actor(caller.node_id),
                f"server.{outcome.state}",
                node_id=caller.node_id,
                server_id=server_id,
                deployment=deployment.name,
                state=outcome.state,
                error_code=(fields.get("error") or {}).get("code"),
                restarts=extra.get("restarts", server.restarts),
            )
    return {
        "expires_at": isoformat(expires_at),
        "desired": reconcile.desired(outcome.state) if outcome.end_lease is None else "stop",
        "state": outcome.state,
    }


def _reported(
    server: DeploymentServer, reported: str, fields: dict[str, Any], now: float
) -> dict[str, Any]:
    """The columns besides the state that a renewal's report changes."""
    changes: dict[str, Any] = {}
    restarts = fields.get("restarts")
    if restarts is not None and restarts != server.restarts:
        changes["restarts"] = restarts
    error = fields.get("error")
    if reported == SERVER_RUNNING:
        if server.state != SERVER_RUNNING:
            changes.update(started_at=now, error=None, next_attempt_at=None)
        return changes
    if error is not None:
        text = json.dumps(error, sort_keys=True)
        if text != server.error:
            changes["error"] = text
    elif reported == SERVER_FAILED:
        changes["error"] = json.dumps(
            {"code": "RUNTIME_EXITED", "message": "the agent reported a failure"}, sort_keys=True
        )
    if reported == SERVER_BACKOFF:
        wait = fields.get("next_attempt_in")
        changes["next_attempt_at"] = now + float(wait) if wait is not None else None
    elif server.next_attempt_at is not None:
        changes["next_attempt_at"] = None
    return changes


_EXPIRED_SQL = (
    "SELECT server_id FROM deployment_server WHERE lease_id IS NOT NULL AND lease_expires_at <= ?"
)

_AWAY = {
    SERVER_LEASE_LOST: "the node's agent stopped renewing the serve lease (the agent or its "
    "node stopped, or lost the control plane); it starts again when the agent is back",
    NODE_OFFLINE: "the node went offline; it starts again when the node is back online",
}


def expire_servers(store: Store, settings: Settings) -> list[str]:
    """End every lease that ran out, or whose node is no longer online: the server waits
    for its node (a stopping one lands where it was going); called before agent fetches
    and admin reads, like work's expiry."""
    now = store.clock.now()
    with store.connection():
        expired = [
            row[0]
            for row in store.db.execute_sql(
                _EXPIRED_SQL.replace("?", store.db.param), (now,)
            ).fetchall()
        ]
        leased = list(
            DeploymentServer.select(DeploymentServer, Node)
            .join(Node)
            .where(
                DeploymentServer.lease_id.is_null(False)
                & DeploymentServer.state.in_(reconcile.RUNNING_ON_NODE)
            )
        )
        offline = [
            s.server_id for s in leased if not placement.node_is_online(s.node, now, settings)
        ]
    todo = sorted(set(expired) | set(offline))
    if not todo:
        return []
    done = []
    with store.write(flushed=False):
        for server_id in todo:
            server = (
                DeploymentServer.select(DeploymentServer, Deployment)
                .join(Deployment)
                .where(DeploymentServer.server_id == server_id)
                .first()
            )
            if server is None or server.lease_id is None:
                continue
            ran_out = server.lease_expires_at is not None and server.lease_expires_at <= now
            if not ran_out and server_id not in offline:
                continue
            outcome = reconcile.step(member_of(server, server.deployment), reconcile.EXPIRE)
            extra: dict[str, Any] = {}
            if outcome.state == SERVER_WAITING:
                code = SERVER_LEASE_LOST if ran_out else NODE_OFFLINE
                extra["error"] = json.dumps({"code": code, "message": _AWAY[code]}, sort_keys=True)
            held = (DeploymentServer.server_id == server_id) & (
                DeploymentServer.lease_id == server.lease_id
            )
            if apply_outcome(store, server, outcome, now, held, **extra) is None:
                continue
            audit.record(
                store,
                "control-plane",
                "server.lease_expired",
                node_id=server.node_id,
                server_id=server_id,
                deployment=server.deployment.name,
                state=outcome.state,
            )
            done.append(server_id)
    if done:
        log.info("%d serve lease(s) expired", len(done))
    return done


def fail_node_servers(store: Store, node_id: str, actor: str, code: str, message: str) -> list[str]:
    """Fail (or, when stopping, stop) every server of a node taken out of service (inside
    the caller's transaction): only a person can choose where they run now."""
    now = store.clock.now()
    done = []
    rows = list(
        DeploymentServer.select(DeploymentServer, Deployment)
        .join(Deployment)
        .where(
            (DeploymentServer.node == node_id)
            & DeploymentServer.state.not_in((SERVER_STOPPED, SERVER_FAILED))
        )
        .order_by(DeploymentServer.server_id)
    )
    for server in rows:
        outcome = reconcile.step(member_of(server, server.deployment), reconcile.DECOMMISSION)
        extra: dict[str, Any] = {}
        if outcome.state == SERVER_FAILED:
            extra["error"] = json.dumps({"code": code, "message": message}, sort_keys=True)
        held = DeploymentServer.server_id == server.server_id
        apply_outcome(store, server, outcome, now, held, actor=actor, **extra)
        audit.record(
            store,
            actor,
            f"server.{outcome.state}",
            node_id=node_id,
            server_id=server.server_id,
            code=code,
        )
        done.append(server.server_id)
    return done
