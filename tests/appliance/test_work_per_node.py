"""What one node may take from the work plane, and what it is credited with (issue 21).

Tried with one enrolled credential, a node claimed 20 items in one burst and completed them
all with forged results, in audit events that named no credential. Now the control plane
leases a node at most its work slots (what its agent reports, never more than the
administrator's maximum for it), answers claims past the node's rate with 429 before the
store is touched, and records which node and credential leased and completed each item.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace

from modelforge_appliance.store.tables import AuditEvent, WorkItem, WorkLease
from modelforge_contract import CLAIM_RATE_LIMITED, HEADER_CLAIM_REASON, PATH_AGENT_WORK_CLAIM
from tests.harness.control_plane import error_code, run_cli, serve, store_env
from tests.harness.scripted_node import WORK, WorkNode, item, submit, work_events

NODES = "/api/v1/admin/hardware/nodes"


def claim_burst(node: WorkNode, count: int, **kwargs) -> list:
    """``count`` claims sent at the same instant from one credential, as the attack sent them."""
    barrier = threading.Barrier(count)
    answers: list = [None] * count

    def send(index: int) -> None:
        barrier.wait()
        answers[index] = node.claim(**kwargs)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def states(cp) -> Counter:
    return Counter(i["state"] for i in cp.admin("GET", f"{WORK}?limit=500").json()["work"])


def what_the_store_holds(cp) -> tuple:
    """Everything a claim would write: audit events, lease rows, item states and holders."""
    cp.heartbeats.flush()  # the buffer's own writes must not count against the claims
    with cp.store.connection():
        return (
            AuditEvent.select().count(),
            WorkLease.select().count(),
            sorted(WorkItem.select(WorkItem.work_id, WorkItem.state, WorkItem.node).tuples()),
        )


def reason(response) -> tuple:
    return response.status_code, response.headers.get(HEADER_CLAIM_REASON)


def test_twenty_claims_at_once_lease_only_the_nodes_slots(control_plane):
    cp = control_plane
    assert cp.settings.work_slots_per_node == 2  # the documented default
    node = WorkNode(cp, "gpu-greedy").ready()
    for _ in range(20):
        submit(cp)
    # The agent may say it runs 64 slots; the administrator's maximum (the default) decides.
    answers = claim_burst(node, 20, work_slots=64)
    granted = [answer.json()["lease"] for answer in answers if answer.status_code == 200]
    assert len(granted) == 2
    assert {reason(a) for a in answers if a.status_code != 200} == {(204, "slots_full")}
    assert states(cp) == {"leased": 2, "queued": 18}
    # A finished item frees its slot: one more is leased, and then no more.
    assert node.complete(granted[0]).status_code == 200
    assert node.claim(work_slots=64).status_code == 200
    assert reason(node.claim(work_slots=64)) == (204, "slots_full")
    assert states(cp) == {"leased": 2, "succeeded": 1, "queued": 17}
    assert [e["action"] for e in work_events(cp)].count("work.leased") == 3


def test_a_claim_without_work_slots_counts_as_one_and_garbage_is_refused(sqlite_control_plane):
    cp = sqlite_control_plane
    node = WorkNode(cp, "gpu-1").ready()
    for _ in range(3):
        submit(cp)
    before = what_the_store_holds(cp)
    for value, code in [
        (0, "FIELD_RANGE"),
        (65, "FIELD_RANGE"),
        (-1, "FIELD_RANGE"),
        ("2", "FIELD_TYPE"),
        (2.5, "FIELD_TYPE"),
        (True, "FIELD_TYPE"),
        (None, "FIELD_TYPE"),
    ]:
        body = {"node_id": node.node_id, "capabilities": ["smoke"], "work_slots": value}
        response = cp.agent("POST", PATH_AGENT_WORK_CLAIM, node.credential, json=body)
        assert (response.status_code, error_code(response)) == (400, code), value
        assert "work_slots" in response.json()["error"]["message"]
    assert what_the_store_holds(cp) == before
    # An agent from before work_slots existed runs one slot: it gets one lease.
    assert node.claim().status_code == 200
    assert reason(node.claim()) == (204, "slots_full")
    assert node.claim(work_slots=2).status_code == 200
    assert reason(node.claim(work_slots=2)) == (204, "slots_full")


def test_an_admin_sets_a_nodes_maximum_by_api_and_cli_audited(sqlite_control_plane):
    cp = sqlite_control_plane
    node, other = WorkNode(cp, "gpu-big").ready(), WorkNode(cp, "gpu-small").ready()
    for _ in range(8):
        submit(cp)
    path = f"{NODES}/{node.node_id}/work-slots"
    view = cp.admin("GET", f"{NODES}/{node.node_id}").json()
    assert (view["work_slots_max"], view["work_slots_max_source"]) == (2, "default")

    answer = cp.admin("PUT", path, json={"work_slots_max": 3})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["work_slots_max"], answer.json()["work_slots_max_source"]) == (3, "node")
    assert [node.claim(work_slots=64).status_code for _ in range(4)] == [200, 200, 200, 204]
    assert reason(node.claim(work_slots=64)) == (204, "slots_full")
    # The other node keeps the default, and its agent's own slots bound it further.
    assert other.claim(work_slots=1).status_code == 200
    assert reason(other.claim(work_slots=1)) == (204, "slots_full")

    before = what_the_store_holds(cp)
    for body, code in [
        ({"work_slots_max": 0}, "FIELD_RANGE"),
        ({"work_slots_max": 65}, "FIELD_RANGE"),
        ({"work_slots_max": "3"}, "FIELD_TYPE"),
        ({"work_slots_max": 1.5}, "FIELD_TYPE"),
        ({}, "FIELD_REQUIRED"),
        ({"work_slots_max": 3, "burst": 9}, "FIELD_UNKNOWN"),
    ]:
        refused = cp.admin("PUT", path, json=body)
        assert (refused.status_code, error_code(refused)) == (400, code), body
    unknown = cp.admin("PUT", f"{NODES}/no-such-node/work-slots", json={"work_slots_max": 2})
    assert unknown.status_code == 404
    assert what_the_store_holds(cp) == before

    env = store_env(cp.settings)
    lowered = run_cli("nodes", "set-work-slots", "gpu-big", "1", env=env, check=True)
    assert f"Node {node.node_id} may hold at most 1 leased work item(s)" in lowered.stdout
    # Leases it holds are kept until they end; it gets no new one while over its maximum.
    assert states(cp)["leased"] == 4
    assert reason(node.claim(work_slots=64)) == (204, "slots_full")
    for bad in ("0", "65", "lots"):
        refused = run_cli("nodes", "set-work-slots", "gpu-big", bad, env=env)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, bad
    back = json.loads(
        run_cli("nodes", "set-work-slots", "gpu-big", "default", "--json", env=env).stdout
    )
    assert (back["work_slots_max"], back["work_slots_max_source"]) == (2, "default")
    shown = run_cli("nodes", "show", "gpu-big", env=env, check=True).stdout
    assert "at most 2 item(s) leased at once (MODELFORGE_WORK_SLOTS_PER_NODE)" in shown

    events = cp.admin("GET", f"/api/v1/admin/audit-events?node_id={node.node_id}").json()
    changes = [
        (e["actor"].split(":")[0], e["detail"]["previous"], e["detail"]["work_slots_max"])
        for e in reversed(events["events"])
        if e["action"] == "node.work_slots_set"
    ]
    assert changes == [("admin", None, 3), ("cli", 3, 1), ("cli", 1, None)]


def test_claims_past_the_rate_get_429_with_retry_after_and_write_nothing(sqlite_settings, clock):
    # Three claims a second; the test's clock only moves when told, so the count is exact.
    with serve(replace(sqlite_settings, work_claims_per_second=3), clock) as cp:
        node, other = WorkNode(cp, "gpu-fast").ready(), WorkNode(cp, "gpu-calm").ready()
        allowed = cp.admin("PUT", f"{NODES}/{node.node_id}/work-slots", json={"work_slots_max": 64})
        assert allowed.status_code == 200
        for _ in range(10):
            submit(cp)
        assert [node.claim(work_slots=64).status_code for _ in range(3)] == [200] * 3
        before = what_the_store_holds(cp)
        for _ in range(5):
            refused = node.claim(work_slots=64)
            assert (refused.status_code, error_code(refused)) == (429, CLAIM_RATE_LIMITED)
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["compatibility"] == "COMPATIBLE"
            assert "MODELFORGE_WORK_CLAIMS_PER_SECOND" in refused.json()["error"]["next_step"]
        # Each of them would have leased an item; none wrote a thing.
        assert what_the_store_holds(cp) == before
        # The limit is the node's own: another node claims as usual.
        assert other.claim().status_code == 200
        clock.advance(0.34)  # a third of a second: one more claim's worth
        assert node.claim(work_slots=64).status_code == 200
        assert node.claim(work_slots=64).status_code == 429
        metrics = cp.admin("GET", "/metrics").text.splitlines()
        assert 'modelforge_work_claims_total{result="rate_limited"} 6.0' in metrics
        assert 'modelforge_work_claims_total{result="leased"} 5.0' in metrics


def test_the_item_names_the_node_and_credential_that_leased_and_completed_it(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    node = WorkNode(cp, "gpu-1").ready()
    credentials = cp.admin("GET", f"{NODES}/{node.node_id}/credentials").json()["credentials"]
    credential_id = credentials[0]["credential_id"]
    secret = node.credential.split("_", 2)[2]
    work = submit(cp)
    lease = node.lease()
    leased = item(cp, work["work_id"])
    assert (leased["node_id"], leased["lease_credential_id"]) == (node.node_id, credential_id)
    assert (leased["completed_by_node_id"], leased["completed_by_credential_id"]) == (None, None)
    # The node says it succeeded and makes up a result: recorded as its claim, not believed.
    forged = {"checked": ["cpu: 8 CPUs", "computation: checksum 42 (expected 42)"]}
    assert node.complete(lease, result=forged).status_code == 200
    done = item(cp, work["work_id"])
    assert (done["state"], done["result"]) == ("succeeded", forged)
    assert done["completed_by_node_id"] == node.node_id
    assert done["completed_by_credential_id"] == credential_id
    assert done["lease_credential_id"] == credential_id
    with cp.store.connection():
        assert WorkLease.get_by_id(lease["lease_id"]).credential_id == credential_id

    events = {e["action"]: e for e in work_events(cp)}
    for action in ("work.leased", "work.completed"):
        assert events[action]["node_id"] == node.node_id, action
        assert events[action]["detail"]["credential_id"] == credential_id, action

    env = store_env(cp.settings)
    shown = run_cli("work", "show", work["work_id"], env=env, check=True).stdout
    assert f"node:     {node.node_id} (credential {credential_id})" in shown
    assert f"reported: by node {node.node_id} with credential {credential_id}" in shown
    assert "not verified" in shown
    as_json = json.loads(run_cli("work", "show", work["work_id"], "--json", env=env).stdout)
    assert as_json["completed_by_credential_id"] == credential_id
    # An id, never the secret: not in the item, the list, the audit trail or the CLI.
    answers = [
        cp.admin("GET", f"{WORK}/{work['work_id']}").text,
        cp.admin("GET", WORK).text,
        cp.admin("GET", "/api/v1/admin/audit-events?limit=500").text,
        shown,
    ]
    assert not any(secret in answer for answer in answers)
