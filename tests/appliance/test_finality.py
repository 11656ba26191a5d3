"""The finality record on both stores: the store keeps it itself, it only grows, stores from
before it are filled in from their rows, and a saved record carries over (restore-finality)."""

from __future__ import annotations

import json
import subprocess

import peewee as pw
import pytest

from modelforge_appliance import lifecycle
from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.identity import admin_tokens, enrollment
from modelforge_appliance.store import backup, finality, tables
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.migrations import MIGRATIONS
from modelforge_appliance.store.tables import Finality
from tests.harness.control_plane import clean_env, invoke_cli, make_settings, new_identity
from tests.harness.old_schema import downgrade

ORIGIN = "http://127.0.0.1:8000"


def claim(store: Store, token: str, identity: dict) -> enrollment.Enrolled:
    return enrollment.claim_token(
        store,
        enrollment.EnrollRequest(
            token=token,
            hostname="gpu",
            agent_version="0.1.0",
            accelerator_mode="cpu",
            protocol_version=1,
            request_origin=ORIGIN,
            identity_id=identity["identity_id"],
            identity_secret=identity["identity_secret"],
        ),
    )


def mint(store: Store) -> str:
    return enrollment.mint_enrollment_token(
        store, display_name="gpu", expires_in_seconds=900, api_origin=ORIGIN, actor="cli"
    ).token


def record(store: Store) -> set[tuple[str, str]]:
    with store.connection():
        return {(row.kind, row.subject_id) for row in Finality.select()}


@pytest.fixture
def store(database_url):
    store = Store(database_url, ManualClock())
    store.migrate()
    yield store
    store.close()


def test_every_revocation_and_spent_secret_lands_in_the_record(store):
    admin, _ = admin_tokens.create_admin_token(store, "t", "cli")
    spare = mint(store)
    used = mint(store)
    identity = new_identity()
    node = claim(store, used, identity).node
    enrollment.revoke_enrollment(store, spare.split("_")[1], "cli")
    first = lifecycle.revoke_node_credential(store, node, "cli")
    second = claim(store, mint(store), identity)  # the decommission below revokes its credential
    admin_tokens.revoke_admin_token(store, admin.token_id, "cli")
    plan = lifecycle.preview_decommission(store, node.node_id, "cli")
    lifecycle.execute_decommission(store, node.node_id, plan["confirmation"], "cli")
    assert record(store) >= {
        ("enrollment_token", spare.split("_")[1]),
        ("enrollment_token", used.split("_")[1]),
        ("credential", first["revoked"][0]),
        ("credential", second.credential.split("_")[1]),
        ("admin_token", admin.token_id),
        ("node", node.node_id),
        ("identity", identity["identity_id"]),
        ("decommission_confirmation", plan["confirmation"].split("_")[1]),
    }
    # Ids and times only, never a secret or a digest.
    with store.connection():
        stored = json.dumps([list(row) for row in store.db.execute_sql("SELECT * FROM finality")])
    for secret in (spare, used, second.credential, plan["confirmation"]):
        assert secret.split("_", 2)[2] not in stored  # the secret part may hold "_" itself


def test_the_record_only_grows(store):
    row, _ = admin_tokens.create_admin_token(store, "t", "cli")
    admin_tokens.revoke_admin_token(store, row.token_id, "cli")
    for statement in (
        "UPDATE finality SET final_at = 0",
        "DELETE FROM finality",
        *(() if store.is_sqlite else ("TRUNCATE finality",)),
    ):
        with pytest.raises(pw.DatabaseError, match="only grows"), store.write():
            store.db.execute_sql(statement)
    assert record(store) == {("admin_token", row.token_id)}


def test_a_store_from_before_the_record_gets_it_from_its_rows(tmp_path, database_url):
    """Migration 3 fills the record in from what a schema-2 store already made final."""
    old = Store(database_url, ManualClock())
    old.db.connect()
    with old.write():
        old.db.create_tables([tables.SchemaVersion])
        for migration in MIGRATIONS[:2]:
            migration.apply(old.db)
            tables.SchemaVersion.create(version=migration.version, name="x", applied_at=0)
    # A revoked admin token, written as a schema-2 store holds one (today's code writes
    # columns that store does not have).
    token_id = "0123456789abcdef"
    with old.write():
        old.db.execute_sql(
            "INSERT INTO admin_token (token_id, name, digest, created_at, revoked_at) "
            "VALUES (?, 't', 'x', 1, 2)".replace("?", old.db.param),
            (token_id,),
        )
    assert old.migrate() == [m.version for m in MIGRATIONS[2:]]
    assert record(old) == {("admin_token", token_id)}
    # Migrating again changes nothing; the migration is also safe to run twice (pg_restore).
    MIGRATIONS[2].apply(old.db)
    assert record(old) == {("admin_token", token_id)}
    old.close()


def test_a_retired_identity_never_enrolls_again_even_where_its_node_is_gone(tmp_path):
    settings = make_settings(tmp_path / "state")
    clock = ManualClock()
    store = Store(settings.database_url, clock)
    store.migrate()
    before = tmp_path / "before.sqlite3"
    backup.backup(settings, before)
    identity = new_identity()
    node = claim(store, mint(store), identity).node
    plan = lifecycle.preview_decommission(store, node.node_id, "cli")
    lifecycle.execute_decommission(store, node.node_id, plan["confirmation"], "cli")
    store.close()
    backup.restore(settings, before, clock)  # a store in which the node never existed
    store = Store(settings.database_url, clock)
    store.migrate()
    with pytest.raises(enrollment.Forbidden) as refused:
        claim(store, mint(store), identity)
    assert refused.value.code == "NODE_DECOMMISSIONED"
    store.close()


def test_chained_restores_of_backups_from_before_the_record(tmp_path):
    """B0 and B1 both predate migration 3; the record still outlives both restores."""
    settings = make_settings(tmp_path / "state")
    clock = ManualClock()
    store = Store(settings.database_url, clock)
    store.migrate()

    def backup_as_schema_2(path):
        """A backup exactly as a release before the record wrote it: none of migrations 3+."""
        backup.backup(settings, path)
        db = pw.SqliteDatabase(str(path))
        downgrade(db, 2)
        db.close()

    b0, b1 = tmp_path / "b0.sqlite3", tmp_path / "b1.sqlite3"
    backup_as_schema_2(b0)
    row, secret = admin_tokens.create_admin_token(store, "t2", "cli")
    backup_as_schema_2(b1)
    admin_tokens.revoke_admin_token(store, row.token_id, "cli")
    store.close()
    backup.restore(settings, b0, clock)
    done = backup.restore(settings, b1, clock)
    assert done["backup_schema_version"] == 2
    assert done["kept_from_current_store"]["admin_tokens"] == 1
    store = Store(settings.database_url, clock)
    store.migrate()
    with pytest.raises(admin_tokens.Unauthorized):
        admin_tokens.authenticate_admin(store, secret)
    store.close()


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return invoke_cli(*args, env=env)


def test_save_and_restore_finality_from_the_command_line(tmp_path):
    """The PostgreSQL procedure's two commands, here around a SQLite store put back by hand."""
    env = clean_env()
    env["MODELFORGE_STATE_DIR"] = str(tmp_path / "state")
    assert cli(env, "init").returncode == 0
    store_file = tmp_path / "state" / "modelforge.sqlite3"
    before, with_token = tmp_path / "before.sqlite3", tmp_path / "with-token.sqlite3"
    assert cli(env, "backup", str(before)).returncode == 0
    made = json.loads(cli(env, "admin-token", "create", "--name", "t", "--json").stdout)
    assert cli(env, "backup", str(with_token)).returncode == 0
    assert cli(env, "admin-token", "revoke", made["token_id"]).returncode == 0

    saved = tmp_path / "record.json"
    answer = json.loads(cli(env, "save-finality", str(saved), "--json").stdout)
    assert answer["entries"] == 1
    assert saved.stat().st_mode & 0o777 == 0o600
    assert made["admin_token"].split("_", 2)[2] not in saved.read_text()
    # An outside restore: an old file put back over the store, knowing nothing since.
    for suffix in ("-wal", "-shm"):
        store_file.with_name(store_file.name + suffix).unlink(missing_ok=True)
    store_file.write_bytes(before.read_bytes())
    carried = json.loads(cli(env, "restore-finality", str(saved), "--json").stdout)
    assert carried["finality_record"] == {"entries": 1, "carried": 1}
    # The record now travels on: a restore of a backup in which the token is still active
    # brings it back revoked.
    assert cli(env, "restore", str(with_token), "--yes").returncode == 0
    listed = json.loads(cli(env, "admin-token", "list", "--json").stdout)["admin_tokens"]
    revoked = {row["token_id"]: row["revoked_at"] is not None for row in listed}
    assert revoked[made["token_id"]] is True


@pytest.mark.parametrize(
    "content, phrase",
    [
        ("not json", "cannot be read"),
        ('{"format": "something else"}', "not a file written by"),
        ('{"format": "modelforge-finality-record", "version": 99}', "version 99"),
        (
            '{"format": "modelforge-finality-record", "version": 1, '
            '"entries": [{"kind": "spaceship", "subject_id": "x", "final_at": 1}]}',
            "unknown kind",
        ),
    ],
)
def test_restore_finality_refuses_a_file_that_is_not_a_record(tmp_path, content, phrase):
    env = clean_env()
    env["MODELFORGE_STATE_DIR"] = str(tmp_path / "state")
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = cli(env, "restore-finality", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert phrase in result.stderr
    assert not (tmp_path / "state" / "modelforge.sqlite3").exists()  # nothing was touched


def test_save_finality_does_not_overwrite_other_files(tmp_path):
    env = clean_env()
    env["MODELFORGE_STATE_DIR"] = str(tmp_path / "state")
    assert cli(env, "init").returncode == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    result = cli(env, "save-finality", str(notes))
    assert result.returncode == 2 and "not a finality record" in result.stderr
    assert notes.read_text() == "precious\n"
    saved = tmp_path / "r.json"
    assert cli(env, "save-finality", str(saved)).returncode == 0
    assert cli(env, "save-finality", str(saved)).returncode == 0  # a record is replaced
    assert finality.load(saved) == []
