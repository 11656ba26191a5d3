"""GPUs by UUID for work items (issue 25): a claim leases exactly the GPUs an item asks,
picked from the node's measured ones that no other leased item (nor a deployment's server)
holds, and the lease names them. Before, every lease said only a count, two 8-GPU items on
one 8-GPU node were both leased, and the worker asked dockerd for every GPU."""

from __future__ import annotations

from modelforge_appliance.identity.credentials import Caller
from modelforge_appliance.store.tables import Credential, WorkItem
from modelforge_appliance.work import leases
from modelforge_appliance.work.placement import gpus_in_use_by_work
from modelforge_contract import HEADER_CLAIM_REASON
from tests.harness.scripted_node import WorkNode, gpu, item, submit, work_events

NODES = "/api/v1/admin/hardware/nodes"
CONTAINER = {"image": "trainer:1.4", "image_id": "sha256:" + "ab" * 32, "command": ["x"]}


def many_slots(node: WorkNode) -> WorkNode:
    answer = node.cp.admin("PUT", f"{NODES}/{node.node_id}/work-slots", json={"work_slots_max": 8})
    assert answer.status_code == 200, answer.text
    return node


def lease_of(node: WorkNode) -> dict:
    response = node.claim(work_slots=8)
    assert response.status_code == 200, (response.status_code, response.headers)
    return response.json()["lease"]


def nothing_for(node: WorkNode) -> str | None:
    response = node.claim(work_slots=8)
    assert response.status_code == 204, response.text
    return response.headers.get(HEADER_CLAIM_REASON)


def test_two_items_on_an_eight_gpu_node_get_disjoint_uuids_and_a_third_waits(control_plane):
    cp = control_plane
    node = many_slots(WorkNode(cp, "gpu-eight", gpus=[gpu(i) for i in range(8)]).ready())
    uuids = [g["uuid"] for g in node.gpus]
    first = submit(cp, "container", input={**CONTAINER, "gpus": 4})
    second = submit(cp, "container", input=CONTAINER, constraints={"gpu_count": 4})
    third = submit(cp, "smoke", constraints={"gpu_count": 1})
    a, b = lease_of(node), lease_of(node)
    assert [a["work_id"], b["work_id"]] == [first["work_id"], second["work_id"]]
    assert a["gpus"] == uuids[:4] and b["gpus"] == uuids[4:]  # by index, never shared
    assert a["input"]["gpus"] == 4 and b["input"].get("gpus") is None  # the admin's count
    # An item asking a count is placed by that count: input.gpus 4 implies gpu_count 4.
    assert item(cp, first["work_id"])["constraints"]["gpu_count"] == 4
    assert item(cp, first["work_id"])["gpus"] == uuids[:4]
    with cp.store.connection():
        assert gpus_in_use_by_work(cp.store, node.node_id) == set(uuids)
    # Every GPU is held: the one-GPU item waits although the node has slots left.
    assert nothing_for(node) == "no_fitting_item"
    assert node.complete(b).status_code == 200
    c = lease_of(node)
    assert c["work_id"] == third["work_id"] and c["gpus"] == [uuids[4]]
    # The finished item keeps what it had; only leased items hold GPUs.
    assert item(cp, second["work_id"])["gpus"] == uuids[4:]
    with cp.store.connection():
        assert gpus_in_use_by_work(cp.store, node.node_id) == {*uuids[:4], uuids[4]}
    leased = [e for e in work_events(cp) if e["action"] == "work.leased"]
    assert [e["detail"]["gpus"] for e in leased] == [uuids[:4], uuids[4:], [uuids[4]]]


def test_the_picked_gpus_meet_the_constraints_and_an_item_without_gpus_gets_none(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    mixed = [gpu(0, 40, "NVIDIA A100-SXM4-40GB"), gpu(1, 80), gpu(2, 40), gpu(3, 80)]
    node = many_slots(WorkNode(cp, "gpu-mixed", gpus=mixed).ready())
    big = submit(cp, "smoke", constraints={"gpu_count": 2, "min_gpu_memory_bytes": 80 * 2**30})
    named = submit(cp, "smoke", constraints={"gpu_name": "a100"})
    plain = submit(cp, "container", input=CONTAINER)
    assert lease_of(node)["gpus"] == [mixed[1]["uuid"], mixed[3]["uuid"]]
    assert lease_of(node)["gpus"] == [mixed[0]["uuid"]]
    lease = lease_of(node)
    assert lease["work_id"] == plain["work_id"] and lease["gpus"] == []  # never "all"
    assert item(cp, plain["work_id"])["gpus"] == []
    assert item(cp, big["work_id"])["state"] == item(cp, named["work_id"])["state"] == "leased"
    # Two more 80 GB GPUs are not there while the first item holds them.
    submit(cp, "smoke", constraints={"gpu_count": 1, "min_gpu_memory_bytes": 80 * 2**30})
    assert nothing_for(node) == "no_fitting_item"


def test_gpus_held_elsewhere_are_never_leased_and_a_requeued_item_holds_none(
    sqlite_control_plane,
):
    """What the deployments domain passes (its servers' GPUs) is left out of every pick."""
    cp = sqlite_control_plane
    node = WorkNode(cp, "gpu-shared", gpus=[gpu(i) for i in range(4)]).ready()
    uuids = [g["uuid"] for g in node.gpus]
    with cp.store.connection():
        credential_id = Credential.get(Credential.node == node.node_id).credential_id
    caller = Caller(credential_id, node.node_id, "nvidia")
    servers = {node.node_id: {uuids[0], uuids[2]}}
    asked = []

    def held_elsewhere(node_id: str) -> set[str]:
        asked.append(node_id)
        return servers[node_id]

    wanted = submit(cp, "smoke", constraints={"gpu_count": 2})
    lease = leases.claim_work(
        cp.store, cp.settings, caller, ["smoke"], reported_slots=4, held_elsewhere=held_elsewhere
    )
    assert isinstance(lease, leases.Lease), lease
    assert lease.work_id == wanted["work_id"] and list(lease.gpus) == [uuids[1], uuids[3]]
    assert set(asked) == {node.node_id} and len(asked) == 2  # looked, then decided
    submit(cp, "smoke", constraints={"gpu_count": 1})
    assert (
        leases.claim_work(
            cp.store,
            cp.settings,
            caller,
            ["smoke"],
            reported_slots=4,
            held_elsewhere=held_elsewhere,
        )  # fmt: skip
        == "no_fitting_item"
    )
    # Handed back (as a decommission or revocation does): queued again, holding nothing.
    with cp.store.write():
        from modelforge_appliance.store.tables import Node

        leases.return_node_leases(cp.store, Node.get_by_id(node.node_id), "test", "test")
        row = WorkItem.get_by_id(wanted["work_id"])
    assert (row.state, row.gpu_uuids) == ("queued", None)
    with cp.store.connection():
        assert gpus_in_use_by_work(cp.store, node.node_id) == set()
