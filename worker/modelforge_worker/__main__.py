"""``python3 -m modelforge_worker`` is ``modelforge-runtime-worker``."""

from .server import main

main()
