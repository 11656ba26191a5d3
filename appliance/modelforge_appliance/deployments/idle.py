"""Load on demand (docs/deployments.md): unload a deployment nobody calls, start it on the next call.

A deployment with ``settings.idle_unload_seconds`` whose servers have had no client request
for that long is unloaded: each server goes ``idle`` (a running one through ``stopping``:
its agent stops the runtime, freeing its GPUs and memory), and it stays listed by ``GET
/v1/models``. The next request wakes it: its idle servers go ``pending`` with their GPUs
picked again, and the relay holds the request until one runs (MODELFORGE_RELAY_COLD_START_
SECONDS).

Several such deployments may name the same GPUs; two never run on one GPU at once unless
they share GPUs: a deployment woken onto GPUs another idle-capable deployment runs on
unloads that one first (the least recently called), and starts once they are free.

When each deployment was last called is kept in memory (``Usage``): a control plane that
restarts counts from its start, so nothing is unloaded the moment it comes back.
"""

from __future__ import annotations

import json
import logging
import threading

from modelforge_contract.deployments import (
    GOAL_IDLE,
    GOAL_RUN,
    GPUS_UNAVAILABLE,
    SERVER_ACTIVE_STATES,
    SERVER_IDLE,
    SERVER_PENDING,
    SERVER_STOPPING,
)

from ..core.errors import Conflict
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Node
from . import placement, reconcile
from .placement import idle_unload_seconds
from .servers import _bump, _servers_of, apply_outcome, member_of

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0  # how often the unloader looks


class Usage:
    """When each deployment last had a client request, as this process saw it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._started = 0.0  # when this process began serving (begin): counted as a call
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def begin(self) -> None:
        """The server starts serving: nothing counts as idle since before now."""
        now = self.store.clock.now()
        with self._lock:
            self._started = now

    def touch(self, name: str) -> None:
        now = self.store.clock.now()
        with self._lock:
            self._last[name] = now

    def last(self, name: str) -> float:
        with self._lock:
            return max(self._started, self._last.get(name, self._started))


def unload_idle(store: Store, usage: Usage) -> list[str]:
    """Unload every deployment whose idle time has run out; the names unloaded."""
    now = store.clock.now()
    with store.connection():
        live = list(Deployment.select().where(Deployment.stopping == False))  # noqa: E712 - peewee's expression
    due = []
    for deployment in live:
        after = idle_unload_seconds(deployment)
        if after is not None and now - usage.last(deployment.name) >= after:
            due.append(deployment)
    unloaded = []
    for deployment in due:
        with store.write(flushed=False):
            fresh = Deployment.get_or_none(Deployment.deployment_id == deployment.deployment_id)
            if fresh is None or fresh.stopping:
                continue
            servers = _servers_of([fresh.deployment_id])[fresh.deployment_id]
            started = max((s.started_at or 0.0 for s, _ in servers), default=0.0)
            after = idle_unload_seconds(fresh) or 0
            if now - max(usage.last(fresh.name), started) < after:
                continue  # a server came up (or a request came) meanwhile
            changed = _apply_all(store, fresh, servers, reconcile.UNLOAD, now)
            if not changed:
                continue
            audit.record(
                store,
                "control-plane",
                "deployment.unloaded",
                name=fresh.name,
                deployment_id=fresh.deployment_id,
                idle_seconds=round(now - usage.last(fresh.name)),
            )
            unloaded.append(fresh.name)
    if unloaded:
        log.info("unloaded idle deployment(s): %s", ", ".join(unloaded))
    return unloaded


def _apply_all(
    store: Store,
    deployment: Deployment,
    servers: list[tuple[DeploymentServer, Node]],
    event: str,
    now: float,
) -> list[str]:
    """Apply ``event`` to each server (inside the caller's transaction); the nodes whose
    servers changed, their generations bumped."""
    nodes = []
    for server, node in servers:
        outcome = reconcile.step(member_of(server, deployment), event)
        if (outcome.state, outcome.goal) == (server.state, server.goal):
            continue
        apply_outcome(store, server, outcome, now, DeploymentServer.server_id == server.server_id)
        nodes.append(node.node_id)
    if nodes:
        _bump(nodes)
    return nodes


def wake(store: Store, name: str, usage: Usage) -> bool:
    """Start an unloaded deployment's servers again (idempotent: the relay asks on each look
    while it holds a cold request); whether any server is now on its way to run. A server
    whose GPUs another idle-capable deployment runs on unloads that one and waits."""
    now = store.clock.now()
    usage.touch(name)
    with store.write(flushed=False):
        deployment = Deployment.get_or_none(Deployment.name == name)
        if deployment is None or deployment.stopping:
            return False
        servers = _servers_of([deployment.deployment_id])[deployment.deployment_id]
        moving = False
        nodes = []
        for server, node in servers:
            member = member_of(server, deployment)
            if server.state == SERVER_STOPPING and server.goal == GOAL_IDLE:
                outcome = reconcile.step(member, reconcile.WAKE)  # starts once it stopped
                row = DeploymentServer.server_id == server.server_id
                apply_outcome(store, server, outcome, now, row)
                moving = True
                continue
            if server.state != SERVER_IDLE:
                moving = moving or (
                    server.goal == GOAL_RUN and server.state in SERVER_ACTIVE_STATES
                )
                continue
            gpus = _gpus_again(store, deployment, server, node, usage)
            if gpus is None:
                continue  # waits for GPUs another deployment is giving up
            outcome = reconcile.step(member, reconcile.WAKE)
            row = (DeploymentServer.server_id == server.server_id) & (
                DeploymentServer.state == SERVER_IDLE
            )
            extra = {"gpus": json.dumps(gpus), "error": None, "next_attempt_at": None}
            if apply_outcome(store, server, outcome, now, row, **extra) is not None:
                moving = moving or outcome.state == SERVER_PENDING
                nodes.append(node.node_id)
        if nodes:
            _bump(nodes)
            audit.record(
                store,
                "relay",
                "deployment.woken",
                name=name,
                deployment_id=deployment.deployment_id,
            )
    return moving


def _gpus_again(
    store: Store, deployment: Deployment, server: DeploymentServer, node: Node, usage: Usage
) -> list[str] | None:
    """The GPUs a woken server runs on (its own again when they are free), or None when
    too few are free: then the least recently called idle-capable deployment on them is
    unloaded, so a later look finds them free (inside the caller's transaction)."""
    own = json.loads(server.gpus or "[]")
    held = placement.gpus_held(node.node_id) | placement.gpus_of_work(store, node.node_id)
    if deployment.share_gpus or not set(own) & held:
        return own
    try:
        return placement.pick_gpus(node, len(own), deployment.share_gpus, held)
    except Conflict:
        pass
    holders = _evictable_on(node.node_id, set(own), deployment.deployment_id)
    if holders:
        victim, victims_servers = min(holders, key=lambda h: usage.last(h[0].name))
        _apply_all(store, victim, victims_servers, reconcile.UNLOAD, store.clock.now())
        audit.record(
            store,
            "relay",
            "deployment.unloaded",
            name=victim.name,
            deployment_id=victim.deployment_id,
            for_deployment=deployment.name,
        )
        log.info("unloading %s to free GPUs for %s", victim.name, deployment.name)
    else:
        error = {
            "code": GPUS_UNAVAILABLE,
            "message": "its GPUs are held by another deployment that does not unload when "
            "idle; stop it, or give this deployment other GPUs",
        }
        DeploymentServer.update(error=json.dumps(error, sort_keys=True)).where(
            DeploymentServer.server_id == server.server_id
        ).execute()
    return None


def _evictable_on(
    node_id: str, gpus: set[str], besides: str
) -> list[tuple[Deployment, list[tuple[DeploymentServer, Node]]]]:
    """The other idle-capable deployments whose servers run on any of ``gpus`` of the node."""
    rows = (
        DeploymentServer.select(DeploymentServer, Deployment)
        .join(Deployment)
        .where(
            (DeploymentServer.node == node_id)
            & DeploymentServer.state.in_(SERVER_ACTIVE_STATES)
            & (DeploymentServer.goal == GOAL_RUN)
            & (Deployment.stopping == False)  # noqa: E712 - peewee's expression
            & (DeploymentServer.deployment != besides)
        )
    )
    found: dict[str, Deployment] = {}
    for row in rows:
        if set(json.loads(row.gpus or "[]")) & gpus and idle_unload_seconds(row.deployment):
            found[row.deployment_id] = row.deployment
    servers = _servers_of(list(found))
    return [(found[d], servers[d]) for d in sorted(found)]


class Unloader:
    """The thread that unloads idle deployments, started and stopped with the server."""

    def __init__(self, store: Store, usage: Usage) -> None:
        self.store, self.usage = store, usage
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.usage.begin()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="idle-unloader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_SECONDS):
            try:
                unload_idle(self.store, self.usage)
            except Exception as exc:  # the store may be away for a moment; look again
                log.warning("idle unload: %s; looking again", type(exc).__name__)
