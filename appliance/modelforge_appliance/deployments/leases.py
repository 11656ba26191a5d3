"""Serve leases: what a node's agent should run, its claims and renewals, and expiry.

A server is started by its node's agent under a long-lived lease it renews while the
server runs (docs/architecture.md §11). Each renewal carries the state the agent sees
(starting, running, stopped, failed) and answers whether the server should keep running.
Every transition is a conditional ``UPDATE`` whose row count decides, as for work leases:
a renewal racing an expiry or a restart changes the row once, and the loser is told how
its lease ended (409 LEASE_LOST with ``lease_end``).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from modelforge_contract import LEASE_LOST
from modelforge_contract.deployments import (
    LEASE_END_EXPIRED,
    LEASE_END_REPLACED,
    LEASE_END_STOPPED,
    NODE_OFFLINE,
    SERVER_FAILED,
    SERVER_LEASE_LOST,
    SERVER_NOT_CLAIMABLE,
    SERVER_PENDING,
    SERVER_RUNNING,
    SERVER_STARTING,
    SERVER_STOPPED,
    SERVER_STOPPING,
)

from ..core.clock import isoformat
from ..core.errors import Conflict
from ..core.settings import Settings
from ..identity.credentials import Caller
from ..models.replicas import shown_state
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model, ModelReplica, Node
from . import placement
from .servers import end_lease, reap

log = logging.getLogger(__name__)

_RUNNABLE = (SERVER_PENDING, SERVER_STARTING, SERVER_RUNNING)


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
                & DeploymentServer.state.in_(_RUNNABLE)
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
        if replica is None or shown_state(replica, node) != "present":
            continue  # waiting for the model: listed once the node reports it present
        settings = json.loads(deployment.settings)
        servers.append(
            {
                "server_id": row.server_id,
                "deployment": deployment.name,
                "model": {"name": model.name, "revision": model.revision, "digest": model.digest},
                "runtime": deployment.runtime,
                "settings": settings,
                "gpus": json.loads(row.gpus),
                "state": row.state,
            }
        )
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
        "stopped, failed or removed",
        code=SERVER_NOT_CLAIMABLE,
        next_step="Stop any runtime of this server and fetch GET /agent/servers again.",
    )


def claim(store: Store, settings: Settings, caller: Caller, server_id: str) -> ServeLease:
    """A serve lease on one of this node's runnable servers. The same node claiming a
    server it already holds (its agent restarted) gets a new lease, and the old one ends
    ``replaced``; the server's state is kept, so a runtime still running is adopted."""
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
        if server is None or server.deployment.stopping or server.state not in _RUNNABLE:
            raise _not_claimable(server_id)
        changes: dict[str, Any] = {
            "lease_id": lease_id,
            "lease_expires_at": expires_at,
            "lease_credential_id": caller.credential_id,
        }
        if server.lease_id is not None:
            changes.update(previous_lease_id=server.lease_id, previous_lease_end=LEASE_END_REPLACED)
        if server.state == SERVER_PENDING:
            changes.update(state=SERVER_STARTING, state_since=now)
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
            adopted=server.state != SERVER_PENDING,
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
        server = DeploymentServer.get_or_none(
            (DeploymentServer.server_id == server_id) & (DeploymentServer.node == caller.node_id)
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
        changes, event = _transition(server, reported, fields, now, expires_at)
        held = (DeploymentServer.server_id == server_id) & (DeploymentServer.lease_id == lease_id)
        if DeploymentServer.update(**changes).where(held).execute() != 1:
            raise _lease_lost(server_id, None)
        if event is not None:
            deployment = Deployment.get_by_id(server.deployment_id)
            audit.record(
                store,
                _actor(caller.node_id),
                event,
                node_id=caller.node_id,
                server_id=server_id,
                deployment=deployment.name,
                state=changes.get("state", server.state),
                error_code=(fields.get("error") or {}).get("code"),
                restarts=changes.get("restarts", server.restarts),
            )
        state = changes.get("state", server.state)
        if state == SERVER_STOPPED:
            reap(store, server.deployment_id, _actor(caller.node_id))
    desired = "run" if state in (SERVER_STARTING, SERVER_RUNNING) else "stop"
    return {"expires_at": isoformat(expires_at), "desired": desired, "state": state}


def _transition(
    server: DeploymentServer,
    reported: str,
    fields: dict[str, Any],
    now: float,
    expires_at: float,
) -> tuple[dict[str, Any], str | None]:
    """The columns a renewal changes, and the audit event when the state moved."""
    changes: dict[str, Any] = {"lease_expires_at": expires_at}
    restarts = fields.get("restarts")
    if restarts is not None and restarts != server.restarts:
        changes["restarts"] = restarts
    error = fields.get("error")
    if server.state == SERVER_STOPPING:
        if reported in (SERVER_STOPPED, SERVER_FAILED):
            return {
                **changes,
                **end_lease(server, LEASE_END_STOPPED),
                "state": SERVER_STOPPED,
                "state_since": now,
            }, "server.stopped"
        return changes, None  # still stopping: the answer says stop
    if reported == SERVER_FAILED:
        failure = error or {"code": "RUNTIME_EXITED", "message": "the agent reported a failure"}
        return {
            **changes,
            **end_lease(server, SERVER_FAILED),
            "state": SERVER_FAILED,
            "state_since": now,
            "error": json.dumps(failure, sort_keys=True),
        }, "server.failed"
    if reported == SERVER_STOPPED:  # stopped on its own (the agent's node is stopping)
        return {
            **changes,
            **end_lease(server, LEASE_END_STOPPED),
            "state": SERVER_PENDING,
            "state_since": now,
        }, "server.stopped"
    if reported == server.state:
        if error is not None and json.dumps(error, sort_keys=True) != server.error:
            changes["error"] = json.dumps(error, sort_keys=True)
        return changes, None
    changes.update(state=reported, state_since=now)
    if reported == SERVER_RUNNING:
        changes.update(started_at=now, error=None)
        return changes, "server.running"
    # back to starting: the runtime exited and the agent is restarting it
    changes["error"] = json.dumps(error, sort_keys=True) if error else server.error
    return changes, "server.restarting"


_EXPIRED_SQL = (
    "SELECT server_id FROM deployment_server WHERE lease_id IS NOT NULL AND lease_expires_at <= ?"
)


def expire_servers(store: Store, settings: Settings) -> list[str]:
    """Fail every server whose lease ran out, or whose node is no longer online (a stopping
    one just stops); called before agent fetches and admin reads, like work's expiry."""
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
                & DeploymentServer.state.in_((SERVER_STARTING, SERVER_RUNNING))
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
            server = DeploymentServer.get_or_none(DeploymentServer.server_id == server_id)
            if server is None or server.lease_id is None:
                continue
            ran_out = server.lease_expires_at is not None and server.lease_expires_at <= now
            if not ran_out and server_id not in offline:
                continue
            if server.state == SERVER_STOPPING:
                values = {"state": SERVER_STOPPED}
            else:
                code, message = (
                    (
                        SERVER_LEASE_LOST,
                        "the node's agent stopped renewing the serve lease (the agent or its "
                        "node stopped, or lost the control plane)",
                    )
                    if ran_out
                    else (NODE_OFFLINE, "the node went offline while the server ran")
                )
                values = {
                    "state": SERVER_FAILED,
                    "error": json.dumps({"code": code, "message": message}, sort_keys=True),
                }
            changed = (
                DeploymentServer.update(
                    **end_lease(server, LEASE_END_EXPIRED), state_since=now, **values
                )
                .where(
                    (DeploymentServer.server_id == server_id)
                    & (DeploymentServer.lease_id == server.lease_id)
                )
                .execute()
            )
            if changed != 1:
                continue
            deployment = Deployment.get_by_id(server.deployment_id)
            audit.record(
                store,
                "control-plane",
                "server.lease_expired",
                node_id=server.node_id,
                server_id=server_id,
                deployment=deployment.name,
                state=values["state"],
            )
            if values["state"] == SERVER_STOPPED:
                reap(store, server.deployment_id, "control-plane")
            done.append(server_id)
    if done:
        log.info("%d serve lease(s) expired", len(done))
    return done


def fail_node_servers(store: Store, node_id: str, actor: str, code: str, message: str) -> list[str]:
    """Fail (or, when stopping, stop) every active server of a node taken out of service
    (inside the caller's transaction); the node's agent can no longer renew."""
    now = store.clock.now()
    done = []
    rows = list(
        DeploymentServer.select()
        .where(
            (DeploymentServer.node == node_id)
            & DeploymentServer.state.in_(_RUNNABLE + (SERVER_STOPPING,))
        )
        .order_by(DeploymentServer.server_id)
    )
    for server in rows:
        stopping = server.state == SERVER_STOPPING
        DeploymentServer.update(
            state=SERVER_STOPPED if stopping else SERVER_FAILED,
            state_since=now,
            error=None if stopping else json.dumps({"code": code, "message": message}),
            **end_lease(server, LEASE_END_STOPPED if stopping else SERVER_FAILED),
        ).where(DeploymentServer.server_id == server.server_id).execute()
        audit.record(
            store, actor, "server.failed", node_id=node_id, server_id=server.server_id, code=code
        )
        if stopping:
            reap(store, server.deployment_id, actor)
        done.append(server.server_id)
    return done
