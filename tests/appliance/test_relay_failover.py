"""Failover and going away on the relay (issue 34): a request whose server is lost
before the runtime's head is answered by another running server of the deployment, once; an
agent that stops says so on its tunnel (RESET of stream 0, TUNNEL_CLOSING) and its streams
end at once, not after the resume grace.

Real parts: the control plane on waitress, two scripted nodes holding running servers of one
deployment through the real serve-lease routes. The server the hub picks first (fewest in
flight, then each in turn from the lowest server id, counted per control plane) is played by the test over a real WebSocket tunnel, frame
by frame, so the test decides when it resets, goes away or drops; the other is the agent's
real tunnel client in front of a scripted origin. Nothing waits on a clock it does not
control: the resume grace is set to 600 s wherever a stream must end without it.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading

import pytest
from websockets.exceptions import ConnectionClosed

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_contract import relay as rel
from modelforge_contract import tunnel as wire
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.tunnel import TunnelClient
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import make_settings, serve
from tests.harness.cut_proxy import CutProxy
from tests.harness.relay_origin import Origin

from .test_deployments import ServingNode, deploy, held, tiny_model
from .test_relay import Relay, hostile_tunnel, read_event
from .test_relay_http_tunnel import with_transport

CHAT = rel.PATH_CLIENT_CHAT_COMPLETIONS
LONG_GRACE = 600.0  # a stream that waited it out would hang the test to its timeout


@pytest.fixture
def cp(tmp_path):
    with serve(make_settings(tmp_path / "cp")) as plane:
        yield plane
        plane.server.app.tunnel_sessions.close_all()  # waitress need not wait for a PING


@pytest.fixture
def origin():
    made = Origin()
    yield made
    made.close()


@pytest.fixture
def requests_pool():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


class Scripted:
    """The test playing one node's agent over a real WebSocket tunnel."""

    def __init__(self, cp, node: ServingNode) -> None:
        self.link = hostile_tunnel(cp, node.credential)  # its RESUME already read

    def next_frame(self) -> wire.Frame:
        return wire.decode(self.link.recv(timeout=30))

    def opened(self) -> wire.Frame:
        """The next OPEN, its request body read to its end."""
        opened = self.next_frame()
        assert opened.type is wire.OPEN, opened
        frame = opened
        while not frame.end_stream and frame.type is not wire.END:
            frame = self.next_frame()
            assert frame.stream_id == opened.stream_id
        return opened

    def send(self, frame: wire.Frame) -> None:
        self.link.send(wire.encode(frame))

    def closed_by_the_control_plane(self) -> bool:
        try:
            while True:
                self.link.recv(timeout=30)
        except ConnectionClosed:
            return True
        except TimeoutError:
            return False


class Deployment:
    """Deployment ``svc`` with a running server on each of two scripted nodes: ``first``
    (the hub's first pick) and ``second``."""

    def __init__(self, cp, tmp_path, origin) -> None:
        self.cp, self.origin = cp, origin
        model = tiny_model(cp, tmp_path)
        nodes = [ServingNode(cp, "failover-a"), ServingNode(cp, "failover-b")]
        held(cp, model, *nodes)
        assert deploy(cp, "svc", nodes).status_code == 201
        members = []
        for node in nodes:
            [entry] = node.servers()
            lease = node.claim_server(entry["server_id"]).json()["lease"]
            node.renew_server(entry["server_id"], lease["lease_id"], "running")
            members.append((entry["server_id"], node))
        members.sort(key=lambda member: member[0])
        (self.first_id, self.first), (self.second_id, self.second) = members
        self.hub = cp.server.app.hub
        self.port = int(cp.url.rsplit(":", 1)[1])
        _, self.key = create_api_key(cp.store, "tests", "tests")
        self.stops: list[threading.Event] = []
        self.tmp_path = tmp_path

    def agent(self, node: ServingNode, server_id: str) -> TunnelClient:
        """The agent's real tunnel client for ``node``, relaying to the origin."""
        env = {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": self.cp.url,
            "MODELFORGE_AGENT_STATE_VOLUME": str(self.tmp_path / f"state-{server_id}"),
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
        }
        stop = threading.Event()
        self.stops.append(stop)
        tunnel = TunnelClient(
            load_settings(env),
            lambda: node.credential,
            lambda sid: (self.origin.port, "svc", None) if sid == server_id else None,
            stop,
            steps=(0.05, 0.1, 0.2),
        )
        tunnel.start()
        wait_until(lambda: self.hub.connected(node.node_id), what="the agent's tunnel up")
        return tunnel

    def scripted(self, node: ServingNode) -> Scripted:
        made = Scripted(self.cp, node)
        wait_until(lambda: self.hub.connected(node.node_id), what="the scripted tunnel up")
        return made

    def close(self) -> None:
        for stop in self.stops:
            stop.set()

    def request(self, body: dict) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        connection.request("POST", CHAT, json.dumps(body).encode(), headers)
        return connection.getresponse()

    def answered(self, body: dict) -> tuple[int, bytes]:
        response = self.request(body)
        return response.status, response.read()

    def metrics(self) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.cp.admin_token}"}
        connection.request("GET", "/metrics", headers=headers)
        return connection.getresponse().read().decode()


@pytest.fixture
def pair(cp, tmp_path, origin):
    made = Deployment(cp, tmp_path, origin)
    yield made
    made.close()


def sample(metrics: str, name: str) -> float:
    """The value of one sample (``name`` with its labels), 0 when not exported."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


FAILOVERS = 'modelforge_relay_failovers_total{deployment="svc"}'
REQUESTS = 'modelforge_relay_requests_total{deployment="svc"}'


def errors_of(metrics: str) -> list[str]:
    return [
        line for line in metrics.splitlines() if line.startswith("modelforge_relay_errors_total")
    ]


@pytest.mark.parametrize(
    "code",
    [
        rel.RUNTIME_UNREACHABLE,
        rel.SERVER_NOT_ON_NODE,
        rel.RESUME_FAILED,
        rel.STREAM_LIMIT,
        rel.TUNNEL_CLOSING,
    ],
)
def test_a_stream_the_node_resets_before_its_head_is_answered_by_another_server(
    pair, origin, requests_pool, code
):
    first = pair.scripted(pair.first)
    pair.agent(pair.second, pair.second_id)
    origin.json_body = b'{"answer": "from the second server"}'
    body = {"model": "svc", "messages": [{"role": "user", "content": "hello"}]}
    answer = requests_pool.submit(pair.answered, body)
    opened = first.opened()
    assert wire.json_of(opened)["server_id"] == pair.first_id
    first.send(wire.reset_frame(opened.stream_id, code, "the node could not serve it"))
    assert answer.result(timeout=60) == (200, b'{"answer": "from the second server"}')
    # The same request, its body kept, reached the second server once.
    assert [json.loads(r["body"]) for r in origin.requests] == [body]
    metrics = pair.metrics()
    assert sample(metrics, FAILOVERS) == 1 and sample(metrics, REQUESTS) == 1
    assert errors_of(metrics) == []  # the client saw no error


def test_a_request_is_sent_once_more_only(pair, requests_pool):
    first, second = pair.scripted(pair.first), pair.scripted(pair.second)
    answer = requests_pool.submit(pair.answered, {"model": "svc"})
    for node, server_id in ((first, pair.first_id), (second, pair.second_id)):
        opened = node.opened()
        assert wire.json_of(opened)["server_id"] == server_id
        node.send(wire.reset_frame(opened.stream_id, rel.RESUME_FAILED, "lost it"))
    # A third try would wait for an answer nobody gives: the 502 says there was none.
    status, raw = answer.result(timeout=60)
    assert status == 502 and json.loads(raw)["error"]["code"] == rel.NODE_LINK_LOST
    metrics = pair.metrics()
    assert sample(metrics, FAILOVERS) == 1
    [error] = errors_of(metrics)  # counted once, with the second server's code
    assert 'deployment="svc"' in error and 'code="RESUME_FAILED"' in error


def test_a_reset_for_the_request_s_own_reason_is_not_sent_again(pair, origin, requests_pool):
    first = pair.scripted(pair.first)
    pair.agent(pair.second, pair.second_id)
    origin.json_body = b'{"ok": true}'
    answer = requests_pool.submit(pair.answered, {"model": "svc"})
    opened = first.opened()
    first.send(wire.reset_frame(opened.stream_id, rel.ROUTE_NOT_RELAYED, "not relayed"))
    status, raw = answer.result(timeout=60)
    assert status == 502 and json.loads(raw)["error"]["code"] == rel.NODE_LINK_LOST
    assert origin.requests == [] and sample(pair.metrics(), FAILOVERS) == 0


def test_without_another_running_server_the_client_gets_node_link_lost(pair, requests_pool):
    first = pair.scripted(pair.first)  # the second server's node has no tunnel
    answer = requests_pool.submit(pair.answered, {"model": "svc"})
    opened = first.opened()
    first.send(wire.reset_frame(opened.stream_id, rel.RUNTIME_UNREACHABLE, "it died"))
    status, raw = answer.result(timeout=60)
    assert status == 502 and json.loads(raw)["error"]["code"] == rel.NODE_LINK_LOST
    assert sample(pair.metrics(), FAILOVERS) == 0


def test_a_tunnel_that_drops_before_the_head_and_stays_away_fails_over_after_the_grace(
    pair, origin, requests_pool
):
    pair.hub.grace = 0.2
    first = pair.scripted(pair.first)
    pair.agent(pair.second, pair.second_id)
    origin.json_body = b'{"ok": true}'
    answer = requests_pool.submit(pair.answered, {"model": "svc"})
    first.opened()
    first.link.close()  # no going away said: the hub waits the grace for a resume first
    assert answer.result(timeout=60) == (200, b'{"ok": true}')
    assert sample(pair.metrics(), FAILOVERS) == 1


def test_an_agent_going_away_before_the_head_fails_over_at_once_and_takes_no_more(
    pair, origin, requests_pool
):
    pair.hub.grace = LONG_GRACE
    first = pair.scripted(pair.first)
    pair.agent(pair.second, pair.second_id)
    origin.json_body = b'{"ok": true}'
    answer = requests_pool.submit(pair.answered, {"model": "svc"})
    first.opened()
    first.send(wire.going_away_frame())  # the agent stops: it will resume nothing
    assert answer.result(timeout=60) == (200, b'{"ok": true}')
    assert first.closed_by_the_control_plane()
    assert not pair.hub.connected(pair.first.node_id)
    # The next request goes straight to the server still there.
    assert pair.answered({"model": "svc"}) == (200, b'{"ok": true}')
    assert len(origin.requests) == 2 and sample(pair.metrics(), FAILOVERS) == 1


def test_an_agent_going_away_after_the_head_ends_the_sse_stream_with_node_link_lost(
    pair, origin, requests_pool
):
    pair.hub.grace = LONG_GRACE
    first = pair.scripted(pair.first)
    pair.agent(pair.second, pair.second_id)
    # getresponse() waits for the head: the request goes from a thread, answered here.
    pending = requests_pool.submit(pair.request, {"model": "svc", "stream": True})
    opened = first.opened()
    first.send(wire.head_frame(opened.stream_id, 200, [("Content-Type", "text/event-stream")]))
    first.send(wire.data_frame(opened.stream_id, b'data: {"n": 1}\n\n'))
    response = pending.result(timeout=60)
    assert response.status == 200
    buffer = bytearray()
    assert read_event(response, buffer) == b'data: {"n": 1}\n\n'
    first.send(wire.going_away_frame())
    rest = bytes(buffer) + response.read()
    assert rest.startswith(b"event: error\ndata: ")
    assert b"NODE_LINK_LOST" in rest and rest.endswith(b"data: [DONE]\n\n")
    assert origin.requests == []  # after the head a request is never sent again
    assert sample(pair.metrics(), FAILOVERS) == 0


# -- the agent's side: its real tunnel client says it is going when it stops ---------------


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_a_stopping_agent_ends_its_open_stream_at_once_and_its_runtime_stops(
    cp, tmp_path, origin, monkeypatch, transport
):
    with_transport(monkeypatch, transport)
    relay = Relay(cp, tmp_path, origin)
    cp.server.app.hub.grace = LONG_GRACE
    # Far more than a socket takes: the runtime is still writing when the agent goes.
    origin.chunks = [b"data: {}\n\n", *[b"data: " + b"x" * 8000 + b"\n\n"] * 200]
    origin.gated = True
    origin.release()
    response = relay.request({"model": "svc", "stream": True})
    buffer = bytearray()
    assert read_event(response, buffer) == b"data: {}\n\n"
    relay.close()  # the agent stops (its run stop, as SIGTERM sets it)
    rest = bytes(buffer) + response.read()
    assert b"event: error" in rest and b"NODE_LINK_LOST" in rest
    assert rest.endswith(b"data: [DONE]\n\n")
    origin.release(len(origin.chunks) - 1)
    assert origin.client_gone.wait(30)  # the agent closed the runtime's connection
    wait_until(lambda: not cp.server.app.hub.connected(relay.node.node_id), what="tunnel gone")


def test_a_stream_whose_tunnel_is_cut_and_stays_away_ends_after_the_grace(cp, tmp_path, origin):
    # The agent lives but cannot come back (no going away said): the grace, then the end.
    proxy = CutProxy(int(cp.url.rsplit(":", 1)[1]))
    relay = Relay(cp, tmp_path, origin, url=proxy.url)
    try:
        cp.server.app.hub.grace = 0.2
        origin.chunks = [b"data: {}\n\n"] * 2
        origin.gated = True
        origin.release()
        response = relay.request({"model": "svc", "stream": True})
        buffer = bytearray()
        read_event(response, buffer)
        proxy.close()  # every connection cut, and no new one taken
        rest = bytes(buffer) + response.read()
        assert b"event: error" in rest and b"NODE_LINK_LOST" in rest
        assert rest.endswith(b"data: [DONE]\n\n")
    finally:
        relay.close()


class RecordingLink:
    """A link that keeps what the agent sends (the agent's own side, without I/O)."""

    def __init__(self) -> None:
        self.sent: list[wire.Frame] = []
        self.closed = False

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))

    def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = True


def test_the_agent_says_it_is_going_first_and_then_starts_no_stream(tmp_path):
    env = {
        "MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:9",
        "MODELFORGE_AGENT_STATE_VOLUME": str(tmp_path / "state"),
        "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
    }
    client = TunnelClient(load_settings(env), lambda: None, lambda sid: None, threading.Event())
    link = RecordingLink()
    client._link = link  # as run() holds an up tunnel
    client._go_away(link)
    assert link.sent == [wire.going_away_frame()] and link.closed
    # An OPEN that crossed it is refused, and nothing runs for it.
    opened = wire.open_frame(5, "srv-1", "POST", CHAT, [], end_stream=True)
    client._dispatch(opened)
    refused = link.sent[-1]
    assert (refused.type, refused.stream_id) == (wire.RESET, 5)
    assert wire.json_of(refused)["code"] == rel.TUNNEL_CLOSING
    assert client._streams == {}
