"""A pytest plugin for tests/test_parts.py: after collection, write each test's id and the
names of its markers as JSON to the file MF_TEST_MARKERS_OUT names."""

from __future__ import annotations

import json
import os


def pytest_collection_finish(session) -> None:
    out = os.environ["MF_TEST_MARKERS_OUT"]
    found = {
        item.nodeid: sorted({mark.name for mark in item.iter_markers()}) for item in session.items
    }
    with open(out, "w") as handle:
        json.dump(found, handle)
