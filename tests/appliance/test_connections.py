"""A hostile network against the real waitress server: idle and trickling sockets, bodies and
headers over the limits, requests waitress refuses itself. Each answer keeps the one error
shape, and no slow client costs another its answer."""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import os
import socket
import sys
import tempfile
import termios
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from modelforge_appliance.web.http import SECURITY_HEADERS
from modelforge_contract.logs import configure_logging
from tests.harness.control_plane import make_settings, serve

from .test_agent_auth import enroll_node

AGENT_PATH = "/api/v1/agent/heartbeat"


def port_of(cp) -> int:
    return int(cp.url.rsplit(":", 1)[1])


def exchange(port: int, data: bytes, timeout: float = 20) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_json_refusal(raw: bytes, status: int, code: str) -> dict:
    answered, headers, body = parse(raw)
    assert answered == status, raw[:300]
    assert headers["Content-Type"] == "application/json"
    assert set(body["error"]) == {"code", "message", "next_step"}
    assert body["error"]["code"] == code
    return body


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed this connection (EOF or reset)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- limits, slow clients ------------------------------------------------------------------


def test_hundreds_of_idle_and_trickling_sockets_cost_nobody_an_answer(tmp_path):
    """Once ~98 such sockets stopped /healthz, every heartbeat and the admin API."""
    with serve(make_settings(tmp_path / "state")) as cp:
        node = enroll_node(cp)
        port = port_of(cp)
        hostile: list[socket.socket] = []
        try:
            for i in range(300):
                sock = socket.create_connection(("127.0.0.1", port))
                if i % 2:  # half trickle a request line and stop; half say nothing
                    sock.sendall(b"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: x\r\nX-A")
                hostile.append(sock)
            assert requests.get(cp.url + "/healthz", timeout=10).status_code == 200
            assert cp.heartbeat(node["credential"], node["node_id"]).status_code == 200
            assert cp.admin("GET", "/api/v1/admin/hardware/nodes").status_code == 200
            metrics = cp.admin("GET", "/metrics").text
            open_now = next(
                line
                for line in metrics.splitlines()
                if line.startswith("modelforge_connections_open")
            )
            assert float(open_now.split()[-1]) >= 300
        finally:
            for sock in hostile:
                sock.close()


@pytest.fixture
def quick_deadline(tmp_path):
    """A control plane that gives a request one second; idle connections keep 30."""
    settings = replace(
        make_settings(tmp_path / "state"), request_timeout_seconds=1, idle_timeout_seconds=30
    )
    with serve(settings) as cp:
        yield cp


def test_a_client_trickling_its_headers_is_cut_off_at_the_request_deadline(quick_deadline):
    cp = quick_deadline
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port_of(cp))) as sock:
        sock.sendall(b"POST /api/v1/agent/heartbeat HTTP/1.1\r\nHost: x\r\n")
        sock.setblocking(False)
        cut = False
        for _ in range(600):  # one header byte every 50 ms: never idle, never finished
            if closed_by_server(sock):
                cut = True
                break
            with contextlib.suppress(OSError):
                sock.send(b"X")
            time.sleep(0.05)
    assert cut, "the server kept a trickling client for 30 s"
    assert time.monotonic() - started >= 1  # not before its deadline
    closed = cp.admin("GET", "/metrics").text
    assert 'modelforge_connections_closed_total{reason="request_timeout"}' in closed


def test_a_socket_that_never_speaks_is_closed_at_the_request_deadline(quick_deadline):
    with socket.create_connection(("127.0.0.1", port_of(quick_deadline)), timeout=30) as sock:
        assert sock.recv(1) == b""  # closed by the server, long before the 30 s idle timeout


def test_a_body_that_never_ends_is_cut_off_at_the_request_deadline(quick_deadline):
    head = (
        f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n{"
    )
    with socket.create_connection(("127.0.0.1", port_of(quick_deadline)), timeout=30) as sock:
        sock.sendall(head.encode())
        assert sock.recv(1) == b""


def test_an_idle_keep_alive_connection_outlives_the_request_deadline(quick_deadline):
    cp = quick_deadline
    connection = http.client.HTTPConnection("127.0.0.1", port_of(cp), timeout=10)
    connection.request("GET", "/healthz")
    first = connection.getresponse()
    first.read()
    time.sleep(2.5)  # past the 1 s request deadline, far from the 30 s idle timeout
    connection.request("GET", "/healthz")
    assert connection.getresponse().status == 200  # the same connection still serves
    connection.close()


# -- bodies and headers waitress refuses itself ----------------------------------------------


def test_waitress_refusals_come_back_in_the_json_shape(sqlite_control_plane):
    port = port_of(sqlite_control_plane)
    malformed = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n")
    assert_json_refusal(malformed, 400, "REQUEST_MALFORMED")
    bad_chunk = exchange(
        port,
        f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".encode(),
    )
    assert_json_refusal(bad_chunk, 400, "REQUEST_MALFORMED")
    coding = exchange(
        port,
        f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nX-ModelForge-Agent-Protocol: 1\r\n"
        "Transfer-Encoding: gzip\r\n\r\n".encode(),
    )
    body = assert_json_refusal(coding, 501, "TRANSFER_ENCODING_UNSUPPORTED")
    assert body["compatibility"] == "COMPATIBLE"  # an agent route: compatibility, as always
    # Exactly 32 KiB of request line and headers, never finished: all of it is read.
    huge = (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40000)[: 32 * 1024]
    assert_json_refusal(exchange(port, huge), 431, "HEADERS_TOO_LARGE")
    # waitress's own answers carry the security headers every other answer carries.
    _, headers, _ = parse(malformed)
    for name, value in SECURITY_HEADERS.items():
        assert headers[name] == value, name


def test_an_oversized_body_is_refused_before_it_is_sent(sqlite_control_plane):
    cp = sqlite_control_plane
    limit = cp.settings.max_body_bytes
    head = (
        f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nX-ModelForge-Agent-Protocol: 1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
    )
    # Only the headers are sent: the answer cannot depend on reading the body.
    body = assert_json_refusal(exchange(port_of(cp), head.encode()), 413, "BODY_TOO_LARGE")
    assert body["compatibility"] == "COMPATIBLE"


# -- bounds one client cannot push past ------------------------------------------------------


def connect_from(source: str, port: int) -> socket.socket:
    """A connection from another loopback address (all of 127/8 is this host's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (by its Content-Length), whether or not the server then closes."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed before answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":", 1)[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed in the middle of its answer"
        body += chunk
    return head + b"\r\n\r\n" + body


def healthz_from(source: str, port: int) -> int:
    with connect_from(source, port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return parse(read_answer(sock))[0]


def test_one_address_holds_at_most_its_share_of_connections(tmp_path):
    """10,050 idle keep-alive sockets from one address stopped /healthz for everyone."""
    settings = replace(
        make_settings(tmp_path / "state"), connection_limit=40, connections_per_address=10
    )
    with serve(settings) as cp:
        port = port_of(cp)
        held = [connect_from("127.0.0.1", port) for _ in range(10)]
        try:
            over = connect_from("127.0.0.1", port)
            raw = read_answer(over)
            over.close()
            status, headers, body = parse(raw)
            assert status == 503 and body["error"]["code"] == "TOO_MANY_CONNECTIONS"
            assert headers["Retry-After"] == "5"
            assert headers["X-Content-Type-Options"] == "nosniff"
            assert healthz_from("127.0.0.2", port) == 200  # another address is served
        finally:
            for sock in held:
                sock.close()
        metrics = cp.admin("GET", "/metrics").text
        assert 'modelforge_connections_closed_total{reason="per_address"} 1.0' in metrics


def test_at_the_connection_limit_the_oldest_idle_connections_make_room(tmp_path):
    settings = replace(
        make_settings(tmp_path / "state"), connection_limit=20, connections_per_address=1000
    )
    with serve(settings) as cp:
        port = port_of(cp)
        oldest = connect_from("127.0.0.3", port)
        time.sleep(0.05)  # last activity orders the eviction; the test only needs an order
        others = [connect_from("127.0.0.3", port) for _ in range(19)]
        try:
            # The limit is reached and every connection is idle: a new client still gets in.
            assert healthz_from("127.0.0.4", port) == 200
            oldest.settimeout(20)
            assert oldest.recv(1) == b""  # closed by the server, the oldest first
        finally:
            for sock in [oldest, *others]:
                sock.close()
        assert "evicted" in cp.admin("GET", "/metrics").text


def test_unfinished_bodies_across_connections_stay_within_the_buffered_bound(tmp_path):
    """Each connection could hold about 1 MiB of unfinished body for 30 s: 1,000 of them took
    the server from 262 to 1,272 MiB."""
    settings = replace(
        make_settings(tmp_path / "state"),
        max_body_bytes=256 * 1024,
        max_buffered_bytes=512 * 1024,
    )
    with serve(settings) as cp:
        port = port_of(cp)
        head = (
            f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nX-ModelForge-Agent-Protocol: 1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {256 * 1024}\r\n\r\n"
        ).encode()
        senders = []
        try:
            for _ in range(2):  # two half-sent bodies of 200 KiB: within the bound
                sock = connect_from("127.0.0.5", port)
                sock.sendall(head + b"x" * (200 * 1024))
                senders.append(sock)

            # The bound is on what the server holds: wait until it holds both bodies.
            def held() -> float:
                metrics = cp.admin("GET", "/metrics").text
                return float(
                    next(
                        line.split()[-1]
                        for line in metrics.splitlines()
                        if line.startswith("modelforge_buffered_request_bytes ")
                    )
                )

            deadline = time.monotonic() + 60
            while held() < 400 * 1024:
                assert time.monotonic() < deadline, "the server never read the two bodies"
                time.sleep(0.05)
            refused = connect_from("127.0.0.5", port)
            refused.sendall(head)
            with contextlib.suppress(OSError):  # the server may close while we still send
                refused.sendall(b"x" * (200 * 1024))
            status, headers, body = parse(read_answer(refused))
            refused.close()
            assert status == 503 and body["error"]["code"] == "SERVER_BUSY"
            assert headers["Retry-After"] == "5"
            # A small request is never refused for the bound: heartbeats keep flowing.
            assert healthz_from("127.0.0.6", port) == 200
        finally:
            for sock in senders:
                sock.close()
        assert 'reason="buffer_full"' in cp.admin("GET", "/metrics").text


def test_metrics_accept_the_bearer_scheme_in_any_case(sqlite_control_plane):
    cp = sqlite_control_plane
    for scheme in ("Bearer", "bearer", "BEARER"):
        answer = requests.get(
            cp.url + "/metrics", headers={"Authorization": f"{scheme} {cp.admin_token}"}, timeout=10
        )
        assert answer.status_code == 200, scheme
    assert (
        requests.get(
            cp.url + "/metrics", headers={"Authorization": "Basic x"}, timeout=10
        ).status_code
        == 401
    )


def spooled_files(directory: Path) -> list[str]:
    """This process's open files inside directory (temporary files show as deleted ones)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)):
                found.append(target)
    return found


def unread_by_server(cp, sock: socket.socket) -> int:
    """Bytes this client sent that the server has not read yet (still in either socket)."""
    unsent = fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0\0\0\0")
    port = sock.getsockname()[1]
    channels = [c for c in list(cp.server.active_channels.values()) if c.addr[1] == port]
    if not channels:
        return -1  # not even accepted yet
    unread = fcntl.ioctl(channels[0].socket, termios.FIONREAD, b"\0\0\0\0")
    return int.from_bytes(unsent, "little") + int.from_bytes(unread, "little")


def test_no_body_is_spooled_to_a_temporary_file(tmp_path, monkeypatch):
    """waitress used to spool up to 16 MiB per unauthenticated connection to disk."""
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where waitress would spool
    settings = make_settings(tmp_path / "state")
    limit = settings.max_body_bytes
    chunk = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)
    with serve(settings) as cp:
        with socket.create_connection(("127.0.0.1", port_of(cp)), timeout=30) as sock:
            sock.sendall(
                f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            sent = 0
            while sent + len(chunk) <= limit:  # just under the limit, twice waitress's spool size
                sock.sendall(chunk)
                sent += len(chunk)
            for _ in range(600):  # until the server has read every byte of it
                if unread_by_server(cp, sock) == 0:
                    break
                time.sleep(0.05)
            assert unread_by_server(cp, sock) == 0
            assert spooled_files(spool) == []  # held in memory, within the limit
            sock.sendall(chunk)  # now over it
            raw = b""
            while received := sock.recv(65536):
                raw += received
        assert_json_refusal(raw, 413, "BODY_TOO_LARGE")
        assert spooled_files(spool) == []
        assert os.listdir(spool) == []


# -- headers that are not UTF-8 -----------------------------------------------------------------


NOT_UTF8 = b"\xff\xfe\x80mfa_"


def raw_request(port: int, method: str, path: str, headers: dict[str, bytes]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name.encode() + b": " + value for name, value in headers.items()]
    if method in ("POST", "PUT"):
        lines += [b"Content-Type: application/json", b"Content-Length: 2"]
        return exchange(port, b"\r\n".join(lines) + b"\r\n\r\n{}")
    return exchange(port, b"\r\n".join(lines) + b"\r\n\r\n")


def test_headers_that_are_not_utf8_are_wrong_values_on_every_route_family(sqlite_control_plane):
    cp = sqlite_control_plane
    port = port_of(cp)
    node = enroll_node(cp)
    admin = {"X-ModelForge-Admin-Token": NOT_UTF8}
    cases = [
        ("GET", "/api/v1/admin/hardware/nodes", admin, 401, "ADMIN_TOKEN_INVALID"),
        ("POST", "/api/v1/admin/node-enrollments", admin, 401, "ADMIN_TOKEN_INVALID"),
        ("GET", "/api/v1/admin/audit-events", admin, 401, "ADMIN_TOKEN_INVALID"),
        ("GET", "/metrics", {"Authorization": b"Bearer " + NOT_UTF8}, 401, "ADMIN_TOKEN_INVALID"),
        ("GET", "/metrics", admin, 401, "ADMIN_TOKEN_INVALID"),
        (
            "POST",
            AGENT_PATH,
            {"X-ModelForge-Agent-Protocol": b"1", "Authorization": b"Bearer " + NOT_UTF8},
            401,  # the credential is checked before the body is read (web/auth.py)
            "CREDENTIAL_INVALID",
        ),
        (
            "POST",
            "/api/v1/agent/enroll",
            {"X-ModelForge-Agent-Protocol": b"\xb9"},  # '¹' in Latin-1, a digit to isdigit()
            426,
            "PROTOCOL_INCOMPATIBLE",
        ),
        (
            "PUT",
            "/api/v1/agent/inventory",
            {"X-ModelForge-Agent-Protocol": b"1\xff"},
            426,
            "PROTOCOL_INCOMPATIBLE",
        ),
    ]
    for method, path, headers, status, code in cases:
        body = assert_json_refusal(raw_request(port, method, path, headers), status, code)
        if path.startswith("/api/v1/agent/"):
            assert "compatibility" in body, path
        if code == "PROTOCOL_INCOMPATIBLE":
            assert body["compatibility"] == "UNKNOWN"
    heartbeat = json.dumps(
        {
            "node_id": node["node_id"],
            "agent_version": "1",
            "health": {"status": "ok", "gpu_probe": "ok"},
        }
    ).encode()
    raw = exchange(
        port,
        f"POST {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        "X-ModelForge-Agent-Protocol: 1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(heartbeat)}\r\nAuthorization: Bearer ".encode()
        + node["credential"].encode()
        + b"\xff\r\n\r\n"
        + heartbeat,
    )
    body = assert_json_refusal(raw, 401, "CREDENTIAL_INVALID")
    assert body["compatibility"] == "COMPATIBLE"
    for path in ("/healthz", "/nowhere"):
        answered, _, _ = parse(raw_request(port, "GET", path, {"X-Anything": NOT_UTF8}))
        assert answered in (200, 404)


def test_framework_refusals_on_agent_routes_carry_compatibility(sqlite_control_plane):
    cp = sqlite_control_plane
    wrong_method = cp.agent("GET", AGENT_PATH)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["compatibility"] == "COMPATIBLE"
    unknown = cp.agent(
        "GET", "/api/v1/agent/nothing-here", headers={"X-ModelForge-Agent-Protocol": "x"}
    )
    assert unknown.status_code == 404
    assert unknown.json()["compatibility"] == "UNKNOWN"


# -- tracebacks go through the mask -----------------------------------------------------------


SECRET = "mfc_0123456789abcdef_" + "S" * 43


def test_a_route_that_raises_answers_500_and_logs_its_traceback_masked(tmp_path, capfd):
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, sys.excepthook, threading.excepthook)
    configure_logging("INFO")
    try:
        with serve(make_settings(tmp_path / "state")) as cp:

            @cp.server.app.get("/test-only/raise", auth="public")
            def raise_with_a_secret():
                raise RuntimeError(f"the store said {SECRET}")

            response = requests.get(cp.url + "/test-only/raise", timeout=10)
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "INTERNAL_ERROR"
        assert SECRET not in response.text
        err = capfd.readouterr().err
        assert "RuntimeError" in err and "Traceback" in err  # logged, with its traceback...
        assert "mfc_0123…" in err
        assert SECRET not in err  # ...masked
    finally:
        root.handlers[:], level, sys.excepthook, threading.excepthook = saved
        root.setLevel(level)
