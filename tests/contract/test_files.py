"""write_atomically: the one way secrets and records are written, and that nobody hand-rolls
another."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from modelforge_contract import files
from modelforge_contract.files import write_atomically

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

ROOT = Path(__file__).resolve().parents[2]


def test_the_file_has_its_mode_and_contents_and_nothing_is_left_beside_it(tmp_path):
    target = tmp_path / "identity.json"
    write_atomically(target, '{"secret": "x"}')
    assert target.read_text() == '{"secret": "x"}'
    assert target.stat().st_mode & 0o777 == 0o600
    write_atomically(target, b"public\n", mode=0o644)
    assert target.read_bytes() == b"public\n" and target.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.json"]


def test_the_data_and_the_rename_are_flushed_to_disk(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(descriptor: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{descriptor}"))
        real(descriptor)

    monkeypatch.setattr(files.os, "fsync", fsync)
    write_atomically(tmp_path / "record.json", "{}")
    # The temporary file's data first, then the directory that holds the new name.
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path and synced[0].endswith(".tmp")
    assert synced[1] == str(tmp_path)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "status.json"
    target.write_text("old")

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        write_atomically(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


# Where a temporary file and a rename are still written by hand, and why.
HAND_WRITTEN = {
    "contract/modelforge_contract/files.py": "write_atomically itself",
    "agent/modelforge_node_agent/join.py": "the env file in two steps, enrolling between them",
    "appliance/modelforge_appliance/store/backup.py": "SQLite's online backup into a file",
    "release/modelforge_release/bundle.py": "the images tarball, streamed from dockerd",
    "release/modelforge_release/debs.py": "a verified download moved into the cache",
    "appliance/modelforge_appliance/models/cache.py": "a model file streamed into the seed cache",
    "agent/modelforge_node_agent/blobs.py": "a blob, resumable, renamed in once it hashes",
    "appliance/modelforge_appliance/models/hub_files.py": "a hub download, resumable, renamed "
    "in once it hashes",
}


def test_no_other_module_writes_a_file_by_temporary_and_rename():
    found = set()
    for package in ("appliance", "agent", "worker", "contract", "release", "packaging"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if re.search(r"\bmkstemp\(|\bos\.replace\(", text):
                found.add(path.relative_to(ROOT).as_posix())
    assert found <= set(HAND_WRITTEN), sorted(found - set(HAND_WRITTEN))
