"""Hypothesis over the answers a control plane can send: statuses, headers, framing and bodies,
from a real HTTP peer on loopback. Whatever arrives, a call returns a JSON object or fails
as TransportFailure / Refused (with only codes the contract defines), within its deadline."""

from __future__ import annotations

import json
import re
import socket
import socketserver
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelforge_node_agent.client import (
    KNOWN_CODES,
    KNOWN_COMPATIBILITY,
    ControlPlaneClient,
    Refused,
    TransportFailure,
)
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.transport import make_session

FAILURE_LINE = re.compile(r"^[A-Za-z]+ on POST /api/v1/agent/heartbeat$")


class Peer(socketserver.ThreadingTCPServer):
    """Reads one request, writes ``self.answer`` byte for byte, closes."""

    daemon_threads = True
    allow_reuse_address = True
    answer = b""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock, buffer = self.request, b""
        try:
            while b"\r\n\r\n" not in buffer:
                data = sock.recv(65536)
                if not data:
                    return
                buffer += data
            head, _, body = buffer.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            while len(body) < length:
                body += sock.recv(65536)
            sock.sendall(self.server.answer)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture(scope="module")
def peer():
    server = Peer()
    yield server
    server.shutdown()
    server.server_close()


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(sorted(KNOWN_CODES))
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=15,
)
SHAPED = st.fixed_dictionaries(
    {},
    optional={
        "error": st.fixed_dictionaries({}, optional={"code": JSON_VALUES, "message": JSON_VALUES})
        | JSON_VALUES,
        "compatibility": st.sampled_from(sorted(KNOWN_COMPATIBILITY)) | JSON_VALUES,
        "heartbeat_interval_seconds": JSON_VALUES,
        "server_time": JSON_VALUES,
    },
)
BODIES = st.one_of(
    SHAPED.map(lambda v: json.dumps(v).encode()),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=512),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.sampled_from([b"", b"NaN", b'{"a": Infinity}', b"{" * 200_000, b'{"a": 1e999}']),
)
STATUSES = st.sampled_from(
    [200, 201, 204, 304, 400, 401, 403, 404, 410, 426, 500, 503]
) | st.integers(100, 999)


@st.composite
def answers(draw) -> bytes:
    status = draw(STATUSES)
    body = draw(BODIES)
    lines = [b"HTTP/1.1 %d %s" % (status, draw(st.sampled_from([b"OK", b"X", b""])))]
    framing = draw(st.sampled_from(["length", "wrong-length", "close", "chunked", "bad-chunked"]))
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "wrong-length":
        lines.append(b"Content-Length: %d" % draw(st.sampled_from([0, len(body) + 7, 10**12])))
    elif framing in ("chunked", "bad-chunked"):
        lines.append(b"Transfer-Encoding: chunked")
        body = (
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            if framing == "chunked"
            else b"zz\r\n" + body
        )
    if draw(st.booleans()):
        lines.append(
            b"Content-Type: " + draw(st.sampled_from([b"application/json", b"text/html", b"\xff"]))
        )
    if draw(st.booleans()):
        lines.append(
            b"Content-Encoding: " + draw(st.sampled_from([b"gzip", b"identity", b"br", b"x"]))
        )
    for name, value in draw(
        st.lists(st.tuples(st.binary(min_size=1, max_size=12), st.binary(max_size=40)), max_size=3)
    ):
        lines.append(
            name.replace(b"\r", b"").replace(b"\n", b"")
            + b": "
            + value.replace(b"\r", b"").replace(b"\n", b"")
        )
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(answer=answers())
def test_any_answer_is_a_json_object_or_a_clean_failure(peer, answer):
    peer.answer = answer
    url = f"http://127.0.0.1:{peer.server_address[1]}"
    client = ControlPlaneClient(
        url,
        make_session(load_settings({"MODELFORGE_AGENT_CONTROL_PLANE_URL": url})),
        deadline_seconds=5,
    )
    try:
        result = client.call("POST", "/api/v1/agent/heartbeat", {"node_id": "n"})
    except Refused as refused:
        assert not 200 <= refused.status < 300
        assert refused.code is None or refused.code in KNOWN_CODES
        assert refused.compatibility is None or refused.compatibility in KNOWN_COMPATIBILITY
        assert refused.describe() == f"HTTP {refused.status} on POST /api/v1/agent/heartbeat"
    except TransportFailure as failure:
        assert FAILURE_LINE.match(failure.describe()), failure.describe()
    else:
        assert isinstance(result, dict)
    finally:
        client.session.close()
