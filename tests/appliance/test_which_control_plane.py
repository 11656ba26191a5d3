"""One source of truth for "which control plane": the CLI uses the store and the origin the
running server really serves, says which store it used, never creates one outside init and
serve, and never locks a token to a wildcard address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from modelforge_contract import EXIT_USAGE, HEADER_ADMIN_TOKEN, PATH_ADMIN_ENROLLMENTS
from tests.harness.control_plane import APPLIANCE_CLI as CLI
from tests.harness.control_plane import (
    clean_env,
    free_port,
    fresh_postgres_database,
    invoke_cli,
    unavailable,
)


@contextmanager
def serving(env: dict[str, str], log: Path, *args: str):
    """`modelforge serve` as a process; yields it with its serving record once written."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [*CLI, "serve", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        record = Path(env["MODELFORGE_STATE_DIR"]) / "serving.json"
        try:
            deadline = time.monotonic() + 60
            while not record.exists():
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            yield process, json.loads(record.read_text())
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=15) == 0, log.read_text()


@pytest.fixture
def state_env(tmp_path) -> dict[str, str]:
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"))
    assert invoke_cli("init", env=env).returncode == 0
    return env


def test_enroll_locks_tokens_to_the_origin_serve_really_serves(tmp_path, state_env):
    # --listen with port 0: only the running server knows the port it got.
    with serving(state_env, tmp_path / "serve.log", "--listen", "127.0.0.1:0") as (_, record):
        minted = invoke_cli("enroll", "--name", "gpu", "--json", env=state_env)
        assert minted.returncode == 0, minted.stderr
        assert json.loads(minted.stdout)["api_origin"] == f"http://127.0.0.1:{record['port']}"
        assert f"modelforge: store {state_env['MODELFORGE_STATE_DIR']}/modelforge.sqlite3" in (
            minted.stderr
        )
        joins = json.loads(minted.stdout)["join_commands"]
        assert set(joins) == {"systemd", "checkout", "container"}
        assert all(f"join http://127.0.0.1:{record['port']} " in c for c in joins.values())
        text = invoke_cli("enroll", "--name", "gpu", env=state_env)
        assert f"pid {record['pid']}" in text.stdout
    assert not (Path(state_env["MODELFORGE_STATE_DIR"]) / "serving.json").exists()
    stopped = invoke_cli("enroll", "--name", "gpu", "--json", env=state_env)
    assert json.loads(stopped.stdout)["api_origin"] == "http://127.0.0.1:8000"


def test_a_wildcard_address_never_becomes_a_tokens_origin(tmp_path, state_env):
    port = free_port()
    env = {**state_env, "MODELFORGE_LISTEN": f"0.0.0.0:{port}"}
    log = tmp_path / "serve.log"
    with serving(env, log) as _:
        assert "without MODELFORGE_PUBLIC_API_ORIGIN" in log.read_text()
        refused = invoke_cli("enroll", "--name", "gpu", env=env)
        assert refused.returncode == EXIT_USAGE
        assert "MODELFORGE_PUBLIC_API_ORIGIN" in refused.stderr and refused.stdout == ""
        # Even the CLI without MODELFORGE_LISTEN knows: it reads what serve bound.
        assert invoke_cli("enroll", "--name", "gpu", env=state_env).returncode == EXIT_USAGE
        wildcard = invoke_cli(
            "enroll", "--name", "gpu", "--origin", f"http://0.0.0.0:{port}", env=env
        )
        assert wildcard.returncode == EXIT_USAGE
        chosen = invoke_cli(
            "enroll", "--name", "gpu", "--origin", "http://10.0.0.5:8000", "--json", env=env
        )
        assert json.loads(chosen.stdout)["api_origin"] == "http://10.0.0.5:8000"

        admin = json.loads(
            invoke_cli("admin-token", "create", "--name", "t", "--json", env=env).stdout
        )
        for host in (f"0.0.0.0:{port}", f"[::]:{port}"):
            answer = requests.post(
                f"http://127.0.0.1:{port}{PATH_ADMIN_ENROLLMENTS}",
                json={"display_name": "gpu", "expires_in_seconds": 900},
                headers={HEADER_ADMIN_TOKEN: admin["admin_token"], "Host": host},
                timeout=10,
            )
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "HOST_INVALID"
        doctor = invoke_cli("doctor", "--json", "--listen", f"0.0.0.0:{free_port()}", env=env)
        checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
        assert checks["origin"]["warning"] is True and checks["origin"]["ok"] is True

    public = {**env, "MODELFORGE_PUBLIC_API_ORIGIN": "http://192.168.1.20:8000"}
    with serving(public, tmp_path / "public.log") as _:
        # The CLI has no origin setting of its own here; the running server's applies.
        minted = invoke_cli("enroll", "--name", "gpu", "--json", env=env)
        assert minted.returncode == 0, minted.stderr
        assert json.loads(minted.stdout)["api_origin"] == "http://192.168.1.20:8000"


def test_behind_a_reverse_proxy_the_listen_address_is_no_origin(tmp_path, state_env):
    """Agents address the trusted proxy, not the loopback address serve listens on: without
    MODELFORGE_PUBLIC_API_ORIGIN, serve and doctor warn and enroll refuses, as for 0.0.0.0."""
    env = {**state_env, "MODELFORGE_TRUSTED_PROXY": "127.0.0.1"}
    log = tmp_path / "serve.log"
    with serving(env, log, "--listen", "127.0.0.1:0") as (_, record):
        assert "behind a reverse proxy" in log.read_text()
        assert record["behind_proxy"] is True
        # The CLI without the setting knows too: it reads what the running serve recorded.
        refused = invoke_cli("enroll", "--name", "gpu", env=state_env)
        assert refused.returncode == EXIT_USAGE and refused.stdout == ""
        assert "MODELFORGE_PUBLIC_API_ORIGIN" in refused.stderr
        chosen = invoke_cli(
            "enroll", "--name", "gpu", "--origin", "https://cp.lan", "--json", env=env
        )
        assert json.loads(chosen.stdout)["api_origin"] == "https://cp.lan"
    doctor = invoke_cli("doctor", "--json", "--listen", f"127.0.0.1:{free_port()}", env=env)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["origin"]["warning"] is True and "proxy" in checks["origin"]["fix"]
    public = {**env, "MODELFORGE_PUBLIC_API_ORIGIN": "https://cp.lan"}
    minted = invoke_cli("enroll", "--name", "gpu", "--json", env=public)
    assert json.loads(minted.stdout)["api_origin"] == "https://cp.lan"


def test_only_init_and_serve_create_a_store(tmp_path):
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"))
    for args in (("nodes",), ("enroll", "--name", "x", "--origin", "http://cp:1"), ("audit",)):
        result = invoke_cli(*args, env=env)
        assert result.returncode == EXIT_USAGE, result.stderr
        assert f"no ModelForge store at {tmp_path}/state/modelforge.sqlite3" in result.stderr
        assert not (tmp_path / "state").exists()
    assert invoke_cli("init", env=env).returncode == 0
    assert invoke_cli("nodes", env=env).returncode == 0


@pytest.mark.postgres
def test_an_empty_postgresql_database_is_no_store(tmp_path):
    with fresh_postgres_database() as url:
        env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "s"), MODELFORGE_DATABASE_URL=url)
        refused = invoke_cli("nodes", env=env)
        assert refused.returncode == EXIT_USAGE and "no ModelForge store" in refused.stderr
        assert invoke_cli("init", env=env).returncode == 0
        assert invoke_cli("nodes", env=env).returncode == 0


def test_files_left_by_another_user_are_named_with_the_fix(tmp_path, state_env):
    if os.geteuid() != 0:
        unavailable("needs root to hand a file to another user")
    store = Path(state_env["MODELFORGE_STATE_DIR"]) / "modelforge.sqlite3"
    os.chown(store, 65534, 65534)
    for args in (("nodes",), ("backup", str(tmp_path / "b.sqlite3")), ("init",)):
        result = invoke_cli(*args, env=state_env)
        assert result.returncode == EXIT_USAGE, result.stderr
        assert "modelforge.sqlite3 (nobody)" in result.stderr
        assert f"chown -R root: {store.parent}" in result.stderr


def test_a_second_serve_on_one_state_directory_exits_2_naming_the_first(tmp_path, state_env):
    """It started beside the first on the same SQLite store, and when it stopped it deleted
    the first one's serving record: the CLI then minted tokens for a dead origin."""
    with serving(state_env, tmp_path / "serve.log", "--listen", "127.0.0.1:0") as (first, record):
        second = subprocess.run(
            [*CLI, "serve", "--listen", "127.0.0.1:0"],
            env=state_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == EXIT_USAGE, second.stderr
        assert "already runs on the state directory" in second.stderr
        assert f"(pid {first.pid})" in second.stderr
        # The first still serves, and its record is still its own.
        record_path = Path(state_env["MODELFORGE_STATE_DIR"]) / "serving.json"
        assert json.loads(record_path.read_text()) == record
        assert requests.get(f"http://127.0.0.1:{record['port']}/healthz", timeout=10).ok
    # Once the first stopped, a serve may start again (the kernel dropped the lock).
    with serving(state_env, tmp_path / "again.log", "--listen", "127.0.0.1:0"):
        pass
