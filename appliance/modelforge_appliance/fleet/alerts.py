"""Alerts derived from liveness, hostnames and telemetry floods, computed when read.

Computing them from the same timestamps as liveness keeps the two consistent: a
``node_offline`` alert exists exactly while the node reads ``offline``, and clears
when it heartbeats again. A ``telemetry_flood`` exists while the node's last dropped
publication is younger than ``telemetry.flood_clear_seconds``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from modelforge_contract import (
    ALERT_HARDWARE_CHANGED,
    ALERT_HOSTNAME_CONFLICT,
    ALERT_NODE_OFFLINE,
    ALERT_NODE_STALE,
    ALERT_TELEMETRY_FLOOD,
    OFFLINE,
    STALE,
)

from ..core.clock import isoformat
from ..core.lookalike import lookalike_key
from ..core.settings import Settings
from ..store.database import Store
from ..store.tables import Node
from . import hardware
from .nodes import liveness_of
from .telemetry import active_floods


def active_alerts(store: Store, settings: Settings) -> list[dict[str, Any]]:
    with store.connection():
        enabled = list(Node.select().where(Node.decommissioned_at.is_null()).order_by(Node.node_id))
    now = store.clock.now()
    alerts: list[dict[str, Any]] = []
    for node in enabled:
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
        changes = hardware.describe_pending(node)
        if changes is not None:
            alerts.append(
                _alert(
                    ALERT_HARDWARE_CHANGED,
                    "warning",
                    node,
                    node.hardware_changed_at,
                    f"the node published other accelerators than those accepted: {changes}; "
                    "it gets no new work until an administrator accepts them",
                    "Check the node's hardware; if the change is expected: modelforge nodes "
                    f"accept-hardware {node.node_id}. If not, the node may be compromised "
                    "(docs/runbooks/credential-loss.md).",
                )
            )
    alerts += _conflicts(enabled)
    alerts += _telemetry_floods(store, settings, {node.node_id: node for node in enabled})
    return alerts


def _alike(names: list[str]) -> bool:
    """Whether two of these different names look alike."""
    return len({lookalike_key(name) for name in names}) < len(names)


def _conflicts(enabled: list[Node]) -> list[dict[str, Any]]:
    """One ``hostname_conflict`` per group of enabled nodes a person could take for one
    another: the same hostname, or hostnames that look alike (core/lookalike.py: they
    differ only by case, invisible characters or confusable letters), or display names that
    look alike without being the same (one display name given twice is an administrator's
    choice, visible as such). Groups that share a node are one group."""
    parent = {node.node_id: node.node_id for node in enabled}

    def root(node_id: str) -> str:
        while parent[node_id] != node_id:
            parent[node_id] = node_id = parent[parent[node_id]]
        return node_id

    by_hostname: dict[str, list[Node]] = defaultdict(list)
    by_display_name: dict[str, list[Node]] = defaultdict(list)
    for node in enabled:
        by_hostname[lookalike_key(node.hostname)].append(node)
        by_display_name[lookalike_key(node.display_name)].append(node)
    groups = [*by_hostname.values()] + [
        named for named in by_display_name.values() if len({n.display_name for n in named}) > 1
    ]
    for group in groups:
        for node in group[1:]:
            parent[root(node.node_id)] = root(group[0].node_id)
    members: dict[str, list[Node]] = defaultdict(list)
    for node in enabled:
        members[root(node.node_id)].append(node)
    found = []
    for claimants in members.values():
        if len(claimants) < 2:
            continue
        hostnames = sorted({n.hostname for n in claimants})
        names = sorted({n.display_name for n in claimants})
        what = []
        if len(hostnames) == 1:
            what.append(f"claim hostname {hostnames[0]}")
        elif _alike(hostnames):  # each written as ascii() does, so the difference shows
            what.append("claim hostnames that look alike: " + ", ".join(map(ascii, hostnames)))
        if len(names) > 1 and _alike(names):
            what.append("have display names that look alike: " + ", ".join(map(ascii, names)))
        newest = max(claimants, key=lambda n: n.created_at)
        alert = _alert(
            ALERT_HOSTNAME_CONFLICT,
            "warning",
            newest,
            newest.created_at,
            f"{len(claimants)} enabled nodes {'; '.join(what)}",
            "Decommission the superseded node (docs/runbooks/decommission.md), or rename one "
            "of two real nodes (modelforge nodes rename); nodes are never merged.",
        )
        alert["node_ids"] = [n.node_id for n in claimants]
        found.append(alert)
    return found


def _telemetry_floods(
    store: Store, settings: Settings, enabled: dict[str, Node]
) -> list[dict[str, Any]]:
    """One alert per flooding node, however many publications it drops."""
    found = []
    for flood in active_floods(store, settings):
        node = enabled.get(flood.node_id)
        if node is None:
            continue
        alert = _alert(
            ALERT_TELEMETRY_FLOOD,
            "warning",
            node,
            flood.since,
            "the node publishes telemetry faster than once per "
            f"{settings.telemetry_min_interval_seconds}s; {flood.dropped_samples} samples "
            "dropped so far",
            "Check the agent's MODELFORGE_AGENT_TELEMETRY_INTERVAL_SECONDS; a node that floods "
            "with a sane interval may be compromised (docs/runbooks/credential-loss.md).",
        )
        alert["dropped_samples"] = flood.dropped_samples
        found.append(alert)
    return found


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
