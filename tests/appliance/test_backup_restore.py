"""Backup while serving, restore while stopped: the runbook's restore path, end to end."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from modelforge_appliance.cli.serve import SERVE_LOCK_NAME
from tests.harness.control_plane import clean_env, free_port, invoke_cli, new_identity, serving

NODES = "/api/v1/admin/hardware/nodes"
AGENT = {"X-ModelForge-Agent-Protocol": "1"}

# The CLI with backup.reached_stage replaced: at the named stage it SIGKILLs itself ("kill")
# or prints "paused at STAGE" and waits for a line on stdin ("pause"). Tests only: the
# stage and action are this wrapper's own first two arguments, never a setting.
_STOPPING_CLI = """
import os, signal, sys
from modelforge_appliance.store import backup
stage, action = sys.argv[1:3]
del sys.argv[1:3]
def reached(name):
    if name != stage:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("paused at " + name, flush=True)
    sys.stdin.readline()
backup.reached_stage = reached
from modelforge_appliance.cli.main import main
main(prog_name="modelforge")
"""


class Host:
    """A control-plane host: its state directory and the ``modelforge`` CLI on it."""

    def __init__(
        self, tmp_path: Path, admin_token: str | None = None, database_url: str | None = None
    ) -> None:
        """A host on tmp_path/state, initialised there unless its admin token is given."""
        self.env = clean_env()
        self.env["MODELFORGE_STATE_DIR"] = str(tmp_path / "state")
        if database_url:
            self.env["MODELFORGE_DATABASE_URL"] = database_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        if admin_token is None:
            admin_token = json.loads(self.cli("init", "--json").stdout)["admin_token"]
        self.admin = {"X-ModelForge-Admin-Token": admin_token}

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return invoke_cli(*args, env=self.env, check=check)

    def start_cli_stopping_at(self, stage: str, action: str, *args: str) -> subprocess.Popen:
        """The CLI run as a child that SIGKILLs itself or pauses at a named restore stage."""
        return subprocess.Popen(
            [sys.executable, "-c", _STOPPING_CLI, stage, action, *args],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @contextmanager
    def serving(self):
        """Its control plane, always on the same port, until the block ends."""
        with serving(self.env, self.log, self.port) as (_, process):
            yield process

    def mint(self, name: str = "gpu") -> str:
        return requests.post(
            f"{self.url}/api/v1/admin/node-enrollments",
            headers=self.admin,
            json={"display_name": name, "expires_in_seconds": 900},
            timeout=10,
        ).json()["token"]

    def delete(self, path: str) -> None:
        assert requests.delete(self.url + path, headers=self.admin, timeout=10).status_code == 200

    def enroll(self, hostname: str) -> dict:
        return self.enroll_with(self.mint(hostname), hostname)

    def enroll_with(self, token: str, hostname: str, check: bool = True):
        """The enrollment answer; with check=False only its status."""
        body = {
            "token": token,
            "hostname": hostname,
            "agent_version": "0.1.0",
            "accelerator_mode": "cpu",
            "identity": new_identity(),
        }
        response = requests.post(
            f"{self.url}/api/v1/agent/enroll", json=body, headers=AGENT, timeout=10
        )
        if not check:
            return response.status_code
        assert response.status_code == 201
        return response.json()

    def publish(self, node: dict, what: str = "heartbeat") -> int:
        headers = {**AGENT, "Authorization": f"Bearer {node['credential']}"}
        if what == "heartbeat":
            body = {
                "node_id": node["node_id"],
                "agent_version": "0.1.0",
                "health": {
                    "status": "ok",
                    "gpu_probe": "not_applicable",
                    "worker": {"reachable": True, "protocol": 1},  # a runtime worker beside it
                },
            }
            return requests.post(
                f"{self.url}/api/v1/agent/heartbeat", json=body, headers=headers, timeout=10
            ).status_code
        body = {"node_id": node["node_id"], "agent_version": "0.1.0", "accelerators": []}
        return requests.put(
            f"{self.url}/api/v1/agent/inventory", json=body, headers=headers, timeout=10
        ).status_code

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, headers=self.admin, timeout=10)


@pytest.mark.slow
def test_restore_brings_back_what_existed_and_keeps_later_revocations(tmp_path):
    host = Host(tmp_path)
    backup = tmp_path / "backups" / "modelforge-backup.sqlite3"
    backup.parent.mkdir()
    with host.serving():
        kept, later_revoked = host.enroll("gpu-a"), host.enroll("gpu-c")
        retired = host.enroll("gpu-d")
        for node in (kept, later_revoked):
            assert host.publish(node) == 200 and host.publish(node, "inventory") == 200
        spare_token, late_token = host.mint("spare"), host.mint("late")
        scraper = json.loads(host.cli("admin-token", "create", "--name", "s", "--json").stdout)
        # Online backup while serving.
        assert json.loads(host.cli("backup", str(backup), "--json").stdout)["schema_version"] >= 1
        assert backup.stat().st_mode & 0o777 == 0o600
        # After the backup: a new node, and things made final that must stay final.
        newcomer = host.enroll("gpu-b")
        late = host.enroll_with(late_token, "gpu-e")
        host.delete(f"{NODES}/{later_revoked['node_id']}/credential")
        spare_id = spare_token.split("_")[1]
        host.delete(f"/api/v1/admin/node-enrollments/{spare_id}")
        host.cli("admin-token", "revoke", scraper["token_id"])
        host.cli("nodes", "decommission", retired["node_id"], "--yes")
        refused = host.cli("restore", str(backup), "--yes", check=False)
        assert refused.returncode == 2
        assert "stop it" in refused.stderr

    restored = json.loads(host.cli("restore", str(backup), "--yes", "--json").stdout)
    assert restored["kept_from_current_store"] == {
        "credentials": 2,  # later_revoked's, and retired's (revoked by its decommission)
        "admin_tokens": 1,
        "enrollment_tokens": 2,  # late (spent after the backup) and spare (revoked)
        "decommissioned_nodes": 1,
        # Previewed and used after the backup: the backup has no row for it.
        "decommission_confirmations": 0,
        "api_keys": 0,
    }

    with host.serving():
        # Final things stayed final.
        assert host.enroll_with(late_token, "gpu-e2", check=False) == 410
        assert host.enroll_with(spare_token, "gpu-f", check=False) == 410
        scraper_headers = {"X-ModelForge-Admin-Token": scraper["admin_token"]}
        assert (
            requests.get(f"{host.url}{NODES}", headers=scraper_headers, timeout=10).status_code
            == 401
        )
        assert host.publish(retired) == 403
        assert host.get(f"{NODES}/{retired['node_id']}").json()["liveness"] == "decommissioned"
        assert host.get(f"{NODES}/{late['node_id']}").status_code == 404
    with host.serving():
        # The node that existed reconnects on its own with its restored credential.
        assert host.publish(kept) == 200
        # The node that did not exist is gone, and so is its credential.
        assert host.get(f"{NODES}/{newcomer['node_id']}").status_code == 404
        assert host.publish(newcomer) == 401
        # A revocation made after the backup survives the restore (invariant 5).
        assert host.publish(later_revoked) == 401
        # Inventory is stale until the agent measures and publishes again.
        checks = {
            c["name"]: c for c in host.get(f"{NODES}/{kept['node_id']}/readiness").json()["checks"]
        }
        assert not checks["inventory_age"]["ok"]
        assert "restore" in checks["inventory_age"]["detail"]
        assert host.publish(kept, "inventory") == 200
        assert host.get(f"{NODES}/{kept['node_id']}/readiness").json()["ready"] is True
        events = host.get("/api/v1/admin/audit-events").json()["events"]
        assert "store.restored" in {e["action"] for e in events}


def test_restore_refuses_a_file_that_is_not_a_backup(tmp_path):
    host = Host(tmp_path)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database at all" * 100)
    result = host.cli("restore", str(junk), "--yes", check=False)
    assert result.returncode == 2
    assert "not a ModelForge backup" in result.stderr
    missing = host.cli("restore", str(tmp_path / "nope"), "--yes", check=False)
    assert missing.returncode == 2


def test_restore_asks_before_replacing(tmp_path):
    host = Host(tmp_path)
    backup = tmp_path / "b.sqlite3"
    host.cli("backup", str(backup))
    result = host.cli("restore", str(backup), check=False)  # no --yes, no answer on stdin
    assert result.returncode == 1
    assert "nothing was changed" in result.stderr


@pytest.mark.slow
def test_nodes_cli_readiness_revoke_cordon_decommission(tmp_path):
    host = Host(tmp_path)
    with host.serving():
        node = host.enroll("gpu-a")
        assert host.publish(node) == 200
    node_id = node["node_id"]
    listed = json.loads(host.cli("nodes", "--json").stdout)["nodes"]
    assert [n["node_id"] for n in listed] == [node_id]
    not_ready = host.cli("nodes", "readiness", node_id, check=False)
    assert not_ready.returncode == 1 and "NOT READY" in not_ready.stdout
    assert "next:" in not_ready.stdout
    cordoned = json.loads(host.cli("nodes", "cordon", node_id, "--json").stdout)
    assert cordoned["cordoned"] is True
    revoked = json.loads(host.cli("nodes", "revoke", node_id, "--json").stdout)
    assert len(revoked["revoked"]) == 1
    creds = json.loads(host.cli("nodes", "credentials", node_id, "--json").stdout)
    assert (creds["active"], creds["revoked"]) == (0, 1)
    declined = host.cli("nodes", "decommission", node_id, check=False)
    assert declined.returncode == 1 and "free hostname:      gpu-a" in declined.stdout
    done = json.loads(host.cli("nodes", "decommission", node_id, "--yes", "--json").stdout)
    assert done["effects"]["hostname_freed"] == "gpu-a"
    shown = json.loads(host.cli("nodes", "show", node_id, "--json").stdout)
    assert shown["liveness"] == "decommissioned"
    unknown = host.cli("nodes", "readiness", "no-such-node", check=False)
    assert unknown.returncode == 7 and "no node 'no-such-node'" in unknown.stderr  # not found
    assert "No active alerts." in host.cli("alerts").stdout


def test_restore_over_an_unreadable_store_needs_consent_to_lose_its_revocations(tmp_path):
    host = Host(tmp_path)
    backup = tmp_path / "b.sqlite3"
    host.cli("backup", str(backup))
    store = tmp_path / "state" / "modelforge.sqlite3"
    store.write_bytes(b"\0garbage" * 4096)
    refused = host.cli("restore", str(backup), "--yes", check=False)
    assert refused.returncode == 2
    assert "--accept-lost-revocations" in refused.stderr
    assert store.read_bytes().startswith(b"\0garbage")  # nothing was changed
    done = host.cli("restore", str(backup), "--yes", "--accept-lost-revocations", "--json")
    answer = json.loads(done.stdout)
    assert set(answer["kept_from_current_store"].values()) == {0}
    assert answer["finality_record"]["carried_from_current_store"] == 0
    assert json.loads(host.cli("nodes", "--json").stdout) == {"nodes": []}


STATE_FILES = {"modelforge.sqlite3", "modelforge.sqlite3-wal", "modelforge.sqlite3-shm"}


def admin_answer(host: Host, token: str) -> int:
    headers = {"X-ModelForge-Admin-Token": token}
    return requests.get(f"{host.url}{NODES}", headers=headers, timeout=10).status_code


def admin_token_ids(host: Host) -> set[str]:
    rows = json.loads(host.cli("admin-token", "list", "--json").stdout)["admin_tokens"]
    return {row["token_id"] for row in rows}


def leftovers(host: Host) -> list[str]:
    """Files in the state directory other than the store, its WAL/SHM and the locks (the
    state lock, and serve's: one serve per state directory)."""
    state = Path(host.env["MODELFORGE_STATE_DIR"])
    locks = {"modelforge.lock", SERVE_LOCK_NAME}
    return sorted(p.name for p in state.iterdir() if p.name not in STATE_FILES | locks)


def one_line_refusal(result, *phrases: str) -> None:
    """Exit 2 and one line saying why (after the line that names the store, if the command
    got that far: every command says which store it uses)."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    if len(lines) == 2 and lines[0].startswith("modelforge: store "):
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("modelforge: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_two_restores_in_a_row_keep_revocations_whose_rows_the_older_backup_lacks(tmp_path):
    """Chained restores revived secrets: restoring an older backup, then a newer one,
    brought back a credential and an admin token revoked after the newer backup, because
    the older backup lacks their rows. The finality record carries both revocations on."""
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
    """A backup could be written over the live store, its WAL or its SHM (by name or
    through a symlink), destroying the store or what the next start replays: each is
    refused in one line, and every write since is still there after a restart."""
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
    """A backup whose schema_version table was empty was restored as an empty store, and
    one lacking a table was accepted: both are refused in one line, and the store is not
    replaced."""
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
    """A backup that failed to migrate left its staged copy in the state directory: the
    restore is refused in one line, nothing is left behind and the store is unchanged."""
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
    """CLI writes made while a restore ran were lost when the restore replaced the store:
    every command that writes, serve included, is refused in one line while a restore runs."""
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
    """A backup into a directory that does not exist must end in one line that says so, and
    create nothing."""
    host = Host(tmp_path)
    missing = tmp_path / "no-such-dir" / "b.sqlite3"
    one_line_refusal(host.cli("backup", str(missing), check=False), "does not exist")
    assert not missing.parent.exists()


def test_backup_into_an_unwritable_directory_is_one_clear_line(tmp_path):
    """A backup into an unwritable directory gave a misleading error. Not "store
    unreachable" (the store is fine), not a temporary file's name: which directory, why,
    and what to do."""
    host = Host(tmp_path)
    if os.geteuid() == 0:
        closed = Path("/sys")  # takes no new files, not even from root
    else:
        closed = tmp_path / "closed"
        closed.mkdir(mode=0o500)
    refused = host.cli("backup", str(closed / "b.sqlite3"), check=False)
    one_line_refusal(refused, f"cannot write the backup into {closed}", "install -d -o")
    assert ".b.sqlite3." not in refused.stderr


def test_backup_does_not_overwrite_a_file_that_is_not_a_backup_unless_forced(tmp_path):
    """backup overwrote whatever file its path named, a backup or not: an earlier backup at
    that name is replaced without asking, anything else only with --force."""
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
    """Backup and restore paths were read as SQLite URIs, so '#' ended the name (a backup
    to a#b.sqlite3 wrote a file 'a') and '?' began a query (restoring b.sqlite3?x read
    b.sqlite3): they are plain file names."""
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
    """backup wrote through a symlink planted at its temporary name (.NAME.partial and its
    journal), overwriting the file it points to: it neither follows nor removes such a
    name."""
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
