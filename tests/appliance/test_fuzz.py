"""Hypothesis over every endpoint: paths, methods, headers, bodies, lengths and encodings.

No answer is a 5xx, none hangs, every error has the one JSON shape, and a refused
request leaves the store exactly as it was.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.control_plane import make_settings, new_identity, serve

from .test_bad_input import snapshot

CODE = re.compile(r"^[A-Z][A-Z0-9_]+$")
ROUTES = [
    "/healthz",
    "/metrics",
    "/api/v1/admin/node-enrollments",
    "/api/v1/admin/node-enrollments/{enrollment}",
    "/api/v1/admin/hardware/nodes",
    "/api/v1/admin/hardware/nodes/{node}",
    "/api/v1/admin/hardware/nodes/{node}/readiness",
    "/api/v1/admin/hardware/nodes/{node}/credentials",
    "/api/v1/admin/hardware/nodes/{node}/credential",
    "/api/v1/admin/hardware/nodes/{node}/decommission/preview",
    "/api/v1/admin/hardware/nodes/{node}/decommission/execute",
    "/api/v1/admin/hardware/nodes/{node}/cordon",
    "/api/v1/admin/hardware/nodes/{node}/uncordon",
    "/api/v1/admin/hardware/nodes/{node}/work-slots",
    "/api/v1/admin/hardware/nodes/{node}/accept-hardware",
    "/api/v1/admin/hardware/nodes/{node}/telemetry",
    "/api/v1/admin/hardware/nodes/{node}/serving",
    "/api/v1/admin/node-agent-image/check",
    "/api/v1/admin/alerts",
    "/api/v1/admin/audit-events",
    "/api/v1/agent/enroll",
    "/api/v1/agent/heartbeat",
    "/api/v1/agent/inventory",
    "/api/v1/agent/telemetry",
    "/api/v1/admin/work",
    "/api/v1/admin/work/{work}",
    "/api/v1/admin/work/{work}/cancel",
    "/api/v1/agent/work/claim",
    "/api/v1/agent/work/{work}/renew",
    "/api/v1/agent/work/{work}/complete",
    "/api/v1/admin/models",
    "/api/v1/admin/models/{name}",
    "/api/v1/admin/models/{name}/replicas",
    "/api/v1/admin/models/{name}/replicas/{node}",
    "/api/v1/admin/model-pulls",
    "/api/v1/admin/model-pulls/{pull}",
    "/api/v1/admin/hub-token",
    "/api/v1/agent/models",
    "/api/v1/agent/blobs/{digest}",
    "/api/v1/admin/deployments",
    "/api/v1/admin/deployments/{name}",
    "/api/v1/admin/deployments/{name}/restart",
    "/api/v1/admin/deployments/{name}/servers",
    "/api/v1/admin/deployments/{name}/servers/{node}",
    "/api/v1/agent/servers",
    "/api/v1/agent/servers/{server}/claim",
    "/api/v1/agent/servers/{server}/renew",
    "/api/v1/admin/api-keys",
    "/api/v1/admin/api-keys/{key}",
    "/api/v1/admin/usage",
    "/api/v1/admin/users",
    "/api/v1/admin/users/{name}",
    "/api/v1/agent/tunnel/down",
    "/api/v1/agent/tunnel/up",
]
HEADER_TEXT = st.text(alphabet=string.printable.strip() + " ", max_size=120)
JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A served control plane with one enrolled node and one pending token."""
    with serve(make_settings(tmp_path_factory.mktemp("fuzz") / "state")) as cp:
        minted = cp.mint()
        node = cp.enroll(cp.mint()["token"], identity=new_identity()).json()
        yield cp, node, minted


def bodies(node: dict, minted: dict):
    """Well-shaped bodies with one field replaced, random JSON, and random bytes."""
    shaped = [
        {"display_name": "n", "expires_in_seconds": 900},
        {
            "token": minted["token"],
            "hostname": "h",
            "agent_version": "1",
            "accelerator_mode": "cpu",
        },
        {
            "node_id": node["node_id"],
            "agent_version": "1",
            "health": {"status": "ok", "gpu_probe": "ok"},
        },
        {"node_id": node["node_id"], "agent_version": "1", "accelerators": []},
        {"node_id": node["node_id"], "samples": [{"uuid": "GPU-1", "index": 0}]},
        {"confirmation": "mfd_0000000000000000_" + "x" * 43},
        {"capability": "smoke", "input": {"matrix_size": 8}, "constraints": {"gpu_count": 0}},
        {"node_id": node["node_id"], "capabilities": ["smoke"], "work_slots": 2},
        {"node_id": node["node_id"], "lease_id": "0" * 32, "outcome": "failed", "log_tail": "x"},
        {"work_slots_max": 4},
        {"digest": "0123456789abcdef"},
        {"name": "d", "model": "m", "runtime": "llama.cpp", "node_ids": [node["node_id"]]},
        {"node_id": node["node_id"], "lease_id": "0" * 32, "state": "running", "restarts": 1},
        {"name": "client"},
    ]
    mutated = st.tuples(st.sampled_from(shaped), st.text(max_size=20), JSON_VALUES).map(
        lambda t: json.dumps({**t[0], t[1]: t[2]}).encode()
    )
    return st.one_of(
        mutated,
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=2048),
        st.text(max_size=512).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.just(b""),
    )


@st.composite
def requests_(draw, node: dict, minted: dict):
    route = draw(st.sampled_from(ROUTES))
    filler = st.sampled_from([node["node_id"], minted["enrollment_id"]]) | st.text(
        alphabet=string.ascii_letters + string.digits + "-_.~%", min_size=1, max_size=40
    )
    digests = st.just("sha256:" + "0" * 64) | filler
    path = route.format(
        node=draw(filler),
        enrollment=draw(filler),
        work=draw(filler),
        name=draw(filler),
        digest=draw(digests),
        server=draw(filler),
        key=draw(filler),
        pull=draw(filler),
    )
    if draw(st.booleans()):
        path += "?" + draw(st.text(alphabet=string.ascii_letters + "=&%0123456789-", max_size=40))
    headers = {}
    for name, values in [
        ("X-ModelForge-Admin-Token", st.sampled_from(["ADMIN"]) | HEADER_TEXT),
        ("Authorization", st.sampled_from(["Bearer CRED", "Bearer ", "Basic x"]) | HEADER_TEXT),
        ("X-ModelForge-Agent-Protocol", st.sampled_from(["1", "0", "2", "x", ""]) | HEADER_TEXT),
        ("Content-Type", st.sampled_from(["application/json", "text/plain", ""]) | HEADER_TEXT),
    ]:
        if draw(st.booleans()):
            headers[name] = draw(values)
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]))
    return method, path, headers, draw(bodies(node, minted))


def _real(headers: dict, cp, node: dict) -> dict:
    swap = {"ADMIN": cp.admin_token, "CRED": node["credential"]}
    return {k: " ".join(swap.get(part, part) for part in v.split(" ")) for k, v in headers.items()}


@pytest.mark.slow
@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_no_request_gets_a_5xx_hangs_or_changes_the_store_when_refused(world, data):
    cp, node, minted = world
    method, path, headers, body = data.draw(requests_(node, minted))
    before = snapshot(cp.store)
    # http.client sends what it is given: no client-side tidying of headers or bodies.
    conn = http.client.HTTPConnection("127.0.0.1", int(cp.url.rsplit(":", 1)[1]), timeout=10)
    try:
        conn.request(method, path, body=body, headers=_real(headers, cp, node))
        response = conn.getresponse()
        # An HTTP tunnel's download streams for as long as its tunnel lives: not read.
        streamed = response.getheader("Content-Type") == "application/vnd.modelforge.tunnel"
        text = b"" if streamed else response.read()
    finally:
        conn.close()
    assert response.status < 500, (method, path, text)
    if response.status >= 400:
        if method != "HEAD":
            error = json.loads(text)["error"]
            assert set(error) == {"code", "message", "next_step"}
            assert CODE.match(error["code"])
        assert snapshot(cp.store) == before, (method, path, response.status)


# -- headers, as bytes on the wire --------------------------------------------------------------

HEADER_NAMES = st.sampled_from(
    [
        b"X-ModelForge-Admin-Token",
        b"Authorization",
        b"X-ModelForge-Agent-Protocol",
        b"Content-Type",
        b"Content-Length",
        b"Transfer-Encoding",
        b"Host",
        b"X-Forwarded-Proto",
        b"X-Forwarded-Host",
        b"Expect",
        b"Connection",
    ]
) | st.binary(min_size=1, max_size=30)
# Any byte but CR and LF (which end a header line); non-UTF-8, controls and DEL included.
HEADER_VALUES = st.sampled_from([b"ADMIN", b"Bearer CRED", b"1", b"application/json"]) | st.binary(
    max_size=200
).map(lambda value: value.replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def raw_requests(draw, node: dict, minted: dict, cp) -> bytes:
    route = draw(st.sampled_from(ROUTES))
    path = route.format(
        node=node["node_id"],
        enrollment=minted["enrollment_id"],
        work="no-such-work",
        name="no-such-model",
        digest="sha256:" + "0" * 64,
        server="no-such-server",
        key="0123456789abcdef",
        pull="no-such-pull",
    ).encode()
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"PATCH", b"DELETE"]))
    swap = {b"ADMIN": cp.admin_token.encode(), b"CRED": node["credential"].encode()}
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    for name, value in draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6)):
        value = b" ".join(swap.get(part, part) for part in value.split(b" "))
        lines.append(name + b": " + value)
    body = draw(bodies(node, minted))
    if draw(st.booleans()):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_no_header_bytes_get_a_5xx_a_hang_or_a_change_when_refused(world, data):
    cp, node, minted = world
    request = data.draw(raw_requests(node, minted, cp))
    before = snapshot(cp.store)
    with socket.create_connection(("127.0.0.1", int(cp.url.rsplit(":", 1)[1])), timeout=10) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        except ConnectionResetError:
            return  # refused before the whole request was read (e.g. 413 on Content-Length)
    if not raw:
        return  # a request the server may drop unanswered (an empty or cut-off one)
    head, _, text = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    # Only the first answer: the body may have held more requests (without Content-Length,
    # the bytes after the headers are the next request on the connection).
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    text = text[: int(length.group(1))] if length else text
    # 501 TRANSFER_ENCODING_UNSUPPORTED is the one documented 5xx a request can earn.
    assert status < 500 or status == 501, (request[:200], raw[:300])
    if status >= 400:
        if not request.startswith(b"HEAD"):
            error = json.loads(text)["error"]
            assert set(error) == {"code", "message", "next_step"}
            assert CODE.match(error["code"])
        assert snapshot(cp.store) == before, (request[:200], status)


def test_every_api_route_is_fuzzed(tmp_path):
    """A new JSON route joins ROUTES above, so both fuzz tests reach it."""
    from modelforge_appliance.runtime.app import make_app

    class NoStore:
        clock = None

    app = make_app(make_settings(tmp_path), store=NoStore())
    names = {
        "node_id": "node",
        "enrollment_id": "enrollment",
        "work_id": "work",
        "name": "name",
        "digest": "digest",
        "server_id": "server",
        "key_id": "key",
        "pull_id": "pull",
        "node": "node",  # a deployment's member: an id, a prefix or a name
    }
    served = {
        re.sub(r"<(\w+)(?::[^>]*)?>", lambda m: "{" + names[m.group(1)] + "}", route.rule)
        for route in app.routes
        if route.rule.startswith("/api/") or route.rule in ("/healthz", "/metrics")
    }
    assert sorted(served - set(ROUTES)) == []
