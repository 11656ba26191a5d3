"""Backup while serving, restore while stopped: the runbook's restore path, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from ..support import clean_env, free_port, new_identity, run_cli, serving

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
        return run_cli(*args, env=self.env, check=check)

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
