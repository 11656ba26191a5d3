"""A restore SIGKILLed at any of its stages leaves the old store or the new one, never a mix,
and the next command leaves no staged copy behind.

Each run stops a real ``modelforge restore`` child at a named stage (backup.reached_stage,
replaced by the child's wrapper), so where it dies is chosen, never timed.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from .test_backup_restore import NODES, Host

STAGES = ["locked", "record-read", "copied", "prepared", "folded", "replaced"]
# Before the rename the old store is whole; from it on, the new one is.
OLD_UNTIL = STAGES.index("replaced")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> dict:
    """A state directory whose latest writes sit in the WAL of a SIGKILLed server, and a
    backup that predates them."""
    root = tmp_path_factory.mktemp("template")
    host = Host(root)
    backup = root / "b.sqlite3"
    with host.serving():
        kept = host.enroll("gpu-kept")
    host.cli("backup", str(backup))
    late = json.loads(host.cli("admin-token", "create", "--name", "late", "--json").stdout)
    with host.serving() as server:
        host.delete(f"{NODES}/{kept['node_id']}/credential")
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
    assert Path(f"{root}/state/modelforge.sqlite3-wal").stat().st_size > 0
    return {
        "root": root,
        "backup": backup,
        "admin": host.admin["X-ModelForge-Admin-Token"],
        "kept": kept,
        "late_token_id": late["token_id"],
    }


def store_state(state: Path) -> dict:
    db = sqlite3.connect(state / "modelforge.sqlite3")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return {
            "admin_tokens": {row[0] for row in db.execute("SELECT name FROM admin_token")},
            "restored": db.execute(
                "SELECT COUNT(*) FROM audit_event WHERE action = 'store.restored'"
            ).fetchone()[0],
            "revoked_credentials": db.execute(
                "SELECT COUNT(*) FROM credential WHERE revoked_at IS NOT NULL"
            ).fetchone()[0],
        }
    finally:
        db.close()


@pytest.mark.parametrize("stage", STAGES)
def test_a_restore_killed_at_any_stage_leaves_one_whole_store(tmp_path, template, stage):
    shutil.copytree(template["root"] / "state", tmp_path / "state")
    host = Host(tmp_path, admin_token=template["admin"])
    restore = host.start_cli_stopping_at(stage, "kill", "restore", str(template["backup"]), "--yes")
    _, err = restore.communicate(timeout=60)
    assert restore.returncode == -signal.SIGKILL, err

    # The next command cleans up and works on a whole store.
    assert len(json.loads(host.cli("admin-token", "list", "--json").stdout)["admin_tokens"]) >= 1
    state = tmp_path / "state"
    assert sorted(p.name for p in state.iterdir() if ".restoring" in p.name) == []
    now = store_state(state)
    if STAGES.index(stage) < OLD_UNTIL:
        # The old store, with the write that was only in its WAL.
        assert now == {
            "admin_tokens": {"first admin", "late"},
            "restored": 0,
            "revoked_credentials": 1,
        }
    else:
        # The new store, with the revocation carried over although the backup has it open.
        assert now == {"admin_tokens": {"first admin"}, "restored": 1, "revoked_credentials": 1}

    # Either way, a restore run again completes and ends in the new store.
    host.cli("restore", str(template["backup"]), "--yes")
    assert store_state(state)["admin_tokens"] == {"first admin"}
    assert store_state(state)["revoked_credentials"] == 1
    with host.serving():
        assert host.publish(template["kept"]) == 401
