"""The ``modelforge`` root loads each command on first use: ``--help`` imports no command
module, and a command that does not serve imports neither waitress nor the server."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.utils import make_default_short_help

from modelforge_appliance.cli.main import COMMANDS, main
from tests.harness.control_plane import clean_env

# What only `serve` may load.
SERVER_MODULES = ("waitress", "bottle", "modelforge_appliance.runtime.server")
REPORT = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
    "from modelforge_appliance.entry import main\n"
    "sys.argv = ['modelforge', *sys.argv[1:]]\n"
    "main()\n"
)


def modules_loaded_by(*args: str, env: dict[str, str]) -> tuple[int, str, set[str]]:
    """Run ``modelforge ARGS`` in a fresh interpreter: (exit, stdout, every module it loaded)."""
    result = subprocess.run(
        [sys.executable, "-c", REPORT, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    loaded = json.loads(result.stderr.strip().splitlines()[-1])
    return result.returncode, result.stdout, set(loaded)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_summary_is_the_first_paragraph_of_its_commands_help(name):
    command = main.get_command(click.Context(main), name)
    assert command is not None and command.name == name
    for width in (30, 60, 1000):
        assert make_default_short_help(COMMANDS[name][2], width) == (
            command.get_short_help_str(width)
        )


def test_an_unknown_command_is_a_usage_error_naming_it():
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["nodez"])
    assert result.exit_code == 2
    assert "No such command 'nodez'" in result.output


def test_help_loads_no_command_module(tmp_path):
    code, out, loaded = modules_loaded_by("--help", env=clean_env(HOME=str(tmp_path)))
    assert code == 0
    assert all(f"  {name} " in out for name in COMMANDS)
    commands = {f"modelforge_appliance.cli.{module}" for module, _, _ in COMMANDS.values()}
    commands.discard("modelforge_appliance.cli.completion")  # the entry reads its PROG, no more
    assert not loaded & commands, sorted(loaded & commands)
    assert not loaded & {"peewee", *SERVER_MODULES}


def test_a_command_that_does_not_serve_loads_no_server(tmp_path):
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"), HOME=str(tmp_path))
    code, out, loaded = modules_loaded_by("init", "--json", env=env)
    assert code == 0 and "admin_token" in out
    for args in (("nodes", "--json"), ("enrollments", "list"), ("audit",)):
        code, out, loaded = modules_loaded_by(*args, env=env)
        assert code == 0, (args, out)
        assert "peewee" in loaded  # it did read the store
        assert not loaded & set(SERVER_MODULES), (args, sorted(loaded & set(SERVER_MODULES)))
