"""Alerts derived from liveness and hostnames, computed when read.

Computing them from the same timestamps as liveness keeps the two consistent: a
``node_offline`` alert exists exactly while the node reads ``offline``, and clears
when it heartbeats again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from modelforge_contract import (
    ALERT_HOSTNAME_CONFLICT,
    ALERT_NODE_OFFLINE,
    ALERT_NODE_STALE,
    OFFLINE,
    STALE,
)

from ..core.clock import isoformat
from ..core.settings import Settings
from ..store.database import Store
from ..store.tables import Node
from .nodes import liveness_of


def active_alerts(store: Store, settings: Settings) -> list[dict[str, Any]]:
    with store.connection():
        enabled = list(Node.select().where(Node.decommissioned_at.is_null()).order_by(Node.node_id))
    now = store.clock.now()
    alerts: list[dict[str, Any]] = []
    by_hostname: dict[str, list[Node]] = defaultdict(list)
    for node in enabled:
        by_hostname[node.hostname.lower()].append(node)
        liveness = liveness_of(node, now, settings)
        if liveness == OFFLINE:
            alerts.append(
                _alert(
                    ALERT_NODE_OFFLINE,
                    "critical",
                    node,
                    node.last_heartbeat_at + settings.offline_after_seconds,
                    "the node has not heartbeated for longer than "
                    f"{settings.offline_after_seconds}s",
                    "Follow docs/runbooks/node-loss.md.",
                )
            )
        elif liveness == STALE:
            alerts.append(
                _alert(
                    ALERT_NODE_STALE,
                    "warning",
                    node,
                    node.last_heartbeat_at + settings.stale_after_seconds,
                    "the node's heartbeats are late",
                    "Check the agent's log and its connection to the control plane.",
                )
            )
    for hostname, claimants in sorted(by_hostname.items()):
        if len(claimants) > 1:
            newest = max(claimants, key=lambda n: n.created_at)
            alert = _alert(
                ALERT_HOSTNAME_CONFLICT,
                "warning",
                newest,
                newest.created_at,
                f"{len(claimants)} enabled nodes claim hostname {hostname}",
                "Decommission the superseded node (docs/runbooks/decommission.md); "
                "nodes are never merged.",
            )
            alert["node_ids"] = [n.node_id for n in claimants]
            alerts.append(alert)
    return alerts


def _alert(kind: str, severity: str, node: Node, since: float, message: str, next_step: str):
    return {
        "kind": kind,
        "severity": severity,
        "node_id": node.node_id,
        "display_name": node.display_name,
        "since": isoformat(since),
        "message": message,
        "next_step": next_step,
    }
