"""Actions that cross domains, in one place above them (docs/architecture.md §8).

Revoking a node's credential (identity) gives its leased work back to the queue (work), and
decommissioning a node is an audited two-step retirement: preview exactly what will happen,
then execute it. No API deletes or hand-edits a node row; a decommissioned node stays as
history, its credentials refused, its identity retired and its hostname free for a new node.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from modelforge_contract import (
    CONFIRMATION_INVALID,
    CONFIRMATION_STALE,
    CONFIRMATION_USED,
    KIND_DECOMMISSION,
    NODE_DECOMMISSIONED,
)

from .core import tokens
from .core.clock import isoformat
from .core.errors import Conflict, Invalid
from .deployments import leases as serve_leases
from .fleet.nodes import get_node
from .identity import credentials
from .store import audit
from .store.database import Store
from .store.tables import Credential, DecommissionConfirmation, Node
from .work import leases

CONFIRMATION_LIFETIME_SECONDS = 600


def revoke_node_credential(store: Store, node: Node, actor: str) -> dict[str, list[str]]:
    """Revoke the node's active credential(s) permanently (invariant 5), and give its leased
    work back to the queue: without a credential the node can neither renew nor complete it."""
    with store.write():
        revoked = credentials.revoke_active_credentials(
            store, node, actor, "revoked by an administrator"
        )
        returned = leases.return_node_leases(store, node, actor, "credential revoked")
    return {"revoked": revoked, "leases_returned": returned}


def planned_effects(node: Node) -> dict[str, Any]:
    """What execute will do to node as it is now."""
    active = [
        row.credential_id
        for row in Credential.select(Credential.credential_id)
        .where((Credential.node == node) & Credential.revoked_at.is_null())
        .order_by(Credential.credential_id)
    ]
    return {
        "credentials_revoked": active,
        # Work items leased to the node go back to the queue (their attempt does not count).
        "leases_returned": leases.leased_work_ids(node),
        "identity_retired": node.identity_id,
        "hostname_freed": node.hostname,
    }


def _fingerprint(node: Node, effects: dict[str, Any]) -> str:
    state = {
        "effects": effects,
        "decommissioned_at": node.decommissioned_at,
        "enrolled_at": node.enrolled_at,
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _refuse_if_decommissioned(node: Node) -> None:
    if node.decommissioned_at is not None:
        raise Conflict(
            f"node {node.node_id} is already decommissioned",
            code=NODE_DECOMMISSIONED,
            next_step="Nothing to do; enroll replacement hardware as a new node.",
        )


def _locked_node(store: Store, node_id: str) -> Node:
    query = Node.select().where(Node.node_id == node_id)
    node = (query if store.is_sqlite else query.for_update()).first()
    return node if node is not None else get_node(store, node_id)  # raises NotFound


def preview_decommission(store: Store, node_id: str, actor: str) -> dict[str, Any]:
    """Describe the decommission and hand out a single-use confirmation for exactly it."""
    confirmation_id, confirmation = tokens.mint_secret(KIND_DECOMMISSION)
    now = store.clock.now()
    with store.write():
        node = _locked_node(store, node_id)
        _refuse_if_decommissioned(node)
        effects = planned_effects(node)
        DecommissionConfirmation.create(
            confirmation_id=confirmation_id,
            node=node,
            digest=tokens.digest(confirmation),
            fingerprint=_fingerprint(node, effects),
            created_by=actor,
            created_at=now,
            expires_at=now + CONFIRMATION_LIFETIME_SECONDS,
        )
        audit.record(
            store,
            actor,
            "node.decommission_previewed",
            node_id=node_id,
            confirmation_id=confirmation_id,
            effects=effects,
        )
    return {
        "node_id": node_id,
        "effects": effects,
        "confirmation": confirmation,
        "expires_at": isoformat(now + CONFIRMATION_LIFETIME_SECONDS),
    }


def execute_decommission(
    store: Store, node_id: str, confirmation: str, actor: str
) -> dict[str, Any]:
    """Do exactly what the preview said, in one transaction, or refuse and change nothing."""
    parsed = tokens.parse(confirmation, KIND_DECOMMISSION)
    invalid = Invalid(
        "the confirmation is not one issued by a preview of this node",
        code=CONFIRMATION_INVALID,
        next_step="Run the decommission preview again and use its confirmation.",
    )
    if parsed is None:
        raise invalid
    confirmation_id, secret = parsed
    now = store.clock.now()
    with store.write():
        row = DecommissionConfirmation.get_or_none(
            DecommissionConfirmation.confirmation_id == confirmation_id
        )
        if row is None or row.node_id != node_id or not tokens.digest_matches(secret, row.digest):
            raise invalid
        if row.used_at is not None:
            raise Conflict(
                "this confirmation was already used",
                code=CONFIRMATION_USED,
                next_step="Run the decommission preview again.",
            )
        node = _locked_node(store, node_id)
        _refuse_if_decommissioned(node)
        effects = planned_effects(node)
        if row.expires_at <= now or row.fingerprint != _fingerprint(node, effects):
            raise Conflict(
                "the node changed since the preview, or the confirmation expired",
                code=CONFIRMATION_STALE,
                next_step="Run the decommission preview again and review it.",
            )
        # Single use even under concurrency: the row count decides.
        used = (
            DecommissionConfirmation.update(used_at=now)
            .where(
                (DecommissionConfirmation.confirmation_id == confirmation_id)
                & DecommissionConfirmation.used_at.is_null()
            )
            .execute()
        )
        if used != 1:
            raise Conflict(
                "this confirmation was already used",
                code=CONFIRMATION_USED,
                next_step="Run the decommission preview again.",
            )
        credentials.revoke_active_credentials(store, node, actor, "decommissioned")
        leases.return_node_leases(store, node, actor, "decommissioned")
        serve_leases.fail_node_servers(
            store,
            node_id,
            actor,
            NODE_DECOMMISSIONED,
            "the node was decommissioned; add another node to the deployment "
            "(modelforge deployments add-nodes NAME NODE) and remove this one",
        )
        Node.update(decommissioned_at=now, cordoned=True).where(Node.node_id == node_id).execute()
        audit.record(
            store,
            actor,
            "node.decommissioned",
            node_id=node_id,
            confirmation_id=confirmation_id,
            effects=effects,
        )
    return {"node_id": node_id, "decommissioned_at": isoformat(now), "effects": effects}
