"""The relay on its event loop (issue 35): client calls hold no thread, a node that never
answers or stalls ends by its deadlines, a client that leaves ends its stream at once, one
key at its share does not hold another back, and a connection moves between waitress and
the loop at each request. Real waitress, the real agent's tunnel client or a scripted
hostile node on a raw tunnel, a stdlib origin for the runtime; outcomes, never durations."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_appliance.relay.shares import Refused, Shares
from modelforge_contract import tunnel as wire
from modelforge_contract.relay import PATH_CLIENT_CHAT_COMPLETIONS
from tests.harness.agent_process import wait_until

from . import test_relay
from .test_relay import hostile_tunnel

# The relay tests' fixtures: a control plane, the stand-in runtime, a node serving `svc`.
cp, origin, relay = test_relay.cp, test_relay.origin, test_relay.relay

CHAT = PATH_CLIENT_CHAT_COMPLETIONS


def port_of(cp) -> int:
    return int(cp.url.rsplit(":", 1)[1])


def chat_request(key: str, body: dict, keep_alive: bool = False) -> bytes:
    raw = json.dumps(body).encode()
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        + ("" if keep_alive else "Connection: close\r\n")
        + "\r\n"
    ).encode() + raw


def get_request(path: str, headers: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode()


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole HTTP/1.1 answer from ``sock`` (Content-Length or chunked)."""
    reader = sock.makefile("rb")
    status_line = reader.readline()
    assert status_line, "the connection closed before an answer"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = reader.readline().decode("latin-1").strip()
        if not line:
            break
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = reader.read(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int(reader.readline().strip(), 16)
            if size == 0:
                reader.readline()
                break
            body += reader.read(size)
            reader.readline()
    else:
        body = reader.read()
    return status, headers, body


def healthz(cp) -> int:
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
        sock.sendall(get_request("/healthz", "Connection: close\r\n"))
        return read_answer(sock)[0]


# -- many streams at once ------------------------------------------------------------------


def streams_complete_while_the_api_answers(cp, relay, origin, count: int) -> None:
    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    origin.gated = True
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=120)
        sock.sendall(chat_request(relay.key, {"model": "svc", "stream": True}))
        socks.append(sock)
    hub, shares = cp.server.app.hub, cp.server.app.relay.shares
    # Every one is carried: those on the node's tunnel up to its slots, the rest waiting.
    wait_until(lambda: shares.in_flight == count, what=f"{count} streams in flight")
    assert hub.stats()["streams"] <= wire.MAX_STREAMS_PER_TUNNEL
    # Meanwhile the control plane answers: /healthz and the node's heartbeat.
    assert healthz(cp) == 200
    relay.node.heartbeat_answer()
    origin.release(2 * count)
    for sock in socks:
        status, _, body = read_answer(sock)
        assert status == 200 and body == b"data: {}\n\ndata: [DONE]\n\n"
        sock.close()
    wait_until(lambda: shares.in_flight == 0, what="every place given back")
    assert hub.stats()["streams"] == 0


def test_a_hundred_concurrent_streams_complete_on_default_settings(cp, relay, origin):
    # Today's default (MODELFORGE_THREADS 8) relayed 4 at once and refused the rest.
    assert cp.server.app.relay.shares.total >= 100
    streams_complete_while_the_api_answers(cp, relay, origin, 100)


@pytest.mark.slow
def test_a_thousand_concurrent_streams_complete_on_default_settings(cp, relay, origin):
    streams_complete_while_the_api_answers(cp, relay, origin, 1000)


# -- a hostile or silent node --------------------------------------------------------------


class Silent:
    """A node's tunnel held by this test: it reads what the control plane sends and
    answers only what the test says."""

    def __init__(self, cp, relay) -> None:
        relay.close()  # the real agent goes; this link is the node's tunnel now
        wait_until(lambda: not cp.server.app.hub.connected(relay.node.node_id), what="agent gone")
        self.link = hostile_tunnel(cp, relay.node.credential)
        self.frames: list[wire.Frame] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: cp.server.app.hub.connected(relay.node.node_id), what="tunnel up")

    def _read(self) -> None:
        try:
            while True:
                frame = wire.decode(self.link.recv())
                with self.lock:
                    self.frames.append(frame)
        except Exception:
            return

    def of(self, kind) -> list[wire.Frame]:
        with self.lock:
            return [f for f in self.frames if f.type == kind]

    def send(self, frame: wire.Frame) -> None:
        self.link.send(wire.encode(frame))


def test_a_client_that_leaves_while_the_head_is_awaited_ends_its_stream_at_once(cp, relay):
    node = Silent(cp, relay)
    sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
    sock.sendall(chat_request(relay.key, {"model": "svc"}))
    wait_until(lambda: node.of(wire.OPEN), what="the OPEN")
    [opened] = node.of(wire.OPEN)
    sock.close()  # the client leaves before any head
    wait_until(lambda: node.of(wire.RESET), what="the RESET of the client's stream")
    [reset] = node.of(wire.RESET)
    assert reset.stream_id == opened.stream_id
    assert wire.json_of(reset)["code"] == "STREAM_CANCELLED"
    shares = cp.server.app.relay.shares
    wait_until(lambda: shares.in_flight == 0, what="its place given back")
    assert cp.server.app.hub.stats()["streams"] == 0


def test_a_node_that_never_sends_a_head_gets_its_stream_reset_at_the_head_deadline(cp, relay):
    cp.server.app.relay.head_timeout = 1  # as MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS=1
    node = Silent(cp, relay)
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=60) as sock:
        sock.sendall(chat_request(relay.key, {"model": "svc"}))
        status, headers, body = read_answer(sock)
    assert status == 504 and json.loads(body)["error"]["code"] == "HEAD_TIMEOUT"
    assert "MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS" in json.loads(body)["error"]["next_step"]
    wait_until(lambda: node.of(wire.RESET), what="the node's stream reset")
    assert cp.server.app.relay.shares.in_flight == 0


def test_a_stalled_body_is_cut_at_the_idle_deadline_and_reset_on_the_node(cp, relay):
    cp.server.app.relay.idle_timeout = 1  # as MODELFORGE_RELAY_IDLE_TIMEOUT_SECONDS=1
    node = Silent(cp, relay)
    sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=60)
    sock.sendall(chat_request(relay.key, {"model": "svc"}))
    wait_until(lambda: node.of(wire.OPEN), what="the OPEN")
    [opened] = node.of(wire.OPEN)
    headers = [["Content-Type", "application/json"], ["Content-Length", "100"]]
    node.send(wire.head_frame(opened.stream_id, 200, headers))
    node.send(wire.data_frame(opened.stream_id, b'{"partial": '))
    reader = sock.makefile("rb")
    assert reader.readline().startswith(b"HTTP/1.1 200")
    received = reader.read()  # to the end: the connection closes, the body cut short
    assert received.endswith(b'{"partial": ')
    sock.close()
    wait_until(lambda: node.of(wire.RESET), what="the node's stream reset")
    assert cp.server.app.relay.shares.in_flight == 0


def test_one_key_at_its_share_of_a_node_does_not_hold_another_key_back(cp, relay):
    node = Silent(cp, relay)
    _, other_key = create_api_key(cp.store, "other", "tests")
    shares = cp.server.app.relay.shares
    mine = []
    for i in range(shares.per_key_on_node + 10):
        sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
        sock.sendall(chat_request(relay.key, {"model": "svc", "n": i}))
        mine.append(sock)
    wait_until(lambda: shares.in_flight == len(mine), what="all of the first key's in flight")
    # The node got the key's share; the other 10 wait at the control plane.
    wait_until(lambda: len(node.of(wire.OPEN)) == shares.per_key_on_node, what="the share")
    assert shares.waiting() == 10
    other = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
    other.sendall(chat_request(other_key, {"model": "svc", "n": "other"}))
    # The other key's request reaches the node while the first key's still wait.
    wait_until(
        lambda: len(node.of(wire.OPEN)) == shares.per_key_on_node + 1, what="the other's OPEN"
    )
    assert shares.waiting() == 10
    for sock in [*mine, other]:
        sock.close()
    wait_until(lambda: shares.in_flight == 0, what="every place given back")


# -- one connection, both sides ------------------------------------------------------------


def test_one_kept_connection_moves_between_waitress_and_the_loop_at_each_request(cp, relay, origin):
    origin.json_body = b'{"ok": true}'
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
        for _ in range(2):
            sock.sendall(get_request("/healthz"))
            status, _, body = read_answer(sock)
            assert status == 200
            sock.sendall(chat_request(relay.key, {"model": "svc"}, keep_alive=True))
            status, headers, body = read_answer(sock)
            assert status == 200 and body == b'{"ok": true}'
            assert headers["x-content-type-options"] == "nosniff"
            sock.sendall(get_request(
                "/api/v1/admin/hardware/nodes", f"X-ModelForge-Admin-Token: {cp.admin_token}\r\n"
            ))  # fmt: skip
            status, _, body = read_answer(sock)
            assert status == 200 and relay.node.node_id in body.decode()


def test_a_refused_key_on_the_loop_is_answered_in_the_one_error_shape(cp, relay):
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
        sock.sendall(chat_request("mfk_" + "x" * 40, {"model": "svc"}, keep_alive=True))
        status, headers, body = read_answer(sock)
        assert status == 401 and json.loads(body)["error"]["code"] == "API_KEY_INVALID"
        assert headers["content-security-policy"].startswith("default-src 'none'")
        # The connection stays usable.
        sock.sendall(get_request("/v1/models", f"Authorization: Bearer {relay.key}\r\n"))
        status, _, body = read_answer(sock)
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["svc"]


def test_a_body_over_the_limit_is_refused_413_on_the_loop(cp, relay):
    limit = cp.settings.max_body_bytes
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {relay.key}\r\n"
        f"Content-Length: {limit + 1}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
        sock.sendall(head)
        status, _, body = read_answer(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "BODY_TOO_LARGE"


# -- the shares, by themselves ---------------------------------------------------------------


def test_shares_refuse_past_each_bound_and_name_it():
    shares = Shares(total=3, per_key=2, per_deployment=2)
    shares.admit("a", "d1")
    shares.admit("a", "d2")
    with pytest.raises(Refused, match="PER_KEY"):
        shares.admit("a", "d3")
    shares.admit("b", "d1")
    with pytest.raises(Refused, match="MODELFORGE_RELAY_STREAMS\\)"):
        shares.admit("c", "d3")


def test_freed_slots_go_to_the_waiting_keys_in_turn():
    async def scenario() -> list[str]:
        shares = Shares(total=100, per_key=100, per_deployment=100, slots_per_node=2,
                        per_key_on_node=2)  # fmt: skip
        holders = [shares.admit("a", "d"), shares.admit("a", "d")]
        for ticket in holders:
            assert shares.take_slot(ticket, "n")
        order: list[str] = []

        async def wanting(key: str) -> None:
            ticket = shares.admit(key, "d")
            assert await shares.slot(ticket, "n", 60)
            order.append(key)
            await asyncio.sleep(0)
            shares.leave(ticket)  # done: its slot goes on

        waiters = [asyncio.ensure_future(wanting(k)) for k in ["a", "a", "a", "b", "c"]]
        await asyncio.sleep(0)
        assert shares.waiting() == 5
        for ticket in holders:
            shares.leave(ticket)
        await asyncio.gather(*waiters)
        assert shares.in_flight == 0 and shares.waiting() == 0
        return order

    # a asked first, then b and c each get a turn before a's second and third.
    assert asyncio.run(scenario()) == ["a", "b", "c", "a", "a"]


def test_a_slot_not_freed_in_time_is_refused_and_leaves_no_waiter_behind():
    async def scenario() -> None:
        shares = Shares(total=9, per_key=9, per_deployment=9, slots_per_node=1, per_key_on_node=1)
        holder, late = shares.admit("a", "d"), shares.admit("b", "d")
        assert shares.take_slot(holder, "n")
        assert await shares.slot(late, "n", 0) is False
        assert shares.waiting() == 0
        shares.leave(holder)
        shares.leave(late)
        assert shares.in_flight == 0

    asyncio.run(scenario())


# -- revocation ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["revoke", "decommission"])
def test_revoking_a_node_closes_its_tunnel_and_ends_its_streams(cp, relay, origin, how):
    from modelforge_appliance import lifecycle
    from modelforge_appliance.fleet import nodes

    origin.chunks = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    origin.gated = True
    origin.release()
    response = relay.request({"model": "svc", "stream": True})
    assert response.status == 200
    assert response.read1(65536).startswith(b"data: {}")
    node_id = relay.node.node_id
    # Out of the serving process's way, as `modelforge nodes revoke` does it.
    node = nodes.get_node(cp.store, node_id)
    if how == "revoke":
        lifecycle.revoke_node_credential(cp.store, node, "cli")
    else:
        preview = lifecycle.preview_decommission(cp.store, node_id, "cli")
        lifecycle.execute_decommission(cp.store, node_id, preview["confirmation"], "cli")
    hub = cp.server.app.hub
    wait_until(lambda: not hub.connected(node_id), what="the revoked node's tunnel closed")
    # The running stream ends at once with the error event, not after the resume grace.
    rest = response.read()
    assert b"NODE_LINK_LOST" in rest and rest.endswith(b"data: [DONE]\n\n")
    # Its agent's next tunnel is refused: no prompt reaches the node again.
    refused = relay.request({"model": "svc"})
    assert refused.status in (502, 503)
    assert not hub.connected(node_id)


# -- tunnel admission ------------------------------------------------------------------------


def tunnel_upgrade(cp, credential: str) -> tuple[socket.socket, bytes]:
    """A raw WebSocket upgrade of the tunnel path; the socket and the answer's head. The
    caller never reads the socket again (a tunnel that will not close)."""
    from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION

    sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
    sock.sendall(
        (
            f"GET {wire.PATH_AGENT_TUNNEL} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\n{HEADER_AGENT_PROTOCOL}: {PROTOCOL_VERSION}\r\n"
            f"Authorization: Bearer {credential}\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    return sock, head


def test_a_node_reconnecting_faster_than_its_tunnels_close_is_refused_not_given_threads(cp):
    from .test_deployments import ServingNode

    node = ServingNode(cp, "flapping")
    held = []
    for _ in range(3):  # its live tunnel, and two replaced ones still closing
        sock, head = tunnel_upgrade(cp, node.credential)
        assert head.startswith(b"HTTP/1.1 101"), head
        held.append(sock)
    wait_until(lambda: cp.server.app.hub.tunnels_held(node.node_id) == 3, what="three held")
    sock, head = tunnel_upgrade(cp, node.credential)
    assert head.startswith(b"HTTP/1.1 503"), head
    assert b"Retry-After: 5" in head
    body = sock.recv(65536)
    assert json.loads(body)["error"]["code"] == "TOO_MANY_TUNNELS"
    for each in [*held, sock]:
        each.close()
    # Once they have closed, the node's agent gets its tunnel again.
    wait_until(lambda: cp.server.app.hub.tunnels_held(node.node_id) == 0, what="all closed")
    sock, head = tunnel_upgrade(cp, node.credential)
    assert head.startswith(b"HTTP/1.1 101"), head
    sock.close()


def test_a_refused_tunnel_request_is_closed_however_slowly_its_client_trickles(cp):
    import time

    sock, head = tunnel_upgrade(cp, "mfc_" + "0" * 16 + "_" + "x" * 43)
    assert head.startswith(b"HTTP/1.1 401"), head
    # A byte now and then, each well within any per-read timeout: the refusal still ends
    # (the old linger read up to 64 KiB, each read with its own 2 s: hours).
    closed = False
    for _ in range(300):
        try:
            sock.send(b"x")
        except OSError:  # reset: the control plane closed its end
            closed = True
            break
        time.sleep(0.1)
    sock.close()
    assert closed


def test_more_http_fallback_tunnels_than_threads_leave_the_api_its_threads_and_hold_none(cp):
    from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION

    from .test_deployments import ServingNode

    nodes = [ServingNode(cp, f"fallback-{i}") for i in range(cp.settings.threads + 4)]
    downloads = []
    for node in nodes:  # each download lives as long as its tunnel
        sock = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
        sock.sendall(get_request(wire.PATH_AGENT_TUNNEL_DOWN, (
            f"Authorization: Bearer {node.credential}\r\n"
            f"{HEADER_AGENT_PROTOCOL}: {PROTOCOL_VERSION}\r\n"
        )))  # fmt: skip
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        downloads.append(sock)
    hub = cp.server.app.hub
    wait_until(lambda: all(hub.connected(n.node_id) for n in nodes), what="every tunnel up")
    # Every thread of waitress would be held by now; the API answers all the same.
    assert healthz(cp) == 200
    # And no tunnel has a thread of its own (a reader and a writer each, before).
    assert [t.name for t in threading.enumerate() if t.name.startswith("tunnel")] == []
    nodes[0].heartbeat_answer()
    listed = cp.admin("GET", "/api/v1/admin/hardware/nodes")
    assert listed.status_code == 200
    for sock in downloads:
        sock.close()
    wait_until(lambda: not any(hub.connected(n.node_id) for n in nodes), what="tunnels down")


def test_a_client_call_pipelined_behind_an_admin_call_is_answered_on_waitress_too(
    cp, relay, origin, monkeypatch
):
    # Both requests in one write: waitress reads the second with the first, so it is
    # answered by the route on waitress's thread, which waits on the relay's loop.
    origin.json_body = b'{"ok": true}'
    on_waitress = []
    real = cp.server.app.relay.answer_blocking
    monkeypatch.setattr(
        cp.server.app.relay, "answer_blocking", lambda r: on_waitress.append(r) or real(r)
    )
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
        sock.sendall(get_request("/healthz") + chat_request(relay.key, {"model": "svc"}))
        status, _, _ = read_answer(sock)
        assert status == 200
        status, headers, body = read_answer(sock)
    assert status == 200 and body == b'{"ok": true}'
    assert headers["content-type"] == "application/json"
    assert len(on_waitress) == 1
    shares = cp.server.app.relay.shares
    wait_until(lambda: shares.in_flight == 0, what="its place given back")


# -- the tunnels on the loop ---------------------------------------------------------------


def test_agents_tunnels_are_served_on_the_loop_without_a_thread_each(cp):
    from tests.harness.scripted_node import WorkNode

    nodes = [WorkNode(cp, f"quiet-{number}") for number in range(24)]
    hub = cp.server.app.hub
    before = threading.active_count()
    held = []
    for node in nodes:
        sock, head = tunnel_upgrade(cp, node.credential)
        assert head.startswith(b"HTTP/1.1 101"), head
        held.append(sock)
    wait_until(lambda: all(hub.connected(n.node_id) for n in nodes), what="every tunnel up")
    grown = threading.active_count() - before
    for sock in held:
        sock.close()
    wait_until(lambda: not any(hub.tunnels_held(n.node_id) for n in nodes), what="all closed")
    # Three threads a tunnel before (the front's handler, websockets' reader, the hub's
    # writer): 72 here. Now at most the loop's store threads that answered the upgrades.
    assert grown <= 4, grown


def test_an_agent_that_stops_reading_its_tunnel_loses_it(cp, relay, monkeypatch, caplog):
    from modelforge_appliance.runtime import tunnel_websocket

    monkeypatch.setattr(tunnel_websocket, "UNSENT_HIGH_BYTES", 64 * 1024)
    monkeypatch.setattr(tunnel_websocket, "SEND_TIMEOUT_SECONDS", 0.5)
    relay.close()  # the real agent goes; this socket is the node's tunnel, never read
    hub = cp.server.app.hub
    wait_until(lambda: not hub.connected(relay.node.node_id), what="agent gone")
    sock, head = tunnel_upgrade(cp, relay.node.credential)
    assert head.startswith(b"HTTP/1.1 101"), head
    wait_until(lambda: hub.connected(relay.node.node_id), what="tunnel up")
    body = {"model": "svc", "messages": [{"role": "user", "content": "x" * 900_000}]}
    clients = []
    try:
        # About 29 MB of requests for a node that takes none: more than loopback buffers.
        for _ in range(32):
            client = socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30)
            client.sendall(chat_request(relay.key, body))
            clients.append(client)
            if not hub.connected(relay.node.node_id):
                break
        wait_until(lambda: not hub.connected(relay.node.node_id), what="the tunnel closed")
        wait_until(lambda: hub.tunnels_held(relay.node.node_id) == 0, what="its link gone")
        assert "the agent stopped reading it" in caplog.text
        # The control plane answers everyone else meanwhile.
        assert cp.admin("GET", "/healthz").status_code == 200
    finally:
        for client in clients:
            client.close()
        sock.close()
