"""The fleet CLI: nodes named by prefix or hostname, detail, rename, enrollments, audit,
alerts for scripts, prompts, completion, and --json on every command."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from modelforge_contract import EXIT_CHECK_FAILED, EXIT_NOT_FOUND, EXIT_USAGE
from tests.harness.cli_fleet import fleet


def ids(result) -> list[str]:
    return [node["node_id"] for node in json.loads(result.stdout)["nodes"]]


def test_nodes_by_unique_prefix_or_hostname_and_ambiguity_refused(tmp_path):
    with fleet(tmp_path) as f:
        # 17 ids share a first hex digit for sure (pigeonhole), so a real ambiguous prefix exists.
        nodes = [f.enroll(f"host-{i}") for i in range(17)]
        first = Counter(node.node_id[0] for node in nodes).most_common(1)[0][0]
        sharing = sorted(n.node_id for n in nodes if n.node_id[0] == first)
        twin = f.enroll("host-0")  # a second enabled node claims host-0

        target = nodes[5]
        by_prefix = f.cli("nodes", "show", target.node_id[:13], "--json")
        assert by_prefix.returncode == 0, by_prefix.stderr
        assert json.loads(by_prefix.stdout)["node_id"] == target.node_id
        by_host = f.cli("nodes", "show", "HOST-5", "--json")
        assert json.loads(by_host.stdout)["node_id"] == target.node_id

        ambiguous = f.cli("nodes", "show", first)
        assert ambiguous.returncode == EXIT_USAGE, ambiguous.stderr
        assert ambiguous.stdout == ""
        assert all(node_id in ambiguous.stderr for node_id in sharing[:6])
        assert "Traceback" not in ambiguous.stderr

        same_host = f.cli("nodes", "cordon", "host-0")
        assert same_host.returncode == EXIT_USAGE
        assert twin.node_id in same_host.stderr and nodes[0].node_id in same_host.stderr

        missing = f.cli("nodes", "readiness", "no-such-host")
        assert missing.returncode == EXIT_NOT_FOUND
        assert missing.stderr.strip().splitlines()[-1].startswith("modelforge: no node")

        # Decommissioning the twin leaves host-0 naming exactly one enabled node again.
        done = f.cli("nodes", "decommission", twin.node_id[:8], "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(f.cli("nodes", "show", "host-0", "--json").stdout)["node_id"] == (
            nodes[0].node_id
        )


def test_nodes_show_details_and_rename(tmp_path):
    with fleet(tmp_path) as f:
        node = f.enroll("gpu-7", name="GPU Seven")
        inventory = {
            "node_id": node.node_id,
            "agent_version": "0.1.0",
            "host": {"os": "Debian 12", "kernel": "6.1.0", "cpu_count": 32},
            "accelerators": [],
            "storage_roots": [
                {"path": "/srv/a", "role": "artifacts", "total_bytes": 2**40, "free_bytes": 2**39}
            ],
        }
        put = f.plane.agent("PUT", "/api/v1/agent/inventory", node.credential, json=inventory)
        assert put.status_code == 200, put.text
        f.heartbeat(node)
        shown = f.cli("nodes", "show", "gpu-7")
        assert shown.returncode == 0, shown.stderr
        for expected in (
            node.node_id,
            "GPU Seven (gpu-7)",
            "offline, last heartbeat",  # 2001 by the fleet's clock: long ago for the CLI
            "ago",
            "Debian 12, kernel 6.1.0, 32 CPUs",
            "source       127.0.0.1",
            "/srv/a (artifacts): 512.0 GiB free of 1024.0 GiB",
            "health       ok, GPU probe not_applicable",
        ):
            assert expected in shown.stdout, (expected, shown.stdout)
        as_json = json.loads(f.cli("nodes", "show", node.node_id, "--json").stdout)
        assert as_json["host"]["cpu_count"] == 32
        assert as_json["source_address"] == "127.0.0.1"

        renamed = f.cli("nodes", "rename", "gpu-7", "Rack 3 / GPU 7", "--json")
        assert renamed.returncode == 0, renamed.stderr
        assert json.loads(renamed.stdout)["display_name"] == "Rack 3 / GPU 7"
        assert json.loads(renamed.stdout)["hostname"] == "gpu-7"
        bad = f.cli("nodes", "rename", "gpu-7", "x" * 121)
        assert bad.returncode == EXIT_USAGE and "display_name" in bad.stderr
        trail = json.loads(f.cli("audit", "--node", "gpu-7", "--json").stdout)["events"]
        assert trail[0]["action"] == "node.renamed"
        assert trail[0]["detail"] == {"display_name": "Rack 3 / GPU 7", "previous": "GPU Seven"}
        assert {e["node_id"] for e in trail} == {node.node_id}


def test_readiness_fails_the_cordoned_check(tmp_path):
    with fleet(tmp_path) as f:
        node = f.enroll("gpu-1")
        assert f.cli("nodes", "cordon", "gpu-1").returncode == 0
        answer = f.cli("nodes", "readiness", "gpu-1", "--json")
        assert answer.returncode == EXIT_CHECK_FAILED
        checks = {c["name"]: c for c in json.loads(answer.stdout)["checks"]}
        assert checks["cordoned"]["ok"] is False
        assert f"modelforge nodes uncordon {node.node_id}" in checks["cordoned"]["next_step"]
        assert f.cli("nodes", "uncordon", "gpu-1").returncode == 0
        answer = json.loads(f.cli("nodes", "readiness", "gpu-1", "--json").stdout)
        assert {c["name"]: c["ok"] for c in answer["checks"]}["cordoned"] is True


def test_nodes_shows_readiness_beside_liveness(tmp_path):
    """`modelforge nodes` showed liveness only: a node whose agent runs without its worker
    read `online` like a ready one."""
    worker = {"reachable": True, "protocol": 1, "version": "0.1.0", "capabilities": ["smoke"]}
    with fleet(tmp_path, past=False) as f:
        # The CLI reads liveness on its own clock: windows of a day keep the nodes fresh.
        f.env.update(
            MODELFORGE_NODE_STALE_AFTER_SECONDS="86400",
            MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="172800",
            MODELFORGE_INVENTORY_MAX_AGE_SECONDS="172800",
        )
        ready, no_worker = f.enroll("ready-1"), f.enroll("no-worker-1")
        f.enroll("pending-1")
        retired = f.enroll("retired-1")
        for node, reported in ((ready, worker), (no_worker, None)):
            health = {"status": "ok", "gpu_probe": "not_applicable", "worker": reported}
            calls = (
                ("POST", "/api/v1/agent/heartbeat", {"health": health}),
                ("PUT", "/api/v1/agent/inventory", {"accelerators": []}),
            )
            for method, path, fields in calls:
                body = {"node_id": node.node_id, "agent_version": "0.1.0", **fields}
                answer = f.plane.agent(method, path, node.credential, json=body)
                assert answer.status_code == 200, answer.text
        f.plane.heartbeats.flush()
        assert f.cli("nodes", "decommission", "retired-1", "--yes").returncode == 0

        shown = f.cli("nodes")
        assert shown.returncode == 0, shown.stderr
        header, *lines = shown.stdout.splitlines()
        assert header.split()[-4:] == ["LIVENESS", "READY", "LAST", "SEEN"]

        def column(line: str, name: str) -> str:
            return line[header.index(name) :].split("  ")[0].strip()

        by_host = {column(line, "HOSTNAME"): line for line in lines}
        assert {host: column(line, "READY") for host, line in by_host.items()} == {
            "ready-1": "READY",
            "no-worker-1": "NOT READY (worker)",
            "pending-1": "NOT READY (connection)",
            "retired-1": "-",
        }, shown.stdout
        assert column(by_host["ready-1"], "LIVENESS") == "online"
        assert column(by_host["no-worker-1"], "LIVENESS") == "online"  # the same green before

        listed = {
            n["hostname"]: n["readiness"]
            for n in json.loads(f.cli("nodes", "--json").stdout)["nodes"]
        }
        assert listed["ready-1"] == {"ready": True, "failing": []}
        assert listed["no-worker-1"] == {"ready": False, "failing": ["worker"]}
        assert listed[retired.hostname]["ready"] is False


def test_alerts_fail_on_severity(tmp_path):
    with fleet(tmp_path) as f:
        assert f.cli("alerts", "--fail-on", "warning").returncode == 0
        first, second = f.enroll("dup"), f.enroll("dup")  # pending: no liveness alert yet
        warning = f.cli("alerts", "--fail-on", "warning", "--json")
        assert warning.returncode == EXIT_CHECK_FAILED
        assert [a["kind"] for a in json.loads(warning.stdout)["alerts"]] == ["hostname_conflict"]
        assert f.cli("alerts", "--fail-on", "critical").returncode == 0
        assert f.cli("alerts").returncode == 0  # listing alone is no failure
        f.heartbeat(first)  # in 2001 by the fleet's clock: offline for the CLI
        critical = f.cli("alerts", "--fail-on", "critical", "--json")
        assert critical.returncode == EXIT_CHECK_FAILED
        kinds = {a["kind"]: a["severity"] for a in json.loads(critical.stdout)["alerts"]}
        assert kinds == {"hostname_conflict": "warning", "node_offline": "critical"}
        assert second.node_id != first.node_id
        assert f.cli("alerts", "--fail-on", "fatal").returncode == EXIT_USAGE


def test_enrollments_list_and_revoke(tmp_path):
    with fleet(tmp_path, past=False) as f:  # tokens minted "in 2001" would read expired
        used = f.enroll("gpu-1")
        pending = f.plane.mint("spare")
        listed = json.loads(f.cli("enrollments", "list", "--json").stdout)["enrollments"]
        states = {row["enrollment_id"]: row["state"] for row in listed}
        assert states[pending["enrollment_id"]] == "pending"
        assert sorted(states.values()) == ["consumed", "pending"]
        assert pending["token"] not in f.cli("enrollments", "list").stdout
        only = json.loads(f.cli("enrollments", "list", "--state", "pending", "--json").stdout)
        assert [row["enrollment_id"] for row in only["enrollments"]] == [pending["enrollment_id"]]

        revoked = f.cli("enrollments", "revoke", pending["enrollment_id"][:10], "--json")
        assert revoked.returncode == 0, revoked.stderr
        assert json.loads(revoked.stdout)["state"] == "revoked"
        consumed_id = next(row["enrollment_id"] for row in listed if row["state"] == "consumed")
        refused = f.cli("enrollments", "revoke", consumed_id)
        assert refused.returncode == EXIT_USAGE
        assert "revoke the node's credential instead" in refused.stderr
        assert f.cli("enrollments", "revoke", "ffffffffffffffff").returncode == EXIT_NOT_FOUND
        assert used.node_id


def test_prompts_go_to_stderr_and_json_never_asks(tmp_path):
    with fleet(tmp_path) as f:
        node = f.enroll("gpu-1")
        declined = f.cli("nodes", "decommission", "gpu-1", stdin="n\n")
        assert declined.returncode == EXIT_CHECK_FAILED
        assert "Execute?" in declined.stderr and "Execute?" not in declined.stdout
        refused = f.cli("nodes", "decommission", "gpu-1", "--json")
        assert refused.returncode == EXIT_USAGE
        assert refused.stdout == "" and "--yes" in refused.stderr
        trail = json.loads(f.cli("audit", "--json").stdout)["events"]
        # The refused --json call previewed nothing: only the declined one did.
        assert [e["action"] for e in trail].count("node.decommission_previewed") == 1
        backup = tmp_path / "b.sqlite3"
        assert f.cli("backup", str(backup)).returncode == 0
        restore = f.cli("restore", str(backup), "--json")
        assert restore.returncode == EXIT_USAGE and restore.stdout == ""
        assert node.node_id


def test_short_help_everywhere(tmp_path):
    with fleet(tmp_path) as f:
        for args in (
            ("-h",),
            ("nodes", "-h"),
            ("nodes", "show", "-h"),
            ("enrollments", "-h"),
            ("admin-password", "set", "-h"),
            ("restore-finality", "-h"),
            ("work", "submit", "-h"),
        ):
            result = f.cli(*args)
            assert result.returncode == 0 and "Usage:" in result.stdout, args


def test_json_output_of_every_command_parses(tmp_path):
    with fleet(tmp_path) as f:
        node = f.enroll("gpu-1")
        backup = tmp_path / "fleet.sqlite3"
        commands = [
            ("init", "--json"),
            ("admin-token", "create", "--name", "ci", "--json"),
            ("admin-token", "list", "--json"),
            ("enroll", "--name", "n", "--origin", "http://cp.lan:8000", "--json"),
            ("enrollments", "list", "--json"),
            ("nodes", "--json"),
            ("nodes", "show", "gpu-1", "--json"),
            ("nodes", "credentials", "gpu-1", "--json"),
            ("nodes", "cordon", "gpu-1", "--json"),
            ("nodes", "uncordon", "gpu-1", "--json"),
            ("nodes", "rename", "gpu-1", "renamed", "--json"),
            ("nodes", "readiness", "gpu-1", "--json"),  # exit 1: never heartbeated
            ("alerts", "--json"),
            ("audit", "--json", "--limit", "5"),
            ("backup", str(backup), "--json"),
            ("save-finality", str(tmp_path / "record.json"), "--json"),
            ("restore-finality", str(tmp_path / "record.json"), "--json"),
            ("work", "submit", "smoke", "--node", "gpu-1", "--json"),
            ("work", "list", "--json"),
            ("nodes", "revoke", "gpu-1", "--json"),
            ("nodes", "decommission", "gpu-1", "--yes", "--json"),
        ]
        for args in commands:
            result = f.cli(*args)
            assert result.returncode in (0, EXIT_CHECK_FAILED), (args, result.stderr)
            assert isinstance(json.loads(result.stdout), dict), args
        created = [c for c in commands if c[:2] == ("admin-token", "create")]
        assert created
        token_id = json.loads(f.cli("admin-token", "list", "--json").stdout)["admin_tokens"][-1]
        revoked = f.cli("admin-token", "revoke", token_id["token_id"], "--json")
        assert isinstance(json.loads(revoked.stdout), dict)
        password = f.cli("admin-password", "set", "--json", stdin="a long enough password\n")
        assert json.loads(password.stdout)["password_set"] is True, password.stderr
        assert node.node_id


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_and_node_completion(tmp_path, shell):
    with fleet(tmp_path) as f:
        node = f.enroll("gpu-1")
        script = f.cli("completion", shell)
        assert script.returncode == 0
        assert "_MODELFORGE_COMPLETE" in script.stdout
        env = {
            **f.env,
            "_MODELFORGE_COMPLETE": "bash_complete",
            "COMP_WORDS": "modelforge nodes show ",
            "COMP_CWORD": "3",
        }
        from tests.harness.control_plane import run_cli

        completed = run_cli(env=env)
        assert completed.returncode == 0, completed.stderr
        assert f"plain,{node.node_id}" in completed.stdout.splitlines()
        assert "plain,gpu-1" in completed.stdout.splitlines()
        commands = run_cli(env={**env, "COMP_WORDS": "modelforge nod", "COMP_CWORD": "1"})
        assert "plain,nodes" in commands.stdout.splitlines()


def test_a_node_is_named_by_its_display_name_too(tmp_path):
    """`enroll --name gpu-01` then `nodes readiness gpu-01` said "no node 'gpu-01'", and
    docs/install-unraid.md tells users to do exactly that."""
    with fleet(tmp_path) as f:
        node = f.enroll("box-a", name="gpu-01")
        shown = f.cli("nodes", "show", "GPU-01", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["node_id"] == node.node_id
        other = f.enroll("box-b", name="gpu-01")
        both = f.cli("nodes", "readiness", "gpu-01")
        assert both.returncode == EXIT_USAGE
        assert "names 2 nodes" in both.stderr
        assert node.node_id in both.stderr and other.node_id in both.stderr
        missing = f.cli("nodes", "show", "gpu-02")
        assert missing.returncode == EXIT_NOT_FOUND
        assert "(by id, id prefix, hostname or name)" in missing.stderr
