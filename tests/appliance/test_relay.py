"""The client API relayed over an agent's tunnel (issue 26), on a real control plane: the
agent's real tunnel client (in this process), a node that holds a running server through
the real serve-lease routes, and a stdlib origin standing in for the runtime, scripted so
the test decides when each byte is written (no timing assumed)."""

from __future__ import annotations

import gzip
import http.client
import json
import threading
import time

import pytest

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_contract.relay import PATH_CLIENT_CHAT_COMPLETIONS
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.tunnel import TunnelClient
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import make_settings, serve
from tests.harness.cut_proxy import CutProxy
from tests.harness.relay_origin import Origin

from .test_deployments import ServingNode, deploy, held, tiny_model

CHAT = PATH_CLIENT_CHAT_COMPLETIONS


@pytest.fixture
def cp(tmp_path):
    with serve(make_settings(tmp_path / "cp")) as plane:
        yield plane


@pytest.fixture
def origin():
    made = Origin()
    yield made
    made.close()


class Relay:
    """A running server of deployment ``svc`` on a scripted node, its agent's tunnel."""

    def __init__(self, cp, tmp_path, origin, url=None) -> None:
        self.cp, self.origin = cp, origin
        model = tiny_model(cp, tmp_path)
        self.node = ServingNode(cp, "relay-a")
        held(cp, model, self.node)
        assert deploy(cp, "svc", [self.node]).status_code == 201
        [entry] = self.node.servers()
        self.server_id = entry["server_id"]
        lease = self.node.claim_server(self.server_id).json()["lease"]
        self.node.renew_server(self.server_id, lease["lease_id"], "running")
        _, self.key = create_api_key(cp.store, "tests", "tests")
        self.state = tmp_path / "agent-state"
        env = {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": url or cp.url,
            "MODELFORGE_AGENT_STATE_VOLUME": str(self.state),
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
        }
        self.settings = load_settings(env)
        self.model_dir = self.settings.artifacts_dir / "models" / ("a" * 64)
        self.stop = threading.Event()
        self.tunnel = TunnelClient(
            self.settings,
            lambda: self.node.credential,
            lambda sid: (
                (origin.port, "svc", str(self.model_dir)) if sid == self.server_id else None
            ),
            self.stop,
            steps=(0.05, 0.1, 0.2),
        )
        self.tunnel.start()
        wait_until(lambda: cp.server.app.hub.connected(self.node.node_id), what="tunnel up")

    def close(self) -> None:
        self.stop.set()

    def request(self, body: dict, key: str | None = None) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", int(self.cp.url.rsplit(":", 1)[1]))
        headers = {"Content-Type": "application/json"}
        if key is not False:
            headers["Authorization"] = f"Bearer {key or self.key}"
        connection.request("POST", CHAT, json.dumps(body).encode(), headers)
        response = connection.getresponse()
        response.connection = connection  # to close the client's socket itself
        return response


@pytest.fixture
def relay(cp, tmp_path, origin):
    made = Relay(cp, tmp_path, origin)
    yield made
    made.close()


def read_event(response, buffer: bytearray) -> bytes:
    """The next complete SSE event from the stream (read as it arrives)."""
    while b"\n\n" not in buffer:
        chunk = response.read1(65536)
        assert chunk, f"the stream ended inside an event: {bytes(buffer)!r}"
        buffer += chunk
    end = buffer.index(b"\n\n") + 2
    event = bytes(buffer[:end])
    del buffer[:end]
    return event


def test_a_quiet_tunnel_outlives_the_connect_timeout(cp, tmp_path, origin, monkeypatch):
    """The connect's timeout is the TCP connect's only: a tunnel that carries nothing for
    longer stays up (it broke at each quiet CONNECT_TIMEOUT once, with every stream in
    flight waiting out a resume)."""
    from modelforge_node_agent import tunnel as agent_tunnel

    monkeypatch.setattr(agent_tunnel, "CONNECT_TIMEOUT", 0.5)
    made = Relay(cp, tmp_path, origin)
    try:
        hub = cp.server.app.hub
        [first] = hub.tunnels_by_credential().values()
        made.stop.wait(3.0)  # six connect timeouts without a frame either way
        assert list(hub.tunnels_by_credential().values()) == [first]
        assert made.tunnel.state == "up"
    finally:
        made.close()


def test_streams_in_flight_run_on_the_agents_loop_not_a_thread_each(relay, origin):
    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    origin.gated = True  # the origin holds every answer's events until released
    count = 12
    connections = []
    for _ in range(count):
        connection = http.client.HTTPConnection("127.0.0.1", int(relay.cp.url.rsplit(":", 1)[1]))
        body = json.dumps({"model": "svc", "stream": True, "messages": []}).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {relay.key}"}
        connection.request("POST", CHAT, body, headers)
        connections.append(connection)
    wait_until(lambda: len(origin.requests) == count, what="every request at the runtime")
    names = [thread.name for thread in threading.enumerate()]
    assert [name for name in names if name.startswith("stream-")] == []  # one each, before
    assert names.count("streams") == 1  # the agent's loop they all run on
    origin.release(2 * count)
    for connection in connections:
        response = connection.getresponse()
        assert response.status == 200
        assert response.read().endswith(b"data: [DONE]\n\n")
        connection.close()


def test_sse_events_arrive_one_by_one_as_the_runtime_writes_them(relay, origin):
    events = [{"choices": [{"delta": {"content": f"word{i} "}}]} for i in range(4)]
    expected = origin.sse(events)
    origin.chunks = [c + b"\n\n" for c in expected.split(b"\n\n") if c]
    origin.gated = True
    # waitress sends the head with the first body bytes: the first event goes at once.
    origin.release()
    response = relay.request({"model": "svc", "stream": True, "messages": []})
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    buffer = bytearray()
    seen = []
    for index, chunk in enumerate(origin.chunks):
        if index:
            origin.release()  # the runtime writes one event, and no more until the test says
        seen.append(read_event(response, buffer))
        assert seen[-1] == chunk, index
    assert b"".join(seen) == expected
    assert (
        origin.requests[0]["body"]
        == json.dumps({"model": "svc", "stream": True, "messages": []}).encode()
    )
    assert "Authorization" not in origin.requests[0]["headers"]  # the key stops here


def test_paths_of_the_node_are_scrubbed_even_split_across_chunks(relay, origin):
    model_file = str(relay.model_dir / "tiny.gguf")
    event = f'data: {{"model": "{model_file}"}}\r\n\r\n'.encode()
    middle = len(event) // 2
    origin.chunks = [event[:middle], event[middle:], b"data: [DONE]\r\n\r\n"]
    response = relay.request({"model": "svc", "stream": True})
    body = response.read()
    assert str(relay.settings.artifacts_dir).encode() not in body
    assert body == b'data: {"model": "svc/tiny.gguf"}\r\n\r\ndata: [DONE]\r\n\r\n'
    # A JSON answer: scrubbed whole (shorter than the runtime's), its one length fixed.
    origin.json_body = json.dumps({"path": model_file, "root": str(relay.state)}).encode()
    answer = relay.request({"model": "svc"})
    raw = answer.read()
    assert json.loads(raw) == {"path": "svc/tiny.gguf", "root": "svc"}
    assert int(answer.getheader("Content-Length")) == len(raw)


def test_client_errors_and_the_models_list(cp, relay):
    missing = relay.request({"model": "nope"})
    assert (
        missing.status == 404
        and json.loads(missing.read())["error"]["code"] == "MODEL_NOT_DEPLOYED"
    )
    # What the client may have meant: a typo's nearest deployment, the deployment serving a
    # model of that name, or that the field is missing or not a name.
    typo = json.loads(relay.request({"model": "svd"}).read())["error"]
    assert "did you mean 'svc'?" in typo["message"]
    by_model = relay.request({"model": "tiny"})
    error = json.loads(by_model.read())["error"]
    assert by_model.status == 404 and error["code"] == "MODEL_NOT_DEPLOYED"
    assert "is a model, not a deployment: deployment(s) svc serve it" in error["message"]
    assert '"model": "svc"' in error["next_step"]
    for body, code in (({}, "FIELD_REQUIRED"), ({"model": ""}, "FIELD_REQUIRED"),
                       ({"model": 7}, "FIELD_TYPE")):  # fmt: skip
        refused = relay.request(body)
        assert (refused.status, json.loads(refused.read())["error"]["code"]) == (400, code)
    unknown_key = relay.request({"model": "svc"}, key="mfk_0123456789abcdef_" + "x" * 43)
    assert unknown_key.status == 401
    no_key = relay.request({"model": "svc"}, key=False)
    assert no_key.status == 401
    connection = http.client.HTTPConnection("127.0.0.1", int(cp.url.rsplit(":", 1)[1]))
    connection.request("GET", "/v1/models", headers={"Authorization": f"Bearer {relay.key}"})
    listed = json.loads(connection.getresponse().read())
    assert [m["id"] for m in listed["data"]] == ["svc"]


def test_a_client_that_goes_away_stops_the_runtime(relay, origin):
    # Far more than a window: the runtime is still writing when the client goes.
    origin.chunks = [b"data: " + b"x" * 8000 + b"\n\n"] * 2000
    origin.gated = True
    origin.release()
    response = relay.request({"model": "svc", "stream": True})
    read_event(response, bytearray())
    response.close()
    response.connection.close()  # the client goes away mid-stream
    origin.release(len(origin.chunks) - 1)
    assert origin.client_gone.wait(60)  # the agent closed the runtime's connection


def test_a_runtime_silent_past_its_timeout_ends_the_stream_with_an_error_event(
    relay, origin, monkeypatch
):
    from modelforge_node_agent import relayed

    monkeypatch.setattr(relayed, "RUNTIME_TIMEOUT", 0.5)
    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    origin.gated = True
    origin.release()  # the first event, then nothing: the runtime hangs
    response = relay.request({"model": "svc", "stream": True})
    buffer = bytearray()
    assert read_event(response, buffer) == b"data: {}\n\n"
    rest = bytes(buffer) + response.read()  # ends: the agent gave up on the runtime
    assert b"event: error" in rest and b"RUNTIME_UNREACHABLE" in rest
    origin.release()


def test_a_stream_survives_a_cut_tunnel_with_no_gap_and_no_duplicate(cp, tmp_path, origin):
    proxy = CutProxy(int(cp.url.rsplit(":", 1)[1]))
    relay = Relay(cp, tmp_path, origin, url=proxy.url)
    try:
        events = [{"choices": [{"delta": {"content": f"token{i} "}}]} for i in range(20)]
        expected = origin.sse(events)
        origin.chunks = [c + b"\n\n" for c in expected.split(b"\n\n") if c]
        origin.gated = True
        origin.release()
        response = relay.request({"model": "svc", "stream": True})
        buffer = bytearray()
        got = []
        for index in range(5):
            if index:
                origin.release()
            got.append(read_event(response, buffer))
        assert proxy.cut() >= 1  # the tunnel's TCP connection dies; agent and runtime live
        origin.release(len(origin.chunks) - 5)  # the runtime goes on meanwhile
        wait_until(lambda: proxy.accepted >= 2, timeout=30, what="the agent reconnected")
        rest = bytes(buffer) + response.read()
        assert b"".join(got) + rest == expected  # every byte once, in order
    finally:
        relay.close()
        proxy.close()


def test_a_tunnel_that_does_not_come_back_ends_the_stream_with_node_link_lost(cp, relay, origin):
    cp.server.app.hub.grace = 0.2
    origin.chunks = [b"data: {}\n\n"] * 3
    origin.gated = True
    origin.release()
    response = relay.request({"model": "svc", "stream": True})
    buffer = bytearray()
    assert read_event(response, buffer) == b"data: {}\n\n"
    relay.close()  # the agent stops: its tunnel goes for good
    deadline = time.monotonic() + 60
    while b"[DONE]" not in buffer and time.monotonic() < deadline:
        chunk = response.read1(65536)
        if not chunk:
            break
        buffer += chunk
    assert b"event: error" in buffer and b"NODE_LINK_LOST" in buffer and buffer.endswith(b"\n\n")


def hostile_tunnel(cp, credential: str):
    from websockets.sync.client import connect

    from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION
    from modelforge_contract.tunnel import PATH_AGENT_TUNNEL

    url = cp.url.replace("http://", "ws://") + PATH_AGENT_TUNNEL
    headers = {
        "Authorization": f"Bearer {credential}",
        HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
    }
    link = connect(url, additional_headers=headers, compression=None, open_timeout=10)
    link.recv(timeout=10)  # the RESUME every new tunnel opens with
    return link


def closed_after(link, data: bytes) -> bool:
    from websockets.exceptions import ConnectionClosed

    link.send(data)
    try:
        while True:
            link.recv(timeout=30)  # a RESET it may answer first, then the close
    except ConnectionClosed:
        return True
    except TimeoutError:
        return False


def test_hostile_frames_close_only_their_own_tunnel_and_nothing_else(cp, relay, origin):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from websockets.exceptions import InvalidStatus

    from modelforge_contract import tunnel as wire

    other = ServingNode(cp, "hostile-b")
    # Unauthenticated, or with a key instead of a credential: refused before the upgrade.
    with pytest.raises(InvalidStatus) as refused:
        hostile_tunnel(cp, "mfc_0000000000000000_" + "x" * 43)
    assert refused.value.response.status_code == 401
    # A well-formed frame for another node's stream: that tunnel closes, the stream lives on.
    origin.chunks = [b"data: {}\n\n"] * 2
    origin.gated = True
    origin.release()
    response = relay.request({"model": "svc", "stream": True})
    buffer = bytearray()
    read_event(response, buffer)
    stream_id = max(cp.server.app.hub._streams)
    link = hostile_tunnel(cp, other.credential)
    assert closed_after(link, wire.encode(wire.data_frame(stream_id, b"data: forged\n\n")))
    origin.release()
    rest = bytes(buffer) + response.read()
    assert b"forged" not in rest and rest.count(b"data: {}") == 1
    shaped = [
        b"",
        b"\x00" * 12,  # type 0
        wire.encode(wire.end_frame(1))[:11],  # a header cut short
        b"\x03\x00\x00\x00\x00\x00\x00\x07\x7f\xff\xff\xff",  # a length far beyond any frame
        b"\x03\x00\x00\x01\x00\x00\x00\x07\x00\x00\x00\x00",  # reserved bits set
        wire.encode(wire.Frame(wire.HEAD, 7, b"not json")),
        wire.encode(wire.Frame(wire.OPEN, 7, b'{"server_id": "x"}')),  # not one an agent sends
    ]
    for data in shaped:
        assert closed_after(hostile_tunnel(cp, other.credential), data), data

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=64))
    def random_bytes_never_crash_it(data: bytes) -> None:
        link = hostile_tunnel(cp, other.credential)
        link.send(data)
        link.close()

    random_bytes_never_crash_it()
    # The control plane goes on: the honest node's tunnel still carries a request.
    origin.gated = False
    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    again = relay.request({"model": "svc", "stream": True})
    assert again.status == 200 and again.read() == b"data: {}\n\ndata: [DONE]\n\n"
    assert cp.server.app.hub.connected(relay.node.node_id)
    metrics = http.client.HTTPConnection("127.0.0.1", int(cp.url.rsplit(":", 1)[1]))
    metrics.request("GET", "/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    text = metrics.getresponse().read().decode()
    assert "modelforge_relay_tunnel_protocol_errors_total" in text


def test_relayed_streams_beyond_the_cap_are_refused_503_and_the_rest_go_on(cp, relay, origin):
    cp.server.app.relay.shares.total = 1  # as MODELFORGE_RELAY_STREAMS=1
    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    origin.gated = True
    origin.release()
    holding = relay.request({"model": "svc", "stream": True})
    read_event(holding, bytearray())
    refused = relay.request({"model": "svc"})
    assert refused.status == 503 and refused.getheader("Retry-After") == "1"
    assert json.loads(refused.read())["error"]["code"] == "STREAM_LIMIT"
    origin.release()
    assert holding.read() == b"data: [DONE]\n\n"
    origin.gated = False
    again = relay.request({"model": "svc", "stream": True})
    assert again.status == 200 and again.read().endswith(b"data: [DONE]\n\n")


def test_many_requests_in_a_row_are_not_held_against_the_tunnel_s_cap(relay, origin):
    # Finished streams are kept for a resume, but only running ones count against the cap.
    origin.json_body = b'{"ok": true}'
    for _ in range(wire_cap() * 2 + 10):
        answer = relay.request({"model": "svc"})
        assert answer.status == 200 and answer.read() == b'{"ok": true}'


def wire_cap() -> int:
    from modelforge_contract.tunnel import MAX_STREAMS_PER_TUNNEL

    return MAX_STREAMS_PER_TUNNEL


def test_a_client_header_the_tunnel_cannot_carry_is_dropped_and_the_tunnel_stays(cp, relay, origin):
    # A header value past the frame contract's bound (8,192 characters) still fits waitress's
    # 32 KiB of headers: sent on, the agent would refuse the OPEN and close the node's tunnel
    # under every other stream. It is left out of the relayed request instead.
    origin.json_body = b'{"ok": true}'
    tunnel = cp.server.app.hub._tunnels[relay.node.node_id]
    port = int(cp.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port)
    headers = {
        "Authorization": f"Bearer {relay.key}",
        "Content-Type": "application/json",
        "User-Agent": "u" * 9000,
    }
    connection.request("POST", CHAT, json.dumps({"model": "svc"}).encode(), headers)
    answer = connection.getresponse()
    assert answer.status == 200 and answer.read() == b'{"ok": true}'
    assert origin.requests[-1]["headers"].get("User-Agent") is None
    assert cp.server.app.hub._tunnels[relay.node.node_id] is tunnel and tunnel.open


# What a node's answer may not carry to a client (issue 35, M1): the runtime (or a hostile
# node) sets them; the relay passes only its allow-list.
NODE_ONLY_HEADERS = [
    ("Set-Cookie", "session=stolen; Path=/"),
    ("Access-Control-Allow-Origin", "*"),
    ("Location", "/api/v1/admin/api-keys"),
    ("X-Accel-Redirect", "/api/v1/admin/api-keys"),
    ("Cache-Control", "private"),  # a second one: the first (the origin's own) is kept
]


@pytest.mark.parametrize("answer", ["json", "sse"])
def test_only_allow_listed_headers_reach_the_client(relay, origin, answer):
    origin.extra_headers = [*NODE_ONLY_HEADERS, ("X-Request-Id", "req-7"), ("Retry-After", "3")]
    if answer == "json":
        origin.json_body = b'{"ok": true}'
    else:
        origin.chunks = [b'data: {"n": 1}\n\n']
    response = relay.request({"model": "svc", "stream": answer == "sse"})
    body = response.read()
    assert response.status == 200 and body
    names = [name.lower() for name, _ in response.getheaders()]
    for name, _ in NODE_ONLY_HEADERS[:-1]:
        assert name.lower() not in names, name
    assert response.getheader("X-Request-Id") == "req-7"
    assert response.getheader("Retry-After") == "3"
    assert names.count("cache-control") <= 1 and response.getheader("Server") != "BaseHTTP"
    assert "BaseHTTP" not in (response.getheader("Server") or "")  # the origin's own name
    # The runtime was asked for an answer it need not compress, whatever the client sent.
    assert origin.requests[-1]["headers"]["Accept-Encoding"] == "identity"


def test_a_compressed_answer_is_refused_not_passed(relay, origin):
    """A body the agent cannot scrub of the node's paths never reaches the client."""
    origin.json_body = gzip.compress(b'{"path": "/var/lib/modelforge-artifacts/models/x"}')
    origin.extra_headers = [("Content-Encoding", "gzip")]
    response = relay.request({"model": "svc"})
    error = json.loads(response.read())["error"]
    assert (response.status, error["code"]) == (502, "BODY_ENCODED")
    assert "deployments set" in error["next_step"]
