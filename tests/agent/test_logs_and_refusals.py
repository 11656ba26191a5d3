"""Invariant 10 against a hostile server: no body, credential or token ever reaches the log."""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modelforge_contract import (
    CREDENTIAL_REVOKED,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_PROTOCOL_INCOMPATIBLE,
    PROTOCOL_INCOMPATIBLE,
    TOO_NEW,
)
from tests.harness.agent_process import AgentProcess, agent_env, nvml_env, run_agent
from tests.harness.nvml import h100_80g_x8
from tests.harness.stand_in_server import answer_json

PLAIN_CANARY = "CANARY-" + secrets.token_hex(12)
SECRET_CANARY = f"mfc_feedfacefeedface_{secrets.token_urlsafe(32)}"
CREDENTIAL = f"mfc_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"
TOKEN = f"mfe_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


class ScriptedServer(ThreadingHTTPServer):
    """Answers each path from a script of (status, body) pairs; the last one repeats."""

    daemon_threads = True

    def __init__(self, script: dict[str, list[tuple[int, dict]]]) -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.script = script
        self.calls: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str) -> tuple[int, dict]:
        with self.lock:
            answers = self.script.get(path) or [(404, error_body("NOT_FOUND"))]
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.calls.append((method, path, status))
            return status, body


class ScriptedHandler(BaseHTTPRequestHandler):
    def _serve(self) -> None:
        status, body = self.server.answer(self.command, self.path)
        answer_json(self, status, json.dumps(body).encode())

    do_POST = do_PUT = _serve

    def log_message(self, *args) -> None:
        pass


def error_body(code: str, **extra) -> dict:
    """An error in the contract's shape with the canaries wherever a body can carry text."""
    return {
        "error": {
            "code": code,
            "message": f"refused {PLAIN_CANARY} {SECRET_CANARY} {CREDENTIAL} {TOKEN}",
            "next_step": f"echo {SECRET_CANARY}",
        },
        "echo": {"credential": CREDENTIAL, "token": TOKEN, "canary": PLAIN_CANARY},
        **extra,
    }


ENROLLED = {
    "node_id": "5f0c1c9e-0000-4000-8000-000000000001",
    "credential": CREDENTIAL,
    "reenrolled": False,
    "heartbeat_interval_seconds": 1,
    "compatibility": "COMPATIBLE",
}


@pytest.fixture
def hostile():
    servers = []

    def start(script):
        server = ScriptedServer(script)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def assert_clean(log: str, tmp_path) -> None:
    state = json.loads((tmp_path / "state" / "identity.json").read_text())
    for secret in (PLAIN_CANARY, "feedface", CREDENTIAL, TOKEN, state["identity_secret"]):
        assert secret not in log, f"{secret[:12]}… leaked into the log:\n{log}"
    assert "echo" not in log and "refused " + PLAIN_CANARY not in log


def test_error_bodies_credentials_and_tokens_never_reach_the_log(hostile, fake_nvml_dir, tmp_path):
    server = hostile(
        {
            "/api/v1/agent/enroll": [(503, error_body("STORE_UNAVAILABLE")), (201, ENROLLED)],
            "/api/v1/agent/inventory": [
                # An error code that is itself secret-looking text is not repeated either.
                (400, error_body(SECRET_CANARY)),
                (400, error_body(PLAIN_CANARY)),
                (200, {"server_time": "now", "compatibility": "COMPATIBLE"}),
            ],
            "/api/v1/agent/telemetry": [(502, error_body("INTERNAL_ERROR"))],
            "/api/v1/agent/heartbeat": [
                (500, error_body("INTERNAL_ERROR")),
                (401, error_body(CREDENTIAL_REVOKED)),
            ],
        }
    )
    env = agent_env(
        control_plane_url=server.url,
        enrollment_token=TOKEN,
        accelerator_mode="nvidia",
        state_volume=tmp_path / "state",
        telemetry_interval_seconds=1,
        **nvml_env(fake_nvml_dir, h100_80g_x8(), tmp_path / "nvml"),
    )
    with AgentProcess(env, tmp_path / "agent.log") as agent:
        status = agent.wait(timeout=20)
        log = agent.log()
    assert status == EXIT_CREDENTIAL_REFUSED, log
    # The failures were logged, as status, method and path ...
    assert "HTTP 503 on POST /api/v1/agent/enroll (backoff 1s…16s): retry in 1s" in log
    assert "HTTP 500 on POST /api/v1/agent/heartbeat (backoff 1s…16s): retry in 1s" in log
    assert "HTTP 400 on PUT /api/v1/agent/inventory (backoff 1s…16s): retry in 1s\n" in log
    assert "HTTP 401 on POST /api/v1/agent/heartbeat" in log
    # ... and nothing the server sent, nor any secret the agent holds.
    assert_clean(log, tmp_path)
    assert ("POST", "/api/v1/agent/heartbeat", 401) in server.calls


@pytest.mark.parametrize("path", ["/api/v1/agent/enroll", "/api/v1/agent/heartbeat"])
def test_incompatible_protocol_exits_5_naming_the_answer(hostile, tmp_path, path):
    refusal = (426, error_body(PROTOCOL_INCOMPATIBLE, compatibility=TOO_NEW))
    script = {"/api/v1/agent/enroll": [(201, ENROLLED)], path: [refusal]}
    server = hostile(script)
    env = agent_env(
        control_plane_url=server.url,
        enrollment_token=TOKEN,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
    )
    result = run_agent(env, timeout=30)
    assert result.returncode == EXIT_PROTOCOL_INCOMPATIBLE, result.stderr
    assert f"HTTP 426 on POST {path}" in result.stderr
    assert "as TOO_NEW: Upgrade the control plane" in result.stderr
    assert_clean(result.stderr, tmp_path)
