"""Load on demand on the control plane (deployments/idle.py), under an injected clock: a
deployment unused for ``idle_unload_seconds`` unloads (its agent is told to stop, the server
lands ``idle`` and holds no GPU), a wake starts it again, and two idle-capable deployments
on one GPU never run at once: the one woken unloads the other first."""

from __future__ import annotations

from modelforge_appliance.deployments import idle, placement
from tests.harness.scripted_node import gpu

from .test_deployments import DEPLOYMENTS, ServingNode, deploy, held, tiny_model


def lazy(cp, name, node, seconds=60, **fields):
    answer = deploy(cp, name, [node], settings={"idle_unload_seconds": seconds}, **fields)
    assert answer.status_code == 201, answer.text
    return answer.json()


def run(node, server_id) -> str:
    lease = node.claim_server(server_id).json()["lease"]
    answer = node.renew_server(server_id, lease["lease_id"], "running")
    assert answer.status_code == 200 and answer.json()["state"] == "running", answer.text
    return lease["lease_id"]


def pass_time(clock, node, seconds, *leases) -> None:
    """Move the clock in steps its leases and the node's liveness outlast, renewing."""
    for _ in range(seconds // 10):
        clock.advance(10)
        node.heartbeat_answer()
        for server_id, lease_id in leases:
            node.renew_server(server_id, lease_id, "running")
    clock.advance(seconds % 10)
    node.heartbeat_answer()


def shown(cp, name) -> dict:
    return cp.admin("GET", f"{DEPLOYMENTS}/{name}").json()


def usage_of(cp) -> idle.Usage:
    return cp.server.app.usage


def test_an_unused_deployment_unloads_and_a_wake_starts_it_again(
    clocked_control_plane, clock, tmp_path
):
    cp = clocked_control_plane
    node = ServingNode(cp, "idle-a")
    held(cp, tiny_model(cp, tmp_path), node)
    made = lazy(cp, "lazy", node)
    assert made["settings"]["idle_unload_seconds"] == 60
    server_id = made["servers"][0]["server_id"]
    lease_id = run(node, server_id)
    usage = usage_of(cp)
    usage.touch("lazy")
    pass_time(clock, node, 59, (server_id, lease_id))
    idle.unload_idle(cp.store, usage)
    assert shown(cp, "lazy")["state"] == "running"  # called 59 s ago: kept
    pass_time(clock, node, 2, (server_id, lease_id))
    idle.unload_idle(cp.store, usage)
    server = shown(cp, "lazy")["servers"][0]
    assert (server["state"], server["goal"]) == ("stopping", "idle")
    told = node.renew_server(server_id, lease_id, "running")
    assert told.json()["desired"] == "stop"
    assert node.renew_server(server_id, lease_id, "stopped").json()["state"] == "idle"
    view = shown(cp, "lazy")
    assert view["state"] == "idle" and view["servers"][0]["lease_expires_at"] is None
    assert node.servers() == []  # nothing for the agent to run
    with cp.store.connection():
        assert placement.gpus_held_apart(node.node_id) == (set(), set())
    # The next request wakes it: pending again, listed to its node, and it runs.
    assert idle.wake(cp.store, "lazy", usage) is True
    assert shown(cp, "lazy")["servers"][0]["state"] == "pending"
    assert [s["server_id"] for s in node.servers()] == [server_id]
    run(node, server_id)
    assert shown(cp, "lazy")["state"] == "running"
    events = [
        e["action"]
        for e in cp.admin("GET", "/api/v1/admin/audit-events?limit=500").json()["events"]
    ]
    assert "deployment.unloaded" in events and "deployment.woken" in events


def test_a_deployment_without_idle_unload_never_unloads(clocked_control_plane, clock, tmp_path):
    cp = clocked_control_plane
    node = ServingNode(cp, "idle-b")
    held(cp, tiny_model(cp, tmp_path), node)
    server_id = deploy(cp, "eager", [node]).json()["servers"][0]["server_id"]
    pass_time(clock, node, 3600, (server_id, run(node, server_id)))
    idle.unload_idle(cp.store, usage_of(cp))
    assert shown(cp, "eager")["servers"][0]["state"] == "running"


def test_two_idle_deployments_on_one_gpu_take_turns_and_never_run_at_once(
    clocked_control_plane, clock, tmp_path
):
    cp = clocked_control_plane
    node = ServingNode(cp, "idle-g", gpus=[gpu(0)])
    held(cp, tiny_model(cp, tmp_path), node)
    one = lazy(cp, "one", node)["servers"][0]
    two = lazy(cp, "two", node)["servers"][0]
    assert one["gpus"] == two["gpus"] == [gpu(0)["uuid"]]  # both may name it
    assert (one["state"], two["state"]) == ("pending", "idle")  # only one may run on it
    assert [s["deployment"] for s in node.servers()] == ["one"]
    lease_one = run(node, one["server_id"])
    usage = usage_of(cp)
    # A request for two: one is unloaded first, and two waits for the GPU.
    assert idle.wake(cp.store, "two", usage) is False
    assert shown(cp, "one")["servers"][0]["state"] == "stopping"
    assert shown(cp, "two")["servers"][0]["state"] == "idle"
    assert node.renew_server(one["server_id"], lease_one, "stopped").json()["state"] == "idle"
    assert idle.wake(cp.store, "two", usage) is True
    assert [s["deployment"] for s in node.servers()] == ["two"]
    run(node, two["server_id"])
    with cp.store.connection():
        hard, soft = placement.gpus_held_apart(node.node_id)
    assert (hard, soft) == (set(), {gpu(0)["uuid"]})
    # A deployment that never unloads may not take a GPU an idle-capable one runs on...
    refused = deploy(cp, "pinned", [node], gpu_count=1)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "GPUS_UNAVAILABLE"
    idle.unload_idle(cp.store, usage)  # not yet: two was just called
    assert shown(cp, "two")["servers"][0]["state"] == "running"


def test_a_woken_server_whose_gpu_a_pinned_deployment_took_says_so(
    clocked_control_plane, clock, tmp_path
):
    cp = clocked_control_plane
    node = ServingNode(cp, "idle-p", gpus=[gpu(0)])
    held(cp, tiny_model(cp, tmp_path), node)
    server = lazy(cp, "sleepy", node)["servers"][0]
    lease_id = run(node, server["server_id"])
    pass_time(clock, node, 61, (server["server_id"], lease_id))
    idle.unload_idle(cp.store, usage_of(cp))
    node.renew_server(server["server_id"], lease_id, "stopped")
    assert shown(cp, "sleepy")["state"] == "idle"
    pinned = deploy(cp, "pinned", [node], gpu_count=1)  # the GPU is free while it sleeps
    assert pinned.status_code == 201, pinned.text
    assert idle.wake(cp.store, "sleepy", usage_of(cp)) is False
    view = shown(cp, "sleepy")["servers"][0]
    assert view["state"] == "idle" and view["error"]["code"] == "GPUS_UNAVAILABLE"
