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
