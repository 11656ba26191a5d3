"""The HTTP fallback of the agents' tunnel (docs/architecture.md §12), on plain waitress.

``GET …/tunnel/down`` opens a session: its answer hands out the session id in
``X-ModelForge-Tunnel-Session`` and streams the control plane's frames back to back for as
long as the tunnel lives. The front hands the download to the relay's event loop
(runtime/client_loop.py), which streams it without holding a thread; one that reached
waitress (a kept connection's later request) streams on its waitress thread. The hub takes
the session as the node's tunnel, exactly as it takes a WebSocket, and reads it on a thread
of its own. ``POST …/tunnel/up`` carries a batch of the agent's frames for the session;
only the node that opened a session may upload to it (403 TUNNEL_SESSION_NOT_YOURS), a
session that ended is 409 TUNNEL_SESSION_CLOSED, one never opened 404
TUNNEL_SESSION_UNKNOWN. An upload that breaks the framing closes the tunnel, as a bad
WebSocket message does.
"""

from __future__ import annotations

import bottle

from modelforge_contract import HEADER_AGENT_PROTOCOL
from modelforge_contract import tunnel as wire

from ..core.errors import ApiError, Conflict, Forbidden, NotFound, TooLarge
from ..relay.endpoint import MAX_TUNNELS_PER_NODE, too_many_tunnels
from ..relay.http_link import HttpLink, HttpSessions, LinkClosed
from ..relay.hub import Hub
from ..web.auth import AGENT, NO_BODY, RAW_BODY, AgentCall
from ..web.http import DEFERRED, ApiContext, request_header

TUNNEL_SESSION_UNKNOWN = "TUNNEL_SESSION_UNKNOWN"
TUNNEL_SESSION_CLOSED = "TUNNEL_SESSION_CLOSED"
TUNNEL_SESSION_NOT_YOURS = "TUNNEL_SESSION_NOT_YOURS"
UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
_AGAIN = f"Open a new session with GET {wire.PATH_AGENT_TUNNEL_DOWN}."


def add_routes(app: bottle.Bottle, context: ApiContext, hub: Hub) -> None:
    sessions = app.tunnel_sessions = HttpSessions()
    max_body = context.settings.max_body_bytes

    @app.get(wire.PATH_AGENT_TUNNEL_DOWN, auth=AGENT, body=NO_BODY)
    def down(agent: AgentCall):
        headers = {"Content-Type": wire.TUNNEL_MEDIA_TYPE, "Cache-Control": "no-store"}
        if bottle.request.method == "HEAD":  # no body goes out, so no tunnel could either
            return bottle.HTTPResponse(status=200, headers=headers)
        node_id = agent.caller.node_id
        if hub.tunnels_held(node_id) >= MAX_TUNNELS_PER_NODE:
            raise too_many_tunnels(request_header(HEADER_AGENT_PROTOCOL))
        link = HttpLink(node_id)
        sessions.add(link)
        # No thread is the tunnel's: uploads feed it, the download streams it.
        hub.register(node_id, link, agent.caller.credential_id).start(
            then=lambda: sessions.remove(link)
        )
        headers[wire.HEADER_TUNNEL_SESSION] = link.session_id
        headers["X-Accel-Buffering"] = "no"  # nginx: pass each frame on as it comes
        deferred = bottle.request.environ.get(DEFERRED)
        if deferred is not None:  # the relay's loop streams the download: no thread held
            deferred.append(link)
            return bottle.HTTPResponse(status=200, headers=headers)
        return bottle.HTTPResponse(link.body(), status=200, headers=headers)

    @app.post(wire.PATH_AGENT_TUNNEL_UP, auth=AGENT, body=RAW_BODY)
    def up(agent: AgentCall):
        session_id = request_header(wire.HEADER_TUNNEL_SESSION) or ""
        link, closed_for = sessions.find(session_id)
        owner = link.node_id if link is not None else closed_for
        if owner is None:
            raise NotFound(
                "no tunnel session has this id",
                code=TUNNEL_SESSION_UNKNOWN,
                next_step=_AGAIN,
            )
        if owner != agent.caller.node_id:
            raise Forbidden(
                "this tunnel session is another node's",
                code=TUNNEL_SESSION_NOT_YOURS,
                next_step="Upload only to a session this node's credential opened.",
            )
        if link is None:
            raise Conflict("this tunnel session has ended", code=TUNNEL_SESSION_CLOSED,
                           next_step=_AGAIN)  # fmt: skip
        raw = _read_frames_body(bottle.request.environ, max_body)
        reader = wire.FrameReader()
        try:
            frames = reader.feed(raw)
            reader.close()
        except wire.FrameError as bad:
            # As a bad WebSocket message: the tunnel closes, the reason logged by the hub.
            frames = []
            link.close(1002, f"protocol error: {bad}")
            raise Conflict(
                "the upload breaks the tunnel's framing; the session is closed",
                code=TUNNEL_SESSION_CLOSED,
                next_step=_AGAIN,
            ) from None
        try:
            link.feed(frames)
        except LinkClosed:
            raise Conflict("this tunnel session has ended", code=TUNNEL_SESSION_CLOSED,
                           next_step=_AGAIN) from None  # fmt: skip
        return bottle.HTTPResponse(status=204)


def _read_frames_body(environ: dict, max_bytes: int) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise ApiError("Content-Length is not a number", code="BAD_REQUEST") from None
    if length > max_bytes:
        raise TooLarge(
            f"the body is {length} bytes; the limit is {max_bytes}",
            next_step="Send smaller batches (MODELFORGE_MAX_BODY_BYTES sets the limit).",
        )
    media_type = (environ.get("CONTENT_TYPE") or "").split(";")[0].strip().lower()
    if media_type != wire.TUNNEL_MEDIA_TYPE:
        raise ApiError(
            f"the body must be sent as Content-Type: {wire.TUNNEL_MEDIA_TYPE}",
            code=UNSUPPORTED_MEDIA_TYPE,
            status=415,
        )
    return environ["wsgi.input"].read(length) if length > 0 else b""
