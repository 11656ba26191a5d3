"""How scripts/test splits the suite, in one place (scripts/lib/pythons.sh reads it with
``python -m tests.parts heavy|quick|portable``; tests/test_parts.py checks the split).

- heavy: fleets of agents, image builds, Debian roots under qemu, Chromium, and the tests
  that change this checkout. Once, on .venv's CPython, in three runs (HEAVY_RUNS): those
  that change this checkout alone first, then the builds (dockerd's images, Debian roots)
  and the rest side by side (one mostly waits on dockerd, debootstrap and qemu while the
  other runs; neither touches what the other uses). A Debian root's tests are marked
  ``roots`` so that the two runs take about as long.
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

# The heavy part's runs, in order; the runs after the first go side by side.
HEAVY_RUNS = {
    "heavy-checkout": "checkout",
    "heavy-builds": "(docker or roots) and not checkout",
    "heavy-rest": "(slow or browser) and not docker and not roots and not checkout",
}
PARTS.update(HEAVY_RUNS)

if __name__ == "__main__":
    print(PARTS[sys.argv[1]])
