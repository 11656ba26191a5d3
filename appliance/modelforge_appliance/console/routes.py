"""The console's routes: pages, sign-in and sign-out, and its static files.

Pages are server-rendered shells; their data comes from the same ``/api/v1/admin``
endpoints automation uses, called by the page's JavaScript with the session cookie and
the ``X-CSRF-Token`` header. Every response carries the strict security headers
(``api.http.SECURITY_HEADERS``); no page has inline script or style.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import bottle

from modelforge_contract import SESSION_COOKIE, WORK_STATES, __version__

from ..core.errors import ApiError, NotFound
from ..core.validation import Field
from ..fleet import node_agent_image, nodes
from ..identity import sessions
from ..identity.users import FIRST_USER
from ..web.auth import PUBLIC, SESSION, SIGN_IN_PATH, signed_in_session
from ..web.http import ApiContext, client_address, json_response, redirect, request_origin
from ..work import items

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
TEMPLATES = str(HERE / "templates")
STATIC = str(HERE / "static")
CONSOLE = "/console/"
SIGN_IN = SIGN_IN_PATH
PAGE_HEADERS = {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store"}
SIGN_IN_FIELDS = {
    "password": Field(str, low=1, high=1024),
    "user": Field(str, required=False, low=1, high=64),
}
IMPORT_COMMAND = "modelforge models import NAME PATH"
HUB_TOKEN_COMMAND = "modelforge hub-token set"
DEPLOY_COMMAND = "modelforge deploy NAME --model M --nodes A,B --runtime llama.cpp"
EXPIRY_CHOICES = ((300, "5 minutes"), (900, "15 minutes"), (3600, "1 hour"), (86400, "24 hours"))


def page(name: str, status: int = 200, **values: Any) -> bottle.HTTPResponse:
    body = bottle.template(name, template_lookup=[TEMPLATES], version=__version__, **values)
    return bottle.HTTPResponse(body, status=status, headers=PAGE_HEADERS)


def is_https() -> bool:
    return bottle.request.environ.get("wsgi.url_scheme") == "https"


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    settings, store = context.settings, context.store

    @app.get("/", auth=PUBLIC)
    def root():
        return redirect(CONSOLE)

    @app.get("/favicon.ico", auth=PUBLIC)
    def favicon():
        return bottle.HTTPResponse(status=204, headers={"Cache-Control": "max-age=86400"})

    @app.get("/console", auth=PUBLIC)
    def console_without_slash():
        return redirect(CONSOLE)

    def sign_in_form(
        error: str = "", status: int = 200, user: str = FIRST_USER
    ) -> bottle.HTTPResponse:
        return page(
            "sign_in",
            status=status,
            password_set=sessions.has_admin_password(store),
            command=sessions.SET_PASSWORD_COMMAND,
            session=None,
            error=error,
            user=user[:64],
        )

    @app.get(SIGN_IN, auth=PUBLIC)
    def sign_in_page():
        if signed_in_session(context) is not None:
            return redirect(CONSOLE)
        return sign_in_form()

    @app.post(SIGN_IN, auth=PUBLIC)
    def sign_in():
        """The sign-in form posts here, as a plain HTML form (no script is needed: the
        password never lands in a URL); a JSON body is answered in JSON."""
        as_form = bottle.request.content_type.startswith("application/x-www-form-urlencoded")
        if as_form:
            password = bottle.request.forms.getunicode("password") or ""
            user = (bottle.request.forms.getunicode("user") or "").strip() or FIRST_USER
        else:
            fields = context.body(SIGN_IN_FIELDS)
            password, user = fields["password"], fields.get("user") or FIRST_USER
        address = client_address()
        try:
            cookie, _ = sessions.sign_in(store, settings, password, address, user)
        except ApiError as refusal:
            log.info("console sign-in refused for %s: %s", address, refusal.code)
            if as_form:
                shown = "Wrong user name or password." if refusal.status == 401 else refusal.message
                if refusal.next_step and refusal.status != 401:
                    shown += f" {refusal.next_step}"
                response = sign_in_form(shown, refusal.status, user)
            else:
                response = json_response(refusal.body(), refusal.status)
            if "retry_after_seconds" in refusal.extra:
                response.set_header("Retry-After", str(refusal.extra["retry_after_seconds"]))
            return response
        response = (
            redirect(CONSOLE) if as_form else json_response({"signed_in": True, "next": CONSOLE})
        )
        response.set_cookie(
            SESSION_COOKIE,
            cookie,
            path="/",
            httponly=True,
            samesite="strict",
            secure=is_https(),
            max_age=settings.session_max_seconds,
        )
        return response

    @app.post("/console/sign-out", auth=SESSION)
    def sign_out(session: sessions.Session):
        sessions.sign_out(store, session)
        response = json_response({"signed_out": True, "next": SIGN_IN})
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=is_https()
        )
        return response

    @app.get(CONSOLE, auth=SESSION)
    def hardware_page(session: sessions.Session):
        origin = settings.public_api_origin or request_origin(bottle.request.environ)
        return page(
            "hardware",
            session=session,
            api_origin=origin,
            expiry_choices=EXPIRY_CHOICES,
            bundle_steps=node_agent_image.bundle_steps(settings),
            image_version=node_agent_image.release_version(settings),
            recreate_command=node_agent_image.RECREATE_COMMAND,
        )

    @app.get("/console/nodes/<node_id>", auth=SESSION)
    def node_page(node_id: str, session: sessions.Session):
        try:
            node = nodes.get_node(store, node_id)
        except NotFound:
            return page("not_found", status=404, session=session, what=f"node {node_id}")
        return page("node", session=session, node_id=node.node_id, display_name=node.display_name)

    @app.get("/console/work", auth=SESSION)
    def work_page(session: sessions.Session):
        return page("work", session=session, states=WORK_STATES)

    @app.get("/console/models", auth=SESSION)
    def models_page(session: sessions.Session):
        return page(
            "models",
            session=session,
            import_command=IMPORT_COMMAND,
            hub_token_command=HUB_TOKEN_COMMAND,
        )

    @app.get("/console/deployments", auth=SESSION)
    def deployments_page(session: sessions.Session):
        # Where clients call the deployments (the cards' "How a client calls it"): the
        # public origin when set, else the one this page was addressed through.
        origin = settings.public_api_origin or request_origin(bottle.request.environ)
        return page(
            "deployments", session=session, deploy_command=DEPLOY_COMMAND, api_origin=origin
        )

    @app.get("/console/keys", auth=SESSION)
    def keys_page(session: sessions.Session):
        return page("keys", session=session)

    @app.get("/console/users", auth=SESSION)
    def users_page(session: sessions.Session):
        return page("users", session=session)

    @app.get("/console/work/<work_id>", auth=SESSION)
    def work_item_page(work_id: str, session: sessions.Session):
        try:
            item = items.get_work(store, work_id)
        except NotFound:
            return page("not_found", status=404, session=session, what=f"work item {work_id}")
        return page("work_item", session=session, work_id=item.work_id)

    @app.get("/console/static/<path:path>", auth=PUBLIC)
    def static(path: str):
        response = bottle.static_file(path, root=STATIC)
        if response.status_code == 200:
            response.set_header("Cache-Control", "no-cache")
        return response
