"""Invariant 3: after a full enrollment run no secret is readable anywhere it was stored.

A real ``modelforge serve`` process logs at DEBUG; afterwards its log, the raw store
(the SQLite file with its WAL, or a pg_dump) and every admin answer after the minting
ones are searched for every secret that was minted, and for a work item's env value, which
the store keeps sealed (docs/work.md, "Secrets"; tests/appliance/test_work_secrets.py).
"""

from __future__ import annotations

import json
import secrets as secrets_module
import subprocess
from pathlib import Path

import requests

from tests.harness.control_plane import (
    clean_env,
    new_identity,
    postgres_admin_url,
    run_cli,
    serving,
)

ADMIN = "X-ModelForge-Admin-Token"
AGENT = {"X-ModelForge-Agent-Protocol": "1"}


def run_scenario(url: str, admin_token: str) -> tuple[list[str], list[str]]:
    """Mint, enroll, publish, re-enroll and misbehave; return (secrets, later answers)."""
    admin = {ADMIN: admin_token}
    secrets = [admin_token]

    def mint() -> str:
        response = requests.post(
            f"{url}/api/v1/admin/node-enrollments",
            json={"display_name": "GPU Node", "expires_in_seconds": 900},
            headers=admin,
            timeout=10,
        )
        assert response.status_code == 201
        secrets.append(response.json()["token"])
        return response.json()["token"]

    def enroll(token: str, identity: dict) -> requests.Response:
        body = {
            "token": token,
            "hostname": "gpu-1",
            "agent_version": "0.1.0",
            "accelerator_mode": "cpu",
            "identity": identity,
        }
        return requests.post(f"{url}/api/v1/agent/enroll", json=body, headers=AGENT, timeout=10)

    identity = new_identity()
    secrets.append(identity["identity_secret"])
    first_token = mint()
    first = enroll(first_token, identity).json()
    secrets.append(first["credential"])
    node_id = first["node_id"]
    auth = {**AGENT, "Authorization": f"Bearer {first['credential']}"}
    beat = {
        "node_id": node_id,
        "agent_version": "0.1.0",
        "health": {"status": "ok", "gpu_probe": "not_applicable"},
    }
    assert requests.post(f"{url}/api/v1/agent/heartbeat", json=beat, headers=auth, timeout=10).ok
    # A work item's env value is a secret the control plane keeps (sealed) for a node.
    hf_token = f"hf_secret_0{secrets_module.token_hex(16)}"
    secrets.append(hf_token)
    job = {"image": "trainer:1.4", "image_id": "sha256:" + "4f" * 32, "env": {"HF": hf_token}}
    submitted = requests.post(
        f"{url}/api/v1/admin/work",
        json={"capability": "container", "input": job},
        headers=admin,
        timeout=10,
    )
    assert submitted.status_code == 201, submitted.text
    work_id = submitted.json()["work_id"]

    # Client API keys: shown once at creation, then never again; one revoked.
    keys = []
    for name in ("chat frontend", "batch"):
        made = requests.post(
            f"{url}/api/v1/admin/api-keys", json={"name": name}, headers=admin, timeout=10
        )
        assert made.status_code == 201, made.text
        secrets.append(made.json()["secret"])
        keys.append(made.json())
    revoked_key = requests.delete(
        f"{url}/api/v1/admin/api-keys/{keys[1]['key_id']}", headers=admin, timeout=10
    )
    assert revoked_key.status_code == 200

    second = enroll(mint(), identity).json()
    secrets.append(second["credential"])
    # Misbehaviour that carries secrets to the server: every one must be refused quietly.
    forged = {**identity, "identity_secret": f"mfi_{identity['identity_id']}_{'Z' * 43}"}
    secrets.append(forged["identity_secret"])
    refusals = [
        requests.post(f"{url}/api/v1/agent/heartbeat", json=beat, headers=auth, timeout=10),
        enroll(first_token, identity),
        enroll(mint(), forged),
        requests.post(
            f"{url}/api/v1/agent/heartbeat",
            data=f"{{{second['credential']}",
            headers={**auth, "Content-Type": "application/json"},
            timeout=10,
        ),
        requests.post(
            f"{url}/api/v1/agent/heartbeat",
            json={**beat, "x": first_token},
            headers=auth,
            timeout=10,
        ),
        # An API key where an admin token or a node credential belongs.
        requests.get(
            f"{url}/api/v1/admin/api-keys",
            headers={ADMIN: keys[0]["secret"]},
            timeout=10,
        ),
        requests.post(
            f"{url}/api/v1/agent/heartbeat",
            json=beat,
            headers={**AGENT, "Authorization": f"Bearer {keys[0]['secret']}"},
            timeout=10,
        ),
    ]
    assert all(400 <= r.status_code < 500 for r in refusals)
    answers = [submitted.text, revoked_key.text] + [response.text for response in refusals]
    for path in (
        "node-enrollments",
        "hardware/nodes",
        f"hardware/nodes/{node_id}",
        f"hardware/nodes/{node_id}/credentials",
        f"hardware/nodes/{node_id}/readiness",
        "alerts",
        "audit-events?limit=500",
        "work",
        f"work/{work_id}",
        "api-keys",
    ):
        answers.append(requests.get(f"{url}/api/v1/admin/{path}", headers=admin, timeout=10).text)
    metrics = requests.get(f"{url}/metrics", headers=admin, timeout=10)
    assert "modelforge_heartbeats_received_total" in metrics.text
    answers.append(metrics.text)
    return secrets, answers


def serve_scenario(tmp_path: Path, database_url: str | None) -> tuple[list[str], list[str], str]:
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"), MODELFORGE_LOG_LEVEL="DEBUG")
    if database_url:
        env["MODELFORGE_DATABASE_URL"] = database_url
    admin_token = json.loads(run_cli("init", "--json", env=env, check=True).stdout)["admin_token"]
    log_path = tmp_path / "serve.log"
    with serving(env, log_path) as (url, process):
        secrets, answers = run_scenario(url, admin_token)
        # Process arguments are world-readable: nothing secret may be in them.
        answers.append(Path(f"/proc/{process.pid}/cmdline").read_bytes().decode())
    return secrets, answers, log_path.read_text()


def assert_nowhere(secrets: list[str], places: dict[str, bytes]) -> None:
    assert len(secrets) >= 8
    for secret in secrets:
        for name, content in places.items():
            assert secret.encode() not in content, f"a secret leaked into {name}"
            assert secret.split("_", 2)[2].encode() not in content, f"secret part in {name}"


def test_no_secret_in_sqlite_file_logs_or_later_answers(tmp_path):
    secrets, answers, log = serve_scenario(tmp_path, None)
    state = tmp_path / "state"
    places = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    assert "modelforge.sqlite3" in places
    places |= {"log": log.encode(), "answers": "\n".join(answers).encode()}
    assert_nowhere(secrets, places)
    # The log still says what happened: method, path, status and code of each refusal.
    assert "POST /api/v1/agent/heartbeat -> 401 CREDENTIAL_REVOKED" in log
    assert "POST /api/v1/agent/enroll -> 403 IDENTITY_SECRET_MISMATCH" in log


def test_no_secret_in_a_postgresql_dump_or_logs(tmp_path):
    from tests.harness.control_plane import fresh_postgres_database

    postgres_admin_url()
    with fresh_postgres_database() as url:
        secrets, answers, log = serve_scenario(tmp_path, url)
        pg_dump = next(Path("/usr/lib/postgresql").glob("*/bin/pg_dump"))
        dump = subprocess.run(
            [str(pg_dump), "--dbname", url], capture_output=True, check=True, timeout=60
        ).stdout
    assert b"COPY public.credential" in dump
    assert_nowhere(
        secrets, {"pg_dump": dump, "log": log.encode(), "answers": "\n".join(answers).encode()}
    )
