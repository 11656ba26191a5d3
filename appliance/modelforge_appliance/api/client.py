"""The client API on the control plane's own port: OpenAI-compatible, relayed to a running
server of the deployment the request's ``model`` names, over its node's tunnel (see
docs/architecture.md §12 and docs/clients.md).

The answer has the runtime's own shape: its status and the allow-listed headers, its
body as it arrives, SSE events one by one, a ``: keepalive`` comment on a stream quiet for
15 s. A server lost before the head (its node's link gone for good, its agent going, or a
RESET for a reason of the node's) gets the request once more, on another running server of
the deployment, so the client sees one answer; without another, 502 NODE_LINK_LOST. After
the head, an SSE stream ends with an ``error`` event and its terminator, never a hang.
Bodies and keys never reach a log.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import bottle

from modelforge_contract import relay as rel

from ..core.errors import ApiError
from ..core.validation import read_json_bytes
from ..identity.api_keys import ApiKeyCaller
from ..relay import routing
from ..relay.hub import Head, Hub, LinkLost, Stream, StreamLimit, StreamReset, may_fail_over
from ..relay.routing import Target
from ..web.auth import CLIENT
from ..web.http import ApiContext, json_response

log = logging.getLogger(__name__)

KEEPALIVE = rel.SSE_KEEPALIVE
# Request headers a runtime may see (nothing of the client's credentials or cookies).
_FORWARDED = ("content-type", "accept", "user-agent", "x-request-id")


def _link_lost() -> ApiError:
    return ApiError(
        "the node serving this request lost its link to the control plane",
        code=rel.NODE_LINK_LOST,
        status=502,
        next_step="Send the request again; another running server takes it if there is one.",
    )


def _refusal(failure: LinkLost | StreamReset) -> ApiError:
    """What the client gets for a stream that failed before its head."""
    if isinstance(failure, StreamReset) and failure.code == rel.BODY_ENCODED:
        return ApiError(
            "the runtime compressed its answer, and the relay passes only what it can scrub "
            "of the node's paths",
            code=rel.BODY_ENCODED,
            status=502,
            next_step="Remove the deployment's argument that turns compression on "
            "(`modelforge deployments set NAME --arg …` or `--no-args`).",
        )
    if isinstance(failure, StreamReset):
        return ApiError(
            f"the node refused the request ({failure.code})",
            code=rel.NODE_LINK_LOST,
            status=502,
            next_step="Send it again; check the server with `modelforge deployments show`.",
        )
    return _link_lost()


def _error_event(code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}})
    return f"event: error\ndata: {body}\n\ndata: [DONE]\n\n".encode()


def add_routes(app: bottle.Bottle, context: ApiContext, hub: Hub) -> None:
    store, settings, metrics = context.store, context.settings, context.metrics

    @app.get(rel.PATH_CLIENT_MODELS, auth=CLIENT)
    def models():
        listed = routing.running_deployments(store)
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

    def opened(
        target: Target, path: str, headers: list[tuple[str, str]], raw: bytes
    ) -> Stream | None:
        """The request's stream to ``target`` (None: its tunnel went meanwhile)."""
        try:
            return hub.open(target.node_id, target.server_id, "POST", path, headers, raw)
        except StreamLimit:
            metrics.relay_errors.labels(target.deployment, rel.STREAM_LIMIT).inc()
            raise ApiError(
                "the control plane relays as many requests as it may at once",
                code=rel.STREAM_LIMIT,
                status=503,
                next_step="Send it again shortly (MODELFORGE_RELAY_STREAMS and "
                "MODELFORGE_THREADS set how many run at once).",
                extra={"retry_after_seconds": 1},
            ) from None

    def answered(
        target: Target, path: str, headers: list[tuple[str, str]], raw: bytes
    ) -> tuple[Target, Stream, Head]:
        """The stream that got the runtime's head, and its server. A server lost before the
        head is tried once more on another running server of the deployment (``raw``, the
        body, is bounded by MODELFORGE_MAX_BODY_BYTES and still at hand), so the client
        sees one answer; without another, or when that one fails too, the error."""
        tried: list[str] = []
        counted = False  # a request counts once, however many servers it took
        while True:
            stream = opened(target, path, headers, raw)
            if stream is None:  # its tunnel went between the pick and the open
                failure: LinkLost | StreamReset = LinkLost()
            else:
                if not counted:
                    metrics.relay_requests.labels(target.deployment).inc()
                    counted = True
                try:
                    return target, stream, stream.wait_head()
                except (LinkLost, StreamReset) as failed:
                    stream.close()
                    failure = failed
            tried.append(target.server_id)
            again = None
            if len(tried) == 1 and may_fail_over(failure):
                again = other_server(target, tried)
            if again is None:
                if stream is None:
                    raise routing.unreachable(target.deployment)
                metrics.relay_errors.labels(target.deployment, _code(failure)).inc()
                raise _refusal(failure) from None
            log.info("deployment %s: server %s lost before its answer began (%s); sent once "
                     "more, to server %s", target.deployment, target.server_id,
                     _code(failure), again.server_id)  # fmt: skip
            metrics.relay_failovers.labels(target.deployment).inc()
            target = again

    def other_server(target: Target, tried: list[str]) -> Target | None:
        try:
            return routing.pick(store, hub, target.deployment, exclude=tried)
        except ApiError:  # none other runs, or none is reachable now
            return None

    def relay(path: str, client: ApiKeyCaller) -> bottle.HTTPResponse:
        metrics.relay_key_requests.labels(client.key_id).inc()
        raw, body = read_json_bytes(bottle.request.environ, settings.max_body_bytes)
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
        target, stream, head = answered(target, path, headers, raw)
        sse = any(
            n.lower() == "content-type" and v.startswith("text/event-stream")
            for n, v in head.headers
        )
        response = bottle.HTTPResponse(
            _body(stream, sse, target.deployment, metrics),
            status=head.status,
        )
        # Only the allow-listed headers: a node is not trusted with the client's browser or
        # with a proxy in front (Set-Cookie, CORS, Location, X-Accel-Redirect never pass).
        for name, value in rel.client_headers(head.headers):
            response.add_header(name, value)
        # A whole body's one length (the agent sets it after scrubbing) frames the answer
        # without chunking; waitress holds the body to it (a shorter body closes the
        # connection, a longer one is cut), so a node cannot frame two answers in one.
        length = rel.single_content_length(head.headers)
        if not sse and length is not None:
            response.add_header("Content-Length", str(length))
        return response

    def route_of(path: str):
        def relayed(client: ApiKeyCaller) -> bottle.HTTPResponse:
            return relay(path, client)

        return relayed

    for path in sorted(rel.RELAYED_PATHS):
        app.route(path, "POST", route_of(path), auth=CLIENT)


def _code(failure: Exception) -> str:
    return failure.code if isinstance(failure, StreamReset) else rel.NODE_LINK_LOST


USAGE_BODY_MAX_BYTES = 4 * 1024 * 1024  # a JSON answer this large is parsed for its usage


def _usage_of(value: object) -> tuple[int, int] | None:
    usage = value.get("usage") if isinstance(value, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0
    completion = (
        completion if isinstance(completion, int) and not isinstance(completion, bool) else 0
    )
    return max(prompt, 0), max(completion, 0)


class Usage:
    """The tokens a relayed answer reports: the ``usage`` of a JSON body, or of the SSE
    event that carries one (the agent forwards whole events, so a chunk holds whole ones)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.body = bytearray()
        self.found: tuple[int, int] | None = None

    def see(self, chunk: bytes) -> None:
        if self.sse:
            if b'"usage"' not in chunk:
                return
            for line in chunk.replace(b"\r", b"\n").split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    try:
                        found = _usage_of(json.loads(line[6:]))
                    except ValueError:
                        continue
                    self.found = found or self.found
        elif len(self.body) + len(chunk) <= USAGE_BODY_MAX_BYTES:
            self.body += chunk

    def tokens(self) -> tuple[int, int] | None:
        if not self.sse and self.body:
            try:
                return _usage_of(json.loads(self.body))
            except ValueError:
                return None
        return self.found


def _body(stream: Stream, sse: bool, deployment: str, metrics) -> Iterator[bytes]:
    """The relayed body; the stream is closed (and reset on the node) however it ends."""
    started = time.monotonic()
    usage = Usage(sse)
    try:
        for chunk in stream.chunks_out(KEEPALIVE if sse else None):
            usage.see(chunk)
            yield chunk
    except (LinkLost, StreamReset) as failure:
        metrics.relay_errors.labels(deployment, _code(failure)).inc()
        if sse:
            yield _error_event(rel.NODE_LINK_LOST, "the node serving this stream lost its link")
        # A sized body cut short: the client sees fewer bytes than Content-Length said.
    finally:
        stream.close()
        metrics.relay_seconds.labels(deployment).observe(time.monotonic() - started)
        tokens = usage.tokens()
        if tokens is not None:
            metrics.relay_tokens.labels(deployment, "prompt").inc(tokens[0])
            metrics.relay_tokens.labels(deployment, "completion").inc(tokens[1])
