"""Agent work routes: claim, renew, complete (docs/architecture.md §5).

Agents ask; the control plane never dials a node (invariant 1). A claim that leases
nothing answers 204 with the reason in ``X-ModelForge-Claim-Reason``.
"""

from __future__ import annotations

import bottle

from modelforge_contract import (
    COMPATIBLE,
    HEADER_CLAIM_REASON,
    PATH_AGENT_WORK_CLAIM,
    PATH_AGENT_WORK_COMPLETE,
    PATH_AGENT_WORK_RENEW,
)

from ..core.clock import isoformat
from ..core.validation import CLAIM_FIELDS, COMPLETE_FIELDS, RENEW_FIELDS
from ..web.auth import AGENT, AgentCall, Body
from ..web.http import ApiContext, json_response
from ..work import leases


def expire_leases(context: ApiContext) -> None:
    """Settle expired leases before anyone reads or claims work."""
    expired = leases.expire_leases(context.store)
    if expired:
        context.metrics.lease_expiries.inc(len(expired))


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store, metrics = context.settings, context.store, context.metrics

    @app.post(PATH_AGENT_WORK_CLAIM, auth=AGENT, body=Body(CLAIM_FIELDS))
    def claim(agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        expire_leases(context)
        lease = leases.claim_work(
            store,
            settings,
            caller,
            fields["capabilities"],
            context.heartbeats.pending(caller.node_id),
        )
        if isinstance(lease, str):
            metrics.work_claims.labels(lease).inc()
            return bottle.HTTPResponse(
                status=204, headers={HEADER_CLAIM_REASON: lease, "Cache-Control": "no-store"}
            )
        metrics.work_claims.labels("leased").inc()
        return json_response({"lease": lease.view(), "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_WORK_RENEW, auth=AGENT, body=Body(RENEW_FIELDS))
    def renew(work_id: str, agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        expires_at = leases.renew_lease(store, settings, caller, work_id, fields["lease_id"])
        return json_response(
            {
                "work_id": work_id,
                "lease_id": fields["lease_id"],
                "expires_at": isoformat(expires_at),
                "lease_seconds": settings.work_lease_seconds,
                "compatibility": COMPATIBLE,
            }
        )

    @app.post(PATH_AGENT_WORK_COMPLETE, auth=AGENT, body=Body(COMPLETE_FIELDS))
    def complete(work_id: str, agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        completed = leases.complete_work(
            store,
            caller,
            work_id,
            fields["lease_id"],
            outcome=fields["outcome"],
            result=fields.get("result"),
            log_tail=fields.get("log_tail"),
            error=fields.get("error"),
        )
        metrics.work_completion.labels(completed.state).observe(
            max(0.0, completed.finished_at - completed.created_at)
        )
        return json_response(
            {"work_id": work_id, "state": completed.state, "compatibility": COMPATIBLE}
        )
