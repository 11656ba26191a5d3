"""Agent work routes: claim, renew, complete (docs/architecture.md §5).

Agents ask; the control plane never dials a node (invariant 1). A claim that leases
nothing answers 204 with the reason in ``X-ModelForge-Claim-Reason``; a node claiming
faster than MODELFORGE_WORK_CLAIMS_PER_SECOND is answered 429 before the store is touched.
"""

from __future__ import annotations

import math

import bottle

from modelforge_contract import (
    CLAIM_RATE_LIMITED,
    COMPATIBLE,
    HEADER_CLAIM_REASON,
    PATH_AGENT_WORK_CLAIM,
    PATH_AGENT_WORK_COMPLETE,
    PATH_AGENT_WORK_RENEW,
)

from ..core.clock import isoformat
from ..core.errors import TooManyRequests
from ..core.rates import TokenBuckets
from ..core.validation import CLAIM_FIELDS, COMPLETE_FIELDS, RENEW_FIELDS
from ..deployments import placement as serve_placement
from ..web.auth import AGENT, AgentCall, Body
from ..web.http import ApiContext, json_response
from ..work import leases


def expire_leases(context: ApiContext) -> None:
    """Settle expired leases before anyone reads or claims work."""
    expired = leases.expire_leases(context.store)
    if expired:
        context.metrics.lease_expiries.inc(len(expired))


def too_fast(wait: float) -> TooManyRequests:
    seconds = max(1, math.ceil(wait))  # Retry-After counts whole seconds
    return TooManyRequests(
        "this node claims work faster than the control plane allows",
        code=CLAIM_RATE_LIMITED,
        next_step=f"Claim again in {seconds} s (MODELFORGE_WORK_CLAIMS_PER_SECOND sets the rate).",
        extra={"retry_after_seconds": seconds},
    )


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store, metrics = context.settings, context.store, context.metrics
    rate = settings.work_claims_per_second
    claims = TokenBuckets(rate, rate, store.clock)  # per node, in this process's memory

    @app.post(PATH_AGENT_WORK_CLAIM, auth=AGENT, body=Body(CLAIM_FIELDS))
    def claim(agent: AgentCall):
        fields, caller = agent.fields, agent.caller
        wait = claims.take(caller.node_id)  # before anything is written (or read) for it
        if wait:
            metrics.work_claims.labels("rate_limited").inc()
            raise too_fast(wait)
        expire_leases(context)
        lease = leases.claim_work(
            store,
            settings,
            caller,
            fields["capabilities"],
            context.heartbeats.pending(caller.node_id),
            fields.get("work_slots", 1),
            held_elsewhere=serve_placement.gpus_held,  # a deployment's servers keep theirs
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
