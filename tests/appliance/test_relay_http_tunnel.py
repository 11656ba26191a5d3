"""The relay over the tunnel's HTTP fallback (docs/architecture.md §12): the same real
control plane, agent tunnel client and scripted origin as test_relay.py, with the agent's
MODELFORGE_AGENT_TUNNEL_TRANSPORT=http (a streamed GET of the control plane's frames, POSTs
of the agent's), or auto behind a proxy that refuses every WebSocket upgrade."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading

import pytest

from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION
from modelforge_contract import tunnel as wire
from modelforge_node_agent import settings as agent_settings
from tests.harness.agent_process import wait_until
from tests.harness.cut_proxy import CutProxy

from . import test_relay
from .test_deployments import ServingNode
from .test_relay import Relay, read_event


@pytest.fixture
def cp(tmp_path):
    with test_relay.serve(test_relay.make_settings(tmp_path / "cp")) as plane:
        yield plane
        plane.server.app.tunnel_sessions.close_all()  # waitress need not wait for a PING


@pytest.fixture
def origin():
    made = test_relay.Origin()
    yield made
    made.close()


def with_transport(monkeypatch, transport: str) -> None:
    """Relay's agent settings, with this tunnel transport."""

    def load(env=None, env_file=None):
        return agent_settings.load_settings(
            {**(env or {}), "MODELFORGE_AGENT_TUNNEL_TRANSPORT": transport}, env_file
        )

    monkeypatch.setattr(test_relay, "load_settings", load)


class UpgradeRefusingProxy(CutProxy):
    """A CutProxy in front of the control plane that answers every WebSocket upgrade with
    426, as a proxy that does not pass WebSocket would, and passes every other request."""

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            head = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    more = client.recv(65536, socket.MSG_PEEK)
                    if not more or len(more) == len(head):
                        break
                    head = more
            if b"upgrade: websocket" in head.lower():
                self.refused += 1
                with contextlib.suppress(OSError):
                    client.sendall(
                        b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n"
                        b"Connection: close\r\n\r\n"
                    )
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._pairs.append((client, upstream))
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    refused = 0


def sse_through(relay: Relay, origin, count: int) -> None:
    """``count`` events, each read before the origin writes the next."""
    events = [{"choices": [{"delta": {"content": f"word{i} "}}]} for i in range(count)]
    expected = origin.sse(events)
    origin.chunks = [c + b"\n\n" for c in expected.split(b"\n\n") if c]
    origin.gated = True
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
    assert b"".join(seen) == expected and response.read() == b""


def test_sse_events_arrive_one_by_one_over_the_http_tunnel(cp, tmp_path, origin, monkeypatch):
    with_transport(monkeypatch, "http")
    relay = Relay(cp, tmp_path, origin)
    try:
        assert len(cp.server.app.tunnel_sessions) == 1  # the tunnel is the HTTP one
        sse_through(relay, origin, 4)
    finally:
        relay.close()


def test_a_stream_survives_a_cut_http_tunnel_with_no_gap_and_no_duplicate(
    cp, tmp_path, origin, monkeypatch
):
    with_transport(monkeypatch, "http")
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
        before = proxy.accepted
        assert proxy.cut() >= 1  # the download (and uploads) die; agent and runtime live
        origin.release(len(origin.chunks) - 5)  # the runtime goes on meanwhile
        wait_until(lambda: proxy.accepted > before, timeout=30, what="the agent reconnected")
        rest = bytes(buffer) + response.read()
        assert b"".join(got) + rest == expected  # every byte once, in order
    finally:
        relay.close()
        proxy.close()


def test_auto_falls_back_to_http_when_a_proxy_refuses_the_upgrade(
    cp, tmp_path, origin, monkeypatch, caplog
):
    with_transport(monkeypatch, "auto")
    proxy = UpgradeRefusingProxy(int(cp.url.rsplit(":", 1)[1]))
    relay = Relay(cp, tmp_path, origin, url=proxy.url)
    try:
        assert proxy.refused == 1 and relay.tunnel.transport == "http"
        assert len(cp.server.app.tunnel_sessions) == 1
        said = [r for r in caplog.records if "using the HTTP tunnel" in r.getMessage()]
        assert len(said) == 1
        sse_through(relay, origin, 3)
    finally:
        relay.close()
        proxy.close()


def open_session(cp, credential: str) -> tuple[http.client.HTTPConnection, str]:
    connection = http.client.HTTPConnection("127.0.0.1", int(cp.url.rsplit(":", 1)[1]), timeout=30)
    connection.request(
        "GET",
        wire.PATH_AGENT_TUNNEL_DOWN,
        headers={
            "Authorization": f"Bearer {credential}",
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
        },
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == wire.TUNNEL_MEDIA_TYPE
    reader = wire.FrameReader()
    frames = []
    while not frames:
        frames = reader.feed(response.read1(65536))
    assert frames[0].type == wire.RESUME  # every new tunnel opens with one
    connection.response = response
    return connection, response.getheader(wire.HEADER_TUNNEL_SESSION)


def upload(cp, credential: str, session: str, body: bytes) -> tuple[int, str | None]:
    import json

    connection = http.client.HTTPConnection("127.0.0.1", int(cp.url.rsplit(":", 1)[1]), timeout=30)
    connection.request(
        "POST",
        wire.PATH_AGENT_TUNNEL_UP,
        body,
        {
            "Authorization": f"Bearer {credential}",
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            wire.HEADER_TUNNEL_SESSION: session,
            "Content-Type": wire.TUNNEL_MEDIA_TYPE,
        },
    )
    response = connection.getresponse()
    text = response.read()
    connection.close()
    return response.status, json.loads(text)["error"]["code"] if text else None


def test_an_upload_goes_only_to_its_own_nodes_open_session(cp):
    mine, other = ServingNode(cp, "http-a"), ServingNode(cp, "http-b")
    connection, session = open_session(cp, mine.credential)
    hub = cp.server.app.hub
    assert hub.connected(mine.node_id)
    ping = wire.encode(wire.ping_frame(b"12345678"))
    assert upload(cp, mine.credential, session, ping) == (204, None)
    pong = wire.FrameReader().feed(connection.response.read1(65536))
    assert [f.type for f in pong] == [wire.PONG] and pong[0].payload == b"12345678"
    assert upload(cp, other.credential, session, ping) == (403, "TUNNEL_SESSION_NOT_YOURS")
    assert upload(cp, mine.credential, "no-such-session", ping) == (404, "TUNNEL_SESSION_UNKNOWN")
    # A frame for a stream this node never had closes its tunnel, as on a WebSocket.
    forged = wire.encode(wire.data_frame(99, b"data: forged\n\n"))
    assert upload(cp, mine.credential, session, forged) == (204, None)
    wait_until(lambda: not hub.connected(mine.node_id), timeout=30, what="the tunnel closed")
    assert upload(cp, mine.credential, session, ping) == (409, "TUNNEL_SESSION_CLOSED")
    assert connection.response.read() == b""  # the download ends with its tunnel
    connection.close()


def test_only_a_refusal_that_says_a_proxy_blocks_websocket_falls_back():
    from websockets.datastructures import Headers
    from websockets.exceptions import InvalidMessage, InvalidStatus
    from websockets.http11 import Response

    from modelforge_node_agent.tunnel import websocket_blocked

    def refused(status: int, body: bytes = b"") -> InvalidStatus:
        return InvalidStatus(Response(status, "", Headers(), body))

    ours = b'{"error": {"code": "PROTOCOL_INCOMPATIBLE", "message": "", "next_step": ""}}'
    assert all(websocket_blocked(refused(s)) for s in (400, 403, 404, 405, 426, 501))
    assert websocket_blocked(refused(403, b"<html>Forbidden</html>"))
    assert not websocket_blocked(refused(426, ours))  # the control plane's own answer
    assert not websocket_blocked(refused(401)) and not websocket_blocked(refused(503))
    assert websocket_blocked(InvalidMessage("did not receive a valid HTTP response"))
    assert websocket_blocked(ConnectionResetError())
    assert not websocket_blocked(ConnectionRefusedError())  # the control plane is down
