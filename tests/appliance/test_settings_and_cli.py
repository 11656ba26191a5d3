"""Settings validation (exit 2, one line) and the ``modelforge`` command line."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from modelforge_appliance.core.clock import Clock, ManualClock
from modelforge_appliance.core.settings import SETTINGS, ConfigError, load_settings
from modelforge_appliance.identity import admin_tokens
from modelforge_appliance.store.database import SCHEMA_VERSION, Store
from modelforge_appliance.store.migrations import MIGRATIONS
from modelforge_appliance.store.tables import AdminToken
from tests.harness.control_plane import clean_env, invoke_cli, serve

ROOT = Path(__file__).resolve().parents[2]


def modelforge(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return invoke_cli(*args, env=clean_env(**env), timeout=timeout)


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
    # The text answer carries the compose files' modelforge-node.env too, with no token in it.
    text = modelforge("enroll", "--name", "GPU 8", env=state_env)
    assert text.returncode == 0, text.stderr
    saved = text.stdout.split("save this as modelforge-node.env beside them (no secret in it):")
    assert len(saved) == 2, text.stdout
    shown = [line.removeprefix("    ") for line in saved[1].strip("\n").splitlines()]
    assert shown == body["env_file"].rstrip("\n").splitlines()
    assert "mfe_" not in saved[1]
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


def test_admin_token_last_used_at_moves(sqlite_settings):
    """An admin token's last_used_at did not follow its use: it is recorded on use, at most
    once a minute (no write for every request), and shows in the token list."""
    clock = ManualClock()
    with serve(sqlite_settings, clock) as cp:

        def last_used():
            with cp.store.connection():
                return AdminToken.get().last_used_at

        assert last_used() is None
        assert cp.admin("GET", "/api/v1/admin/alerts").status_code == 200
        assert last_used() == clock.now()
        first = clock.now()
        clock.advance(30)
        cp.admin("GET", "/api/v1/admin/alerts")
        assert last_used() == first  # to the minute: no write for every request
        clock.advance(31)
        cp.admin("GET", "/api/v1/admin/alerts")
        assert last_used() == clock.now()
        listed = admin_tokens.list_admin_tokens(cp.store)[0]
        assert listed["last_used_at"] is not None


@pytest.mark.parametrize(
    "value",
    ["*", "10.0.0.0/8", "proxy.lan", "127.0.0.1,junk", "127.0.0.1;10.0.0.1", "localhost", " , "],
)
def test_a_trusted_proxy_that_is_not_addresses_exits_2(tmp_path, value):
    """MODELFORGE_TRUSTED_PROXY took wildcards, networks, host names and junk, trusting
    more than meant or failing late: anything but a comma-separated list of IP addresses
    makes serve exit 2 with one line naming the variable."""
    result = modelforge(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"MODELFORGE_STATE_DIR": str(tmp_path / "s"), "MODELFORGE_TRUSTED_PROXY": value},
    )
    assert result.returncode == 2
    assert "MODELFORGE_TRUSTED_PROXY" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_trusted_proxies_are_addresses_in_canonical_form():
    """Trusted proxies were kept as written, so 0:0:0:0:0:0:0:1 never matched a peer seen
    as ::1: they are kept as addresses in canonical form, and none are trusted by default."""
    settings = load_settings({"MODELFORGE_TRUSTED_PROXY": " 127.0.0.1 , 0:0:0:0:0:0:0:1,10.0.0.5"})
    assert settings.trusted_proxies == ("127.0.0.1", "::1", "10.0.0.5")
    assert load_settings({}).trusted_proxies == ()


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"MODELFORGE_CONNECTION_LIMIT": "lots"}, ["MODELFORGE_CONNECTION_LIMIT"]),
        ({"MODELFORGE_CONNECTION_LIMIT": "5"}, ["MODELFORGE_CONNECTION_LIMIT"]),
        ({"MODELFORGE_REQUEST_TIMEOUT_SECONDS": "0"}, ["MODELFORGE_REQUEST_TIMEOUT_SECONDS"]),
        (
            {"MODELFORGE_IDLE_TIMEOUT_SECONDS": "10"},
            ["MODELFORGE_IDLE_TIMEOUT_SECONDS", "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS"],
        ),
    ],
)
def test_connection_settings_are_validated(env, names):
    """Connection settings were not validated: a limit that is no number or too small, a
    zero request timeout, an idle timeout shorter than the heartbeat interval (which would
    drop every agent's keep-alive) must each refuse to start, naming the variables."""
    with pytest.raises(ConfigError) as refused:
        load_settings(env)
    for name in names:
        assert name in str(refused.value)


def limit_files(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_limit_the_process_cannot_hold_exits_2(tmp_path):
    """A connection limit beyond the process's hard file limit was accepted, to fail only
    when the connections came: serve exits 2 naming the setting and the hard limit."""
    env = {
        "MODELFORGE_STATE_DIR": str(tmp_path / "s"),
        "MODELFORGE_CONNECTION_LIMIT": "5000",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        [sys.executable, "-m", "modelforge_appliance.cli", "serve", "--listen", "127.0.0.1:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_files(256, 1024),
    )
    assert result.returncode == 2
    assert "MODELFORGE_CONNECTION_LIMIT=5000" in result.stderr
    assert "1024" in result.stderr


def test_serve_raises_its_own_soft_file_limit_to_fit_the_connections(tmp_path):
    """serve kept the soft file limit it was started with (often 256 or 1024), below what
    its connection limit needs: it raises its own soft limit, within the hard one, to the
    connections plus a margin."""
    code = (
        "import resource, sys\n"
        "from modelforge_appliance.runtime.server import ensure_file_descriptors\n"
        "print(ensure_file_descriptors(3000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_files(256, 8192),
        check=True,
    )
    assert result.stdout.split() == ["3064", "3064"]


@pytest.mark.parametrize("expires", ["5s", "soon", "48h"])
def test_an_enrollment_lifetime_out_of_range_names_the_option_and_the_value(state_env, expires):
    refused = modelforge("enroll", "--name", "gpu", "--expires", expires, env=state_env)
    assert refused.returncode == 2
    assert f"Invalid value for --expires: {expires!r}" in refused.stderr
