"""Agent routes: enroll, heartbeat, inventory, telemetry.

Every call names its agent protocol (invariant 8) and, after enrollment, carries the
node's credential; every answer carries ``compatibility``.
"""

from __future__ import annotations

import bottle

from modelforge_contract import (
    COMPATIBILITY_NEXT_STEPS,
    COMPATIBLE,
    HEADER_AGENT_PROTOCOL,
    PATH_AGENT_ENROLL,
    PATH_AGENT_HEARTBEAT,
    PATH_AGENT_INVENTORY,
    PATH_AGENT_TELEMETRY,
    compatibility_of,
)

from ..core.clock import isoformat
from ..core.errors import ApiError, UpgradeRequired
from ..core.validation import ENROLL_FIELDS, HEARTBEAT_FIELDS, INVENTORY_FIELDS, TELEMETRY_FIELDS
from ..fleet import nodes
from ..identity import credentials, enrollment
from ..web.http import ApiContext, json_response, request_header, request_origin


def agent_protocol() -> int:
    """Invariant 8: every agent call names its protocol; anything else gets 426."""
    header = request_header(HEADER_AGENT_PROTOCOL)
    answer = compatibility_of(header)
    if answer != COMPATIBLE:
        shown = header if header is None else header[:32]
        raise UpgradeRequired(
            f"agent protocol {shown!r} is not accepted ({answer})",
            next_step=COMPATIBILITY_NEXT_STEPS[answer],
            extra={"compatibility": answer},
        )
    return int(header)


def agent_caller(context: ApiContext, node_id: str) -> credentials.Caller:
    """The node whose credential this request carries (401/403 otherwise, invariant 4)."""
    return credentials.authenticate_node(context.store, request_header("Authorization"), node_id)


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

    @app.post(PATH_AGENT_ENROLL)
    def enroll():
        protocol = agent_protocol()
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

    @app.post(PATH_AGENT_HEARTBEAT)
    def heartbeat():
        protocol = agent_protocol()
        fields = context.body(HEARTBEAT_FIELDS)
        caller = agent_caller(context, fields["node_id"])
        metrics.heartbeats.inc()
        at = heartbeats.record(
            caller,
            agent_version=fields["agent_version"],
            protocol=protocol,
            health=fields["health"],
        )
        return json_response(
            {
                "server_time": isoformat(at),
                "heartbeat_interval_seconds": settings.heartbeat_interval_seconds,
                "compatibility": COMPATIBLE,
                # Additive: what to publish again now (an older agent ignores it).
                "republish": list(caller.republish),
            }
        )

    @app.put(PATH_AGENT_INVENTORY)
    def inventory():
        agent_protocol()
        fields = context.body(INVENTORY_FIELDS)
        caller = agent_caller(context, fields["node_id"])
        at = nodes.record_inventory(store, caller, fields, source_address())
        return json_response({"server_time": isoformat(at), "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_TELEMETRY)
    def telemetry():
        agent_protocol()
        fields = context.body(TELEMETRY_FIELDS)
        caller = agent_caller(context, fields["node_id"])
        at = context.telemetry.record(caller, fields["samples"], source_address())
        return json_response({"server_time": isoformat(at), "compatibility": COMPATIBLE})
