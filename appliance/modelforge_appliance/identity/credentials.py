"""Per-node credentials: issued at enrollment, stored as digests, revoked forever."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from modelforge_contract import (
    CREDENTIAL_INVALID,
    CREDENTIAL_MISSING,
    CREDENTIAL_NODE_MISMATCH,
    CREDENTIAL_REVOKED,
    KIND_CREDENTIAL,
    NODE_DECOMMISSIONED,
    REPUBLISH_INVENTORY,
    REPUBLISH_TELEMETRY,
)

from ..core import tokens
from ..core.clock import isoformat
from ..core.errors import Forbidden, Unauthorized
from ..store import audit
from ..store.database import Store
from ..store.tables import Credential, Node

_REENROLL = "Re-enroll the node with a fresh enrollment token; its persisted identity keeps its id."


def issue_credential(store: Store, node: Node, actor: str) -> str:
    """Create a credential for node inside the caller's transaction; return the secret once."""
    credential_id, secret = tokens.mint_secret(KIND_CREDENTIAL)
    Credential.create(
        credential_id=credential_id,
        node=node,
        digest=tokens.digest(secret),
        created_at=store.clock.now(),
    )
    audit.record(
        store, actor, "credential.issued", node_id=node.node_id, credential_id=credential_id
    )
    return secret


def revoke_active_credentials(store: Store, node: Node, actor: str, reason: str) -> list[str]:
    """Revoke every active credential of node (inside the caller's transaction)."""
    active = [
        row.credential_id
        for row in Credential.select(Credential.credential_id).where(
            (Credential.node == node) & Credential.revoked_at.is_null()
        )
    ]
    if active:
        Credential.update(revoked_at=store.clock.now(), revoked_reason=reason).where(
            Credential.credential_id.in_(active) & Credential.revoked_at.is_null()
        ).execute()
        for credential_id in active:
            audit.record(
                store,
                actor,
                "credential.revoked",
                node_id=node.node_id,
                credential_id=credential_id,
                reason=reason,
            )
    return active


def bearer_secret(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized(
            "this call needs the node credential as 'Authorization: Bearer mfc_…'",
            code=CREDENTIAL_MISSING,
            next_step="Start the node agent with its state volume; it sends its credential.",
        )
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized(
            "the Authorization header is not 'Bearer <credential>'",
            code=CREDENTIAL_INVALID,
            next_step=_REENROLL,
        )
    return value.strip()


@dataclass(frozen=True)
class Caller:
    """An agent request's authenticated credential and the node it may speak for."""

    credential_id: str
    node_id: str
    accelerator_mode: str
    # What the control plane holds no fresh measurement of (after a restore, or before the
    # first publication since enrollment): the heartbeat answer asks for it again.
    republish: tuple[str, ...] = ()
    # The node's models generation (models/replicas.py), carried by the heartbeat answer.
    models_generation: int = 0
    # The node's servers generation (deployments/), carried by the heartbeat answer.
    servers_generation: int = 0


# The heartbeat path runs this for every call: one indexed read, no model objects.
_CALLER_SQL = (
    "SELECT c.digest, c.revoked_at, n.node_id, n.decommissioned_at, n.accelerator_mode, "
    "n.enrolled_at, n.inventory_at, n.telemetry_at, n.models_generation, n.servers_generation "
    "FROM credential AS c JOIN node AS n ON n.node_id = c.node_id "
    "WHERE c.credential_id = ?"
)


def _republish(
    mode: str, enrolled_at: float, inventory_at: float | None, telemetry_at: float | None
) -> tuple[str, ...]:
    wanted = []
    if inventory_at is None or inventory_at < enrolled_at:
        wanted.append(REPUBLISH_INVENTORY)
    # An nvidia node must send telemetry to be ready; an auto node sends it when it has GPUs.
    if mode == "nvidia" and (telemetry_at is None or telemetry_at < enrolled_at):
        wanted.append(REPUBLISH_TELEMETRY)
    return tuple(wanted)


@dataclass(frozen=True)
class Credentialed:
    """A request's credential that authenticated: known, its secret matching, not revoked,
    its node not decommissioned. Which node it may speak for is :meth:`for_node`'s answer."""

    credential_id: str
    owner: str
    accelerator_mode: str
    republish: tuple[str, ...]
    models_generation: int = 0
    servers_generation: int = 0

    def for_node(self, node_id: str) -> Caller:
        """The caller, authorised for node_id (403 when the credential is another node's)."""
        if self.owner != node_id:
            raise Forbidden(
                "the credential authenticates but belongs to another node",
                code=CREDENTIAL_NODE_MISMATCH,
            )
        return Caller(
            self.credential_id,
            self.owner,
            self.accelerator_mode,
            self.republish,
            self.models_generation,
            self.servers_generation,
        )


def authenticate_credential(store: Store, authorization: str | None) -> Credentialed:
    """The credential this request carries (invariant 4).

    401: unknown, malformed or revoked. 403: its node is decommissioned. Runs before the
    request's body is read, so an unauthenticated caller never has its body parsed.
    """

    def lookup(credential_id: str) -> tuple | None:
        with store.connection():
            found = store.db.execute_sql(
                _CALLER_SQL.replace("?", store.db.param), (credential_id,)
            ).fetchone()
        return None if found is None else (credential_id, *found)

    row = tokens.verified(bearer_secret(authorization), KIND_CREDENTIAL, lookup, lambda r: r[1])
    if row is None:
        raise Unauthorized(
            "the node credential is unknown or malformed",
            code=CREDENTIAL_INVALID,
            next_step=_REENROLL,
        )
    credential_id, row = row[0], row[1:]
    _, revoked_at, owner, decommissioned_at, accelerator_mode = row[:5]
    if decommissioned_at is not None:
        raise Forbidden(
            "the node this credential belongs to is decommissioned",
            code=NODE_DECOMMISSIONED,
            next_step="Enroll the hardware as a new node if it should return to service.",
        )
    if revoked_at is not None:
        raise Unauthorized(
            "the node credential has been revoked; revoked credentials stay refused",
            code=CREDENTIAL_REVOKED,
            next_step=_REENROLL,
        )
    return Credentialed(
        credential_id,
        owner,
        accelerator_mode,
        _republish(accelerator_mode, *row[5:8]),
        row[8],
        row[9],
    )


def authenticate_node(store: Store, authorization: str | None, node_id: str) -> Caller:
    """The credential for this request, authorised for node_id (invariant 4): 401 unknown,
    malformed or revoked; 403 another node's, or its node decommissioned."""
    return authenticate_credential(store, authorization).for_node(node_id)


def credentials_of(store: Store, node: Node) -> dict:
    """Active and revoked counts with dates; never a digest."""
    with store.connection():
        rows = list(
            Credential.select().where(Credential.node == node).order_by(Credential.created_at)
        )
    return {
        "node_id": node.node_id,
        "active": sum(1 for row in rows if row.revoked_at is None),
        "revoked": sum(1 for row in rows if row.revoked_at is not None),
        "credentials": [
            {
                "credential_id": row.credential_id,
                "created_at": isoformat(row.created_at),
                "last_used_at": isoformat(row.last_used_at),
                "revoked_at": isoformat(row.revoked_at),
                "revoked_reason": row.revoked_reason,
            }
            for row in rows
        ],
    }


def still_valid(store: Store, credential_ids: Collection[str]) -> set[str]:
    """Of ``credential_ids``, those not revoked whose node is not decommissioned (the relay
    closes the tunnels opened with the others)."""
    if not credential_ids:
        return set()
    with store.connection():
        rows = (
            Credential.select(Credential.credential_id)
            .join(Node)
            .where(
                Credential.credential_id.in_(list(credential_ids))
                & Credential.revoked_at.is_null()
                & Node.decommissioned_at.is_null()
            )
            .tuples()
        )
        return {row[0] for row in rows}
