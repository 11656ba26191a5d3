"""One model across several nodes: llama.cpp's RPC, carried over the agents' tunnels.

A split deployment names its members in ``settings.split``, the main node first. The main
node's server runs ``llama-server --rpc`` and holds the model; each helper's server runs
``ggml-rpc-server`` on its own loopback, and needs no replica: the main node sends it its
tensors. The main node's agent listens on 127.0.0.1 for each helper and carries each
connection to it as a LINK over the two agents' tunnels, which the hub splices; only a
group's main server may open one, to a helper of the same deployment (relay/links.py).
The control plane still dials no node.

The layers follow each member's memory (``shares``): a GPU member's free GPU memory, a CPU
member's host memory. A lost or stalled member ends the main server's links, so its
``llama-server`` exits and starts again after the usual backoff; once every member is
back, the group serves again.
"""

from __future__ import annotations

import json
from typing import Any

from modelforge_contract import FIELD_FORMAT
from modelforge_contract.deployments import (
    ROLE_HELPER,
    ROLE_MAIN,
    RUNTIME_LLAMA_CPP,
    SERVER_PENDING,
    SERVER_RUNNING,
)

from ..core.errors import Invalid
from ..store.tables import DeploymentServer, Node


def members_of(fields: dict[str, Any]) -> list[str] | None:
    """The split's node ids, the main node first; None for a whole deployment. 400 when the
    split does not fit the rest of the request."""
    given = (fields.get("settings") or {}).get("split")
    if not given:
        return None
    split = list(given)
    if len(set(split)) != len(split):
        raise Invalid(
            "settings.split names a node twice",
            code=FIELD_FORMAT,
            next_step="Name each member once: the main node first, then its helpers.",
        )
    if fields["runtime"] != RUNTIME_LLAMA_CPP:
        raise Invalid(
            f"settings.split: only llama.cpp splits a model across nodes, not {fields['runtime']}",
            code=FIELD_FORMAT,
            next_step="Deploy with --runtime llama.cpp, or leave out --split.",
        )
    if list(dict.fromkeys(fields["node_ids"])) != split[:1]:
        raise Invalid(
            "node_ids must be the split's main node alone (its first node)",
            code=FIELD_FORMAT,
            next_step="modelforge deploy NAME --model M --split MAIN,HELPER[,HELPER…]",
        )
    settings = fields.get("settings") or {}
    if settings.get("idle_unload_seconds") is not None:
        raise Invalid(
            "settings.idle_unload_seconds: a split deployment is not unloaded when idle",
            code=FIELD_FORMAT,
            next_step="Leave out --idle-unload, or deploy the model whole on one node.",
        )
    return split


def memory_of(node: Node, gpus: list[str]) -> int:
    """What a member can hold: its servers' GPUs' free memory (total less used, from the
    last telemetry), else the host's memory."""
    inventory = json.loads(node.inventory or "{}")
    if gpus:
        used = {
            str(g.get("uuid")): int(g.get("memory_used_bytes") or 0)
            for g in (json.loads(node.telemetry or "{}").get("accelerators") or [])
            if isinstance(g, dict)
        }
        return sum(
            max(0, int(a.get("memory_total_bytes") or 0) - used.get(str(a.get("uuid")), 0))
            for a in inventory.get("accelerators") or []
            if isinstance(a, dict) and a.get("uuid") in gpus
        )
    return int((inventory.get("host") or {}).get("memory_total_bytes") or 0)


def shares(memory: list[int]) -> list[float]:
    """Each member's part of the layers, in proportion to its memory, rounded to 3 places
    (equal parts when a member says nothing of its memory)."""
    if not memory or min(memory) <= 0:
        return [round(1 / len(memory), 3)] * len(memory) if memory else []
    total = sum(memory)
    return [round(m / total, 3) for m in memory]


def role_for(split: list[str] | None, node_id: str) -> str | None:
    if not split:
        return None
    return ROLE_MAIN if node_id == split[0] else ROLE_HELPER


def agent_entry(
    row: DeploymentServer, settings: dict[str, Any]
) -> tuple[bool, dict[str, Any] | None]:
    """Whether the server is listed to its agent now, and what the agent of a split's member
    needs beyond the deployment: its role, and for the main server its helpers' server ids
    (in the split's order) and the shares (None for a whole server)."""
    if row.role is None:
        return True, None
    if row.role == ROLE_HELPER:
        return True, {"role": ROLE_HELPER}
    split = settings.get("split") or []
    by_node = {s.node_id: s for s in _helpers(row)}
    if row.state == SERVER_PENDING and any(h.state != SERVER_RUNNING for h in by_node.values()):
        # Not yet started, it waits until every helper runs: started before them, its
        # llama-server would find nobody at the other end of its links and exit (once
        # started, it comes back by itself after a helper is lost, as any runtime does).
        return False, None
    return True, {
        "role": ROLE_MAIN,
        "helpers": [by_node[n].server_id for n in split[1:] if n in by_node],
        "shares": settings.get("shares") or [],
    }


def _helpers(row: DeploymentServer) -> list[DeploymentServer]:
    return list(
        DeploymentServer.select(
            DeploymentServer.server_id, DeploymentServer.node, DeploymentServer.state
        )
        .where(DeploymentServer.deployment == row.deployment_id)
        .where(DeploymentServer.role == ROLE_HELPER)
    )
