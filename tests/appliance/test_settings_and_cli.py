"""Settings validation (exit 2, one line) and the ``modelforge`` command line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.core.settings import SETTINGS, ConfigError, load_settings
from modelforge_appliance.store.database import SCHEMA_VERSION, Store
from modelforge_appliance.store.migrations import MIGRATIONS

from ..support import clean_env, run_cli

ROOT = Path(__file__).resolve().parents[2]


def modelforge(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_cli(*args, env=clean_env(**env), timeout=timeout)


@pytest.fixture
def state_env(tmp_path) -> dict:
    return {"MODELFORGE_STATE_DIR": str(tmp_path / "state")}


@pytest.mark.parametrize(
    ("stale", "offline", "names"),
    [
        (
            "30",
            "30",
            ("MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", "MODELFORGE_NODE_STALE_AFTER_SECONDS"),
        ),
        (
            "60",
            "45",
            ("MODELFORGE_NODE_OFFLINE_AFTER_SECONDS", "MODELFORGE_NODE_STALE_AFTER_SECONDS"),
        ),
        (
            "10",
            "90",
            ("MODELFORGE_NODE_STALE_AFTER_SECONDS", "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS"),
        ),
    ],
)
def test_serve_refuses_bad_thresholds_with_exit_2_naming_both(state_env, stale, offline, names):
    env = {
        **state_env,
        "MODELFORGE_NODE_STALE_AFTER_SECONDS": stale,
        "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": offline,
    }
    result = modelforge("serve", "--listen", "127.0.0.1:0", env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    assert not Path(state_env["MODELFORGE_STATE_DIR"]).exists()  # refused before touching state


def test_unknown_setting_names_the_nearest_known_one(state_env):
    env = {**state_env, "MODELFORGE_NODE_STALE_AFTER_SECOND": "30"}
    result = modelforge("init", env=env)
    assert result.returncode == 2
    assert "MODELFORGE_NODE_STALE_AFTER_SECOND" in result.stderr
    assert "did you mean MODELFORGE_NODE_STALE_AFTER_SECONDS?" in result.stderr


def test_agent_variables_are_not_the_control_planes_business():
    load_settings({"MODELFORGE_STATE_DIR": "/tmp/x", "MODELFORGE_AGENT_HOSTNAME": "gpu"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MODELFORGE_LISTEN", "8000"),
        ("MODELFORGE_LISTEN", "127.0.0.1:99999"),
        ("MODELFORGE_HEARTBEAT_INTERVAL_SECONDS", "ten"),
        ("MODELFORGE_MAX_BODY_BYTES", "-1"),
        ("MODELFORGE_DATABASE_URL", "mysql://db/modelforge"),
        ("MODELFORGE_PUBLIC_API_ORIGIN", "ftp://cp.lan"),
        ("MODELFORGE_PUBLIC_API_ORIGIN", "https://cp.lan/api"),
        ("MODELFORGE_LOG_LEVEL", "LOUD"),
    ],
)
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ConfigError) as raised:
        load_settings({"MODELFORGE_STATE_DIR": "/tmp/x", name: value})
    assert name in str(raised.value)


def test_env_file_is_read_and_the_environment_wins(tmp_path):
    env_file = tmp_path / "modelforge.env"
    env_file.write_text(
        "# comment\nMODELFORGE_LISTEN=0.0.0.0:9000\nexport MODELFORGE_LOG_LEVEL='debug'\n"
    )
    settings = load_settings({"MODELFORGE_LISTEN": "127.0.0.1:8001"}, env_file=env_file)
    assert settings.listen == "127.0.0.1:8001"
    assert settings.log_level == "DEBUG"


def test_public_origin_is_normalised():
    env = {"MODELFORGE_PUBLIC_API_ORIGIN": "HTTPS://CP.Lan:443/"}
    assert load_settings(env).public_api_origin == "https://cp.lan"


def test_every_setting_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [spec.name for spec in SETTINGS if f"`{spec.name}`" not in text]
    assert missing == []
    for spec in SETTINGS:
        if spec.default is not None:
            row = next(line for line in text.splitlines() if f"`{spec.name}`" in line)
            assert f"`{spec.default}`" in row, spec.name


def test_init_prints_the_first_token_once(state_env):
    first = modelforge("init", "--json", env=state_env)
    assert first.returncode == 0, first.stderr
    token = json.loads(first.stdout)["admin_token"]
    assert token.startswith("mfa_")
    second = modelforge("init", "--json", env=state_env)
    assert second.returncode == 0
    assert json.loads(second.stdout)["admin_token"] is None
    assert token not in second.stdout + second.stderr
    state = Path(state_env["MODELFORGE_STATE_DIR"])
    assert state.stat().st_mode & 0o777 == 0o700
    assert (state / "modelforge.sqlite3").stat().st_mode & 0o777 == 0o600


def test_admin_token_create_list_revoke(state_env, tmp_path):
    assert modelforge("init", env=state_env).returncode == 0
    created = json.loads(
        modelforge("admin-token", "create", "--name", "ci", "--json", env=state_env).stdout
    )
    listed = modelforge("admin-token", "list", "--json", env=state_env)
    tokens = json.loads(listed.stdout)["admin_tokens"]
    assert {t["name"] for t in tokens} == {"first admin", "ci"}
    assert created["admin_token"] not in listed.stdout
    revoked = modelforge("admin-token", "revoke", created["token_id"], env=state_env)
    assert revoked.returncode == 0
    missing = modelforge("admin-token", "revoke", "0000000000000000", env=state_env)
    assert missing.returncode == 7  # not found
    assert "no admin token" in missing.stderr


def test_revoked_admin_token_is_refused(sqlite_control_plane):
    cp = sqlite_control_plane
    from modelforge_appliance.identity import admin_tokens
    from modelforge_appliance.store import audit

    row, secret = admin_tokens.create_admin_token(cp.store, "temp", audit.CLI_ACTOR)
    headers = {"X-ModelForge-Admin-Token": secret}
    url = f"{cp.url}/api/v1/admin/hardware/nodes"
    assert requests.get(url, headers=headers, timeout=10).status_code == 200
    admin_tokens.revoke_admin_token(cp.store, row.token_id, audit.CLI_ACTOR)
    refused = requests.get(url, headers=headers, timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "ADMIN_TOKEN_INVALID"
    assert requests.get(url, timeout=10).json()["error"]["code"] == "ADMIN_TOKEN_REQUIRED"


def test_cli_enroll_and_nodes(state_env):
    assert modelforge("init", env=state_env).returncode == 0
    minted = modelforge("enroll", "--name", "GPU 7", "--expires", "1h", "--json", env=state_env)
    assert minted.returncode == 0, minted.stderr
    body = json.loads(minted.stdout)
    assert body["token"].startswith("mfe_")
    assert body["api_origin"] == "http://127.0.0.1:8000"
    assert body["production_eligible"] is False
    assert body["token"] not in body["env_file"]
    assert body["token"] not in body["start_command"]
    too_long = modelforge("enroll", "--name", "x", "--expires", "2d", env=state_env)
    assert too_long.returncode == 2
    nodes = modelforge("nodes", "--json", env=state_env)
    assert json.loads(nodes.stdout) == {"nodes": []}


def test_a_store_from_a_newer_program_is_refused(state_env):
    assert modelforge("init", env=state_env).returncode == 0
    url = f"sqlite:///{state_env['MODELFORGE_STATE_DIR']}/modelforge.sqlite3"
    store = Store(url, Clock())
    store.db.execute_sql(
        "INSERT INTO schema_version (version, name, applied_at) VALUES (?, 'future', 0)",
        (SCHEMA_VERSION + 1,),
    )
    store.close()
    result = modelforge("serve", "--listen", "127.0.0.1:0", env=state_env)
    assert result.returncode == 2
    assert f"schema version {SCHEMA_VERSION + 1}" in result.stderr
    assert "newer than this program" in result.stderr


def test_migrations_apply_once(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/m.sqlite3", Clock())
    assert store.migrate() == [m.version for m in MIGRATIONS]
    assert store.migrate() == []
    assert store.current_version() == SCHEMA_VERSION
