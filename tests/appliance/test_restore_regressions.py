"""Regression tests for the ways backup and restore used to lose a revocation or a store.

Each test is named for what broke: chained restores reviving secrets, a backup written over
the live store, an empty schema_version table restored as an empty store, a failed migration
leaving its staged copy, CLI writes lost to a concurrent restore, and unsafe backup paths.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import requests

from .test_backup_restore import NODES, Host

STATE_FILES = {"modelforge.sqlite3", "modelforge.sqlite3-wal", "modelforge.sqlite3-shm"}


def admin_answer(host: Host, token: str) -> int:
    headers = {"X-ModelForge-Admin-Token": token}
    return requests.get(f"{host.url}{NODES}", headers=headers, timeout=10).status_code


def admin_token_ids(host: Host) -> set[str]:
    rows = json.loads(host.cli("admin-token", "list", "--json").stdout)["admin_tokens"]
    return {row["token_id"] for row in rows}


def leftovers(host: Host) -> list[str]:
    """Files in the state directory other than the store, its WAL/SHM and the lock."""
    state = Path(host.env["MODELFORGE_STATE_DIR"])
    return sorted(
        p.name for p in state.iterdir() if p.name not in STATE_FILES | {"modelforge.lock"}
    )


def one_line_refusal(result, *phrases: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelforge: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_two_restores_in_a_row_keep_revocations_whose_rows_the_older_backup_lacks(tmp_path):
    host = Host(tmp_path)
    b0, b1 = tmp_path / "b0.sqlite3", tmp_path / "b1.sqlite3"
    host.cli("backup", str(b0))
    with host.serving():
        x = host.enroll("gpu-x")
        t2 = json.loads(host.cli("admin-token", "create", "--name", "t2", "--json").stdout)
        host.cli("backup", str(b1))
        host.delete(f"{NODES}/{x['node_id']}/credential")
        host.cli("admin-token", "revoke", t2["token_id"])
        assert host.publish(x) == 401
        assert admin_answer(host, t2["admin_token"]) == 401
    first = json.loads(host.cli("restore", str(b0), "--yes", "--json").stdout)
    host.cli("restore", str(b1), "--yes")
    with host.serving():
        assert host.publish(x) == 401
        assert admin_answer(host, t2["admin_token"]) == 401
        # And what B1 holds that was never revoked still works.
        assert admin_answer(host, host.admin["X-ModelForge-Admin-Token"]) == 200
    # B0 has neither row, yet both revocations travelled on in the finality record.
    assert first["finality_record"]["carried_from_current_store"] >= 2


def test_backup_refuses_the_live_store_its_wal_and_its_shm(tmp_path):
    host = Host(tmp_path)
    store = tmp_path / "state" / "modelforge.sqlite3"
    alias = tmp_path / "alias.sqlite3"
    alias.symlink_to(store)
    with host.serving():
        node = host.enroll("gpu-a")
        for target in (store, Path(f"{store}-wal"), Path(f"{store}-shm"), alias):
            assert target.exists()
            one_line_refusal(host.cli("backup", str(target), check=False), "the store")
        host.delete(f"{NODES}/{node['node_id']}/credential")
    with host.serving():
        # Every write since the refused backups is still there after a restart.
        assert host.publish(node) == 401
        assert host.get(f"{NODES}/{node['node_id']}").status_code == 200
    # Also by name when the server is stopped and the WAL is gone: a backup there would be
    # taken for the store's WAL by the next start.
    assert not Path(f"{store}-wal").exists()
    one_line_refusal(host.cli("backup", f"{store}-wal", check=False), "the store")
    assert not Path(f"{store}-wal").exists()


def test_restore_refuses_schema_version_zero_and_missing_tables(tmp_path):
    host = Host(tmp_path)
    with host.serving():
        node = host.enroll("gpu-a")
    empty_versions = tmp_path / "zero.sqlite3"
    host.cli("backup", str(empty_versions))
    with sqlite3.connect(empty_versions) as db:
        db.execute("DELETE FROM schema_version")
    db.close()
    one_line_refusal(
        host.cli("restore", str(empty_versions), "--yes", check=False), "schema version 0"
    )
    lacking = tmp_path / "lacking.sqlite3"
    host.cli("backup", str(lacking))
    with sqlite3.connect(lacking) as db:
        db.execute("DROP TABLE decommission_confirmation")
    db.close()
    one_line_refusal(
        host.cli("restore", str(lacking), "--yes", check=False), "decommission_confirmation"
    )
    # The store was not replaced: its admin token and node are still there.
    assert [n["node_id"] for n in json.loads(host.cli("nodes", "--json").stdout)["nodes"]] == [
        node["node_id"]
    ]
    assert len(admin_token_ids(host)) == 1
    assert leftovers(host) == []


def test_a_backup_that_fails_to_migrate_is_refused_in_one_line_and_leaves_no_staged_copy(
    tmp_path,
):
    host = Host(tmp_path)
    broken = tmp_path / "broken.sqlite3"
    host.cli("backup", str(broken))
    # Claims schema version 1 but already has version 2's table: migration 2 cannot run.
    with sqlite3.connect(broken) as db:
        db.execute("DELETE FROM schema_version WHERE version > 1")
    db.close()
    before = admin_token_ids(host)
    one_line_refusal(host.cli("restore", str(broken), "--yes", check=False), "migrat")
    assert leftovers(host) == []
    assert admin_token_ids(host) == before


def test_commands_that_write_are_refused_while_a_restore_runs(tmp_path):
    host = Host(tmp_path)
    backup = tmp_path / "b.sqlite3"
    spare = json.loads(host.cli("admin-token", "create", "--name", "spare", "--json").stdout)
    with host.serving():
        node = host.enroll("gpu-a")
    host.cli("backup", str(backup))
    restore = host.start_cli_stopping_at("locked", "pause", "restore", str(backup), "--yes")
    try:
        assert restore.stdout.readline().strip() == "paused at locked"
        for args in (
            ("admin-token", "revoke", spare["token_id"]),
            ("nodes", "revoke", node["node_id"]),
            ("admin-token", "create", "--name", "late"),
            ("enroll", "--name", "late"),
            ("init",),
            ("backup", str(tmp_path / "during.sqlite3")),
        ):
            one_line_refusal(host.cli(*args, check=False), "a restore is running")
        serve = host.cli("serve", "--listen", f"127.0.0.1:{host.port}", check=False)
        assert serve.returncode == 2 and "a restore is running" in serve.stderr
    finally:
        out, err = restore.communicate("\n", timeout=60)
    assert restore.returncode == 0, err
    assert not (tmp_path / "during.sqlite3").exists()
    # What the refused commands did not do is not done; nothing claims otherwise.
    with host.serving():
        assert admin_answer(host, spare["admin_token"]) == 200
        assert host.publish(node) == 200


def test_backup_into_a_missing_directory_is_one_clear_line(tmp_path):
    host = Host(tmp_path)
    missing = tmp_path / "no-such-dir" / "b.sqlite3"
    one_line_refusal(host.cli("backup", str(missing), check=False), "does not exist")
    assert not missing.parent.exists()


def test_backup_does_not_overwrite_a_file_that_is_not_a_backup_unless_forced(tmp_path):
    host = Host(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    one_line_refusal(host.cli("backup", str(notes), check=False), "--force")
    assert notes.read_text() == "precious\n"
    # An earlier backup at the same name is replaced without asking (rotating names)...
    backup = tmp_path / "b.sqlite3"
    host.cli("backup", str(backup))
    host.cli("admin-token", "create", "--name", "second")
    host.cli("backup", str(backup))
    with sqlite3.connect(backup) as db:
        assert db.execute("SELECT COUNT(*) FROM admin_token").fetchone() == (2,)
    db.close()
    # ...and --force replaces anything.
    host.cli("backup", str(notes), "--force")
    with sqlite3.connect(notes) as db:
        assert db.execute("SELECT COUNT(*) FROM admin_token").fetchone() == (2,)
    db.close()


def test_paths_with_hash_and_question_mark_are_plain_file_names(tmp_path):
    host = Host(tmp_path)
    backups = tmp_path / "backups"
    backups.mkdir()
    hashed = backups / "a#b.sqlite3"
    done = json.loads(host.cli("backup", str(hashed), "--json").stdout)
    assert done["backup"] == str(hashed) and done["schema_version"] >= 1
    assert sorted(p.name for p in backups.iterdir()) == ["a#b.sqlite3"]  # no stray "a"
    # Restoring "b.sqlite3?x" must read that file, not its namesake "b.sqlite3".
    wanted = backups / "b.sqlite3?x"
    host.cli("admin-token", "create", "--name", "only-in-wanted")
    host.cli("backup", str(wanted))
    decoy = backups / "b.sqlite3"
    host.cli("admin-token", "create", "--name", "only-in-decoy")
    host.cli("backup", str(decoy))
    host.cli("restore", str(wanted), "--yes")
    names = {
        row["name"]
        for row in json.loads(host.cli("admin-token", "list", "--json").stdout)["admin_tokens"]
    }
    assert "only-in-wanted" in names and "only-in-decoy" not in names
    host.cli("restore", str(hashed), "--yes")
    assert len(admin_token_ids(host)) == 1
    assert sorted(p.name for p in backups.iterdir()) == ["a#b.sqlite3", "b.sqlite3", "b.sqlite3?x"]


def test_backup_neither_follows_nor_removes_a_planted_temporary_name(tmp_path):
    host = Host(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    backups = tmp_path / "backups"
    backups.mkdir()
    planted = [backups / ".b.sqlite3.partial", backups / ".b.sqlite3.partial-journal"]
    for name in planted:
        name.symlink_to(victim)
    host.cli("backup", str(backups / "b.sqlite3"))
    assert victim.read_text() == "keep me\n"
    for name in planted:
        assert name.is_symlink()
    assert sorted(p.name for p in backups.iterdir()) == sorted(
        [".b.sqlite3.partial", ".b.sqlite3.partial-journal", "b.sqlite3"]
    )
