"""The ``modelforge`` console script: the CLI, or one line naming the missing extra.

``pip install .`` without ``[appliance]`` installs the command but not what the control
plane imports; instead of an ImportError traceback the operator learns what to install. The
root group loads each command on first use (cli/main.py), so that is where a missing extra
is met and named; importing the root itself needs only click and the wire contract.
"""

from __future__ import annotations


def main() -> None:
    from .cli.completion import COMPLETE_VAR, PROG
    from .cli.main import main as cli

    cli(prog_name=PROG, complete_var=COMPLETE_VAR)
