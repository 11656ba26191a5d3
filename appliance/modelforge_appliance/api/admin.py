"""Admin routes: enrollment tokens, the fleet, lifecycle actions, alerts, audit, metrics.

Each route declares its caller (web/auth.py authenticates it), then calls one service function.
"""

from __future__ import annotations

import bottle

from modelforge_contract import (
    HOST_INVALID,
    PATH_ADMIN_ALERTS,
    PATH_ADMIN_AUDIT,
    PATH_ADMIN_ENROLLMENT,
    PATH_ADMIN_ENROLLMENTS,
    PATH_ADMIN_NODE,
    PATH_ADMIN_NODE_ACCEPT_HARDWARE,
    PATH_ADMIN_NODE_AGENT_IMAGE_CHECK,
    PATH_ADMIN_NODE_CORDON,
    PATH_ADMIN_NODE_CREDENTIAL,
    PATH_ADMIN_NODE_CREDENTIALS,
    PATH_ADMIN_NODE_DECOMMISSION_EXECUTE,
    PATH_ADMIN_NODE_DECOMMISSION_PREVIEW,
    PATH_ADMIN_NODE_READINESS,
    PATH_ADMIN_NODE_TELEMETRY,
    PATH_ADMIN_NODE_UNCORDON,
    PATH_ADMIN_NODE_WORK_SLOTS,
    PATH_ADMIN_NODES,
    PATH_HEALTHZ,
    PATH_METRICS,
)

from .. import lifecycle
from ..core.clock import isoformat
from ..core.errors import Invalid, StoreUnavailable
from ..core.validation import (
    ACCEPT_HARDWARE_FIELDS,
    EXECUTE_FIELDS,
    IMAGE_CHECK_FIELDS,
    MINT_FIELDS,
    WORK_SLOTS_FIELDS,
)
from ..fleet import alerts, hardware, node_agent_image, nodes, readiness, telemetry
from ..identity import credentials, enrollment
from ..store import audit
from ..web.auth import ADMIN, PUBLIC, SCRAPER
from ..web.http import ApiContext, json_response, query_int, request_origin
from ..web.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store
    clock = store.clock

    @app.get(PATH_METRICS, auth=SCRAPER)
    def prometheus_metrics():
        return bottle.HTTPResponse(
            context.metrics.exposition(),
            headers={"Content-Type": METRICS_CONTENT_TYPE, "Cache-Control": "no-store"},
        )

    @app.get(PATH_HEALTHZ, auth=PUBLIC)
    def healthz():
        if not store.ping():
            raise StoreUnavailable("the store did not answer")
        return json_response({"status": "ok"})

    # -- enrollment tokens -------------------------------------------------------

    @app.post(PATH_ADMIN_ENROLLMENTS, auth=ADMIN, action="nodes.enroll")
    def mint(actor: str):
        fields = context.body(MINT_FIELDS)
        origin = settings.public_api_origin or request_origin(bottle.request.environ)
        if origin == "unknown":
            raise Invalid(
                "the Host header of this request is not an origin a token can be locked to "
                "(a wildcard address such as 0.0.0.0 never is)",
                code=HOST_INVALID,
                next_step="Set MODELFORGE_PUBLIC_API_ORIGIN, or mint through the address the "
                "agents use.",
            )
        minted = enrollment.mint_enrollment_token(
            store,
            display_name=fields["display_name"],
            expires_in_seconds=fields["expires_in_seconds"],
            api_origin=origin,
            actor=actor,
            accelerator_mode=fields.get("accelerator_mode", enrollment.DEFAULT_ACCELERATOR_MODE),
        )
        return json_response(minted.response(clock.now()), 201)

    @app.get(PATH_ADMIN_ENROLLMENTS, auth=ADMIN, action="nodes.read")
    def list_enrollments():
        return json_response({"enrollments": enrollment.list_enrollments(store)})

    @app.delete(PATH_ADMIN_ENROLLMENT, auth=ADMIN, action="nodes.enroll")
    def revoke_enrollment(enrollment_id: str, actor: str):
        return json_response(enrollment.revoke_enrollment(store, enrollment_id, actor))

    # -- fleet and lifecycle -------------------------------------------------------

    @app.get(PATH_ADMIN_NODES, auth=ADMIN, action="nodes.read")
    def fleet():
        listed = readiness.list_nodes(store, settings)
        # server_time lets the console show ages on the control plane's clock, not the browser's.
        return json_response({"nodes": listed, "server_time": isoformat(clock.now())})

    @app.get(PATH_ADMIN_NODE, auth=ADMIN, action="nodes.read")
    def one_node(node_id: str):
        node = nodes.get_node(store, node_id)
        view = nodes.node_view(node, clock.now(), settings)
        # What its telemetry floods cost it (publications and samples dropped, never stored).
        return json_response({**view, "telemetry_dropped": context.telemetry.dropped(node_id)})

    @app.get(PATH_ADMIN_NODE_READINESS, auth=ADMIN, action="nodes.read")
    def node_readiness(node_id: str):
        return json_response(readiness.readiness_of(store, settings, node_id))

    @app.get(PATH_ADMIN_NODE_TELEMETRY, auth=ADMIN, action="nodes.read")
    def node_telemetry(node_id: str):
        nodes.get_node(store, node_id)  # 404 for an unknown node
        now = clock.now()
        since = query_int("since", None, 0, 2**40)
        start = now - telemetry.DEFAULT_WINDOW_SECONDS if since is None else since
        return json_response(telemetry.history(store, node_id, start))

    @app.post(PATH_ADMIN_NODE_AGENT_IMAGE_CHECK, auth=ADMIN, action="nodes.enroll")
    def check_node_agent_image():
        fields = context.body(IMAGE_CHECK_FIELDS)
        return json_response(node_agent_image.check(settings, fields))

    @app.get(PATH_ADMIN_NODE_CREDENTIALS, auth=ADMIN, action="nodes.read")
    def node_credentials(node_id: str):
        return json_response(credentials.credentials_of(store, nodes.get_node(store, node_id)))

    @app.delete(PATH_ADMIN_NODE_CREDENTIAL, auth=ADMIN, action="nodes.decommission")
    def revoke_node_credential(node_id: str, actor: str):
        node = nodes.get_node(store, node_id)
        revocation = lifecycle.revoke_node_credential(store, node, actor)
        return json_response({"node_id": node_id, **revocation})

    @app.post(PATH_ADMIN_NODE_DECOMMISSION_PREVIEW, auth=ADMIN, action="nodes.decommission")
    def decommission_preview(node_id: str, actor: str):
        return json_response(lifecycle.preview_decommission(store, node_id, actor))

    @app.post(PATH_ADMIN_NODE_DECOMMISSION_EXECUTE, auth=ADMIN, action="nodes.decommission")
    def decommission_execute(node_id: str, actor: str):
        confirmation = context.body(EXECUTE_FIELDS)["confirmation"]
        return json_response(lifecycle.execute_decommission(store, node_id, confirmation, actor))

    @app.post(PATH_ADMIN_NODE_CORDON, auth=ADMIN, action="nodes.change")
    def cordon(node_id: str, actor: str):
        node = nodes.set_cordoned(store, node_id, True, actor)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.post(PATH_ADMIN_NODE_UNCORDON, auth=ADMIN, action="nodes.change")
    def uncordon(node_id: str, actor: str):
        node = nodes.set_cordoned(store, node_id, False, actor)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.put(PATH_ADMIN_NODE_WORK_SLOTS, auth=ADMIN, action="nodes.change")
    def set_work_slots(node_id: str, actor: str):
        wanted = context.body(WORK_SLOTS_FIELDS)["work_slots_max"]
        node = nodes.set_work_slots(store, node_id, wanted, actor)
        return json_response(nodes.node_view(node, clock.now(), settings))

    @app.post(PATH_ADMIN_NODE_ACCEPT_HARDWARE, auth=ADMIN, action="nodes.change")
    def accept_hardware(node_id: str, actor: str):
        # The body is optional: {"digest": …} accepts only what the caller was shown.
        has_body = bottle.request.content_length > 0
        digest = context.body(ACCEPT_HARDWARE_FIELDS).get("digest") if has_body else None
        accepted = hardware.accept_hardware(store, node_id, actor, digest)
        view = nodes.node_view(nodes.get_node(store, node_id), clock.now(), settings)
        return json_response({**view, "accepted": accepted.as_dict()})

    # -- alerts and audit ----------------------------------------------------------

    @app.get(PATH_ADMIN_ALERTS, auth=ADMIN, action="nodes.read")
    def list_alerts():
        return json_response({"alerts": alerts.active_alerts(store, settings)})

    @app.get(PATH_ADMIN_AUDIT, auth=ADMIN, action="audit.read")
    def audit_events():
        limit = query_int("limit", 50, 1, 500)
        before = query_int("before", None, 1, 2**62)
        node_id = bottle.request.query.get("node_id") or None
        return json_response(audit.list_events(store, limit=limit, before=before, node_id=node_id))
