"""What the relay carries (docs/architecture.md §12): the client routes, the headers it drops, the
runtime routes it never reaches, and its error codes (a RESET's ``code``, and the client
API's). The framing that carries it is ``modelforge_contract.tunnel``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The client API on the control plane's port. /v1/models is answered by the control
# plane itself (its deployments); the others are relayed to a running server.
PATH_CLIENT_MODELS = "/v1/models"
PATH_CLIENT_CHAT_COMPLETIONS = "/v1/chat/completions"
PATH_CLIENT_COMPLETIONS = "/v1/completions"
PATH_CLIENT_EMBEDDINGS = "/v1/embeddings"
RELAYED_PATHS = frozenset(
    {PATH_CLIENT_CHAT_COMPLETIONS, PATH_CLIENT_COMPLETIONS, PATH_CLIENT_EMBEDDINGS}
)
RELAYED_METHOD = "POST"
# Runtime routes that only leak (the model's path, the prompt cache, the runtime's own
# counters): never relayed, whatever a client asks.
RUNTIME_PATHS_NOT_RELAYED = frozenset({"/props", "/slots", "/metrics"})


def is_relayed(method: str, path: str) -> bool:
    """True for exactly the requests a tunnel may carry (``POST /v1/chat/completions``…).

    The path must match exactly: no query, no trailing slash, no dot segments.
    """
    return method == RELAYED_METHOD and path in RELAYED_PATHS


# Hop-by-hop headers (RFC 9110 section 7.6.1, plus the proxy ones and the pre-RFC names that
# proxies still send): never relayed in either direction. A header named in Connection
# is hop-by-hop too (relayable_headers drops it).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-authentication-info",
    }
)
# Request headers that stop at the control plane: the client's API key and cookies are
# the control plane's business, and the agent sets Host for the runtime.
REQUEST_HEADERS_NOT_RELAYED = HOP_BY_HOP | {"authorization", "cookie", "host"}
# Response headers the relay sets itself (a scrubbed body changes its length).
RESPONSE_HEADERS_NOT_RELAYED = HOP_BY_HOP | {"content-length", "set-cookie"}


def relayable_headers(
    headers: Iterable[tuple[str, str]], dropped: frozenset[str] = HOP_BY_HOP
) -> list[tuple[str, str]]:
    """The headers minus ``dropped`` (lowercase names) and those named in Connection."""
    pairs = [(name, value) for name, value in headers]
    named = {
        token.strip().lower()
        for name, value in pairs
        if name.lower() == "connection"
        for token in value.split(",")
    }
    return [(n, v) for n, v in pairs if n.lower() not in dropped and n.lower() not in named]


# The runtime's response headers a client sees (docs/architecture.md §12): an allow-list,
# since the control plane frames the answer itself and a node is not trusted with the
# client's browser or the proxy in front (Set-Cookie, Access-Control-*, Location, Server,
# X-Accel-Redirect and framing headers never pass). One of each, the first.
RESPONSE_HEADERS_FOR_CLIENTS = ("content-type", "cache-control", "retry-after", "x-request-id")


def client_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs of ``headers`` a client may see: the allowed names, the first of each."""
    seen: set[str] = set()
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in RESPONSE_HEADERS_FOR_CLIENTS and lowered not in seen:
            seen.add(lowered)
            kept.append((name, value))
    return kept


def single_content_length(headers: Iterable[tuple[str, str]]) -> int | None:
    """The answer's Content-Length when it has exactly one that is a plain decimal (two,
    or one that is not a number, say nothing: the control plane then frames it chunked)."""
    values = [value.strip() for name, value in headers if name.lower() == "content-length"]
    if len(values) != 1 or not re.fullmatch(r"[0-9]{1,15}", values[0]):
        return None
    return int(values[0])


# What the agent asks the runtime for: a compressed answer cannot be scrubbed of the node's
# paths, so one that comes compressed anyway is refused (BODY_ENCODED), never passed on.
ACCEPT_ENCODING_TO_RUNTIME = "identity"


def is_identity_encoding(content_encoding: str | None) -> bool:
    return (content_encoding or "identity").strip().lower() in ("", "identity")


# A quiet relayed SSE stream gets SSE_KEEPALIVE between two events this often.
SSE_KEEPALIVE_SECONDS = 15
SSE_KEEPALIVE = b": keepalive\n\n"


# -- error codes (a RESET's code, and the client API's errors) ---------------------------

MODEL_NOT_DEPLOYED = "MODEL_NOT_DEPLOYED"  # 404: no deployment of that name
NO_RUNNING_SERVER = "NO_RUNNING_SERVER"  # 503: the deployment has no running server
COLD_START_TIMEOUT = "COLD_START_TIMEOUT"  # 503: an idle deployment did not start in time
BODY_ENCODED = "BODY_ENCODED"  # 502: the runtime compressed its answer, which cannot be scrubbed
NODE_LINK_LOST = "NODE_LINK_LOST"  # 502, or an SSE error event: the tunnel went away
TUNNEL_PROTOCOL_ERROR = "TUNNEL_PROTOCOL_ERROR"  # a frame broke the tunnel contract
STREAM_LIMIT = "STREAM_LIMIT"  # 503: the node's tunnel carries its most streams
STREAM_CANCELLED = "STREAM_CANCELLED"  # the client went away: the runtime stops
ROUTE_NOT_RELAYED = "ROUTE_NOT_RELAYED"  # an OPEN for a path is_relayed refuses
SERVER_NOT_ON_NODE = "SERVER_NOT_ON_NODE"  # an OPEN for a server this node does not run
RUNTIME_UNREACHABLE = "RUNTIME_UNREACHABLE"  # 502: the agent could not reach the runtime
RESUME_FAILED = "RESUME_FAILED"  # the agent no longer holds the bytes to resume from
TUNNEL_REPLACED = "TUNNEL_REPLACED"  # RESET of stream 0: a newer tunnel of the node won
TUNNEL_CLOSING = "TUNNEL_CLOSING"  # RESET of stream 0: the sender shuts down
HEAD_TIMEOUT = "HEAD_TIMEOUT"  # 504: no head within MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS
# A link of a model split across nodes (LINK) that the control plane will not splice: the
# server is not this node's main, the peer is not a helper of the same deployment, or the
# peer's node has no tunnel.
LINK_REFUSED = "LINK_REFUSED"
# A link whose helper sent nothing back within MODELFORGE_AGENT_RPC_STALL_SECONDS.
LINK_STALLED = "LINK_STALLED"
BODY_IDLE_TIMEOUT = "BODY_IDLE_TIMEOUT"  # a body that is not SSE went quiet past its deadline
RELAY_ERROR_CODES = (
    MODEL_NOT_DEPLOYED,
    NO_RUNNING_SERVER,
    COLD_START_TIMEOUT,
    NODE_LINK_LOST,
    TUNNEL_PROTOCOL_ERROR,
    STREAM_LIMIT,
    STREAM_CANCELLED,
    ROUTE_NOT_RELAYED,
    SERVER_NOT_ON_NODE,
    RUNTIME_UNREACHABLE,
    RESUME_FAILED,
    TUNNEL_REPLACED,
    TUNNEL_CLOSING,
    BODY_ENCODED,
    HEAD_TIMEOUT,
    BODY_IDLE_TIMEOUT,
    LINK_REFUSED,
    LINK_STALLED,
)
# A RESET with one of these codes says the node did not serve the request (it could not
# reach the runtime, does not run the server, carries its most streams, lost the stream over
# a reconnect, or is going away): one whose head has not reached its client is sent once
# more, to another running server of the deployment (docs/architecture.md §12).
FAILOVER_CODES = frozenset(
    {NODE_LINK_LOST, STREAM_LIMIT, SERVER_NOT_ON_NODE, RUNTIME_UNREACHABLE, RESUME_FAILED,
     TUNNEL_CLOSING}
)  # fmt: skip
# The status a client gets when the code ends its request before any header went out.
RELAY_ERROR_STATUS = {
    MODEL_NOT_DEPLOYED: 404,
    NO_RUNNING_SERVER: 503,
    COLD_START_TIMEOUT: 503,
    NODE_LINK_LOST: 502,
    TUNNEL_PROTOCOL_ERROR: 502,
    STREAM_LIMIT: 503,
    ROUTE_NOT_RELAYED: 404,
    SERVER_NOT_ON_NODE: 502,
    RUNTIME_UNREACHABLE: 502,
    RESUME_FAILED: 502,
    TUNNEL_REPLACED: 502,
    TUNNEL_CLOSING: 502,
    BODY_ENCODED: 502,
    HEAD_TIMEOUT: 504,
}
