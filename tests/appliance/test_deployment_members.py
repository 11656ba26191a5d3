"""Live membership (issue 34): nodes join and leave a deployment while it serves,
through ``POST /admin/deployments/{name}/servers`` and ``DELETE …/servers/{node}`` and the
CLI's ``deployments add-nodes`` / ``remove-nodes``, on SQLite and PostgreSQL, with nodes that
speak the agent API step by step."""

from __future__ import annotations

import json
import subprocess
import threading
import time

from modelforge_appliance.store.tables import DeploymentServer
from tests.harness.control_plane import APPLIANCE_CLI, error_code, store_env
from tests.harness.scripted_node import gpu

from .test_deployments import DEPLOYMENTS, ServingNode, cli, deploy, held, tiny_model


def members_path(name: str, node_id: str | None = None) -> str:
    path = f"{DEPLOYMENTS}/{name}/servers"
    return f"{path}/{node_id}" if node_id else path


def add(cp, name, *nodes, **fields):
    body = {"node_ids": [n.node_id if hasattr(n, "node_id") else n for n in nodes], **fields}
    return cp.admin("POST", members_path(name), json=body)


def remove(cp, name, node):
    return cp.admin("DELETE", members_path(name, node.node_id))


def shown(cp, name) -> dict:
    answer = cp.admin("GET", f"{DEPLOYMENTS}/{name}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def by_node(view: dict) -> dict[str, dict]:
    return {s["node_id"]: s for s in view["servers"]}


def rows(cp) -> list[tuple[str, str, str]]:
    with cp.store.connection():
        return sorted(
            (s.node_id, s.state, s.goal)
            for s in DeploymentServer.select(
                DeploymentServer.node, DeploymentServer.state, DeploymentServer.goal
            )
        )


def actions(cp) -> list[str]:
    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    return [e["action"] for e in events]


def run(node: ServingNode, server_id: str) -> dict:
    """Claimed by its node's agent and reported running: its lease."""
    lease = node.claim_server(server_id).json()["lease"]
    answer = node.renew_server(server_id, lease["lease_id"], "running")
    assert answer.status_code == 200 and answer.json()["desired"] == "run", answer.text
    return lease


def test_an_added_member_is_pending_listed_to_its_node_with_its_own_gpus(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    first = ServingNode(cp, "grow-a", gpus=[gpu(0), gpu(1)])
    second = ServingNode(cp, "grow-b", gpus=[gpu(0), gpu(1)])
    held(cp, model, first, second)
    made = deploy(cp, "grow", [first])
    assert made.status_code == 201, made.text
    [first_entry] = first.servers()
    run(first, first_entry["server_id"])
    # Another deployment already holds the second node's first GPU.
    assert deploy(cp, "other", [second]).json()["servers"][0]["gpus"] == [gpu(0)["uuid"]]
    before = second.heartbeat_answer()["servers_generation"]
    answer = add(cp, "grow", second)
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert view["name"] == "grow" and view["state"] == "degraded"  # one of two runs
    added = by_node(view)[second.node_id]
    assert (added["state"], added["gpus"], added["restarts"]) == ("pending", [gpu(1)["uuid"]], 0)
    assert by_node(view)[first.node_id]["state"] == "running"  # the first serves on
    # Its agent is told at its next heartbeat, and is listed the new server.
    assert second.heartbeat_answer()["servers_generation"] == before + 1
    listed = [s for s in second.servers() if s["deployment"] == "grow"]
    assert [(s["server_id"], s["gpus"]) for s in listed] == [(added["server_id"], added["gpus"])]
    assert listed[0]["settings"]["model_file"] == "tiny.gguf"
    run(second, added["server_id"])
    assert shown(cp, "grow")["state"] == "running"
    assert "deployment.members_added" in actions(cp)


def test_an_add_is_refused_with_the_reason_and_nothing_changes(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    member = ServingNode(cp, "refuse-a")
    ready = ServingNode(cp, "refuse-b")
    lacking = ServingNode(cp, "refuse-c")  # never given the model
    no_runtime = ServingNode(cp, "refuse-d", runtimes=("vllm",))
    cordoned = ServingNode(cp, "refuse-e")
    held(cp, model, member, ready, no_runtime, cordoned)
    assert cp.admin("POST", f"/api/v1/admin/hardware/nodes/{cordoned.node_id}/cordon").ok
    assert deploy(cp, "keep", [member]).status_code == 201
    before = rows(cp)
    generations = {n.node_id: n.heartbeat_answer()["servers_generation"] for n in (ready, lacking)}
    cases = [
        (add(cp, "keep", ready, cordoned), 409, "NODE_NOT_ELIGIBLE"),
        (add(cp, "keep", ready, no_runtime), 409, "RUNTIME_UNSUPPORTED"),
        (add(cp, "keep", ready, lacking), 409, "MODEL_MISSING"),
        (add(cp, "keep", ready, member), 409, "ALREADY_A_MEMBER"),
        (add(cp, "keep", ready, "no-such-node"), 404, "NOT_FOUND"),
        (add(cp, "nope", ready), 404, "DEPLOYMENT_NOT_FOUND"),
        (add(cp, "keep"), 400, "FIELD_RANGE"),
        (cp.admin("POST", members_path("keep"), json={"node_ids": [ready.node_id], "x": 1}),
         400, "FIELD_UNKNOWN"),
    ]  # fmt: skip
    for answer, status, code in cases:
        assert (answer.status_code, error_code(answer)) == (status, code), answer.text
    missing = add(cp, "keep", ready, lacking).json()
    assert missing["node_ids"] == [lacking.node_id]
    assert "--replicate" in missing["error"]["next_step"]
    already = add(cp, "keep", member).json()
    assert already["node_ids"] == [member.node_id] and "refuse-a" in already["error"]["message"]
    # All or nothing: the eligible node named beside each refused one was not added either.
    assert rows(cp) == before
    for node in (ready, lacking):
        assert node.heartbeat_answer()["servers_generation"] == generations[node.node_id]
        assert node.servers() == []
    # A deployment being undeployed takes no member.
    [entry] = member.servers()
    run(member, entry["server_id"])
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/keep").json()["state"] == "stopping"
    late = add(cp, "keep", ready)
    assert (late.status_code, error_code(late)) == (409, "DEPLOYMENT_STOPPING")
    gone = remove(cp, "keep", member)
    assert (gone.status_code, error_code(gone)) == (409, "DEPLOYMENT_STOPPING")
    assert ready.servers() == []


def test_replicate_true_replicates_first_and_the_server_is_listed_once_the_model_is_present(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    member, newcomer = ServingNode(cp, "repl-a"), ServingNode(cp, "repl-b")
    held(cp, model, member)
    assert deploy(cp, "repl", [member]).status_code == 201
    answer = add(cp, "repl", newcomer, replicate=True)
    assert answer.status_code == 200, answer.text
    assert by_node(answer.json())[newcomer.node_id]["state"] == "pending"
    replicas = cp.admin("GET", "/api/v1/admin/models/tiny/replicas").json()["replicas"]
    assert {r["node_id"]: r["state"] for r in replicas}[newcomer.node_id] == "pending"
    assert newcomer.servers() == []  # not before its node reports the model present
    newcomer.report([model["digest"]])
    assert [s["deployment"] for s in newcomer.servers()] == ["repl"]


def test_an_unleased_member_goes_at_once_and_the_last_one_cannot(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a, b = ServingNode(cp, "shrink-a"), ServingNode(cp, "shrink-b")
    held(cp, model, a, b)
    assert deploy(cp, "shrink", [a, b]).status_code == 201
    before = b.heartbeat_answer()["servers_generation"]
    answer = remove(cp, "shrink", b)
    assert answer.status_code == 200, answer.text
    assert list(by_node(answer.json())) == [a.node_id]
    assert [n for n, _, _ in rows(cp)] == [a.node_id]  # the row went at once
    assert b.heartbeat_answer()["servers_generation"] > before and b.servers() == []
    again = remove(cp, "shrink", b)
    assert (again.status_code, error_code(again)) == (404, "NOT_A_MEMBER")
    last = remove(cp, "shrink", a)
    assert (last.status_code, error_code(last)) == (409, "LAST_MEMBER")
    assert "modelforge undeploy shrink" in last.json()["error"]["next_step"]
    assert [n for n, _, _ in rows(cp)] == [a.node_id]
    nowhere = cp.admin("DELETE", members_path("nope", a.node_id))
    assert (nowhere.status_code, error_code(nowhere)) == (404, "DEPLOYMENT_NOT_FOUND")
    assert {"deployment.member_removed", "server.removed"} <= set(actions(cp))


def test_a_leased_member_stops_before_it_goes_and_counts_as_a_member_until_then(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a, b = ServingNode(cp, "leave-a"), ServingNode(cp, "leave-b")
    held(cp, model, a, b)
    servers = by_node(deploy(cp, "leave", [a, b]).json())
    run(a, servers[a.node_id]["server_id"])
    server_id = servers[b.node_id]["server_id"]
    lease = run(b, server_id)
    answer = remove(cp, "leave", b)
    assert answer.status_code == 200, answer.text
    leaving = by_node(answer.json())[b.node_id]
    assert (leaving["state"], leaving["goal"]) == ("stopping", "remove")
    assert b.servers() == []  # no longer asked of its node
    # Still a member until it has gone: it cannot be added back yet, and removing it again
    # changes nothing; the other member cannot leave (it would be the last).
    back = add(cp, "leave", b)
    assert (back.status_code, error_code(back)) == (409, "ALREADY_A_MEMBER")
    assert "finish leaving" in back.json()["error"]["next_step"]
    assert remove(cp, "leave", b).status_code == 200
    last = remove(cp, "leave", a)
    assert (last.status_code, error_code(last)) == (409, "LAST_MEMBER")
    # Its agent's next renewal is told to stop; once it reports stopped the row is gone.
    told = b.renew_server(server_id, lease["lease_id"], "running")
    assert told.status_code == 200 and told.json()["desired"] == "stop", told.text
    done = b.renew_server(server_id, lease["lease_id"], "stopped")
    assert done.status_code == 200, done.text
    assert list(by_node(shown(cp, "leave"))) == [a.node_id]
    assert shown(cp, "leave")["state"] == "running"
    assert rows(cp) == [(a.node_id, "running", "run")]
    assert b.servers() == []
    # Gone, it may join again: a fresh server, pending.
    joined = add(cp, "leave", b)
    assert joined.status_code == 200, joined.text
    assert by_node(joined.json())[b.node_id]["state"] == "pending"
    assert by_node(joined.json())[b.node_id]["server_id"] != server_id


def test_a_leaving_member_whose_lease_runs_out_goes_too(clocked_control_plane, clock, tmp_path):
    cp = clocked_control_plane
    model = tiny_model(cp, tmp_path)
    a, b = ServingNode(cp, "lapse-a"), ServingNode(cp, "lapse-b")
    held(cp, model, a, b)
    servers = by_node(deploy(cp, "lapse", [a, b]).json())
    for node in (a, b):
        run(node, servers[node.node_id]["server_id"])
    assert remove(cp, "lapse", b).json()["servers"][1]["state"] == "stopping"
    clock.advance(cp.settings.serve_lease_seconds + 1)
    a.heartbeat_answer()
    assert list(by_node(shown(cp, "lapse"))) == [a.node_id]


def test_the_cli_adds_and_removes_nodes_by_name(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a, b, c = ServingNode(cp, "cli-m-a"), ServingNode(cp, "cli-m-b"), ServingNode(cp, "cli-m-c")
    held(cp, model, a, b)
    assert deploy(cp, "cli-m", [a]).status_code == 201
    added = cli(cp, "deployments", "add-nodes", "cli-m", "cli-m-b", "--json")
    assert added.returncode == 0, added.stderr
    assert set(by_node(json.loads(added.stdout))) == {a.node_id, b.node_id}
    refused = cli(cp, "deployments", "add-nodes", "cli-m", "cli-m-c")
    assert refused.returncode == 1 and "MODEL_MISSING" in refused.stderr
    assert "--replicate" in refused.stderr
    replicated = cli(cp, "deployments", "add-nodes", "cli-m", c.node_id, "--replicate")
    assert replicated.returncode == 0, replicated.stderr
    assert "cli-m-c" in replicated.stdout and "pending" in replicated.stdout
    shown_text = cli(cp, "deployments", "show", "cli-m").stdout
    assert shown_text.count("pending since") == 3 and "0 restarts" in shown_text
    # Unleased, b and c go at once; --wait returns as soon as they have gone.
    gone = cli(cp, "deployments", "remove-nodes", "cli-m", "cli-m-b", c.node_id[:8], "--wait")
    assert gone.returncode == 0, gone.stderr
    assert "cli-m-b" in gone.stdout and "left" in gone.stdout
    assert list(by_node(shown(cp, "cli-m"))) == [a.node_id]
    last = cli(cp, "deployments", "remove-nodes", "cli-m", "cli-m-a")
    assert last.returncode == 1 and "LAST_MEMBER" in last.stderr
    unknown = cli(cp, "deployments", "remove-nodes", "cli-m", "cli-m-b")
    assert unknown.returncode == 7 and "NOT_A_MEMBER" in unknown.stderr


def test_the_cli_show_says_why_a_server_waits_or_backs_off_and_when_it_tries_again(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "show-a")
    held(cp, model, node)
    assert deploy(cp, "show", [node]).status_code == 201
    [entry] = node.servers()
    lease = node.claim_server(entry["server_id"]).json()["lease"]
    crash = {"code": "RUNTIME_EXITED", "message": "the runtime exited with status 3"}
    answer = node.renew_server(
        entry["server_id"], lease["lease_id"], "backoff", restarts=2, error=crash,
        next_attempt_in=10,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    server = shown(cp, "show")["servers"][0]
    text = cli(cp, "deployments", "show", "show").stdout
    assert f"backoff since {server['state_since']}" in text
    assert "2 restarts" in text and f"next attempt {server['next_attempt_at']}" in text
    assert "RUNTIME_EXITED: the runtime exited with status 3" in text
    assert "starts it again by itself" in text  # the next step: no restart needed
    listed = cli(cp, "deployments").stdout
    assert "show: down" in listed and "backoff since" in listed


def test_deploy_idle_unload_takes_durations_and_refuses_nonsense(control_plane, tmp_path):
    from modelforge_appliance.cli.deployments import parse_duration

    assert [parse_duration(v) for v in ("90s", "10m", "1h", "45", "1")] == [90, 600, 3600, 45, 1]
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "unload-a")
    held(cp, model, node)
    for bad in ("0", "0s", "soon", "-5m", "1.5"):
        refused = cli(cp, "deploy", "u", "--model", "tiny", "--nodes", "unload-a",
                      "--idle-unload", bad)  # fmt: skip
        assert refused.returncode == 2 and "--idle-unload" in refused.stderr, (bad, refused.stderr)
    assert rows(cp) == []
    made = cli(cp, "deploy", "u", "--model", "tiny", "--nodes", "unload-a", "--idle-unload", "10m")
    assert made.returncode == 0, made.stderr
    assert shown(cp, "u")["settings"]["idle_unload_seconds"] == 600
    assert "unload:   after 600 s without a request" in cli(cp, "deployments", "show", "u").stdout


def test_add_nodes_wait_returns_once_the_added_server_runs_and_restart_wait_too(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a, b = ServingNode(cp, "wait-a"), ServingNode(cp, "wait-b")
    held(cp, model, a, b)
    [first] = deploy(cp, "wait", [a]).json()["servers"]
    run(a, first["server_id"])

    def follow(*args: str, agent) -> str:
        """The CLI waits while ``agent`` (this test, as the node's agent) starts it."""
        command = subprocess.Popen(
            [*APPLIANCE_CLI, *args], env=dict(store_env(cp.settings)), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            agent()
            out, err = command.communicate(timeout=60)
        finally:
            command.kill()
        assert command.returncode == 0, err
        return out

    def start_b():
        entries = wait_for(lambda: [s for s in b.servers() if s["deployment"] == "wait"])
        run(b, entries[0]["server_id"])

    out = follow("deployments", "add-nodes", "wait", "wait-b", "--wait", agent=start_b)
    assert "wait-b" in out and "wait: every added server runs." in out
    leases = {}

    def start_both():
        for node in (a, b):
            [entry] = wait_for(lambda n=node: [s for s in n.servers() if s["state"] == "pending"])
            leases[node.node_id] = run(node, entry["server_id"])

    out = follow("deployments", "restart", "wait", "--wait", agent=start_both)
    assert "wait: every server runs." in out
    assert shown(cp, "wait")["state"] == "running"


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_eight_concurrent_adds_of_one_node_make_one_member(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a = ServingNode(cp, "race-m-a")
    b = ServingNode(cp, "race-m-b", gpus=[gpu(i) for i in range(8)])
    held(cp, model, a, b)
    assert deploy(cp, "race-m", [a]).status_code == 201
    answers = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        answers.append(add(cp, "race-m", b))

    threads = [threading.Thread(target=go) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answer.status_code for answer in answers) == [200] + [409] * 7
    assert {error_code(x) for x in answers if x.status_code == 409} == {"ALREADY_A_MEMBER"}
    assert [n for n, _, _ in rows(cp)].count(b.node_id) == 1


def test_set_changes_the_runtime_arguments_and_restarts_every_server_with_them(
    control_plane, tmp_path
):
    """A runtime that exits because of its own --arg: `deployments set` (PATCH) replaces the
    arguments, checked as a deploy checks them, and restarts each server with them; a refusal
    or an unchanged setting restarts nothing."""
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "set-a")
    held(cp, model, node)
    settings = {"args": ["--no-such-flag"], "context_length": 512}
    assert deploy(cp, "set", [node], settings=settings).status_code == 201
    [entry] = node.servers()
    server_id = entry["server_id"]
    assert entry["settings"]["args"] == ["--no-such-flag"]
    lease = run(node, server_id)
    path = f"{DEPLOYMENTS}/set"

    # Refused, nothing changed: a reserved argument, a field set only by deploying again.
    reserved = cp.admin("PATCH", path, json={"settings": {"args": ["--port", "9"]}})
    assert (reserved.status_code, error_code(reserved)) == (400, "FIELD_FORMAT")
    other = cp.admin("PATCH", path, json={"settings": {"image_id": "sha256:" + "0" * 64}})
    assert (other.status_code, error_code(other)) == (400, "FIELD_UNKNOWN")
    same = cp.admin("PATCH", path, json={"settings": {"context_length": 512}})
    assert same.status_code == 200 and same.json()["servers"][0]["state"] == "running"
    assert node.renew_server(server_id, lease["lease_id"], "running").json()["desired"] == "run"
    assert "deployment.settings_changed" not in actions(cp)

    # Changed: the lease ends "restarted" and the server is claimed again with the new args.
    changed = cp.admin("PATCH", path, json={"settings": {"args": ["--threads", "2"]}})
    assert changed.status_code == 200, changed.text
    assert changed.json()["settings"]["args"] == ["--threads", "2"]
    assert changed.json()["settings"]["context_length"] == 512  # what was not given is kept
    assert changed.json()["servers"][0]["state"] == "pending"
    lost = node.renew_server(server_id, lease["lease_id"], "running")
    assert (lost.status_code, lost.json()["lease_end"]) == (409, "restarted")
    [entry] = node.servers()
    assert entry["settings"]["args"] == ["--threads", "2"]
    run(node, server_id)
    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    [audited] = [e for e in events if e["action"] == "deployment.settings_changed"]
    assert audited["detail"]["changed"] == ["args"]
    assert "--threads" not in json.dumps(audited)  # names, never an argument's value

    # The CLI: --no-args clears them; nothing to change is a usage error.
    cleared = cli(cp, "deployments", "set", "set", "--no-args", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["settings"]["args"] == []
    nothing = cli(cp, "deployments", "set", "set")
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr
    unknown = cli(cp, "deployments", "set", "no-such", "--context-length", "64")
    assert unknown.returncode == 7 and "DEPLOYMENT_NOT_FOUND" in unknown.stderr
