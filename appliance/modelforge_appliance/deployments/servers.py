"""Deployments, the admin side: deploy, list, show, restart, change settings, undeploy.

A deployment is one model revision, one runtime and its settings, and one server row per
member node (docs/architecture.md §11). Nothing starts unless every member is eligible,
offers the runtime and reports the model present (placement.py); the call is all or
nothing. Each change bumps the members' ``servers_generation`` in its transaction, so
their agents fetch ``GET /agent/servers`` at their next heartbeat.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import peewee as pw

from modelforge_contract import FIELD_FORMAT
from modelforge_contract.deployments import (
    DEPLOYMENT_EXISTS,
    DEPLOYMENT_NAME_RE,
    DEPLOYMENT_NOT_FOUND,
    DEPLOYMENT_STOPPING,
    GOAL_IDLE,
    GOAL_REMOVE,
    GOAL_RUN,
    MODEL_FORMAT_UNSUPPORTED,
    ROLE_HELPER,
    ROLE_MAIN,
    RUNTIME_LLAMA_CPP,
    RUNTIME_LLAMA_CPP_RPC,
    RUNTIME_VLLM,
    SERVER_ACTIVE_STATES,
    SERVER_IDLE,
    SERVER_PENDING,
    SERVER_STOPPED,
    reserved_arg,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound
from ..core.settings import Settings
from ..models import catalog, replicas
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, DeploymentServer, Model, Node
from . import placement, reconcile, split

_IMAGE_ID_LENGTH = 71


def _load(text: str | None) -> Any:
    return json.loads(text) if text else None


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# -- views ------------------------------------------------------------------------------


def server_view(server: DeploymentServer, node: Node) -> dict[str, Any]:
    return {
        "server_id": server.server_id,
        "node_id": node.node_id,
        "display_name": node.display_name,
        "state": server.state,
        "state_since": isoformat(server.state_since),
        "error": _load(server.error),
        "gpus": _load(server.gpus) or [],
        "restarts": server.restarts,
        "role": server.role,
        "next_attempt_at": isoformat(server.next_attempt_at),
        "goal": server.goal,
        "lease_expires_at": isoformat(server.lease_expires_at),
        "started_at": isoformat(server.started_at),
    }


def derived_state(deployment: Deployment, states: list[str]) -> str:
    """One word for the whole deployment, from its servers' states."""
    return reconcile.deployment_state(states, bool(deployment.stopping))


def deployment_view(
    deployment: Deployment, model: Model, servers: list[tuple[DeploymentServer, Node]]
) -> dict[str, Any]:
    settings = _load(deployment.settings) or {}
    return {
        "deployment_id": deployment.deployment_id,
        "name": deployment.name,
        "model": model.name,
        "revision": model.revision,
        "digest": model.digest,
        "runtime": deployment.runtime,
        "gpu_count": deployment.gpu_count,
        "share_gpus": deployment.share_gpus,
        "settings": {
            "context_length": settings.get("context_length"),
            "args": settings.get("args") or [],
            "image_id": settings.get("image_id"),
            "model_file": settings.get("model_file"),
            "idle_unload_seconds": settings.get("idle_unload_seconds"),
            "split": settings.get("split"),
            "shares": settings.get("shares"),
        },
        # A member on its way out no longer counts towards how the deployment serves.
        "state": derived_state(
            deployment, [s.state for s, _ in servers if s.goal != GOAL_REMOVE] or ["stopped"]
        ),
        "created_at": isoformat(deployment.created_at),
        "created_by": deployment.created_by,
        "servers": [server_view(s, n) for s, n in servers],
    }


def _servers_of(deployment_ids: list[str]) -> dict[str, list[tuple[DeploymentServer, Node]]]:
    rows = (
        DeploymentServer.select(DeploymentServer, Node)
        .join(Node)
        .where(DeploymentServer.deployment.in_(deployment_ids))
        .order_by(Node.display_name, Node.node_id)
    )
    found: dict[str, list[tuple[DeploymentServer, Node]]] = {d: [] for d in deployment_ids}
    for row in rows:
        found[row.deployment_id].append((row, row.node))
    return found


def servers_on_node(store: Store, node_id: str) -> list[dict[str, Any]]:
    """The servers one node holds, each with its deployment's name, model and runtime."""
    with store.connection():
        rows = list(
            DeploymentServer.select(DeploymentServer, Deployment, Model, Node)
            .join(Deployment)
            .join(Model)
            .switch(DeploymentServer)
            .join(Node)
            .where(DeploymentServer.node == node_id)
            .order_by(Deployment.name)
        )
    return [
        {
            "deployment": s.deployment.name,
            "model": s.deployment.model.name,
            "revision": s.deployment.model.revision,
            "runtime": s.deployment.runtime,
            **server_view(s, s.node),
        }
        for s in rows
    ]


def list_deployments(store: Store) -> list[dict[str, Any]]:
    with store.connection():
        rows = list(Deployment.select(Deployment, Model).join(Model).order_by(Deployment.name))
        servers = _servers_of([d.deployment_id for d in rows])
    return [deployment_view(d, d.model, servers[d.deployment_id]) for d in rows]


def _get(name: str) -> Deployment:
    found = Deployment.select(Deployment, Model).join(Model).where(Deployment.name == name).first()
    if found is None:
        raise NotFound(
            f"no deployment {name}",
            code=DEPLOYMENT_NOT_FOUND,
            next_step="See the deployments with `modelforge deployments`.",
        )
    return found


def get_deployment(store: Store, name: str) -> dict[str, Any]:
    with store.connection():
        deployment = _get(name)
        servers = _servers_of([deployment.deployment_id])[deployment.deployment_id]
    return deployment_view(deployment, deployment.model, servers)


# -- deploy -------------------------------------------------------------------------------


def check_name(name: str) -> str:
    if not DEPLOYMENT_NAME_RE.fullmatch(name):
        raise Invalid(
            f"name: {name[:80]!r} is not a deployment name (lower-case letters, digits, '.', "
            "'_' and '-', starting with a letter or digit, at most 63)",
            code=FIELD_FORMAT,
            next_step="Clients name the deployment as their `model`; pick a short name like "
            "qwen-7b.",
        )
    return name


def model_file_for(model: Model, runtime: str, wanted: str | None) -> str | None:
    """The file the runtime loads (llama.cpp: one GGUF of the manifest), or None (vLLM
    loads the directory); 400 MODEL_FORMAT_UNSUPPORTED when there is none to choose."""
    paths = [entry["path"] for entry in json.loads(model.manifest)["files"]]
    if wanted is not None:
        if wanted not in paths:
            raise Invalid(
                f"settings.model_file: {wanted!r} is not a file of {model.name} revision "
                f"{model.revision}",
                code=MODEL_FORMAT_UNSUPPORTED,
                next_step=f"Name one of its files (modelforge models show {model.name}).",
            )
        return wanted
    if runtime != RUNTIME_LLAMA_CPP:
        return None
    ggufs = sorted(p for p in paths if p.lower().endswith(".gguf"))
    first_shards = [p for p in ggufs if "-00001-of-" in p]
    weights = [p for p in ggufs if "mmproj" not in p.lower()]
    chosen = first_shards or weights
    if len(chosen) == 1:
        return chosen[0]
    raise Invalid(
        f"model {model.name} revision {model.revision} has "
        f"{'no' if not ggufs else len(chosen)} GGUF file(s) llama.cpp could load"
        + (f" ({', '.join(chosen[:5])})" if chosen else ""),
        code=MODEL_FORMAT_UNSUPPORTED,
        next_step="Import a GGUF model for llama.cpp, or name the file with settings.model_file "
        "(--model-file).",
    )


def _settings_of(fields: dict[str, Any], model: Model) -> dict[str, Any]:
    given = fields.get("settings") or {}
    runtime = fields["runtime"]
    image_id = given.get("image_id")
    if runtime == RUNTIME_VLLM and not image_id:
        raise Invalid(
            "settings.image_id: a vllm deployment runs an image loaded on each node, pinned by "
            "its id",
            code=FIELD_FORMAT,
            next_step="docker load the vLLM image on each node and pass --image-id "
            "$(docker image inspect --format '{{.Id}}' IMAGE).",
        )
    if image_id is not None and (
        len(image_id) != _IMAGE_ID_LENGTH
        or not image_id.startswith("sha256:")
        or any(c not in "0123456789abcdef" for c in image_id[7:])
    ):
        raise Invalid(
            "settings.image_id: must be sha256:<64 hex digits>",
            code=FIELD_FORMAT,
            next_step="Pin the image by its id: docker image inspect --format '{{.Id}}' IMAGE",
        )
    reserved = reserved_arg(given.get("args") or [])
    if reserved is not None:
        raise Invalid(
            f"settings.args: {reserved} is set by the runtime worker itself (the address, port, "
            "served name and model are the deployment's)",
            code=FIELD_FORMAT,
            next_step="Leave it out; the runtime listens on the node's loopback and serves the "
            "deployment's name.",
        )
    return {
        "context_length": given.get("context_length"),
        "args": list(given.get("args") or []),
        "image_id": image_id,
        "model_file": model_file_for(model, runtime, given.get("model_file")),
        "idle_unload_seconds": given.get("idle_unload_seconds"),
    }


def deploy(
    store: Store,
    settings: Settings,
    fields: dict[str, Any],
    actor: str,
    pending: Callable[[str], tuple[float, str] | None] = lambda node_id: None,
) -> dict[str, Any]:
    """Make the deployment and its servers (all or nothing); see the module. ``pending``
    gives a node's newest heartbeat not yet in the store (the server's buffer)."""
    name = check_name(fields["name"])
    model = catalog.get_revision(store, fields["model"], fields.get("revision"))
    runtime = fields["runtime"]
    server_settings = _settings_of(fields, model)
    idle_capable = server_settings.get("idle_unload_seconds") is not None
    group = split.members_of(fields)
    node_ids = group or list(dict.fromkeys(fields["node_ids"]))
    now = store.clock.now()
    with store.connection():
        found = {n.node_id: n for n in Node.select().where(Node.node_id.in_(node_ids))}
        members = [
            placement.check_member(
                found.get(i),
                i,
                RUNTIME_LLAMA_CPP_RPC if split.role_for(group, i) == ROLE_HELPER else runtime,
                now,
                settings,
                pending(i),
            )
            for i in node_ids
        ]
        if Deployment.select().where(Deployment.name == name).exists():
            raise _exists(name)
        # A split's helpers hold no replica: the main node sends them their tensors.
        missing = placement.missing_on(store, model, members[:1] if group else members)
        # Checked before anything is replicated (and again where it decides, below).
        for node in members:
            place_server(store, node, fields, idle_capable)
    if missing and not fields.get("replicate"):
        placement.refuse_missing(model, missing)
    if missing:  # replicate first; each server starts once its node reports the model
        replicas.replicate(
            store, settings, model.name, [n.node_id for n in missing], actor, model.revision
        )
    deployment_id = uuid.uuid4().hex
    with store.write():
        # Counted again where it decides: deploys to the same node commit one at a time
        # (SQLite's write lock; on PostgreSQL the members' rows, locked in node_id order).
        if not store.is_sqlite:
            for node_id in sorted(node_ids):
                store.db.execute_sql(
                    "SELECT node_id FROM node WHERE node_id = %s FOR NO KEY UPDATE", (node_id,)
                )
        if Deployment.select().where(Deployment.name == name).exists():
            raise _exists(name)
        placed = {node.node_id: place_server(store, node, fields, idle_capable) for node in members}
        chosen = {node_id: gpus for node_id, (gpus, _) in placed.items()}
        if group:
            memory = [split.memory_of(node, chosen[node.node_id]) for node in members]
            server_settings = {**server_settings, "split": group, "shares": split.shares(memory)}
        try:
            Deployment.create(
                deployment_id=deployment_id,
                name=name,
                model=model.model_id,
                runtime=runtime,
                gpu_count=fields.get("gpu_count"),
                share_gpus=bool(fields.get("share_gpus")),
                settings=_dump(server_settings),
                stopping=False,
                created_by=actor,
                created_at=now,
            )
        except pw.IntegrityError:  # the same name, committed in between
            raise _exists(name) from None
        for node in members:
            DeploymentServer.create(
                server_id=uuid.uuid4().hex,
                deployment=deployment_id,
                node=node.node_id,
                state=placed[node.node_id][1],
                goal=GOAL_IDLE if placed[node.node_id][1] == SERVER_IDLE else GOAL_RUN,
                state_since=now,
                error=None,
                gpus=_dump(chosen[node.node_id]),
                restarts=0,
                role=split.role_for(group, node.node_id),
            )
        _bump(node_ids)
        audit.record(
            store,
            actor,
            "deployment.created",
            name=name,
            deployment_id=deployment_id,
            model=model.name,
            revision=model.revision,
            digest=model.digest,
            runtime=runtime,
            node_ids=node_ids,
            gpus=chosen,
            replicated=[n.node_id for n in missing],
            split=server_settings.get("split"),
            shares=server_settings.get("shares"),
        )
    return get_deployment(store, name)


def place_server(
    store: Store, node: Node, fields: dict[str, Any], idle_capable: bool
) -> tuple[list[str], str]:
    """The GPUs a new server on ``node`` gets, and the state it starts in (inside the
    caller's transaction): ``pending``; or ``idle`` for a deployment that unloads when idle
    placed on GPUs another such deployment runs on now: the first request wakes it, and
    that one unloads (idle.py). 409 GPUS_UNAVAILABLE when too few are free."""
    share = bool(fields.get("share_gpus"))
    hard, soft = placement.gpus_held_apart(node.node_id)
    held = hard | placement.gpus_of_work(store, node.node_id) | (set() if idle_capable else soft)
    gpus = placement.pick_gpus(node, fields.get("gpu_count"), share, held)
    waits = idle_capable and not share and bool(set(gpus) & soft)
    return gpus, SERVER_IDLE if waits else SERVER_PENDING


def _exists(name: str) -> Conflict:
    return Conflict(
        f"a deployment named {name} exists",
        code=DEPLOYMENT_EXISTS,
        next_step=f"Choose another name, or undeploy it first: modelforge undeploy {name} --wait.",
    )


def _bump(node_ids: list[str]) -> None:
    Node.update(servers_generation=Node.servers_generation + 1).where(
        Node.node_id.in_(node_ids)
    ).execute()


# -- applying the state machine --------------------------------------------------------


def member_of(server: DeploymentServer, deployment: Deployment) -> reconcile.Member:
    return reconcile.Member(
        state=server.state,
        goal=server.goal,
        leased=server.lease_id is not None,
        undeploying=bool(deployment.stopping),
    )


def end_lease(server: DeploymentServer, how: str) -> dict[str, Any]:
    """The columns that end the server's current lease, remembering how."""
    if server.lease_id is None:
        return {}
    return {
        "lease_id": None,
        "lease_expires_at": None,
        "lease_credential_id": None,
        "previous_lease_id": server.lease_id,
        "previous_lease_end": how,
    }


def apply_outcome(
    store: Store,
    server: DeploymentServer,
    outcome: reconcile.Outcome,
    now: float,
    held: Any,
    actor: str = "control-plane",
    **extra: Any,
) -> bool | None:
    """Write what reconcile.step made of ``server`` (inside the caller's transaction), on
    the rows ``held`` still matches: None when none did (someone else changed it first),
    True when the row went (a removed member that stopped), False otherwise. A deployment
    being undeployed goes with its last server."""
    if outcome.delete:
        if DeploymentServer.delete().where(held).execute() != 1:
            return None
        audit.record(
            store, actor, "server.removed", server_id=server.server_id, node_id=server.node_id
        )
        _bump([server.node_id])
        return True
    changes: dict[str, Any] = dict(extra)
    if outcome.state != server.state:
        changes.update(state=outcome.state, state_since=now)
    if outcome.goal != server.goal:
        changes["goal"] = outcome.goal
    if outcome.end_lease is not None:
        changes.update(end_lease(server, outcome.end_lease))
    if changes and DeploymentServer.update(**changes).where(held).execute() != 1:
        return None
    if outcome.state == SERVER_STOPPED:
        reap(store, server.deployment_id, actor)
    if server.role == ROLE_HELPER and outcome.state != server.state:
        # A split's main server waits for its helpers to run (split.agent_entry):
        # its agent fetches again at its next heartbeat.
        mains = DeploymentServer.select(DeploymentServer.node).where(
            (DeploymentServer.deployment == server.deployment_id)
            & (DeploymentServer.role == ROLE_MAIN)
        )
        _bump([row.node_id for row in mains])
    return False


def reap(store: Store, deployment_id: str, actor: str) -> bool:
    """Delete a stopping deployment whose servers have all stopped (inside the caller's
    transaction), so its name is free again; whether it went."""
    deployment = Deployment.get_or_none(Deployment.deployment_id == deployment_id)
    if deployment is None or not deployment.stopping:
        return False
    states = {
        s
        for (s,) in DeploymentServer.select(DeploymentServer.state)
        .where(DeploymentServer.deployment == deployment_id)
        .tuples()
    }
    if states - {SERVER_STOPPED}:
        return False
    DeploymentServer.delete().where(DeploymentServer.deployment == deployment_id).execute()
    deployment.delete_instance()
    audit.record(
        store, actor, "deployment.removed", name=deployment.name, deployment_id=deployment_id
    )
    return True


# -- undeploy and restart -----------------------------------------------------------------


def undeploy(store: Store, name: str, actor: str) -> dict[str, Any]:
    """Stop every server: one nobody runs stops at once, a leased one goes ``stopping``
    until its agent says it stopped (or its lease runs out). The deployment goes with its
    last server."""
    now = store.clock.now()
    with store.write():
        deployment = _get(name)
        servers = _servers_of([deployment.deployment_id])[deployment.deployment_id]
        Deployment.update(stopping=True).where(
            Deployment.deployment_id == deployment.deployment_id
        ).execute()
        deployment.stopping = True
        for server, _node in servers:
            outcome = reconcile.step(member_of(server, deployment), reconcile.UNDEPLOY)
            held = DeploymentServer.server_id == server.server_id
            apply_outcome(store, server, outcome, now, held, actor=actor)
        _bump([n.node_id for _, n in servers])
        audit.record(
            store, actor, "deployment.stopping", name=name, deployment_id=deployment.deployment_id
        )
        gone = reap(store, deployment.deployment_id, actor) or not (
            Deployment.select().where(Deployment.deployment_id == deployment.deployment_id).exists()
        )
        servers = _servers_of([deployment.deployment_id])[deployment.deployment_id]
    view = deployment_view(deployment, deployment.model, servers)
    if gone:
        view["state"] = SERVER_STOPPED
    return view


def restart(store: Store, name: str, actor: str) -> dict[str, Any]:
    """Every server started afresh: a running one's lease ends ``restarted``, so its agent
    stops the runtime at its next renewal and claims it again; one that holds no GPU now
    (failed, idle) gets its restarts back and GPUs picked again (its old ones may have gone
    to another server meanwhile): 409 GPUS_UNAVAILABLE, with nothing restarted, when too
    few are free."""
    now = store.clock.now()
    with store.write():
        deployment = _changeable(name)
        _restart_servers(store, deployment, now, actor)
        audit.record(
            store, actor, "deployment.restarted", name=name, deployment_id=deployment.deployment_id
        )
    return get_deployment(store, name)


# What `deployments set` may change: the runtime's own arguments and context size. The
# rest (model, runtime, image, GPUs, idle unload) shape where and how servers are placed:
# undeploy and deploy for those.
CHANGEABLE_SETTINGS = ("args", "context_length")


def change_settings(store: Store, name: str, given: dict[str, Any], actor: str) -> dict[str, Any]:
    """New runtime settings (the fields in ``given`` replace the deployment's, each checked
    as a deploy checks it), and every server restarted with them: the way out of a runtime
    that exits because of its own ``--arg``. Settings equal to the current ones change
    nothing and restart nothing."""
    now = store.clock.now()
    with store.write():
        deployment = _changeable(name)
        current = _load(deployment.settings) or {}
        wanted = {**current, **{k: given[k] for k in CHANGEABLE_SETTINGS if k in given}}
        wanted["args"] = list(wanted.get("args") or [])
        checked = _settings_of(
            {"runtime": deployment.runtime, "settings": wanted}, deployment.model
        )
        changed = sorted(k for k in CHANGEABLE_SETTINGS if checked.get(k) != current.get(k))
        if changed:
            Deployment.update(settings=_dump(checked)).where(
                Deployment.deployment_id == deployment.deployment_id
            ).execute()
            _restart_servers(store, deployment, now, actor)
            audit.record(
                store,
                actor,
                "deployment.settings_changed",
                name=name,
                deployment_id=deployment.deployment_id,
                changed=changed,  # the names only: an argument's value is the operator's
            )
    return get_deployment(store, name)


def _changeable(name: str) -> Deployment:
    """Inside a write: the deployment, unless it is being stopped (409)."""
    deployment = _get(name)
    if deployment.stopping:
        raise Conflict(
            f"deployment {name} is being stopped",
            code=DEPLOYMENT_STOPPING,
            next_step=f"Wait for it to go (modelforge undeploy {name} --wait), then deploy "
            "it again.",
        )
    return deployment


def _restart_servers(store: Store, deployment: Deployment, now: float, actor: str) -> None:
    """Inside a write: each server of ``deployment`` started afresh (see ``restart``)."""
    servers = _servers_of([deployment.deployment_id])[deployment.deployment_id]
    for server, node in servers:
        outcome = reconcile.step(member_of(server, deployment), reconcile.RESTART)
        extra: dict[str, Any] = {}
        if outcome.state == SERVER_PENDING:
            extra.update(error=None, restarts=0, started_at=None, next_attempt_at=None)
        if outcome.state == SERVER_PENDING and server.state not in SERVER_ACTIVE_STATES:
            wanted = len(_load(server.gpus) or [])
            held = placement.gpus_held(node.node_id) | placement.gpus_of_work(store, node.node_id)
            gpus = placement.pick_gpus(node, wanted, deployment.share_gpus, held)
            extra["gpus"] = _dump(gpus)
        row = DeploymentServer.server_id == server.server_id
        apply_outcome(store, server, outcome, now, row, actor=actor, **extra)
    _bump([n.node_id for _, n in servers])


def server_counts(store: Store) -> dict[str, int]:
    """Servers per state (the metrics gauge)."""
    with store.connection():
        counts: dict[str, int] = {}
        for (state,) in DeploymentServer.select(DeploymentServer.state).tuples():
            counts[state] = counts.get(state, 0) + 1
    return counts
