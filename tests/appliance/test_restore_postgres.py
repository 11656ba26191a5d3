"""The chained-restore case on PostgreSQL, run with the runbook's own commands.

The shell blocks of docs/runbooks/backup-restore.md are read from the file and run as
written against the real PostgreSQL of scripts/test (pg_dump, save-finality, the database
re-created by the superuser, pg_restore, restore-finality), with the control plane's own login
role owning its database as in a real install; only the example URLs, the example database and
role names, the backup directory and `systemctl` (this test starts and stops `modelforge serve`
itself) are replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import pytest

from modelforge_appliance.store.database import open_database
from modelforge_appliance.store.migrations import MIGRATIONS
from tests.harness.control_plane import fresh_postgres_database, postgres_admin_url
from tests.harness.old_schema import downgrade

from .test_backup_restore import NODES, Host, admin_answer

# every_python: the one PostgreSQL module the other CPythons run too (scripts/lib/pythons.sh),
# so psycopg2's compiled module for each of them meets the real server.
pytestmark = [pytest.mark.postgres, pytest.mark.every_python]

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "runbooks" / "backup-restore.md"


def runbook_block(containing: str) -> str:
    blocks = re.findall(r"```bash\n(.*?)```", RUNBOOK.read_text(), re.S)
    matching = [block for block in blocks if containing in block]
    assert len(matching) == 1, f"one runbook block with {containing!r}"
    return matching[0]


@contextlib.contextmanager
def database_of_its_own() -> Iterator[tuple[str, str, str]]:
    """(URL, role, database): a login role without special rights that owns a new database,
    as a PostgreSQL install for the control plane has it; both dropped afterwards."""
    admin_url = postgres_admin_url()
    suffix = secrets.token_hex(6)
    role, name = f"mf_role_{suffix}", f"mf_test_{suffix}"
    conn = psycopg2.connect(admin_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE ROLE "{role}" LOGIN')
            cur.execute(f'CREATE DATABASE "{name}" OWNER "{role}"')
        parts = urlsplit(admin_url)
        netloc = f"{role}@{parts.hostname}:{parts.port}"
        yield urlunsplit(parts._replace(netloc=netloc, path=f"/{name}")), role, name
    finally:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
            cur.execute(f'DROP ROLE IF EXISTS "{role}"')
        conn.close()


# The runbook's example names, and what the test puts in their place.
EXAMPLE_NAMES = (
    ("'DROP DATABASE modelforge'", "'DROP DATABASE \"{database}\"'"),
    (
        "'CREATE DATABASE modelforge OWNER modelforge'",
        '\'CREATE DATABASE "{database}" OWNER "{role}"\'',
    ),
)


def run_runbook(
    block: str, cwd: Path, env: dict, backups: Path, role: str = "", database: str = ""
) -> None:
    block = block.replace("/var/backups/modelforge", str(backups))
    for example, ours in EXAMPLE_NAMES:
        if example in block:
            block = block.replace(example, ours.format(role=role, database=database))
    lines = [
        line
        for line in block.splitlines()
        if not line.startswith(("systemctl ", "export PGURL=", "export PGSUPERURL="))
    ]
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    result = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"


def as_before_the_record(url: str) -> None:
    """Make the database exactly what a release before the finality record (schema 2) left,
    rows included: the record and its triggers, the console's tables and every later column
    are gone, as in a real dump from then."""
    db = open_database(url)
    try:
        downgrade(db, 2)
    finally:
        db.close()


@pytest.mark.parametrize("dumps", ["with the record", "from before the record"])
def test_two_restores_in_a_row_keep_revocations_on_postgresql(tmp_path, dumps):
    """A dump from before the record is a real schema-2 database: restoring it must not keep
    anything a later migration made in the current one (pg_restore --clean left the console's
    tables behind, and migrating the restored database then failed on them)."""
    pg_bin = next(Path("/usr/lib/postgresql").glob("*/bin"), None)
    assert pg_bin is not None, "scripts/test installs PostgreSQL"
    before = dumps == "from before the record"
    with database_of_its_own() as (url, role, database):
        host = Host(tmp_path / "host", database_url=url)
        env = {
            **host.env,
            "PGURL": url,
            "PGSUPERURL": postgres_admin_url(),
            "PATH": f"{pg_bin}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        backups = tmp_path / "backups"
        backups.mkdir()
        d0, d1 = tmp_path / "d0", tmp_path / "d1"
        d0.mkdir()
        d1.mkdir()
        dump = runbook_block("--file=modelforge.dump")
        restore = runbook_block("restore-finality")
        assert all(example in restore for example, _ in EXAMPLE_NAMES)

        if before:
            as_before_the_record(url)
        run_runbook(dump, d0, env, backups)
        with host.serving():
            x = host.enroll("gpu-x")
            t2 = json.loads(host.cli("admin-token", "create", "--name", "t2", "--json").stdout)
        if before:
            as_before_the_record(url)
        run_runbook(dump, d1, env, backups)
        with host.serving():  # this release again: migrated, the record filled in from rows
            host.delete(f"{NODES}/{x['node_id']}/credential")
            host.cli("admin-token", "revoke", t2["token_id"])
            assert host.publish(x) == 401
            assert admin_answer(host, t2["admin_token"]) == 401

        run_runbook(restore, d0, env, backups, role, database)
        run_runbook(restore, d1, env, backups, role, database)
        with host.serving():
            assert host.publish(x) == 401
            assert admin_answer(host, t2["admin_token"]) == 401
            assert admin_answer(host, host.admin["X-ModelForge-Admin-Token"]) == 200
            events = host.get("/api/v1/admin/audit-events").json()["events"]
            assert "store.finality_restored" in {e["action"] for e in events}
        # The restored database is this release's schema, owned by the control plane's role.
        conn = psycopg2.connect(url)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT MAX(version) FROM schema_version")
                assert cur.fetchone() == (MIGRATIONS[-1].version,)
                cur.execute("SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'")
                assert cur.fetchall() == [(role,)]
        finally:
            conn.close()
        # One record file per restore, named by the second (two in one second share a name:
        # the later record holds everything the earlier one did).
        saved = sorted(backups.iterdir())
        assert saved and all(p.stat().st_mode & 0o777 == 0o600 for p in saved)


def test_the_state_lock_reaches_across_hosts_on_postgresql(tmp_path):
    """Two hosts, one database: each has its own state directory, and the lock still holds."""
    with fresh_postgres_database() as url:
        a = Host(tmp_path / "a", database_url=url)
        b = Host(tmp_path / "b", admin_token=a.admin["X-ModelForge-Admin-Token"], database_url=url)
        record = tmp_path / "record.json"
        b.cli("save-finality", str(record))
        with a.serving():
            refused = b.cli("restore-finality", str(record), check=False)
            assert refused.returncode == 2, refused.stderr
            assert "possibly from another host" in refused.stderr
        paused = a.start_cli_stopping_at("locked", "pause", "restore-finality", str(record))
        try:
            assert paused.stdout.readline().strip() == "paused at locked"
            for args in (("admin-token", "create", "--name", "late"), ("init",)):
                result = b.cli(*args, check=False)
                assert result.returncode == 2 and "a restore is running" in result.stderr
        finally:
            _, err = paused.communicate("\n", timeout=60)
        assert paused.returncode == 0, err
        assert b.cli("admin-token", "create", "--name", "after").returncode == 0
