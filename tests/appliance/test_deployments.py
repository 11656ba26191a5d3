"""Deployments on the control plane (issue 25), on SQLite and PostgreSQL, with nodes that
speak the agent API step by step: what a deploy refuses (and that nothing is made then),
which servers an agent is told to run, the serve lease from claim to stop, expiry under an
injected clock, restart, undeploy, GPUs, concurrent deploys, and the CLI."""

from __future__ import annotations

import json
import threading

from modelforge_appliance.store.tables import Deployment, DeploymentServer
from modelforge_contract.deployments import (
    PATH_ADMIN_DEPLOYMENTS,
    PATH_AGENT_SERVER_CLAIM,
    PATH_AGENT_SERVER_RENEW,
    PATH_AGENT_SERVERS,
    server_path,
)
from modelforge_contract.models import PATH_ADMIN_MODELS
from tests.harness.control_plane import error_code, make_settings, run_cli, serve, store_env
from tests.harness.scripted_node import WorkNode, gpu, submit, worker_health

from .test_models import import_model, make_model_dir

DEPLOYMENTS = PATH_ADMIN_DEPLOYMENTS
GGUF = {"tiny.gguf": b"GGUF" + b"\0" * 2000, "README.md": b"tiny"}


def serving(runtimes=("llama.cpp",)) -> dict:
    health = worker_health()
    return {
        **health,
        "capabilities": [*health["capabilities"], "serve"],
        "runtimes": list(runtimes),
    }


class ServingNode(WorkNode):
    """A scripted node whose worker offers runtimes and that reports models present."""

    def __init__(self, cp, hostname, gpus=None, runtimes=("llama.cpp",)) -> None:
        super().__init__(
            cp, hostname, gpus=[] if gpus is None else gpus, mode="nvidia" if gpus else "cpu"
        )
        self.runtimes = runtimes
        self.heartbeat(serving(runtimes))
        self.inventory()

    def heartbeat_answer(self) -> dict:
        health = {"status": "ok", "gpu_probe": "ok", "worker": serving(self.runtimes)}
        body = {"node_id": self.node_id, "agent_version": "0.1.0", "health": health}
        answer = self.cp.agent("POST", "/api/v1/agent/heartbeat", self.credential, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def report(self, digests: list[str]) -> None:
        models = [
            {"digest": d, "state": "present", "bytes_done": 1, "bytes_total": 1} for d in digests
        ]
        body = {
            "node_id": self.node_id,
            "agent_version": "0.1.0",
            "accelerators": self.gpus,
            "models": models,
        }
        answer = self.cp.agent("PUT", "/api/v1/agent/inventory", self.credential, json=body)
        assert answer.status_code == 200, answer.text

    def servers(self) -> list[dict]:
        answer = self.cp.agent("GET", PATH_AGENT_SERVERS, self.credential)
        assert answer.status_code == 200, answer.text
        return answer.json()["servers"]

    def claim_server(self, server_id: str):
        path = server_path(PATH_AGENT_SERVER_CLAIM, server_id)
        return self.cp.agent("POST", path, self.credential, json={"node_id": self.node_id})

    def renew_server(self, server_id: str, lease_id: str, state: str, **extra):
        path = server_path(PATH_AGENT_SERVER_RENEW, server_id)
        body = {"node_id": self.node_id, "lease_id": lease_id, "state": state, **extra}
        return self.cp.agent("POST", path, self.credential, json=body)


def tiny_model(cp, tmp_path, name="tiny", files=None) -> dict:
    answer = import_model(cp, name, make_model_dir(tmp_path / name, files or GGUF))
    assert answer.status_code == 201, answer.text
    return answer.json()


def held(cp, model: dict, *members: ServingNode) -> None:
    """Replicated to the members, and reported present by each."""
    ids = [m.node_id for m in members]
    made = cp.admin("POST", f"{PATH_ADMIN_MODELS}/{model['name']}/replicas", json={"node_ids": ids})
    assert made.status_code == 202, made.text
    for member in members:
        member.report([model["digest"]])


def deploy(cp, name, members, model="tiny", **fields):
    body = {"name": name, "model": model, "runtime": "llama.cpp"}
    return cp.admin(
        "POST", DEPLOYMENTS, json={**body, "node_ids": [m.node_id for m in members], **fields}
    )


def cli(cp, *args: str):
    return run_cli(*args, env=store_env(cp.settings))


def counts(cp) -> tuple[int, int]:
    with cp.store.connection():
        return Deployment.select().count(), DeploymentServer.select().count()


def test_a_deploy_is_refused_with_the_reason_and_nothing_is_made(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    tiny_model(cp, tmp_path, "no-gguf", {"weights.safetensors": b"w" * 100})
    ready = ServingNode(cp, "ready-a")
    no_runtime = ServingNode(cp, "no-llama", runtimes=("vllm",))
    silent = WorkNode(cp, "silent", gpus=[], mode="cpu")  # enrolled, never heard from
    held(cp, model, ready, no_runtime)
    cases = [
        (deploy(cp, "x", [ready], model="absent"), 404, "MODEL_NOT_FOUND"),
        (
            cp.admin(
                "POST",
                DEPLOYMENTS,
                json={"name": "x", "model": "tiny", "runtime": "llama.cpp", "node_ids": ["nope"]},
            ),
            404,
            "NOT_FOUND",
        ),  # fmt: skip
        (deploy(cp, "x", [silent]), 409, "NODE_NOT_ELIGIBLE"),
        (deploy(cp, "x", [ready, no_runtime]), 409, "RUNTIME_UNSUPPORTED"),
        (deploy(cp, "Bad Name", [ready]), 400, "FIELD_FORMAT"),
        (deploy(cp, "x", [ready], runtime="tgi"), 400, "FIELD_CHOICE"),
        (deploy(cp, "x", [ready], settings={"args": ["--host", "0.0.0.0"]}), 400, "FIELD_FORMAT"),
        (deploy(cp, "x", [ready], settings={"args": ["--port=9"]}), 400, "FIELD_FORMAT"),
        (deploy(cp, "x", [ready], settings={"args": ["--api_key", "k"]}), 400, "FIELD_FORMAT"),
        (deploy(cp, "x", [ready], settings={"args": ["--rpc", "h:1"]}), 400, "FIELD_FORMAT"),
        (deploy(cp, "x", [ready], runtime="vllm"), 400, "FIELD_FORMAT"),  # no image_id
        (deploy(cp, "x", [ready], model="no-gguf"), 400, "MODEL_FORMAT_UNSUPPORTED"),
        (deploy(cp, "x", [ready], gpu_count=1), 409, "GPUS_UNAVAILABLE"),  # a node without GPUs
    ]
    for answer, status, code in cases:
        assert (answer.status_code, error_code(answer)) == (status, code), answer.text
    assert counts(cp) == (0, 0)
    # The cordoned node is refused too, naming it.
    assert cp.admin("POST", f"/api/v1/admin/hardware/nodes/{ready.node_id}/cordon").ok
    refused = deploy(cp, "x", [ready])
    assert (refused.status_code, error_code(refused)) == (409, "NODE_NOT_ELIGIBLE")
    assert ready.node_id in refused.json()["error"]["message"]
    assert counts(cp) == (0, 0)


def test_model_missing_names_the_nodes_and_replicate_first_waits_for_presence(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    a, b = ServingNode(cp, "miss-a"), ServingNode(cp, "miss-b")
    held(cp, model, a)
    refused = deploy(cp, "tiny-chat", [a, b])
    assert (refused.status_code, error_code(refused)) == (409, "MODEL_MISSING")
    assert refused.json()["node_ids"] == [b.node_id] and "miss-b" in refused.text
    assert counts(cp) == (0, 0) and a.servers() == []
    made = deploy(cp, "tiny-chat", [a, b], replicate=True)
    assert made.status_code == 201, made.text
    view = made.json()
    assert [s["state"] for s in view["servers"]] == ["pending", "pending"]
    assert view["settings"]["model_file"] == "tiny.gguf" and view["state"] == "starting"
    # a holds the model: its agent is told at once; b only once it reports the model present.
    generation = b.heartbeat_answer()["servers_generation"]
    assert [s["deployment"] for s in a.servers()] == ["tiny-chat"]
    assert b.servers() == []
    b.report([model["digest"]])
    assert b.heartbeat_answer()["servers_generation"] > generation
    [entry] = b.servers()
    assert entry["model"]["digest"] == model["digest"] and entry["runtime"] == "llama.cpp"
    assert entry["settings"]["model_file"] == "tiny.gguf" and entry["gpus"] == []
    # A second deployment of the same name is refused; the model cannot be deleted.
    again = deploy(cp, "tiny-chat", [a])
    assert (again.status_code, error_code(again)) == (409, "DEPLOYMENT_EXISTS")
    gone = cp.admin("DELETE", f"{PATH_ADMIN_MODELS}/tiny")
    assert (gone.status_code, error_code(gone)) == (409, "MODEL_IN_USE")
    assert (
        gone.json()["error"]["next_step"]
        == "Undeploy them first: modelforge undeploy tiny-chat --wait."
    )
    kept = cp.admin("DELETE", f"{PATH_ADMIN_MODELS}/tiny/replicas/{a.node_id}")
    assert (kept.status_code, error_code(kept)) == (409, "MODEL_IN_USE")


def test_the_serve_lease_from_claim_to_running_restart_and_stop(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node, other = ServingNode(cp, "lease-a"), ServingNode(cp, "lease-b")
    held(cp, model, node, other)
    before = node.heartbeat_answer()["servers_generation"]
    assert deploy(cp, "svc", [node]).status_code == 201
    assert node.heartbeat_answer()["servers_generation"] == before + 1
    [entry] = node.servers()
    server_id = entry["server_id"]
    # Another node cannot claim it.
    stolen = other.claim_server(server_id)
    assert (stolen.status_code, error_code(stolen)) == (409, "SERVER_NOT_CLAIMABLE")
    claimed = node.claim_server(server_id)
    assert claimed.status_code == 200, claimed.text
    lease = claimed.json()["lease"]
    assert lease["lease_seconds"] == cp.settings.serve_lease_seconds

    def shown():
        return cp.admin("GET", f"{DEPLOYMENTS}/svc").json()

    assert shown()["servers"][0]["state"] == "starting"
    answer = node.renew_server(server_id, lease["lease_id"], "running")
    assert answer.status_code == 200 and answer.json()["desired"] == "run", answer.text
    assert shown()["state"] == "running" and shown()["servers"][0]["started_at"]
    # The runtime crashed and is restarting: starting with the error, then running again.
    crash = {"code": "RUNTIME_EXITED", "message": "the runtime exited with status 1"}
    node.renew_server(server_id, lease["lease_id"], "starting", restarts=1, error=crash)
    server = shown()["servers"][0]
    assert (server["state"], server["restarts"], server["error"]) == ("starting", 1, crash)
    node.renew_server(server_id, lease["lease_id"], "running", restarts=1)
    assert shown()["servers"][0]["error"] is None
    # The agent restarted: it claims again and keeps the state; the old lease is replaced.
    adopted = node.claim_server(server_id).json()["lease"]
    old = node.renew_server(server_id, lease["lease_id"], "running")
    assert (old.status_code, error_code(old), old.json()["lease_end"]) == (
        409,
        "LEASE_LOST",
        "replaced",
    )
    assert shown()["servers"][0]["state"] == "running"
    # Restart: the lease ends "restarted", the server is pending again and is claimed anew.
    assert cp.admin("POST", f"{DEPLOYMENTS}/svc/restart").status_code == 200
    lost = node.renew_server(server_id, adopted["lease_id"], "running")
    assert lost.json()["lease_end"] == "restarted"
    assert node.servers()[0]["state"] == "pending"
    fresh = node.claim_server(server_id).json()["lease"]
    node.renew_server(server_id, fresh["lease_id"], "running")
    # Undeploy: stopping until the agent says it stopped; then the deployment is gone.
    stopping = cp.admin("DELETE", f"{DEPLOYMENTS}/svc")
    assert stopping.status_code == 200 and stopping.json()["state"] == "stopping"
    assert node.servers() == []  # no longer listed: the agent renews and is told to stop
    told = node.renew_server(server_id, fresh["lease_id"], "running")
    assert told.json()["desired"] == "stop"
    done = node.renew_server(server_id, fresh["lease_id"], "stopped")
    assert done.status_code == 200 and done.json()["state"] == "stopped"
    assert cp.admin("GET", f"{DEPLOYMENTS}/svc").status_code == 404
    assert counts(cp) == (0, 0)
    events = [
        e["action"]
        for e in cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    ]
    for action in ("deployment.created", "server.leased", "server.running", "deployment.restarted",
                   "deployment.stopping", "server.stopped", "deployment.removed"):  # fmt: skip
        assert action in events, action


def test_an_expired_serve_lease_leaves_the_server_waiting_for_its_node_and_a_stopping_one_stops(
    clocked_control_plane, clock, tmp_path
):
    cp = clocked_control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "expiry-a")
    held(cp, model, node)
    for name in ("one", "two"):
        assert deploy(cp, name, [node], share_gpus=True).status_code == 201
    leases = {}
    for entry in node.servers():
        leases[entry["deployment"]] = node.claim_server(entry["server_id"]).json()["lease"]
        node.renew_server(entry["server_id"], leases[entry["deployment"]]["lease_id"], "running")
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/two").json()["state"] == "stopping"
    clock.advance(cp.settings.serve_lease_seconds + 1)
    node.heartbeat_answer()  # online still: it is the lease, not the node, that ran out
    one = cp.admin("GET", f"{DEPLOYMENTS}/one").json()
    assert (one["state"], one["servers"][0]["state"]) == ("down", "waiting")
    assert one["servers"][0]["error"]["code"] == "SERVER_LEASE_LOST"
    assert cp.admin("GET", f"{DEPLOYMENTS}/two").status_code == 404  # stopped, so gone
    server_id = one["servers"][0]["server_id"]
    late = node.renew_server(server_id, leases["one"]["lease_id"], "running")
    assert late.status_code == 409 and late.json()["lease_end"] == "expired"
    # Still listed to its node: its agent claims it again, with no person, and it runs.
    assert [(s["server_id"], s["state"]) for s in node.servers()] == [(server_id, "waiting")]
    again = node.claim_server(server_id).json()["lease"]
    shown = cp.admin("GET", f"{DEPLOYMENTS}/one").json()["servers"][0]
    assert (shown["state"], shown["error"]) == ("starting", None)
    node.renew_server(server_id, again["lease_id"], "running")
    assert cp.admin("GET", f"{DEPLOYMENTS}/one").json()["state"] == "running"


def test_gpus_by_uuid_disjoint_unless_shared_and_freed_by_undeploy(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "gpus-a", gpus=[gpu(i) for i in range(4)])
    held(cp, model, node)
    first = deploy(cp, "g1", [node], gpu_count=2).json()["servers"][0]["gpus"]
    second = deploy(cp, "g2", [node]).json()["servers"][0]["gpus"]  # default: one
    assert first == [gpu(0)["uuid"], gpu(1)["uuid"]] and second == [gpu(2)["uuid"]]
    full = deploy(cp, "g3", [node], gpu_count=2)
    assert (full.status_code, error_code(full)) == (409, "GPUS_UNAVAILABLE")
    shared = deploy(cp, "g3", [node], gpu_count=2, share_gpus=True)
    assert shared.json()["servers"][0]["gpus"] == first
    assert [s["gpus"] for s in node.servers() if s["deployment"] == "g1"] == [first]
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/g1").json()["state"] == "stopped"  # never claimed
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/g3").json()["state"] == "stopped"
    assert deploy(cp, "g4", [node], gpu_count=2).json()["servers"][0]["gpus"] == [
        gpu(0)["uuid"],
        gpu(1)["uuid"],
    ]


def test_eight_concurrent_deploys_of_one_name_make_one_deployment(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "race-a", gpus=[gpu(i) for i in range(8)])
    held(cp, model, node)
    answers = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        answers.append(deploy(cp, "race", [node]))

    threads = [threading.Thread(target=go) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status_code for a in answers) == [201] + [409] * 7
    assert {error_code(a) for a in answers if a.status_code == 409} == {"DEPLOYMENT_EXISTS"}
    assert counts(cp) == (1, 1)


def test_the_cli_deploys_lists_shows_restarts_and_undeploys(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "cli-a")
    held(cp, model, node)
    made = cli(cp, "deploy", "cli-svc", "--model", "tiny", "--nodes", "cli-a", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["servers"][0]["node_id"] == node.node_id
    listed = cli(cp, "deployments")
    assert listed.returncode == 0 and "cli-svc: starting" in listed.stdout
    shown = cli(cp, "deployments", "show", "cli-svc")
    assert "tiny.gguf" in shown.stdout and "cli-a" in shown.stdout
    missing = cli(cp, "deployments", "show", "nope")
    assert missing.returncode != 0 and "DEPLOYMENT_NOT_FOUND" in missing.stderr
    refused = cli(
        cp, "deploy", "cli-2", "--model", "tiny", "--nodes", "cli-a", "--arg", "--host=0.0.0.0"
    )
    assert refused.returncode != 0 and "FIELD_FORMAT" in refused.stderr
    assert cli(cp, "deployments", "restart", "cli-svc").returncode == 0
    gone = cli(cp, "undeploy", "cli-svc", "--wait")
    assert gone.returncode == 0, gone.stderr
    assert "the deployment is gone" in gone.stdout
    assert counts(cp) == (0, 0)


def test_after_a_restore_a_deploy_waits_for_the_node_to_report_the_model_again(tmp_path):
    settings = make_settings(tmp_path / "state")
    backup = tmp_path / "backup.sqlite3"
    with serve(settings) as cp:
        model = tiny_model(cp, tmp_path)
        node = ServingNode(cp, "restored-a")
        held(cp, model, node)
        run_cli("backup", str(backup), env=store_env(settings), check=True)
    run_cli("restore", str(backup), "--yes", env=store_env(settings), check=True)
    with serve(settings) as cp:
        node.cp = cp
        node.heartbeat_answer()
        node.inventory()  # measured again: the node's inventory, without the model yet
        refused = deploy(cp, "after", [node])
        assert (refused.status_code, error_code(refused)) == (409, "MODEL_MISSING")
        node.report([model["digest"]])
        assert deploy(cp, "after", [node]).status_code == 201


def test_servers_and_work_items_never_share_a_gpu(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "mixed-a", gpus=[gpu(i) for i in range(4)])
    held(cp, model, node)
    served = deploy(cp, "mixed", [node], gpu_count=2).json()["servers"][0]["gpus"]
    submit(cp, "smoke", constraints={"gpu_count": 2})
    claimed = node.claim(capabilities=("smoke",))
    assert claimed.status_code == 200, claimed.text
    leased = claimed.json()["lease"]["gpus"]
    assert len(leased) == 2 and not set(leased) & set(served)
    # Every GPU is held now: another deploy asking one is refused, naming the node.
    full = deploy(cp, "more", [node])
    assert (full.status_code, error_code(full)) == (409, "GPUS_UNAVAILABLE")


def test_a_restart_picks_gpus_again_and_never_shares_one_taken_meanwhile(control_plane, tmp_path):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    node = ServingNode(cp, "restart-g", gpus=[gpu(0)])
    held(cp, model, node)
    assert deploy(cp, "first", [node]).json()["servers"][0]["gpus"] == [gpu(0)["uuid"]]
    [entry] = node.servers()
    lease = node.claim_server(entry["server_id"]).json()["lease"]
    crash = {"code": "RUNTIME_EXITED", "message": "the runtime exited with status 1"}
    node.renew_server(entry["server_id"], lease["lease_id"], "failed", error=crash)
    # Failed, it holds no GPU: another deployment may take it.
    assert deploy(cp, "second", [node]).json()["servers"][0]["gpus"] == [gpu(0)["uuid"]]
    refused = cp.admin("POST", f"{DEPLOYMENTS}/first/restart")
    assert (refused.status_code, error_code(refused)) == (409, "GPUS_UNAVAILABLE")
    assert cp.admin("GET", f"{DEPLOYMENTS}/first").json()["servers"][0]["state"] == "failed"
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/second").json()["state"] == "stopped"
    again = cp.admin("POST", f"{DEPLOYMENTS}/first/restart")
    assert again.status_code == 200, again.text
    assert again.json()["servers"][0]["gpus"] == [gpu(0)["uuid"]]
    # A deployment being stopped cannot be restarted.
    [entry] = node.servers()
    lease = node.claim_server(entry["server_id"]).json()["lease"]
    node.renew_server(entry["server_id"], lease["lease_id"], "running")
    assert cp.admin("DELETE", f"{DEPLOYMENTS}/first").json()["state"] == "stopping"
    late = cp.admin("POST", f"{DEPLOYMENTS}/first/restart")
    assert (late.status_code, error_code(late)) == (409, "DEPLOYMENT_STOPPING")
    listed = cp.admin("GET", DEPLOYMENTS).json()
    assert listed["server_time"].endswith("Z")


def test_the_cli_splits_a_model_across_nodes_and_says_each_member_s_role_and_share(
    control_plane, tmp_path
):
    cp = control_plane
    model = tiny_model(cp, tmp_path)
    main = ServingNode(cp, "split-a")
    helper = ServingNode(cp, "split-b", runtimes=("llama.cpp", "llama.cpp-rpc"))
    held(cp, model, main)
    both = cli(
        cp, "deploy", "big", "--model", "tiny", "--nodes", "split-a", "--split", "split-a,split-b"
    )
    assert both.returncode == 2 and "one of --nodes or --split" in both.stderr
    alone = cli(cp, "deploy", "big", "--model", "tiny", "--split", "split-a")
    assert alone.returncode == 2 and "fewer than two nodes" in alone.stderr
    made = cli(cp, "deploy", "big", "--model", "tiny", "--split", "split-a,split-b", "--json")
    assert made.returncode == 0, made.stderr
    view = json.loads(made.stdout)
    assert view["settings"]["split"] == [main.node_id, helper.node_id]
    assert {s["node_id"]: s["role"] for s in view["servers"]} == {
        main.node_id: "main",
        helper.node_id: "helper",
    }
    shown = cli(cp, "deployments", "show", "big")
    assert shown.returncode == 0, shown.stderr
    assert "split across 2 nodes (split-a 50%, split-b 50% of the layers)" in shown.stdout
    assert "split-b (" in shown.stdout and "[helper]" in shown.stdout
    fixed = cli(cp, "deployments", "add-nodes", "big", "split-b")
    assert fixed.returncode != 0 and "SPLIT_FIXED" in fixed.stderr
