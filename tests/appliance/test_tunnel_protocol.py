"""docs/tunnel-protocol.md held to both sides: every frame of its table goes through the real
hub (a real control plane, this test as the node on a raw WebSocket tunnel) or the real
agent (its real TunnelClient, this test as the control plane's end of the tunnel), and the
receiver does what the page says."""

from __future__ import annotations

import json
import queue
import re
import socket
import threading
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve as websocket_server

from modelforge_contract import tunnel as wire
from modelforge_contract.relay import PATH_CLIENT_CHAT_COMPLETIONS
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.tunnel import TunnelClient
from tests.harness.agent_process import wait_until

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "tunnel-protocol.md"


def test_the_page_lists_every_frame_type_the_contract_has():
    table = [line for line in SPEC.read_text().splitlines() if line.startswith("| ")]
    named = {line.split("|")[1].strip() for line in table}
    assert {kind.name for kind in wire.FrameType} <= named


# -- the hub's side: this test is the node ------------------------------------------------


@pytest.fixture
def plane(tmp_path):
    from tests.appliance.test_relay import Relay
    from tests.harness.control_plane import make_settings, serve
    from tests.harness.relay_origin import Origin

    origin = Origin()
    with serve(make_settings(tmp_path / "cp")) as cp:
        relay = Relay(cp, tmp_path, origin)
        relay.close()  # the real agent goes: this test holds the node's tunnel
        wait_until(lambda: not cp.server.app.hub.connected(relay.node.node_id), what="gone")
        yield cp, relay
    origin.close()


class Node:
    """The node's end of a tunnel, held by the test: frames in a queue, sent as told."""

    def __init__(self, cp, credential: str) -> None:
        from tests.appliance.test_relay import hostile_tunnel

        self.link = hostile_tunnel(cp, credential)  # it read the RESUME that opens a tunnel
        self.frames: queue.Queue[wire.Frame | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                self.frames.put(wire.decode(self.link.recv()))
        except Exception:
            self.frames.put(None)  # closed

    def next(self, kind: wire.FrameType) -> wire.Frame:
        while True:
            frame = self.frames.get(timeout=30)
            assert frame is not None, f"the tunnel closed before a {kind.name}"
            if frame.type == kind:
                return frame

    def closed(self) -> bool:
        while True:
            try:
                frame = self.frames.get(timeout=30)
            except queue.Empty:
                return False
            if frame is None:
                return True

    def send(self, frame: wire.Frame) -> None:
        self.link.send(wire.encode(frame))


def client_request(cp, key: str) -> tuple[socket.socket, threading.Thread, dict]:
    """A client call in the background; its answer's raw bytes in ``got["raw"]``."""
    body = json.dumps({"model": "svc"}).encode()
    sock = socket.create_connection(("127.0.0.1", int(cp.url.rsplit(":", 1)[1])), timeout=60)
    sock.sendall(
        (
            f"POST {PATH_CLIENT_CHAT_COMPLETIONS} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        + body
    )
    got: dict = {}

    def read() -> None:
        chunks = []
        try:
            while data := sock.recv(65536):
                chunks.append(data)
        except OSError:  # the test closed it
            pass
        got["raw"] = b"".join(chunks)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return sock, thread, got


def test_head_data_and_end_from_the_node_reach_the_client_with_only_allowed_headers(plane):
    cp, relay = plane
    node = Node(cp, relay.node.credential)
    sock, thread, got = client_request(cp, relay.key)
    opened = node.next(wire.OPEN)
    assert wire.json_of(opened)["server_id"] == relay.server_id
    headers = [["Content-Type", "text/event-stream"], ["Set-Cookie", "a=b"]]
    node.send(wire.head_frame(opened.stream_id, 200, headers))
    node.send(wire.data_frame(opened.stream_id, b"data: {}\n\n"))
    node.send(wire.end_frame(opened.stream_id))
    thread.join(30)
    sock.close()
    raw = got["raw"]
    assert raw.startswith(b"HTTP/1.1 200") and b"data: {}" in raw
    assert b"Set-Cookie" not in raw and raw.endswith(b"0\r\n\r\n")


def test_a_reset_before_the_head_is_a_502_and_ping_is_answered_by_pong(plane):
    cp, relay = plane
    node = Node(cp, relay.node.credential)
    node.send(wire.ping_frame(b"12345678"))
    pong = node.next(wire.PONG)
    assert pong.payload == b"12345678" and pong.stream_id == 0
    node.send(wire.Frame(wire.PONG, 0, b"87654321"))  # nothing to answer
    sock, thread, got = client_request(cp, relay.key)
    opened = node.next(wire.OPEN)
    node.send(wire.reset_frame(opened.stream_id, "RUNTIME_UNREACHABLE", "down"))
    thread.join(30)
    sock.close()
    assert got["raw"].startswith(b"HTTP/1.1 502")
    assert cp.server.app.hub.connected(relay.node.node_id)  # PONG and RESET closed nothing


def test_reset_of_stream_zero_is_going_away_and_a_window_from_the_node_closes_the_tunnel(
    plane,
):
    cp, relay = plane
    hub = cp.server.app.hub
    node = Node(cp, relay.node.credential)
    node.send(wire.going_away_frame())
    assert node.closed() and not hub.connected(relay.node.node_id)
    node = Node(cp, relay.node.credential)
    wait_until(lambda: hub.connected(relay.node.node_id), what="a new tunnel")
    sock, thread, got = client_request(cp, relay.key)
    opened = node.next(wire.OPEN)
    node.send(wire.window_frame(opened.stream_id, 4096))  # the agent never sends WINDOW
    assert node.closed()
    sock.close()


def test_a_link_from_a_node_that_runs_no_split_s_main_server_is_refused(plane):
    """A LINK reaches a helper's ggml-rpc-server only from its split's main server: a node
    naming its own (whole) server, or any other, is refused, nothing is spliced, and an id
    the agent may not choose closes its tunnel."""
    cp, relay = plane
    hub = cp.server.app.hub
    node = Node(cp, relay.node.credential)
    [server] = cp.admin("GET", "/api/v1/admin/deployments/svc").json()["servers"]
    link_id = wire.LINK_STREAM_BIT | 1
    node.send(wire.link_frame(link_id, server["server_id"], server["server_id"]))
    refused = node.next(wire.RESET)
    assert refused.stream_id == link_id and reset_code(refused) == "LINK_REFUSED"
    node.send(wire.link_frame(link_id + 1, "someone-else", server["server_id"]))
    assert reset_code(node.next(wire.RESET)) == "LINK_REFUSED"
    assert hub.links() == 0
    node.send(wire.data_frame(link_id, b"not a link"))  # nothing was spliced
    assert reset_code(node.next(wire.RESET)) == "STREAM_UNKNOWN"
    node.send(wire.link_frame(7, server["server_id"], server["server_id"]))
    assert node.closed()


# -- the agent's side: this test is the control plane ---------------------------------------


@pytest.fixture
def agent_link(tmp_path):
    """A real TunnelClient dialled into a WebSocket server of this test; the server's end
    of the tunnel, and its frames."""
    accepted: queue.Queue = queue.Queue()
    frames: queue.Queue[wire.Frame | None] = queue.Queue()

    def handler(connection) -> None:
        accepted.put(connection)
        try:
            for message in connection:
                frames.put(wire.decode(message))
        except ConnectionClosed:
            pass
        frames.put(None)

    with websocket_server(handler, "127.0.0.1", 0, compression=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.socket.getsockname()[1]
        settings = load_settings(
            {
                "MODELFORGE_AGENT_CONTROL_PLANE_URL": f"http://127.0.0.1:{port}",
                "MODELFORGE_AGENT_STATE_VOLUME": str(tmp_path / "agent-state"),
                "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
            }
        )
        stop = threading.Event()
        client = TunnelClient(settings, lambda: "mfc_x_y", lambda sid: None, stop,
                              steps=(0.05, 0.1))  # fmt: skip
        client.start()
        connection = accepted.get(timeout=30)
        connection.send(wire.encode(wire.resume_frame({})))  # what every tunnel begins with

        def next_frame(kind: wire.FrameType) -> wire.Frame:
            while True:
                frame = frames.get(timeout=30)
                assert frame is not None, f"the tunnel closed before a {kind.name}"
                if frame.type == kind:
                    return frame

        def closed() -> bool:
            while True:
                try:
                    if frames.get(timeout=30) is None:
                        return True
                except queue.Empty:
                    return False

        yield connection, next_frame, closed
        stop.set()
        server.shutdown()


def reset_code(frame: wire.Frame) -> str:
    return wire.json_of(frame)["code"]


def test_the_agent_answers_open_data_window_reset_ping_and_resume_as_the_page_says(agent_link):
    connection, next_frame, _ = agent_link
    send = lambda frame: connection.send(wire.encode(frame))  # noqa: E731
    send(wire.ping_frame(b"abcdefgh"))
    assert next_frame(wire.PONG).payload == b"abcdefgh"
    # An OPEN for a server this node does not run.
    send(wire.open_frame(7, "no-such-server", "POST", PATH_CLIENT_CHAT_COMPLETIONS, [],
                         end_stream=True))  # fmt: skip
    reset = next_frame(wire.RESET)
    assert reset.stream_id == 7 and reset_code(reset) == "SERVER_NOT_ON_NODE"
    # DATA, END and WINDOW for a stream the agent does not hold: RESET STREAM_UNKNOWN each.
    for stream_id, frame in ((11, wire.data_frame(11, b"x")), (12, wire.end_frame(12)),
                             (13, wire.window_frame(13, 10))):  # fmt: skip
        send(frame)
        reset = next_frame(wire.RESET)
        assert reset.stream_id == stream_id and reset_code(reset) == "STREAM_UNKNOWN"
    send(wire.reset_frame(14, "STREAM_CANCELLED", "gone"))  # a RESET is not answered
    send(wire.ping_frame(b"after-rs"))
    assert next_frame(wire.PONG).payload == b"after-rs"
    # A RESUME naming a stream the agent never had: RESET RESUME_FAILED.
    payload = json.dumps(
        {"streams": [{"stream_id": 21, "received": 0, "delivered": 0, "head": False}]}
    ).encode()
    send(wire.Frame(wire.RESUME, 0, payload))
    reset = next_frame(wire.RESET)
    assert reset.stream_id == 21 and reset_code(reset) == "RESUME_FAILED"


def test_a_head_from_the_control_plane_closes_the_agent_s_tunnel(agent_link):
    connection, next_frame, closed = agent_link
    send = lambda frame: connection.send(wire.encode(frame))  # noqa: E731
    send(wire.head_frame(4, 200, []))  # a stream it does not hold: STREAM_UNKNOWN, as always
    assert reset_code(next_frame(wire.RESET)) == "STREAM_UNKNOWN"
    # A stream it holds (its body still to come), then a HEAD for it: a protocol error.
    send(wire.open_frame(5, "server", "POST", PATH_CLIENT_CHAT_COMPLETIONS, []))
    send(wire.head_frame(5, 200, []))
    assert closed()


def test_every_reset_code_the_page_names_is_one_the_contract_has():
    from modelforge_contract import relay as rel

    named = set(re.findall(r"`([A-Z][A-Z_]+)`", SPEC.read_text()))
    codes = set(rel.RELAY_ERROR_CODES) | {"STREAM_UNKNOWN", "TOO_MANY_TUNNELS"}
    settings_and_others = {n for n in named if n.startswith(("MODELFORGE_", "FLAG_", "WINDOW_"))}
    frames = {kind.name for kind in wire.FrameType}
    others = {"END_STREAM", "FAILOVER_CODES", "LINK_STREAM_BIT"}
    unknown = named - codes - settings_and_others - frames - others
    assert unknown == set(), unknown
