"""The chained-restore case on PostgreSQL, run with the runbook's own commands.

The shell blocks of docs/runbooks/backup-restore.md are read from the file and run as
written against the real PostgreSQL of scripts/test (pg_dump, save-finality, pg_restore,
restore-finality); only the example URL, the backup directory and `systemctl` (this test
starts and stops `modelforge serve` itself) are replaced.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg2
import pytest

from ..support import fresh_postgres_database
from .test_backup_restore import NODES, Host
from .test_restore_regressions import admin_answer

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "runbooks" / "backup-restore.md"


def runbook_block(containing: str) -> str:
    blocks = re.findall(r"```bash\n(.*?)```", RUNBOOK.read_text(), re.S)
    matching = [block for block in blocks if containing in block]
    assert len(matching) == 1, f"one runbook block with {containing!r}"
    return matching[0]


def run_runbook(block: str, cwd: Path, env: dict, backups: Path) -> None:
    lines = [
        line
        for line in block.replace("/var/backups/modelforge", str(backups)).splitlines()
        if not line.startswith(("systemctl ", "export PGURL="))
    ]
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    result = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"


def drop_the_record(url: str) -> None:
    """Make the database what a release before the finality record left (schema 2)."""
    conn = psycopg2.connect(url)
    try:
        with conn, conn.cursor() as cur:
            cur.execute('DROP TABLE "finality" CASCADE')
            for kind in ("credential", "admin_token", "enrollment_token", "node"):
                cur.execute(f'DROP FUNCTION "{kind}_final"() CASCADE')
            cur.execute('DROP FUNCTION "decommission_confirmation_final"() CASCADE')
            cur.execute('DROP FUNCTION "finality_only_grows"() CASCADE')
            cur.execute("DELETE FROM schema_version WHERE version > 2")
    finally:
        conn.close()


@pytest.mark.parametrize("dumps", ["with the record", "from before the record"])
def test_two_restores_in_a_row_keep_revocations_on_postgresql(tmp_path, dumps):
    pg_bin = next(Path("/usr/lib/postgresql").glob("*/bin"), None)
    assert pg_bin is not None, "scripts/test installs PostgreSQL"
    with fresh_postgres_database() as url:
        host = Host(tmp_path / "host", database_url=url)
        env = {
            **host.env,
            "PGURL": url,
            "PATH": f"{pg_bin}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        backups = tmp_path / "backups"
        backups.mkdir()
        d0, d1 = tmp_path / "d0", tmp_path / "d1"
        d0.mkdir()
        d1.mkdir()
        dump = runbook_block("pg_dump ")
        restore = runbook_block("restore-finality")

        if dumps == "from before the record":
            drop_the_record(url)
        run_runbook(dump, d0, env, backups)
        with host.serving():
            x = host.enroll("gpu-x")
            t2 = json.loads(host.cli("admin-token", "create", "--name", "t2", "--json").stdout)
            if dumps == "from before the record":
                drop_the_record(url)
            run_runbook(dump, d1, env, backups)
            host.delete(f"{NODES}/{x['node_id']}/credential")
            host.cli("admin-token", "revoke", t2["token_id"])
            assert host.publish(x) == 401
            assert admin_answer(host, t2["admin_token"]) == 401

        run_runbook(restore, d0, env, backups)
        run_runbook(restore, d1, env, backups)
        with host.serving():
            assert host.publish(x) == 401
            assert admin_answer(host, t2["admin_token"]) == 401
            assert admin_answer(host, host.admin["X-ModelForge-Admin-Token"]) == 200
            events = host.get("/api/v1/admin/audit-events").json()["events"]
            assert "store.finality_restored" in {e["action"] for e in events}
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
