"""Agent server routes: what to run, serve-lease claims and renewals.

See docs/architecture.md §11. Agents ask; the control plane never dials a node (invariant 1).
"""

from __future__ import annotations

import bottle

from modelforge_contract import COMPATIBLE
from modelforge_contract.deployments import (
    PATH_AGENT_SERVER_CLAIM,
    PATH_AGENT_SERVER_RENEW,
    PATH_AGENT_SERVERS,
)

from ..core.validation import SERVER_CLAIM_FIELDS, SERVER_RENEW_FIELDS
from ..deployments import leases
from ..web.auth import AGENT, NO_BODY, AgentCall, Body
from ..web.http import ApiContext, json_response


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    @app.get(PATH_AGENT_SERVERS, auth=AGENT, body=NO_BODY)
    def desired(agent: AgentCall):
        leases.expire_servers(store, settings)
        answer = leases.desired_for(store, agent.caller.node_id)
        return json_response({**answer, "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_SERVER_CLAIM, auth=AGENT, body=Body(SERVER_CLAIM_FIELDS))
    def claim(server_id: str, agent: AgentCall):
        leases.expire_servers(store, settings)
        lease = leases.claim(store, settings, agent.caller, server_id)
        return json_response({"lease": lease.view(), "compatibility": COMPATIBLE})

    @app.post(PATH_AGENT_SERVER_RENEW, auth=AGENT, body=Body(SERVER_RENEW_FIELDS))
    def renew(server_id: str, agent: AgentCall):
        answer = leases.renew(store, settings, agent.caller, server_id, agent.fields)
        return json_response({**answer, "compatibility": COMPATIBLE})
