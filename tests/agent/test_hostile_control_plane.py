"""The agent against a hostile or broken control plane: a real HTTP server on loopback that
answers with endless bodies, trickled bytes, absurd intervals, 100k-deep JSON and forged log
lines. The agent stays bounded (memory, time per call), logs one clear line per failure, and
still stops within a second of SIGTERM."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from modelforge_contract import EXIT_AGENT_FAILED, EXIT_ENROLLMENT_REFUSED, EXIT_OK
from modelforge_node_agent.client import ControlPlaneClient, Refused, TransportFailure
from modelforge_node_agent.identity import new_identity
from modelforge_node_agent.nvidia import PreflightResult
from modelforge_node_agent.publisher import Publisher
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.transport import CALL_DEADLINE_SECONDS, make_session
from tests.harness.agent_process import AgentProcess, agent_env, wait_until
from tests.harness.work_node import fast_agent_settings
from tests.harness.worker_process import WorkerProcess, worker_env

CREDENTIAL = f"mfc_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"
TOKEN = f"mfe_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"
NODE_ID = "5f0c1c9e-0000-4000-8000-000000000001"
ENROLLED = {
    "node_id": NODE_ID,
    "credential": CREDENTIAL,
    "reenrolled": False,
    "heartbeat_interval_seconds": 1,
    "compatibility": "COMPATIBLE",
}
HEARTBEAT_OK = {
    "server_time": "now",
    "heartbeat_interval_seconds": 1,
    "compatibility": "COMPATIBLE",
}
MiB = 1024 * 1024

# What the hostile server does with a request: write to the socket until the client leaves.
Behaviour = Callable[[socket.socket], None]

# "Stops at once" means it does not wait out the call in flight (CALL_DEADLINE_SECONDS) or a
# retry backoff; a third of the deadline tells the two apart with room for a loaded machine
# (on 2 busy cores the exit took over 1 s).
PROMPTLY = CALL_DEADLINE_SECONDS / 3


def answer(status: int, body: object, raw: bytes | None = None) -> Behaviour:
    data = raw if raw is not None else json.dumps(body).encode()

    def send(sock: socket.socket) -> None:
        sock.sendall(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    return send


def endless(declared_length: bool) -> Behaviour:
    """A 200 whose body never ends: 10 GiB declared, or no length and no end at all."""

    def send(sock: socket.socket) -> None:
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        head += (
            "Content-Length: 10737418240\r\n\r\n"
            if declared_length
            else "Connection: close\r\n\r\n"
        )
        sock.sendall(head.encode())
        block = b'{"node_id": "' + b"x" * MiB
        while True:
            sock.sendall(block)

    return send


def trickle(interval: float = 0.2) -> Behaviour:
    """One byte of a valid answer at a time: every recv() succeeds, the call never ends."""

    def send(sock: socket.socket) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 10**6:
            sock.sendall(bytes([byte]))
            time.sleep(interval)

    return send


class HostileServer(socketserver.ThreadingTCPServer):
    """Reads each request whole, then lets the scripted behaviour for its path loose."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, script: dict[str, list[Behaviour]]) -> None:
        self.script = script
        self.calls: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def behaviour(self, path: str) -> Behaviour:
        with self.lock:
            self.calls.append(path)
            steps = self.script.get(path) or [answer(404, {"error": {"code": "NOT_FOUND"}})]
            return steps.pop(0) if len(steps) > 1 else steps[0]

    def count(self, path: str) -> int:
        with self.lock:
            return self.calls.count(path)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock, buffer = self.request, b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                buffer = buffer[length:]
                self.server.behaviour(path)(sock)
        except OSError:
            return  # the agent gave up on us, as it should


@pytest.fixture
def hostile():
    servers: list[HostileServer] = []

    def start(script: dict[str, list[Behaviour]]) -> HostileServer:
        server = HostileServer(script)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def cpu_agent(server: HostileServer, tmp_path: Path, **extra: str) -> dict[str, str]:
    return agent_env(
        control_plane_url=server.url,
        enrollment_token=TOKEN,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
        **extra,
    )


# -- in process: one call against each kind of hostile answer -------------------------------


def client_for(server: HostileServer, deadline: float = 1.5) -> ControlPlaneClient:
    settings = load_settings({"MODELFORGE_AGENT_CONTROL_PLANE_URL": server.url})
    return ControlPlaneClient(server.url, make_session(settings), deadline_seconds=deadline)


@pytest.mark.parametrize(
    ("behaviour", "failure"),
    [
        (endless(declared_length=True), "AnswerTooLarge"),
        (endless(declared_length=False), "AnswerTooLarge"),
        (trickle(), "DeadlineExceeded"),
        (answer(200, None, raw=b"[" * 100_000 + b"]" * 100_000), "BadResponse"),
        (answer(200, None, raw=b'{"heartbeat_interval_seconds": NaN}'), "BadResponse"),
        (answer(200, None, raw=b"\xff\xfe not json"), "BadResponse"),
        (answer(200, [1, 2, 3]), "BadResponse"),
    ],
    ids=[
        "10GiB-declared",
        "no-length-endless",
        "trickled",
        "100k-deep",
        "NaN",
        "not-utf8",
        "array",
    ],
)
def test_each_call_is_bounded_in_time_and_size(hostile, behaviour, failure):
    server = hostile({"/api/v1/agent/heartbeat": [behaviour]})
    client = client_for(server)
    started = time.monotonic()
    with pytest.raises(TransportFailure) as failed:
        client.call("POST", "/api/v1/agent/heartbeat", {"node_id": NODE_ID})
    assert failed.value.name == failure
    assert failed.value.describe() == f"{failure} on POST /api/v1/agent/heartbeat"
    # A trickled answer would hold the call for ever (each recv() is within its timeout):
    # the deadline ends it. Generous slack for a busy machine; without it, it never ends.
    assert time.monotonic() - started < 1.5 + 10


def test_deadlines_of_overlapping_calls_each_end_their_own_call_and_no_thread_stays(hostile):
    """One watchdog thread keeps every call's deadline: a trickled call with a short deadline
    ends at it while a quick call beside it is untouched, and once no call is in flight the
    thread ends."""
    server = hostile(
        {
            "/api/v1/agent/heartbeat": [trickle()],
            "/api/v1/agent/inventory": [answer(200, {"ok": True})] * 20,
        }
    )
    slow, quick = client_for(server, deadline=1.0), client_for(server, deadline=600)
    failures: list[TransportFailure] = []

    def trickled() -> None:
        try:
            slow.call("POST", "/api/v1/agent/heartbeat", {"node_id": NODE_ID})
        except TransportFailure as failure:
            failures.append(failure)

    caller = threading.Thread(target=trickled)
    caller.start()
    for _ in range(20):  # calls whose later deadlines sit in the heap beside the short one
        assert quick.call("POST", "/api/v1/agent/inventory", {}) == {"ok": True}
    caller.join(timeout=60)
    assert not caller.is_alive()
    assert [failure.name for failure in failures] == ["DeadlineExceeded"]
    deadline = time.monotonic() + 60
    while any(thread.name == "call-deadlines" for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the deadline thread outlived every call"
        time.sleep(0.1)


def test_a_deeply_nested_refusal_is_still_a_refusal(hostile):
    deep = b'{"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    server = hostile({"/api/v1/agent/heartbeat": [answer(503, None, raw=deep)]})
    with pytest.raises(Refused) as refused:
        client_for(server).call("POST", "/api/v1/agent/heartbeat", {})
    assert (refused.value.status, refused.value.code) == (503, None)


def test_a_publisher_loop_that_fails_stops_the_agent_with_a_non_zero_status(tmp_path, caplog):
    """No thread may die while the process stays up looking healthy."""
    settings = load_settings(
        {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:9",
            "MODELFORGE_AGENT_STATE_VOLUME": str(tmp_path),
        }
    )
    state = new_identity().with_enrollment(NODE_ID, CREDENTIAL)
    preflight = PreflightResult(mode="cpu", nvml=None, accelerators=[], samples=[])

    class Broken(Publisher):
        def inventory_loop(self) -> None:
            raise KeyError("a bug")

    stop = threading.Event()
    client = ControlPlaneClient(settings.control_plane_url, make_session(settings), CREDENTIAL)
    publisher = Broken(settings, state, client, preflight, stop, heartbeat_interval=3600)
    outcome = publisher.run(poll=0.05)
    assert outcome is not None and outcome.exit_code == EXIT_AGENT_FAILED
    assert "inventory_loop failed unexpectedly (KeyError)" in outcome.message
    assert any(
        "inventory_loop stopped by an unexpected KeyError" in r.getMessage() for r in caplog.records
    )


def test_publisher_ignores_intervals_no_agent_can_keep():
    settings = load_settings({"MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:9"})
    state = new_identity().with_enrollment(NODE_ID, CREDENTIAL)
    preflight = PreflightResult(mode="cpu", nvml=None, accelerators=[], samples=[])
    client = ControlPlaneClient(settings.control_plane_url, requests.Session())
    for bad in (-5, 0, 0.001, float("nan"), float("inf"), 10**9, True, "2", None):
        publisher = Publisher(
            settings, state, client, preflight, threading.Event(), heartbeat_interval=bad
        )
        assert publisher.heartbeat_interval == 10, bad
        publisher._take_interval(bad)
        assert publisher.heartbeat_interval == 10, bad
    publisher._take_interval(2.5)
    assert publisher.heartbeat_interval == 2.5


# -- the agent process ----------------------------------------------------------------------------


@pytest.mark.parametrize("declared_length", [True, False], ids=["10GiB-declared", "no-length"])
def test_endless_answers_keep_the_agent_small_and_it_stops_on_sigterm(
    hostile, tmp_path, declared_length
):
    server = hostile({"/api/v1/agent/enroll": [endless(declared_length)]})
    with AgentProcess(cpu_agent(server, tmp_path), tmp_path / "agent.log") as agent:
        agent.wait_for_log(r"AnswerTooLarge on POST /api/v1/agent/enroll", count=2, timeout=30)
        peak = peak_rss_mib(agent.process.pid)
        status, took = agent.terminate()
        log = agent.log()
    assert peak < 100, f"{peak:.0f} MiB"
    assert status == EXIT_OK and took < PROMPTLY, log
    lines = [line for line in log.splitlines() if "AnswerTooLarge" in line]
    assert lines[0].endswith(
        "AnswerTooLarge on POST /api/v1/agent/enroll (backoff 1s…16s): retry in 1s"
    )


def test_a_trickling_control_plane_cannot_hold_the_agent(hostile, tmp_path):
    server = hostile({"/api/v1/agent/enroll": [trickle(0.5)]})
    with AgentProcess(cpu_agent(server, tmp_path), tmp_path / "agent.log") as agent:
        # SIGTERM in the middle of a trickled call: the agent goes at once.
        time.sleep(1.5)
        assert server.count("/api/v1/agent/enroll") == 1
        status, took = agent.terminate()
        log = agent.log()
    assert status == EXIT_OK and took < PROMPTLY, log


def test_absurd_intervals_and_deep_json_neither_flood_nor_stop_the_heartbeat(hostile, tmp_path):
    heartbeat = "/api/v1/agent/heartbeat"
    server = hostile(
        {
            "/api/v1/agent/enroll": [answer(201, {**ENROLLED, "heartbeat_interval_seconds": -5})],
            heartbeat: [
                answer(200, {**HEARTBEAT_OK, "heartbeat_interval_seconds": 1}),
                answer(200, {**HEARTBEAT_OK, "heartbeat_interval_seconds": -1}),
                answer(200, {**HEARTBEAT_OK, "heartbeat_interval_seconds": 1e-9}),
                answer(200, None, raw=b'{"heartbeat_interval_seconds": 1e400}'),
                answer(200, {**HEARTBEAT_OK, "heartbeat_interval_seconds": "0\nFORGED ERROR line"}),
                answer(200, None, raw=b'{"heartbeat_interval_seconds": NaN}'),
                answer(200, None, raw=b"[" * 100_000 + b"]" * 100_000),
                answer(200, {**HEARTBEAT_OK, "heartbeat_interval_seconds": True}),
                answer(200, HEARTBEAT_OK),
            ],
            "/api/v1/agent/inventory": [answer(200, {"compatibility": "COMPATIBLE"})],
        }
    )
    with AgentProcess(cpu_agent(server, tmp_path), tmp_path / "agent.log") as agent:
        # The enrollment's -5 was ignored (10 s); the first heartbeat answer sets 1 s.
        agent.wait_for_log(r"heartbeating every 1s", count=4, timeout=60)
        began, beats_then = time.monotonic(), server.count(heartbeat)
        wait_until(lambda: server.count(heartbeat) >= beats_then + 3, what="more heartbeats")
        elapsed, beats = time.monotonic() - began, server.count(heartbeat) - beats_then
        assert agent.process.poll() is None, agent.log()  # still up, still heartbeating
        status, took = agent.terminate()
        log = agent.log()
    assert beats <= 2 + 2 * elapsed, (beats, elapsed)  # about one a second, not a flood
    assert status == EXIT_OK and took < PROMPTLY
    assert "ignoring heartbeat_interval_seconds=0?FORGED ERROR line from the control plane" in log
    assert not any(line.startswith("FORGED") for line in log.splitlines())
    # The NaN answer and the 100k-deep one: one line each, then the next try.
    assert log.count("BadResponse on POST /api/v1/agent/heartbeat") == 2
    assert "RecursionError" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    "node_id",
    [
        "abc\n2026-01-01 00:00:00,000 ERROR forged line",
        "\x1b[2J\x1b[31mred",
        "n" * 65,
        "../../etc",
        "",
        42,
    ],
    ids=["newline", "ansi", "long", "path", "empty", "number"],
)
def test_a_node_id_fit_for_no_log_line_refuses_the_enrollment(hostile, tmp_path, node_id):
    server = hostile({"/api/v1/agent/enroll": [answer(201, {**ENROLLED, "node_id": node_id})]})
    with AgentProcess(cpu_agent(server, tmp_path), tmp_path / "agent.log") as agent:
        status = agent.wait(timeout=30)
        log = agent.log()
    assert status == EXIT_ENROLLMENT_REFUSED, log
    assert "the enrollment answer carried no usable node id" in log
    assert "forged" not in log and "\x1b" not in log and "../" not in log
    assert json.loads((tmp_path / "state" / "identity.json").read_text())["node_id"] is None


def test_the_enrollment_token_is_gone_from_the_agents_own_environment(hostile, tmp_path):
    """What the agent starts inherits no token; /proc/<pid>/environ keeps the kernel's copy."""
    code = (
        "import os, sys\n"
        "from modelforge_node_agent.settings import load_settings\n"
        "settings = load_settings()\n"
        "assert settings.enrollment_token, 'the settings keep it for the enrollment'\n"
        "print('MODELFORGE_AGENT_ENROLLMENT_TOKEN' in os.environ)\n"
    )
    env = agent_env(control_plane_url="http://127.0.0.1:9", enrollment_token=TOKEN)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "False"


# -- leases from a hostile control plane (issue 21) -----------------------------------------------

CLAIM = "/api/v1/agent/work/claim"
GOOD_WORK_ID = "7a1d2c3b-0000-4000-8000-0000000000aa"
GOOD_LEASE = {
    "work_id": GOOD_WORK_ID,
    "lease_id": "0f" * 16,
    "expires_at": "2026-01-01T00:00:00Z",
    "lease_seconds": 60,
    "attempt": 1,
    "capability": "smoke",
    "input": {"matrix_size": 8},
    "timeout_seconds": 60,
}
FORGED_WORK_ID = "\x1b[31mred\n2026-01-01 00:00:00,000 ERROR FORGED line"
MALFORMED_LEASES = [
    {k: v for k, v in GOOD_LEASE.items() if k != "work_id"},
    {**GOOD_LEASE, "timeout_seconds": "30"},
    {**GOOD_LEASE, "lease_seconds": "abc"},
    {**GOOD_LEASE, "work_id": FORGED_WORK_ID},
    {**GOOD_LEASE, "work_id": 42, "lease_id": None},
    {**GOOD_LEASE, "capability": "rm -rf /\x1b[2J"},
    {**GOOD_LEASE, "input": "not an object"},
    {**GOOD_LEASE, "timeout_seconds": True, "attempt": "one"},
]


def no_content(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 204 No Content\r\nX-ModelForge-Claim-Reason: no_fitting_item\r\n\r\n")


def test_malformed_leases_are_refused_and_the_slot_claims_the_good_one_after(hostile, tmp_path):
    """Before: the first lease without a work_id killed the work slot with a KeyError; the node
    stayed online and never claimed again. Now each is refused with one escaped warning."""
    complete = f"/api/v1/agent/work/{GOOD_WORK_ID}/complete"
    leases = [
        answer(200, {"lease": lease, "compatibility": "COMPATIBLE"}) for lease in MALFORMED_LEASES
    ]
    infinite = json.dumps({**GOOD_LEASE, "timeout_seconds": 0}).replace(
        '"timeout_seconds": 0', '"timeout_seconds": 1e400'
    )
    leases.append(answer(200, None, raw=b'{"lease": ' + infinite.encode() + b"}"))
    server = hostile(
        {
            "/api/v1/agent/enroll": [answer(201, ENROLLED)],
            "/api/v1/agent/heartbeat": [answer(200, HEARTBEAT_OK)],
            "/api/v1/agent/inventory": [answer(200, {"compatibility": "COMPATIBLE"})],
            CLAIM: [
                *leases,
                answer(200, {"lease": GOOD_LEASE, "compatibility": "COMPATIBLE"}),
                no_content,
            ],
            f"/api/v1/agent/work/{GOOD_WORK_ID}/renew": [
                answer(200, {"compatibility": "COMPATIBLE"})
            ],
            complete: [answer(200, {"state": "succeeded", "compatibility": "COMPATIBLE"})],
        }
    )
    sockets = Path(tempfile.mkdtemp(prefix="mfh-", dir="/tmp"))
    try:
        socket_path = sockets / "w.sock"
        with (
            WorkerProcess(worker_env(socket_path), tmp_path / "worker.log"),
            AgentProcess(
                cpu_agent(server, tmp_path, **fast_agent_settings(socket_path)),
                tmp_path / "agent.log",
            ) as agent,
        ):
            # A deadline only bounds the failure: the slot refuses each and goes on claiming.
            wait_until(lambda: server.count(complete) == 1, timeout=90, what="the good lease run")
            agent.wait_for_log(rf"work {GOOD_WORK_ID} succeeded")
            assert agent.process.poll() is None
            status, _ = agent.terminate()
            log = agent.log()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    assert status == EXIT_OK, log
    refused = [line for line in log.splitlines() if "refusing a malformed lease" in line]
    assert len(refused) == len(leases), log
    assert all(" WARNING " in line for line in refused)
    assert f"work {GOOD_WORK_ID} leased: smoke, attempt 1, timeout 60s" in log
    # Every server-provided identifier is escaped: no raw escape, no forged line.
    assert "\x1b" not in log
    assert not any("FORGED" in line and "refusing" not in line for line in log.splitlines())
    assert "(work ?[31mred?2026-01-01 00:00:00,000 ERROR FORGED line" in log
    assert "capability rm -rf /?[2J)" in log
    assert "timeout_seconds is not a number of seconds" in log and "lease_seconds is not" in log
    assert "Traceback" not in log and "uncaught" not in log and "stopped by" not in log
    # The malformed ones were never run: the worker ran the good one only.
    assert server.count(CLAIM) >= len(leases) + 1
