"""The client API on the control plane's own port: OpenAI-compatible, relayed to a running
server of the deployment the request's ``model`` names, over its node's tunnel (see
docs/architecture.md §12 and docs/clients.md).

These routes authenticate the key, read the body and choose the server; the answer itself
is the relay's (``relay.answer``), on its event loop. A connection the one-port front
handed to the loop (``runtime/client_loop.py``) runs these routes on a store thread and
leaves the answer to the loop (``DEFERRED``); one that reached waitress waits for it on
its thread. The answer has the runtime's own shape: its status and the allow-listed
headers, its body as it arrives. Bodies and keys never reach a log.
"""

from __future__ import annotations

import bottle

from modelforge_contract import relay as rel

from ..core.validation import read_json_bytes
from ..identity.api_keys import ApiKeyCaller
from ..relay import routing
from ..relay.answer import Relay, Request
from ..relay.limits import Limits
from ..web.auth import CLIENT
from ..web.http import DEFERRED, ApiContext, json_response

# Request headers a runtime may see (nothing of the client's credentials or cookies).
_FORWARDED = ("content-type", "accept", "user-agent", "x-request-id")


def add_routes(app: bottle.Bottle, context: ApiContext, relay: Relay, limits: Limits) -> None:
    store, settings, metrics, hub = context.store, context.settings, context.metrics, relay.hub

    @app.get(rel.PATH_CLIENT_MODELS, auth=CLIENT)
    def models(client: ApiKeyCaller):
        listed = [d for d in routing.running_deployments(store) if client.may_call(d["name"])]
        data = [
            {
                "id": d["name"],
                "object": "model",
                "created": int(d["created_at"]),
                "owned_by": "modelforge",
            }
            for d in listed
        ]
        return json_response({"object": "list", "data": data})

    def relayed(path: str, client: ApiKeyCaller) -> bottle.HTTPResponse:
        metrics.relay_key_requests.labels(client.key_id).inc()
        raw, body = read_json_bytes(bottle.request.environ, settings.max_body_bytes)
        if isinstance(body.get("model"), str):  # else routing says what is wrong with it
            limits.admit(client, body["model"])  # before any deployment is looked up
        target = routing.pick_or_start(
            store,
            hub,
            body.get("model"),
            app.usage,
            settings.relay_cold_start_seconds,
            lambda name: metrics.relay_cold_starts.labels(name).inc(),
        )
        headers = [
            (name, value)
            for name, value in bottle.request.headers.items()
            if name.lower() in _FORWARDED
        ]
        request = Request(target, path, headers, raw, client.key_id)
        deferred = bottle.request.environ.get(DEFERRED)
        if deferred is not None:
            deferred.append(request)
            return bottle.HTTPResponse(status=200)  # not sent: the loop answers
        answer, pieces = relay.answer_blocking(request)
        response = bottle.HTTPResponse(pieces, status=answer.status)
        for name, value in answer.headers:
            response.add_header(name, value)
        return response

    def route_of(path: str):
        def route(client: ApiKeyCaller) -> bottle.HTTPResponse:
            return relayed(path, client)

        return route

    for path in sorted(rel.RELAYED_PATHS):
        app.route(path, "POST", route_of(path), auth=CLIENT)
