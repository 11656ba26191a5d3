"""How scripts/test splits the suite, in one place (scripts/lib/pythons.sh reads it with
``python -m tests.parts heavy|quick|portable``; tests/test_parts.py checks the split).

- heavy: fleets of agents, image builds, Debian roots under qemu, Chromium, and the tests
  that change this checkout. Once, on .venv's CPython, with the machine to themselves.
- quick: everything else, once, on .venv's CPython.
- portable: what depends on the interpreter, on each other supported CPython: compiling and
  importing every module, the wire contract, the archives and their launcher, the
  operators' verifiers, an enrollment and heartbeat end to end, and PostgreSQL's driver
  against the real server. A quick test joins it by its marker, every_python.
"""

from __future__ import annotations

import sys

HEAVY_MARKERS = ("slow", "docker", "browser", "checkout")
PARTS = {
    "heavy": " or ".join(HEAVY_MARKERS),
    "quick": " and ".join(f"not {marker}" for marker in HEAVY_MARKERS),
    "portable": "every_python and " + " and ".join(f"not {marker}" for marker in HEAVY_MARKERS),
}

if __name__ == "__main__":
    print(PARTS[sys.argv[1]])
