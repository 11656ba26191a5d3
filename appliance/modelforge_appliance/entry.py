"""The ``modelforge`` console script: the CLI, or one line naming the missing extra.

``pip install .`` without ``[appliance]`` installs the command but not what the control
plane imports; instead of an ImportError traceback the operator learns what to install.
"""

from __future__ import annotations

import sys

from modelforge_contract import EXIT_USAGE

# Top-level modules of the appliance extra (pyproject.toml).
EXTRA_MODULES = frozenset(
    {"bottle", "waitress", "peewee", "psycopg2", "bcrypt", "prometheus_client"}
)


def missing_extra_message(program: str, extra: str, module: str) -> str:
    return (
        f"{program}: the {extra} extra is not installed (no module named {module!r}); install "
        f"it with: pip install 'modelforge[{extra}]' (from a checkout: pip install -e "
        f"'.[{extra}]')"
    )


def main() -> None:
    try:
        from .cli.completion import COMPLETE_VAR, PROG
        from .cli.main import main as cli
    except ModuleNotFoundError as exc:
        module = (exc.name or "").split(".")[0]
        if module not in EXTRA_MODULES:
            raise
        print(missing_extra_message("modelforge", "appliance", module), file=sys.stderr)
        sys.exit(EXIT_USAGE)
    cli(prog_name=PROG, complete_var=COMPLETE_VAR)
