"""Agent routes: enroll, heartbeat, inventory, telemetry.

Every call names its agent protocol (invariant 8) and, after enrollment, carries the
node's credential; every answer carries ``compatibility``.
"""

from __future__ import annotations

import bottle

from modelforge_contract import (
    COMPATIBLE,
    PATH_AGENT_ENROLL,
    PATH_AGENT_HEARTBEAT,
    PATH_AGENT_INVENTORY,
    PATH_AGENT_TELEMETRY,
)

from ..core.clock import isoformat
from ..core.errors import ApiError
from ..core.validation import ENROLL_FIELDS, HEARTBEAT_FIELDS, INVENTORY_FIELDS, TELEMETRY_FIELDS
from ..fleet import nodes
from ..identity import enrollment
from ..models import replicas
from ..web.auth import AGENT, ENROLLING, AgentCall, Body
from ..web.http import ApiContext, json_response, request_origin


def source_address() -> str | None:
    """The peer address as waitress saw it: the proxy's client behind a trusted proxy
    (server.forwarded_headers); an X-Forwarded-For from anyone else is dropped."""
    return bottle.request.environ.get("REMOTE_ADDR") or None


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store, heartbeats, metrics = (
        context.settings,
        context.store,
        context.heartbeats,
        context.metrics,
    )

    def claim(request: enrollment.EnrollRequest) -> enrollment.Enrolled:
        try:
            enrolled = enrollment.claim_token(store, request, context.refusals)
        except ApiError as refusal:
            metrics.enrollments.labels(refusal.code).inc()
            raise
        metrics.enrollments.labels("REENROLLED" if enrolled.reenrolled else "ENROLLED").inc()
        return enrolled

    @app.post(PATH_AGENT_ENROLL, auth=ENROLLING)
    def enroll(protocol: int):
        fields = context.body(ENROLL_FIELDS)
        identity = fields.get("identity") or {}
        enrolled = claim(
            enrollment.EnrollRequest(
                token=fields["token"],
                hostname=fields["hostname"],
                agent_version=fields["agent_version"],
                accelerator_mode=fields["accelerator_mode"],
                protocol_version=protocol,
                request_origin=request_origin(bottle.request.environ),
                identity_id=identity.get("identity_id"),
                identity_secret=identity.get("identity_secret"),
                source_address=source_address(),
            ),
        )
        return json_response(
            {
                "node_id": enrolled.node.node_id,
                "credential": enrolled.credential,
                "reenrolled": enrolled.reenrolled,
                "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                "compatibility": COMPATIBLE,
            },
            201,
        )

    @app.post(PATH_AGENT_HEARTBEAT, auth=AGENT, body=Body(HEARTBEAT_FIELDS))
    def heartbeat(agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        protocol = agent.protocol
        metrics.heartbeats.inc()
        at, held = heartbeats.record(
            caller,
            agent_version=fields["agent_version"],
            protocol=protocol,
            health=fields["health"],
        )
        if not held:  # faster than the interval allows: answered all the same
            metrics.heartbeats_unwritten.inc()
        return json_response(
            {
                "server_time": isoformat(at),
                "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                "compatibility": COMPATIBLE,
                # Additive: what to publish again now (an older agent ignores it).
                "republish": list(caller.republish),
                # Additive (issue 24): changes when the node's replicas do; an agent that
                # sees a new value fetches GET /agent/models.
                "models_generation": caller.models_generation,
                # Additive (issue 25): changes when the node's servers do; an agent that
                # sees a new value fetches GET /agent/servers.
                "servers_generation": caller.servers_generation,
                # Additive (issue 37): optional inventory fields this control plane takes
                # (an older one refuses a field it does not know, so the agent asks first).
                "accepts": ["host.hostname"],
            }
        )

    @app.put(PATH_AGENT_INVENTORY, auth=AGENT, body=Body(INVENTORY_FIELDS))
    def inventory(agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        at = nodes.record_inventory(store, caller, fields, source_address())
        replicas.record_report(store, caller, fields.get("models"), at)
        return json_response({"server_time": isoformat(at), "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_TELEMETRY, auth=AGENT, body=Body(TELEMETRY_FIELDS))
    def telemetry(agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        samples = fields["samples"]
        published = context.telemetry.publish(caller, samples, source_address())
        if not published.stored:  # faster than MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS
            metrics.telemetry_dropped.labels(caller.node_id).inc(len(samples))
        return json_response(
            {
                "server_time": isoformat(published.at),
                "stored": published.stored,
                "compatibility": COMPATIBLE,
            }
        )
