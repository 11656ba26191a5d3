"""The ``modelforge`` console script: the CLI, or one line naming the missing extra.

``pip install .`` without ``[appliance]`` installs the command but not what the control
plane imports; instead of an ImportError traceback the operator learns what to install.
"""

from __future__ import annotations

from modelforge_contract.extras import exit_if_extra_missing

# Top-level modules of the appliance extra (pyproject.toml).
EXTRA_MODULES = frozenset(
    {"bottle", "waitress", "peewee", "psycopg2", "bcrypt", "prometheus_client"}
)


def main() -> None:
    try:
        from .cli.completion import COMPLETE_VAR, PROG
        from .cli.main import main as cli
    except ModuleNotFoundError as exc:
        exit_if_extra_missing(exc, "modelforge", "appliance", EXTRA_MODULES)
    cli(prog_name=PROG, complete_var=COMPLETE_VAR)
