"""Deployments on real nodes (issue 25): a real control plane (waitress, SQLite) deploys an
imported GGUF to node agents whose real runtime workers launch llama.cpp's real
``llama-server`` on the replicated files, on CPU."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import requests

from modelforge_contract.deployments import (
    MODEL_MISSING,
    PATH_ADMIN_DEPLOYMENTS,
    RUNTIME_EXITED,
    SERVER_LEASE_LOST,
)
from modelforge_contract.models import PATH_ADMIN_MODELS
from modelforge_node_agent.serve import ServeWorker
from tests.harness.agent_process import AgentProcess, wait_until
from tests.harness.control_plane import make_settings, serve
from tests.harness.llama import GREEDY
from tests.harness.nvml import load_host
from tests.harness.work_node import short_dir, start_node

pytestmark = pytest.mark.slow

DEPLOYMENTS = PATH_ADMIN_DEPLOYMENTS


@pytest.fixture
def cp(tmp_path):
    settings = make_settings(tmp_path / "cp", heartbeat_interval_seconds=1, serve_lease_seconds=4)
    with serve(settings) as plane:
        yield plane


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


@pytest.fixture
def model(cp, tmp_path, tiny_gguf):
    source = tmp_path / "src"
    source.mkdir()
    (source / "tiny.gguf").write_bytes(Path(tiny_gguf).read_bytes())
    answer = cp.admin(
        "POST", PATH_ADMIN_MODELS, json={"name": "tiny", "source": {"path": str(source)}}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def serving_node(cp, tmp_path, sockets, name, binary, mode="cpu", **settings):
    node = start_node(
        cp,
        tmp_path / name,
        sockets,
        name,
        mode=mode,
        worker_settings={"MODELFORGE_WORKER_LLAMA_SERVER": str(binary)},
        **settings,
    )

    def online():
        if not (node.state_volume / "identity.json").exists():
            return False
        answer = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node.node_id}")
        if answer.status_code != 200 or answer.json().get("liveness") != "online":
            return False
        readiness = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node.node_id}/readiness")
        return readiness.json().get("ready")

    try:
        wait_until(online, timeout=90, what=f"{name} online and ready")
    except BaseException:
        print(node.agent.log())
        node.close()
        raise
    return node


def replicate(cp, nodes) -> None:
    made = cp.admin(
        "POST", f"{PATH_ADMIN_MODELS}/tiny/replicas", json={"node_ids": [n.node_id for n in nodes]}
    )
    assert made.status_code == 202, made.text

    def present():
        listed = cp.admin("GET", f"{PATH_ADMIN_MODELS}/tiny/replicas").json()["replicas"]
        return all(r["state"] == "present" for r in listed) and len(listed) == len(nodes)

    wait_until(present, timeout=90, what="replicas present")


def deploy(cp, name, nodes, **fields) -> requests.Response:
    body = {"name": name, "model": "tiny", "runtime": "llama.cpp"}
    body["node_ids"] = [n.node_id for n in nodes]
    return cp.admin("POST", DEPLOYMENTS, json={**body, **fields})


def deployment(cp, name) -> dict | None:
    answer = cp.admin("GET", f"{DEPLOYMENTS}/{name}")
    return answer.json() if answer.status_code == 200 else None


def wait_servers(cp, name, state, timeout=120, count=None) -> dict:
    def reached():
        shown = deployment(cp, name)
        if shown is None:
            return None
        states = [s["state"] for s in shown["servers"]]
        wanted = count if count is not None else len(states)
        return shown if states.count(state) == wanted and wanted else None

    return wait_until(reached, timeout=timeout, what=f"{name} servers {state}")


def worker_servers(node) -> dict[str, dict]:
    return ServeWorker(node.worker.socket_path).servers()


def complete(port: int, name: str) -> str:
    answer = requests.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": name, "prompt": "Once upon a time", "max_tokens": 12, **GREEDY},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def llama_processes(binary) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "exe") == str(binary):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_cluster_deploy_to_two_nodes_runs_both_then_undeploy_stops_them(
    cp, tmp_path, sockets, model, llama_server_binary
):
    a = serving_node(cp, tmp_path, sockets, "serve-a", llama_server_binary)
    b = serving_node(cp, tmp_path, sockets, "serve-b", llama_server_binary)
    try:
        replicate(cp, [a, b])
        made = deploy(cp, "tiny-chat", [a, b])
        assert made.status_code == 201, made.text
        view = made.json()
        assert view["digest"] == model["digest"] and len(view["servers"]) == 2
        assert view["settings"]["model_file"] == "tiny.gguf"
        shown = wait_servers(cp, "tiny-chat", "running")
        assert shown["state"] == "running"
        texts = []
        for node in (a, b):
            [server] = worker_servers(node).values()
            assert server["served_name"] == "tiny-chat" and server["exit"] is None
            pid = server["ident"]["pid"]
            # The runtime reads the replicated files and sees no GPU at all on a CPU node.
            digest_hex = model["digest"].removeprefix("sha256:")
            model_dir = node.state_volume / "artifacts" / "models" / digest_hex
            assert str(model_dir / "tiny.gguf") in Path(f"/proc/{pid}/cmdline").read_text()
            assert environ_of(pid)["CUDA_VISIBLE_DEVICES"] == ""
            listening = Path(f"/proc/{pid}/net/tcp").read_text()
            assert f"0100007F:{server['port']:04X}" in listening  # bound to 127.0.0.1 only
            texts.append(complete(server["port"], "tiny-chat"))
        assert texts[0] == texts[1] and texts[0]  # the same greedy text on both members
        gone = cp.admin("DELETE", f"{DEPLOYMENTS}/tiny-chat")
        assert gone.status_code == 200, gone.text
        wait_until(lambda: deployment(cp, "tiny-chat") is None, timeout=60, what="undeployed")
        for node in (a, b):
            assert worker_servers(node) == {}
        assert llama_processes(llama_server_binary) == []
    finally:
        a.close()
        b.close()


def test_model_missing_before_anything_starts_then_replicate_first_starts_it(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-m", llama_server_binary)
    try:
        refused = deploy(cp, "tiny-m", [node])
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == MODEL_MISSING and node.node_id in error["message"]
        assert refused.json()["node_ids"] == [node.node_id]
        assert deployment(cp, "tiny-m") is None and worker_servers(node) == {}
        made = deploy(cp, "tiny-m", [node], replicate=True)
        assert made.status_code == 201, made.text
        assert made.json()["servers"][0]["state"] == "pending"
        wait_servers(cp, "tiny-m", "running")
        [server] = worker_servers(node).values()
        assert complete(server["port"], "tiny-m")
    finally:
        node.close()


def test_agent_killed_and_restarted_adopts_its_runtime_without_a_duplicate(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-r", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-r", [node]).status_code == 201
        wait_servers(cp, "tiny-r", "running")
        [before] = worker_servers(node).values()
        node.agent.process.send_signal(signal.SIGKILL)
        node.agent.process.wait(timeout=10)
        node.agent.close()
        node.agent = AgentProcess(node.agent.env, tmp_path / "serve-r" / "agent-2.log")
        node.agent.wait_for_log(r"adopted: its runtime still runs", timeout=60)
        [after] = worker_servers(node).values()
        assert after["ident"] == before["ident"]  # the same process, not a second one
        assert llama_processes(llama_server_binary) == [before["ident"]["pid"]]
        shown = wait_servers(cp, "tiny-r", "running")
        assert shown["servers"][0]["restarts"] == 0
        assert complete(after["port"], "tiny-r")
        events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
        leased = [e for e in events if e["action"] == "server.leased"]
        assert [e["detail"]["adopted"] for e in reversed(leased)] == [False, True]
        # Adopted as it runs: the server never went back to starting.
        assert [e for e in events if e["action"] == "server.restarting"] == []
    finally:
        node.close()


def test_a_runtime_killed_comes_back_by_itself_and_is_never_failed(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-k", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-k", [node]).status_code == 201
        wait_servers(cp, "tiny-k", "running")
        [first] = worker_servers(node).values()
        os.kill(first["ident"]["pid"], signal.SIGKILL)
        backing_off = wait_servers(cp, "tiny-k", "backoff", timeout=30)["servers"][0]
        assert backing_off["error"]["code"] == RUNTIME_EXITED
        assert "killed by signal 9" in backing_off["error"]["message"]
        assert backing_off["next_attempt_at"] is not None and backing_off["restarts"] == 1

        def restarted():
            server = deployment(cp, "tiny-k")["servers"][0]
            return server if server["restarts"] == 1 and server["state"] == "running" else None

        server = wait_until(restarted, timeout=60, what="running again")
        assert server["error"] is None and server["next_attempt_at"] is None
        [second] = worker_servers(node).values()
        assert second["ident"] != first["ident"]
        assert complete(second["port"], "tiny-k")
        events = cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
        assert "server.failed" not in {e["action"] for e in events}
    finally:
        node.close()


def test_a_runtime_that_always_exits_backs_off_doubling_and_never_fails(
    cp, tmp_path, sockets, model
):
    """Three launches of a runtime that exits at once take more than 15 s (5, then double: 10),
    not a tight loop, and the server is ``backoff`` all along, never ``failed``."""
    launches = tmp_path / "launches"
    exits = tmp_path / "exiting-llama-server"
    exits.write_text(f"#!/bin/sh\ndate +%s.%N >> {launches}\necho 'no such model' >&2\nexit 3\n")
    exits.chmod(0o755)
    node = serving_node(cp, tmp_path, sockets, "serve-x", exits)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-x", [node]).status_code == 201

        def launched(count):
            times = launches.read_text().split() if launches.exists() else []
            return [float(t) for t in times] if len(times) >= count else None

        times = wait_until(lambda: launched(3), timeout=120, what="three launches")
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert [round(g) >= want for g, want in zip(gaps, (5, 10), strict=True)] == [True] * 2
        server = deployment(cp, "tiny-x")["servers"][0]
        assert server["state"] in ("backoff", "starting") and server["restarts"] >= 2
        assert server["error"]["code"] == RUNTIME_EXITED
        assert "no such model" in server["error"]["message"]  # the runtime's last line
    finally:
        node.close()


def test_an_agent_gone_past_its_lease_leaves_the_server_waiting_and_it_serves_again_on_return(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-l", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-l", [node]).status_code == 201
        wait_servers(cp, "tiny-l", "running")
        [before] = worker_servers(node).values()
        node.agent.process.send_signal(signal.SIGKILL)
        node.agent.process.wait(timeout=10)
        shown = wait_servers(cp, "tiny-l", "waiting", timeout=60)
        assert shown["state"] == "down"
        assert shown["servers"][0]["error"]["code"] in (SERVER_LEASE_LOST, "NODE_OFFLINE")
        assert len(worker_servers(node)) == 1  # the worker still runs it, unwatched
        node.agent.close()
        node.agent = AgentProcess(node.agent.env, tmp_path / "serve-l" / "agent-2.log")
        # No admin call: the agent claims it again and adopts the runtime that still runs.
        shown = wait_servers(cp, "tiny-l", "running", timeout=60)
        assert shown["servers"][0]["error"] is None and shown["servers"][0]["restarts"] == 0
        [after] = worker_servers(node).values()
        assert after["ident"] == before["ident"]
        assert llama_processes(llama_server_binary) == [before["ident"]["pid"]]
        assert complete(after["port"], "tiny-l")
    finally:
        node.close()


def test_restart_of_a_running_deployment_serves_again_with_a_fresh_runtime(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-s", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-s", [node]).status_code == 201
        wait_servers(cp, "tiny-s", "running")
        [before] = worker_servers(node).values()
        again = cp.admin("POST", f"{DEPLOYMENTS}/tiny-s/restart")
        assert again.status_code == 200, again.text
        assert again.json()["servers"][0]["state"] == "pending"

        def fresh():
            listed = list(worker_servers(node).values())
            shown = deployment(cp, "tiny-s")["servers"][0]
            if shown["state"] == "running" and listed and listed[0]["ident"] != before["ident"]:
                return listed[0]
            return None

        after = wait_until(fresh, timeout=60, what="running again, a new runtime")
        assert llama_processes(llama_server_binary) == [after["ident"]["pid"]]
        assert complete(after["port"], "tiny-s")
        # The agent took the 409 as the lease's end, once, never as a refusal to retry.
        assert node.agent.log().count("its lease ended (restarted)") == 1
        assert "the serve loop tries again" not in node.agent.log()
    finally:
        node.close()


def test_servers_on_an_eight_gpu_node_get_disjoint_uuids_and_undeploy_frees_them(
    cp, tmp_path, sockets, model, llama_server_binary, fake_nvml_dir
):
    node = serving_node(
        cp,
        tmp_path,
        sockets,
        "serve-g",
        llama_server_binary,
        mode="nvidia",
        host=load_host("h100_80g_x8"),
        fake_nvml_dir=fake_nvml_dir,
    )
    try:
        replicate(cp, [node])
        one = deploy(cp, "tiny-g1", [node], gpu_count=3)
        two = deploy(cp, "tiny-g2", [node], gpu_count=3)
        assert one.status_code == 201 and two.status_code == 201, (one.text, two.text)
        gpus_one = set(one.json()["servers"][0]["gpus"])
        gpus_two = set(two.json()["servers"][0]["gpus"])
        assert len(gpus_one) == len(gpus_two) == 3 and not gpus_one & gpus_two
        too_many = deploy(cp, "tiny-g3", [node], gpu_count=3)
        assert (
            too_many.status_code == 409 and too_many.json()["error"]["code"] == "GPUS_UNAVAILABLE"
        )
        wait_servers(cp, "tiny-g1", "running")
        wait_servers(cp, "tiny-g2", "running")
        by_name = {s["served_name"]: s for s in worker_servers(node).values()}
        for name, gpus in (("tiny-g1", gpus_one), ("tiny-g2", gpus_two)):
            visible = environ_of(by_name[name]["ident"]["pid"])["CUDA_VISIBLE_DEVICES"]
            assert set(visible.split(",")) == gpus  # exactly its own, never all eight
        assert cp.admin("DELETE", f"{DEPLOYMENTS}/tiny-g1").status_code == 200
        wait_until(lambda: deployment(cp, "tiny-g1") is None, timeout=60, what="undeployed")
        three = deploy(cp, "tiny-g3", [node], gpu_count=3)
        assert three.status_code == 201, three.text
        assert not set(three.json()["servers"][0]["gpus"]) & gpus_two
    finally:
        node.close()


def test_deployments_are_listed_with_their_servers(
    cp, tmp_path, sockets, model, llama_server_binary
):
    node = serving_node(cp, tmp_path, sockets, "serve-v", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-v", [node]).status_code == 201
        listed = cp.admin("GET", DEPLOYMENTS).json()["deployments"]
        assert [d["name"] for d in listed] == ["tiny-v"]
        assert listed[0]["servers"][0]["node_id"] == node.node_id
        # The model cannot be deleted while deployed.
        refused = cp.admin("DELETE", f"{PATH_ADMIN_MODELS}/tiny")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "MODEL_IN_USE"
        assert json.dumps(listed)  # plain JSON all the way down
    finally:
        node.close()
