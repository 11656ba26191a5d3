"""The one-port front: agents' tunnels upgrade on the control plane's own port (or on
MODELFORGE_TUNNEL_LISTEN), and every other request is waitress's, exactly as without it.

A real control plane on loopback with an echo handler registered on its front, a real
WebSocket client (websockets.sync.client), and raw sockets for what a client library would
never send."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import requests
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from modelforge_appliance.core.errors import ApiError
from modelforge_appliance.core.settings import ConfigError, load_settings
from modelforge_appliance.runtime.server import OUTBUF_HIGH_WATERMARK
from modelforge_appliance.runtime.tunnel_websocket import (
    MAX_MESSAGE_BYTES,
    WebSocketLink,
    websocket_tunnel,
)
from modelforge_contract import (
    HEADER_AGENT_PROTOCOL,
    NOT_FOUND,
    PROTOCOL_VERSION,
    TOO_MANY_CONNECTIONS,
    TOO_MANY_TUNNELS,
    TUNNEL_UPGRADE_REQUIRED,
)
from modelforge_contract.tunnel import PATH_AGENT_TUNNEL, TUNNEL_SUBPROTOCOL
from tests.harness.control_plane import clean_env, free_port, make_settings, run_cli, serve, serving

from .test_connections import assert_json_refusal, exchange, parse, port_of, read_answer

REFUSED_CREDENTIAL = "Bearer mfc_refused"
REFUSAL_BODY = {
    "error": {"code": "CREDENTIAL_INVALID", "message": "no", "next_step": "enroll"},
    "compatibility": "COMPATIBLE",
}


def accept(headers) -> str:
    """The echo tunnel's check: one credential is refused, everything else upgrades."""
    if headers.get("Authorization") == REFUSED_CREDENTIAL:
        error = REFUSAL_BODY["error"]
        raise ApiError(
            error["message"],
            code=error["code"],
            status=401,
            next_step=error["next_step"],
            extra={"compatibility": REFUSAL_BODY["compatibility"]},
        )
    return "admitted"


class Echo:
    """Serves each tunnel by sending every message back; remembers what it saw."""

    def __init__(self) -> None:
        self.headers: list = []
        self.peers: list = []
        self.closed: list[int | None] = []

    def __call__(self, link: WebSocketLink, admission: str) -> None:
        assert admission == "admitted"
        self.headers.append(link.headers)
        self.peers.append(link.peer)
        link.start(link.send, lambda reason: self.closed.append(link.close_code))


def register(cp, handler) -> None:
    """``handler`` on the front, run on the control plane's relay loop."""
    cp.server.tunnel_front.register(handler, cp.server.app.relay.start)


@contextlib.contextmanager
def front_plane(settings) -> Iterator[tuple[object, Echo]]:
    echo = Echo()
    with serve(settings) as cp:
        register(cp, websocket_tunnel(accept, echo))
        yield cp, echo


@pytest.fixture
def plane(tmp_path):
    with front_plane(make_settings(tmp_path / "state")) as (cp, echo):
        yield cp, echo


def tunnel_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}{PATH_AGENT_TUNNEL}"


def open_tunnel(port: int, subprotocols=(TUNNEL_SUBPROTOCOL,), **headers: str) -> ClientConnection:
    return connect(
        tunnel_url(port),
        additional_headers={HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION), **headers},
        subprotocols=list(subprotocols) or None,
        compression=None,
        max_size=None,
        open_timeout=20,
        close_timeout=5,
    )


def upgrade_head(path: str = PATH_AGENT_TUNNEL, extra: str = "") -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"{extra}\r\n"
    ).encode()


def wait_for(condition, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# -- the tunnel on the one port ---------------------------------------------------------------


def test_a_websocket_client_upgrades_on_the_one_port_and_is_echoed(plane):
    cp, echo = plane
    with open_tunnel(port_of(cp), Authorization="Bearer mfc_agent") as ws:
        for message in (b"\x00", b"frame" * 1000, bytes(range(256)) * 1024):
            ws.send(message)
            assert ws.recv(timeout=20) == message
        ws.send(b"\xff" * MAX_MESSAGE_BYTES)  # one whole tunnel frame, the largest
        assert ws.recv(timeout=20) == b"\xff" * MAX_MESSAGE_BYTES
        # no compression, whatever the client offers; the tunnel's subprotocol
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
        assert ws.subprotocol == TUNNEL_SUBPROTOCOL
    wait_for(lambda: echo.closed, "the handler never saw the close")
    assert echo.closed == [1000]
    assert echo.headers[0]["Authorization"] == "Bearer mfc_agent"
    assert echo.headers[0][HEADER_AGENT_PROTOCOL] == str(PROTOCOL_VERSION)
    assert echo.peers[0][0] == "127.0.0.1"


def test_compression_is_never_agreed_and_the_subprotocol_is_optional(plane):
    cp, _ = plane
    with connect(
        tunnel_url(port_of(cp)), compression="deflate", subprotocols=None, open_timeout=20
    ) as ws:
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
        assert ws.subprotocol is None
        ws.send(b"plain")
        assert ws.recv(timeout=20) == b"plain"


def test_a_message_larger_than_one_tunnel_frame_closes_the_tunnel(plane):
    cp, echo = plane
    with open_tunnel(port_of(cp)) as ws:
        ws.send(b"x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=20)
    assert closed.value.rcvd.code == 1009  # message too big
    wait_for(lambda: echo.closed, "the handler never saw the close")


def test_many_tunnels_at_once_each_get_their_own_echo(plane):
    cp, _ = plane
    with contextlib.ExitStack() as stack:
        tunnels = [stack.enter_context(open_tunnel(port_of(cp))) for _ in range(8)]
        for number, ws in enumerate(tunnels):
            ws.send(f"tunnel {number}".encode())
        for number, ws in enumerate(tunnels):
            assert ws.recv(timeout=20) == f"tunnel {number}".encode()
        assert cp.server.tunnel_front.live == 8
    wait_for(lambda: cp.server.tunnel_front.live == 0, "tunnels still held after closing")


def test_the_handler_gets_the_head_and_not_a_byte_past_it(tmp_path):
    """A client that sends more right behind its head: those bytes stay on the socket."""
    seen: list[tuple[bytes, bytes]] = []

    async def raw(sock: socket.socket, head: bytes, peer: tuple) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        rest = b""
        while len(rest) < 5:
            rest += await loop.sock_recv(sock, 5 - len(rest))
        seen.append((head, rest))
        await loop.sock_sendall(sock, b"done")

    with serve(make_settings(tmp_path / "state")) as cp:
        register(cp, raw)
        head = upgrade_head()
        assert exchange(port_of(cp), head + b"AFTER") == b"done"
    assert seen == [(head, b"AFTER")]


def test_a_handler_that_raises_closes_its_connection_and_nothing_else(tmp_path):
    async def broken(sock: socket.socket, head: bytes, peer: tuple) -> None:
        raise RuntimeError("a bug in the relay")

    with serve(make_settings(tmp_path / "state")) as cp:
        register(cp, broken)
        assert exchange(port_of(cp), upgrade_head()) == b""
        assert requests.get(cp.url + "/healthz", timeout=20).status_code == 200
        wait_for(lambda: cp.server.tunnel_front.live == 0, "the broken tunnel is still held")


# -- refusals ---------------------------------------------------------------------------------


def test_a_refused_handshake_is_answered_with_the_status_accept_gave(plane):
    cp, echo = plane
    with pytest.raises(InvalidStatus) as refused:
        open_tunnel(port_of(cp), Authorization=REFUSED_CREDENTIAL)
    response = refused.value.response
    assert response.status_code == 401
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert json.loads(response.body) == REFUSAL_BODY
    assert echo.headers == []  # never served


def test_a_get_of_the_tunnel_path_without_upgrade_is_426_in_the_one_shape(plane):
    cp, _ = plane
    for path in (PATH_AGENT_TUNNEL, PATH_AGENT_TUNNEL + "?resume=1"):
        response = cp.agent("GET", path)
        assert response.status_code == 426
        assert response.headers["Upgrade"] == "websocket"
        body = response.json()
        assert body["error"]["code"] == TUNNEL_UPGRADE_REQUIRED
        assert set(body["error"]) == {"code", "message", "next_step"}
        assert body["compatibility"] == "COMPATIBLE"


def test_a_broken_upgrade_request_is_400_in_the_one_shape(plane):
    cp, _ = plane
    head = upgrade_head().replace(b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b"")
    assert_json_refusal(exchange(port_of(cp), head), 400, "REQUEST_MALFORMED")


def test_a_header_accept_reads_sent_twice_is_400_not_a_dropped_connection(plane):
    cp, echo = plane
    head = upgrade_head(extra="Authorization: Bearer a\r\nAuthorization: Bearer b\r\n")
    body = assert_json_refusal(exchange(port_of(cp), head), 400, "REQUEST_MALFORMED")
    assert body["compatibility"] == "UNKNOWN"  # no protocol header
    assert echo.headers == []


def test_a_tunnel_head_past_the_header_limits_is_431(plane):
    """Past 32 KiB waitress refuses it; a line past websockets' 8 KiB, the front."""
    cp, _ = plane
    for padding in (40_000, 10_000):
        head = upgrade_head(extra="X-Padding: " + "p" * padding + "\r\n")
        assert_json_refusal(exchange(port_of(cp), head), 431, "HEADERS_TOO_LARGE")


def test_past_the_fronts_cap_a_tunnel_is_refused_503_with_retry_after(plane):
    cp, _ = plane
    cp.server.tunnel_front.max_tunnels = 1
    with open_tunnel(port_of(cp)) as first:
        first.send(b"held")
        assert first.recv(timeout=20) == b"held"
        raw = exchange(port_of(cp), upgrade_head())
        body = assert_json_refusal(raw, 503, TOO_MANY_TUNNELS)
        assert "compatibility" in body
        assert parse(raw)[1]["Retry-After"]


def test_a_tunnel_counts_against_its_address_until_it_ends(tmp_path):
    settings = replace(make_settings(tmp_path / "state"), connections_per_address=1)
    with front_plane(settings) as (cp, _):
        port = port_of(cp)
        with open_tunnel(port), socket.create_connection(("127.0.0.1", port), timeout=20) as over:
            assert_json_refusal(read_answer(over), 503, TOO_MANY_CONNECTIONS)

        def healthz_answers() -> bool:
            try:  # refused (and perhaps reset) while the tunnel is still counted
                raw = exchange(
                    port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                )
            except OSError:
                return False
            return parse(raw)[0] == 200

        wait_for(healthz_answers, "the tunnel's address count was never released")


# -- everything else is waitress's, as before -------------------------------------------------

DATE = re.compile(rb"\r\nDate: [^\r]*")


def answers_of(port: int, data: bytes) -> bytes:
    """What the server answers to raw bytes, its Date headers left out."""
    return DATE.sub(b"", exchange(port, data))


PLAIN_REQUESTS = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    # a POST with a body (an enrollment with a token that does not exist)
    b"POST /api/v1/agent/enroll HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"X-ModelForge-Agent-Protocol: 1\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
    # three pipelined requests in one write, the last one closing
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2
    + b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    # paths that begin like the tunnel's and are not it
    b"GET /api/v1/agent/tunnels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /api/v1/agent/tunnel HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    b"Content-Length: 0\r\n\r\n",
    b"GET /api/v1/agent/tunne HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    # the HTTP fallback's streamed GET is a route like any other (here: not yet one)
    b"GET /api/v1/agent/tunnel/down HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    # not HTTP at all
    b"\x16\x03\x01\x00\xa5 no request line\r\n\r\n",
]


def test_plain_requests_are_answered_byte_for_byte_as_without_the_front(tmp_path):
    with serve(make_settings(tmp_path / "without")) as without:
        expected = [answers_of(port_of(without), data) for data in PLAIN_REQUESTS]
    with front_plane(make_settings(tmp_path / "with")) as (cp, echo):
        assert cp.server.tunnel_front.taking
        got = [answers_of(port_of(cp), data) for data in PLAIN_REQUESTS]
        assert echo.headers == []
    for data, before, now in zip(PLAIN_REQUESTS, expected, got, strict=True):
        assert now == before, data[:60]
    assert got[2].count(b"HTTP/1.1 200 OK") == 2 and b"HTTP/1.1 404" in got[2]


def test_a_request_trickled_a_byte_at_a_time_is_served(plane):
    """The bytes the front took while it could not tell reach waitress, in order."""
    cp, _ = plane
    for request in (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /api/v1/agent/tunnels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=20) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.002)
            status = parse(read_answer(sock))[0]
        assert status == (200 if b"healthz" in request else 404)


def test_a_tunnel_request_trickled_a_byte_at_a_time_upgrades(plane):
    cp, _ = plane
    with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=20) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in upgrade_head():
            sock.sendall(bytes([byte]))
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in answer


def test_a_silent_client_does_not_stop_another_clients_request(plane):
    cp, _ = plane
    port = port_of(cp)
    silent = socket.create_connection(("127.0.0.1", port))
    half_tunnel = socket.create_connection(("127.0.0.1", port))
    half_tunnel.sendall(b"GET /api/v1/agent/tunnel HTTP/1.1\r\nHost: x\r\n")  # and no more
    half_word = socket.create_connection(("127.0.0.1", port))
    half_word.sendall(b"GET /api/v1/ag")
    try:
        assert requests.get(cp.url + "/healthz", timeout=20).status_code == 200
        with open_tunnel(port) as ws:
            ws.send(b"through")
            assert ws.recv(timeout=20) == b"through"
    finally:
        for sock in (silent, half_tunnel, half_word):
            sock.close()


def test_a_half_sent_tunnel_head_is_cut_off_at_the_request_deadline(tmp_path):
    settings = replace(
        make_settings(tmp_path / "state"), request_timeout_seconds=1, idle_timeout_seconds=30
    )
    with front_plane(settings) as (cp, _):
        with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
            sock.sendall(b"GET /api/v1/agent/tunnel HTTP/1.1\r\nHost: x\r\n")
            assert sock.recv(1) == b""  # closed long before the 30 s idle timeout
        closed = cp.admin("GET", "/metrics").text
        assert 'modelforge_connections_closed_total{reason="request_timeout"}' in closed


def test_waitress_holds_about_one_tunnel_window_for_a_client(plane):
    cp, _ = plane
    assert cp.server.adj.outbuf_high_watermark == OUTBUF_HIGH_WATERMARK == 1 << 20


# -- a separate tunnel port (MODELFORGE_TUNNEL_LISTEN) ----------------------------------------


@pytest.fixture
def two_ports(tmp_path):
    tunnel_port = free_port()
    settings = replace(make_settings(tmp_path / "state"), tunnel_listen=("127.0.0.1", tunnel_port))
    with front_plane(settings) as (cp, echo):
        assert int(cp.server.tunnel_servers[0].effective_port) == tunnel_port
        yield cp, echo, tunnel_port


def test_on_its_own_port_the_tunnel_upgrades_and_echoes(two_ports):
    cp, echo, tunnel_port = two_ports
    with open_tunnel(tunnel_port) as ws:
        ws.send(b"own port")
        assert ws.recv(timeout=20) == b"own port"
    with pytest.raises(InvalidStatus) as refused:
        open_tunnel(tunnel_port, Authorization=REFUSED_CREDENTIAL)
    assert refused.value.response.status_code == 401


def test_the_tunnel_port_answers_everything_else_404_in_the_one_shape(two_ports):
    cp, _, tunnel_port = two_ports
    url = f"http://127.0.0.1:{tunnel_port}"
    for method, path in (("GET", "/healthz"), ("POST", "/api/v1/agent/heartbeat")):
        response = requests.request(method, url + path, json={}, timeout=20)
        assert response.status_code == 404
        body = response.json()
        assert body["error"]["code"] == NOT_FOUND
        assert set(body["error"]) == {"code", "message", "next_step"}
        assert ("compatibility" in body) == path.startswith("/api/v1/agent/")
        assert response.headers["X-Frame-Options"] == "DENY"
    response = requests.get(url + PATH_AGENT_TUNNEL, timeout=20)
    assert response.status_code == 426


def test_with_a_tunnel_port_the_one_port_serves_the_api_alone(two_ports):
    cp, echo, _ = two_ports
    assert requests.get(cp.url + "/healthz", timeout=20).status_code == 200
    with pytest.raises(InvalidStatus) as refused:
        open_tunnel(port_of(cp))
    assert refused.value.response.status_code == 404  # waitress's, the route does not exist
    assert echo.headers == []


def test_the_tunnel_listen_setting_is_host_and_port_and_not_the_one_port(tmp_path):
    env = {"MODELFORGE_STATE_DIR": str(tmp_path)}
    assert load_settings(env).tunnel_listen is None
    assert load_settings({**env, "MODELFORGE_TUNNEL_LISTEN": "0.0.0.0:8443"}).tunnel_listen == (
        "0.0.0.0",
        8443,
    )
    with pytest.raises(ConfigError, match="MODELFORGE_TUNNEL_LISTEN"):
        load_settings({**env, "MODELFORGE_TUNNEL_LISTEN": "8443"})
    with pytest.raises(ConfigError, match="MODELFORGE_LISTEN itself"):
        load_settings(
            {
                **env,
                "MODELFORGE_LISTEN": "127.0.0.1:9000",
                "MODELFORGE_TUNNEL_LISTEN": "127.0.0.1:9000",
            }
        )


def test_a_tunnel_port_already_taken_stops_startup_naming_the_setting(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        settings = replace(
            make_settings(tmp_path / "state"), tunnel_listen=("127.0.0.1", taken.getsockname()[1])
        )
        with (
            pytest.raises(ConfigError, match="MODELFORGE_TUNNEL_LISTEN=127.0.0.1:"),
            serve(settings),
        ):
            pass


def test_no_handler_registered_leaves_the_tunnel_path_to_waitress(sqlite_control_plane):
    cp = sqlite_control_plane
    cp.server.tunnel_front.register(None)
    assert not cp.server.tunnel_front.taking
    with pytest.raises(InvalidStatus) as refused:
        open_tunnel(port_of(cp))
    assert refused.value.response.status_code == 404


def test_serve_takes_the_tunnel_port_from_the_environment(tmp_path):
    """`modelforge serve` with MODELFORGE_TUNNEL_LISTEN: the port answers, and a taken one
    stops startup with exit 2 naming the setting."""
    tunnel_port = free_port()
    env = clean_env(
        MODELFORGE_STATE_DIR=str(tmp_path / "state"),
        MODELFORGE_TUNNEL_LISTEN=f"127.0.0.1:{tunnel_port}",
    )
    log_path = tmp_path / "serve.log"
    with serving(env, log_path):
        response = requests.get(f"http://127.0.0.1:{tunnel_port}/healthz", timeout=20)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == NOT_FOUND
    assert f"agent tunnels on 127.0.0.1:{tunnel_port}" in log_path.read_text()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port = taken.getsockname()[1]
        result = run_cli(
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            env={**env, "MODELFORGE_TUNNEL_LISTEN": f"127.0.0.1:{taken_port}"},
        )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"MODELFORGE_TUNNEL_LISTEN=127.0.0.1:{taken_port}" in result.stderr
