"""Downloads kept between runs and between clones (.deb files, wheels): under
/var/cache/modelforge-test (MF_TEST_CACHE) when writable, else under the tree's build/."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def machine_cache(name: str) -> Path:
    """The folder NAME of the machine's test cache (made on first use by its user)."""
    preferred = Path(os.environ.get("MF_TEST_CACHE", "/var/cache/modelforge-test"))
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred / name
    except OSError:
        pass
    return ROOT / "build" / "test-cache" / name
