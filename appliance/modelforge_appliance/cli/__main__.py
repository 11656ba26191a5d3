"""``python3 -m modelforge_appliance.cli``: the same as ``modelforge``."""

from .completion import COMPLETE_VAR, PROG
from .main import main

main(prog_name=PROG, complete_var=COMPLETE_VAR)
