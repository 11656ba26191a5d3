"""No command prints a traceback: a missing directory, an unwritable path, PostgreSQL down,
the wrong user and a missing extra each end in one line with a next step and a documented
exit code, over every command group. The trace comes only with --debug."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modelforge_contract import (
    EXIT_CHECK_FAILED,
    EXIT_NOT_FOUND,
    EXIT_STORE_UNREACHABLE,
    EXIT_USAGE,
)
from tests.harness.control_plane import clean_env, free_port, invoke_cli, run_cli, unavailable

ROOT = Path(__file__).resolve().parents[2]
# /sys takes no new files, not even from root (EACCES, or EROFS where it is mounted read-only).
UNWRITABLE = Path("/sys/modelforge-test")

# One command of every group, as an operator would type it (NODE and PATH are filled in).
COMMANDS = {
    "init": ["init"],
    "serve": ["serve", "--listen", "{busy}"],
    "admin-token": ["admin-token", "create", "--name", "ci"],
    "admin-password": ["admin-password", "set"],
    "api-keys": ["api-keys", "create", "--name", "chat"],
    "usage": ["usage", "--by", "deployment"],
    "users": ["users", "set-role", "alice", "operator"],
    "enroll": ["enroll", "--name", "gpu", "--origin", "http://cp.lan:8000"],
    "enrollments": ["enrollments", "revoke", "0123456789abcdef"],
    "nodes": ["nodes", "show", "gpu-1"],
    "alerts": ["alerts", "--fail-on", "critical"],
    "audit": ["audit", "--node", "gpu-1"],
    "backup": ["backup", "{backup}"],
    "restore": ["restore", "{backup}", "--yes"],
    "save-finality": ["save-finality", "{record}"],
    "restore-finality": ["restore-finality", "{record}"],
    "work": ["work", "show", "0123456789abcdef"],
    "models": ["models", "show", "tiny"],
    "hub-token": ["hub-token", "show"],
    "deploy": ["deploy", "tiny-chat", "--model", "tiny", "--nodes", "gpu-1"],
    "deployments": ["deployments", "show", "tiny-chat"],
    "undeploy": ["undeploy", "tiny-chat"],
    "doctor": ["doctor", "--listen", "{busy}"],
    "completion": ["completion", "bash"],
}
# What an operator may see: ok, "no", usage/configuration, not found, store unreachable.
# (Every command group of `modelforge` is here: test_every_group_is_covered.)
DOCUMENTED = {0, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_STORE_UNREACHABLE}


@pytest.fixture(scope="module")
def busy_port():
    """A port something listens on, so serve fails fast instead of serving."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def prepared(tmp_path: Path, condition: str) -> tuple[dict[str, str], dict[str, str]]:
    """(environment, placeholders) for one failure condition."""
    state = tmp_path / "state"
    backup = tmp_path / "backup.sqlite3"
    env = clean_env(MODELFORGE_STATE_DIR=str(state))
    if condition == "missing directory":
        env["MODELFORGE_STATE_DIR"] = str(tmp_path / "no" / "such" / "dir")
        backup = tmp_path / "no-such-dir" / "backup.sqlite3"
    elif condition == "unwritable path":
        assert invoke_cli("init", env=env).returncode == 0
        try:
            UNWRITABLE.mkdir()
        except OSError:
            pass
        else:
            UNWRITABLE.rmdir()
            unavailable(f"{UNWRITABLE.parent} takes new directories here")
        backup = UNWRITABLE / "backup.sqlite3"
    elif condition == "postgres down":
        env["MODELFORGE_DATABASE_URL"] = (
            f"postgresql://modelforge:s3cret@127.0.0.1:{free_port()}/mf"
        )
    elif condition == "wrong user":
        if os.geteuid() != 0:
            unavailable("needs root to give the state directory to another user")
        assert invoke_cli("init", env=env).returncode == 0
        for path in (state, *state.iterdir()):
            os.chown(path, 65534, 65534)  # nobody
    return env, {"backup": str(backup), "record": str(backup.with_suffix(".json"))}


CONDITIONS = ["missing directory", "unwritable path", "postgres down", "wrong user"]


@pytest.mark.parametrize("group", sorted(COMMANDS))
def test_no_command_prints_a_traceback(tmp_path, busy_port, group):
    for condition in CONDITIONS:
        work = tmp_path / condition.replace(" ", "-")
        work.mkdir()
        env, holes = prepared(work, condition)
        holes["busy"] = f"127.0.0.1:{busy_port}"
        args = [part.format(**holes) for part in COMMANDS[group]]
        result = invoke_cli(*args, env=env)
        where = f"{group} under {condition}: exit {result.returncode}\n{result.stderr}"
        assert "Traceback" not in result.stderr + result.stdout, where
        assert result.returncode in DOCUMENTED, where
        if result.returncode not in (0, EXIT_CHECK_FAILED):
            last = result.stderr.strip().splitlines()[-1]
            assert last.startswith("modelforge: "), where
            assert "s3cret" not in result.stderr, where
        owner_checked = ("init", "backup", "restore", "nodes", "admin-password", "save-finality")
        if condition == "wrong user" and group in (*owner_checked, "restore-finality"):
            assert result.returncode == EXIT_USAGE and "run it as nobody" in result.stderr, where
        if condition == "postgres down" and group in ("nodes", "enroll", "audit", "init"):
            assert result.returncode == EXIT_STORE_UNREACHABLE, where
            assert "PostgreSQL" in result.stderr, where
        # Only init and serve create a store (restore may create the directory to restore into).
        if condition == "missing directory" and group not in ("init", "serve", "restore"):
            assert not Path(env["MODELFORGE_STATE_DIR"]).exists(), f"{where}: created the store"


def test_every_group_is_covered():
    from modelforge_appliance.cli.main import main

    assert set(COMMANDS) == set(main.list_commands(None))


def test_debug_shows_the_trace(tmp_path):
    env = clean_env(
        MODELFORGE_STATE_DIR=str(tmp_path / "state"),
        MODELFORGE_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/mf",
    )
    plain = run_cli("nodes", env=env)
    debug = run_cli("--debug", "nodes", env=env)
    assert plain.returncode == debug.returncode == EXIT_STORE_UNREACHABLE
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr
    assert plain.stderr.strip().splitlines()[-1] == debug.stderr.strip().splitlines()[-1]


# -- a missing extra: the console scripts' entry modules ---------------------------------


def _without_extras(tmp_path: Path) -> Path:
    """A site directory holding only what `pip install .` without extras installs: click."""
    import click

    site = tmp_path / "site"
    site.mkdir()
    (site / "click").symlink_to(Path(click.__file__).parent)
    for part in ("contract", "appliance", "agent"):
        for package in (ROOT / part).glob("modelforge_*"):
            (site / package.name).symlink_to(package)
    return site


@pytest.mark.parametrize(
    ("entry", "args", "extra"),
    [
        ("modelforge_appliance.entry", ["nodes"], "appliance"),
        ("modelforge_appliance.entry", ["init"], "appliance"),
        ("modelforge_appliance.entry", ["enroll", "--name", "x"], "appliance"),
        ("modelforge_appliance.entry", ["backup", "/tmp/x"], "appliance"),
        ("modelforge_node_agent.entry", [], "agent"),
        ("modelforge_node_agent.entry", ["join", "http://cp.lan:8000"], "agent"),
        ("modelforge_node_agent.entry", ["status"], "agent"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(tmp_path, entry, args, extra):
    site = _without_extras(tmp_path)
    # -S: no site-packages at all (not this virtualenv's, not the system's); -E: no PYTHON*.
    code = f"import sys; sys.path.insert(0, {str(site)!r}); sys.argv = ['prog', *{args!r}]; "
    code += f"from {entry} import main; main()"
    result = subprocess.run(
        [sys.executable, "-S", "-E", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"the {extra} extra is not installed" in line
    assert f"modelforge[{extra}]" in line
