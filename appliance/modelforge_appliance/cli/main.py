"""The ``modelforge`` command line (click): the root group, its one error handler, and the one
place that names every command. Exit codes: see cli/errors.py and docs/cli.md.

Commands load lazily: ``modelforge --help`` and ``modelforge nodes`` import only the modules
they run (the store, not waitress or the server; the server only for ``serve``). The table
below carries each command's one-line summary, so the root help lists them without importing
any; tests/appliance/test_cli_lazy.py holds each line to its command's own help.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import click
from click.utils import make_default_short_help

from modelforge_contract import EXIT_USAGE, PROTOCOL_VERSION, __version__
from modelforge_contract.extras import exit_if_extra_missing

from ..core.errors import OperatorError

# Top-level modules of the appliance extra (pyproject.toml): a command that needs one that is
# missing says which extra to install, in one line.
EXTRA_MODULES = frozenset(
    {
        "bottle",
        "waitress",
        "peewee",
        "psycopg2",
        "bcrypt",
        "prometheus_client",
        "cryptography",
        "huggingface_hub",
    }
)

# name -> (module of this package, its attribute, the first paragraph of the command's help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": (
        "init",
        "init",
        "Create the state directory and store; print the first admin token once.",
    ),
    "serve": (
        "serve",
        "serve",
        "Serve the control plane (default 127.0.0.1:8000, SQLite under the state directory).",
    ),
    "admin-password": (
        "admin_password",
        "admin_password",
        "Set the admin password that signs in to the web console.",
    ),
    "admin-token": (
        "admin_tokens",
        "admin_token",
        "Create, list and revoke admin tokens (shown once, stored as digests).",
    ),
    "api-keys": (
        "api_keys",
        "api_keys_group",
        "Create, list and revoke client API keys (mfk_…; shown once, stored as digests).",
    ),
    "users": (
        "users",
        "users_group",
        "Add, list and change the users who sign in to the console, and their roles.",
    ),
    "usage": (
        "api_keys",
        "usage_command",
        "What each API key (or deployment, or day) used: requests, tokens, errors.",
    ),
    "enroll": (
        "enrollments",
        "enroll",
        "Mint a single-use enrollment token and print the command that joins a node with it.",
    ),
    "enrollments": (
        "enrollments",
        "enrollments_group",
        "List enrollment tokens (never the tokens themselves) and revoke unused ones.",
    ),
    "nodes": (
        "nodes",
        "nodes_group",
        "List nodes with their liveness and readiness, or act on one (see the commands below).",
    ),
    "alerts": (
        "nodes",
        "alerts_command",
        "Active alerts: offline and stale nodes, hostname conflicts.",
    ),
    "audit": ("audit", "audit_command", "Who did what to which node, and when; never a secret."),
    "backup": (
        "store",
        "backup_command",
        "Copy the SQLite store to PATH (consistent while serving; mode 0600).",
    ),
    "restore": (
        "store",
        "restore_command",
        "Replace the store with a backup (the control plane must be stopped).",
    ),
    "save-finality": (
        "store",
        "save_finality_command",
        "Save the store's finality record to PATH (before a pg_restore).",
    ),
    "restore-finality": (
        "store",
        "restore_finality_command",
        "Carry a saved finality record into the restored store (the control plane stopped).",
    ),
    "doctor": (
        "doctor",
        "doctor",
        "Check this host before starting: Python, state directory, port, store, clock, settings, and with --ca-cert the TLS certificate agents will see.",
    ),
    "completion": (
        "completion",
        "completion",
        "Print the shell completion script for bash, zsh or fish (node ids complete too).",
    ),
    "work": ("work", "work_group", "Submit work to the nodes and follow it (docs/work.md)."),
    "models": (
        "models",
        "models_group",
        "Import models into the seed cache and replicate them to nodes (docs/models.md).",
    ),
    "hub-token": (
        "hub_token",
        "hub_token_group",
        "Set, show or clear the hub token models pull sends for gated and private repositories.",
    ),
    "deploy": (
        "deployments",
        "deploy_command",
        "Serve MODEL as NAME on NODES: one server per node, each started by its agent.",
    ),
    "deployments": (
        "deployments",
        "deployments_group",
        "List deployments and their servers; `show`, `restart`, `set`, `add-nodes`, "
        "`remove-nodes`.",
    ),
    "undeploy": (
        "deployments",
        "undeploy_command",
        "Stop every server of NAME; the deployment goes once they all have stopped.",
    ),
}


class Group(click.Group):
    """The root group: commands from COMMANDS, loaded on first use, and the one error handler:
    every failure is one line with a next step and its exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        if cmd_name not in self.commands:
            module, attribute, _ = COMMANDS[cmd_name]
            try:
                loaded = importlib.import_module(f"{__package__}.{module}")
            except ModuleNotFoundError as exc:
                exit_if_extra_missing(exc, "modelforge", "appliance", EXTRA_MODULES)
            command = getattr(loaded, attribute)
            self.add_command(command, cmd_name)
        return self.commands[cmd_name]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, from the table's summaries instead of the loaded commands."""
        width = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [
            (name, make_default_short_help(COMMANDS[name][2], width)) for name in sorted(COMMANDS)
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OperatorError as exc:
            click.echo(f"modelforge: {exc}", err=True)
            sys.exit(EXIT_USAGE)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # everything else: one line, the trace only with --debug
            # Only on failure: the handler's imports (peewee among them) cost a run nothing.
            from .errors import report
            from .support import Context

            obj = ctx.obj if isinstance(ctx.obj, Context) else None
            report(
                exc,
                debug=bool(obj and obj.debug),
                database_url=obj.database_url if obj else None,
            )


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__, message=f"modelforge %(version)s (agent protocol {PROTOCOL_VERSION})"
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read MODELFORGE_* settings from this KEY=VALUE file; the environment wins on "
    "conflicts. Default: the settings scripts/run left in this virtualenv, if any.",
)
@click.option("--debug", is_flag=True, help="On failure, show the Python traceback too.")
@click.pass_context
def main(ctx: click.Context, env_file: Path | None, debug: bool) -> None:
    """ModelForge control plane: enrollment, node credentials, liveness and the console.

    Settings come from MODELFORGE_* environment variables (docs/configuration.md).
    Exit codes: 0 ok, 1 the answer is no (not ready, a check failed, alerts, declined),
    2 usage or configuration, 7 not found, 8 store unreachable, 9 the system refused
    (disk full, I/O error), 70 internal error.
    """
    # Runs only when a command does (never for --help): that command imports support anyway.
    from .support import Context

    # Everything this program writes (store, WAL, backups, lock) is for its own user only.
    os.umask(0o077)
    ctx.obj = Context(env_file, debug)
    ctx.call_on_close(ctx.obj.close)  # the state lock is held until the command ends


__all__ = ["COMMANDS", "EXTRA_MODULES", "main"]

if __name__ == "__main__":
    main()
