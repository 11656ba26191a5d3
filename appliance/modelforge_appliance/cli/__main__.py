"""``python3 -m modelforge_appliance.cli``: the same as ``modelforge``."""

from .main import main

main()
