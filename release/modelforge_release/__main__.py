"""``python3 -m modelforge_release``: the same as ``modelforge-release``."""

from .cli import main

main()
