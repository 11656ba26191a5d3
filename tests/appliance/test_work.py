"""The work plane on the control plane (issue 13): placement, leases, idempotency, cancel."""

from __future__ import annotations

import threading

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.identity import credentials
from modelforge_appliance.work import leases
from modelforge_contract import (
    EXIT_NOT_FOUND,
    HEADER_AGENT_PROTOCOL,
    HEADER_CLAIM_REASON,
    LEASE_EXPIRED,
    LEASE_LOST,
    WORK_FINISHED,
)
from tests.harness.control_plane import error_code, run_cli, store_env
from tests.harness.scripted_node import (
    GIB,
    WORK,
    WorkNode,
    gpu,
    item,
    submit,
    work_events,
    worker_health,
)

NODES = "/api/v1/admin/hardware/nodes"


def _decommission(cp, node: WorkNode) -> dict:
    preview = cp.admin("POST", f"{NODES}/{node.node_id}/decommission/preview").json()
    response = cp.admin(
        "POST",
        f"{NODES}/{node.node_id}/decommission/execute",
        json={"confirmation": preview["confirmation"]},
    )
    assert response.status_code == 200, response.text
    return preview


def test_placement_only_a_fitting_eligible_node_receives_the_item(clocked_control_plane, clock):
    cp = clocked_control_plane
    settings = cp.settings
    names = [
        "offline",
        "stale",
        "cordoned",
        "decommissioned",
        "incompatible-agent",
        "incompatible-worker",
        "worker-down",
        "inventory-too-old",
        "too-few-gpus",
        "too-little-memory",
        "wrong-model",
        "fitting",
    ]
    gpus = {
        "too-few-gpus": [gpu(0)],
        "too-little-memory": [gpu(0, 24, "NVIDIA GeForce RTX 4090"), gpu(1, 24)],
        "wrong-model": [gpu(0, 80, "NVIDIA A100 80GB"), gpu(1, 80, "NVIDIA A100 80GB")],
    }
    nodes = {name: WorkNode(cp, name, gpus.get(name)) for name in names}
    # Timestamps first: the clock only moves forward.
    nodes["inventory-too-old"].inventory()
    nodes["offline"].ready()
    clock.advance(settings.inventory_max_age_seconds + 1)
    nodes["stale"].ready()
    clock.advance(settings.stale_after_seconds)
    for name, node in nodes.items():
        if name in ("offline", "stale"):
            continue
        if name == "inventory-too-old":
            node.heartbeat()
        elif name == "incompatible-worker":
            node.heartbeat(worker_health(protocol=2))
            node.inventory()
        elif name == "worker-down":
            node.heartbeat(worker_health(reachable=False, protocol=None), status="degraded")
            node.inventory()
        else:
            node.ready()
    assert cp.admin("POST", f"{NODES}/{nodes['cordoned'].node_id}/cordon").status_code == 200
    _decommission(cp, nodes["decommissioned"])

    work = submit(
        cp, constraints={"gpu_count": 2, "min_gpu_memory_bytes": 40 * GIB, "gpu_name": "H100"}
    )

    expected_reasons = {
        "offline": "not_online",
        "stale": "not_online",
        "cordoned": "cordoned",
        "incompatible-worker": "worker",
        "worker-down": "worker",
        "inventory-too-old": "inventory_age",
        "too-few-gpus": "no_fitting_item",
        "too-little-memory": "no_fitting_item",
        "wrong-model": "no_fitting_item",
    }
    for name, reason in expected_reasons.items():
        response = nodes[name].claim()
        assert (response.status_code, response.headers.get(HEADER_CLAIM_REASON)) == (204, reason)
    assert nodes["decommissioned"].claim().status_code == 403
    refused = nodes["incompatible-agent"].claim(headers={HEADER_AGENT_PROTOCOL: "2"})
    assert refused.status_code == 426
    assert refused.json()["compatibility"] == "TOO_NEW"
    assert item(cp, work["work_id"])["state"] == "queued"

    lease = nodes["fitting"].lease()
    assert lease["work_id"] == work["work_id"]
    leased = [e for e in work_events(cp) if e["action"] == "work.leased"]
    assert [e["node_id"] for e in leased] == [nodes["fitting"].node_id]


def test_readiness_shows_the_worker_check_with_its_answer(sqlite_control_plane):
    cp = sqlite_control_plane
    node = WorkNode(cp, "gpu-r")

    def worker_check():
        answer = cp.admin("GET", f"{NODES}/{node.node_id}/readiness").json()
        return {c["name"]: c for c in answer["checks"]}["worker"]

    assert worker_check()["ok"] is False
    assert "UNKNOWN" in worker_check()["detail"]
    node.heartbeat(worker_health(protocol=0))
    check = worker_check()
    assert (check["ok"], "TOO_OLD" in check["detail"]) == (False, True)
    assert "Upgrade the runtime worker" in check["next_step"]
    node.heartbeat(worker_health(protocol=7))
    assert "TOO_NEW" in worker_check()["detail"]
    node.heartbeat(worker_health(reachable=False, protocol=None))
    assert "does not answer" in worker_check()["detail"]
    node.heartbeat()
    check = worker_check()
    assert check["ok"] is True
    assert "COMPATIBLE" in check["detail"] and "smoke" in check["detail"]


def test_lease_expiry_requeues_and_a_late_completion_is_lost(clocked_control_plane, clock):
    cp = clocked_control_plane
    first, second = WorkNode(cp, "gpu-1").ready(), WorkNode(cp, "gpu-2").ready()
    work = submit(cp, max_attempts=3)
    lease = first.lease()
    assert (lease["attempt"], lease["capability"]) == (1, "smoke")
    assert first.renew(lease).status_code == 200
    clock.advance(cp.settings.work_lease_seconds + 1)
    first.ready(), second.ready()
    again = second.lease()
    assert again["work_id"] == work["work_id"] and again["attempt"] == 2
    before = item(cp, work["work_id"])
    late = first.complete(lease)
    assert (late.status_code, error_code(late)) == (409, LEASE_LOST)
    assert error_code(first.renew(lease)) == LEASE_LOST
    assert item(cp, work["work_id"]) == before
    done = second.complete(again, log_tail="x" * 40000)
    assert done.status_code == 200, done.text
    finished = item(cp, work["work_id"])
    assert finished["state"] == "succeeded"
    assert finished["node_id"] == second.node_id
    assert len(finished["log_tail"]) == 16384  # bounded: the tail is kept
    assert error_code(second.complete(again)) == LEASE_LOST  # exactly once
    actions = [(e["action"], e["detail"].get("lease_id")) for e in work_events(cp)]
    assert actions == [
        ("work.submitted", None),
        ("work.leased", lease["lease_id"]),
        ("work.lease_expired", lease["lease_id"]),
        ("work.leased", again["lease_id"]),
        ("work.completed", again["lease_id"]),
    ]


def test_a_claim_that_began_before_an_expiry_leases_from_the_time_it_is_granted(
    clocked_control_plane, clock, monkeypatch
):
    # A claim reads the clock, looks, then leases in its write transaction. The expiry that
    # freed the item can commit in between (seen in CI: the item's lease ran out twice and
    # its attempts counted three): the lease's time is the one read where it is granted.
    cp = clocked_control_plane
    first, second = WorkNode(cp, "gpu-1").ready(), WorkNode(cp, "gpu-2").ready()
    work = submit(cp, max_attempts=3)
    lease = first.lease()
    before_expiry = clock.now()
    clock.advance(cp.settings.work_lease_seconds + 1)
    second.ready()
    assert [e["work_id"] for e in leases.expire_leases(cp.store)] == [work["work_id"]]
    reads = iter([before_expiry])  # the claim's first read, as if taken before the expiry
    real_now = ManualClock.now
    monkeypatch.setattr(clock, "now", lambda: next(reads, None) or real_now(clock))
    caller = credentials.authenticate_node(cp.store, f"Bearer {second.credential}", second.node_id)
    again = leases.claim_work(cp.store, cp.settings, caller, ["smoke"])
    assert isinstance(again, leases.Lease), again
    assert next(reads, "read") == "read"  # the stale time was taken
    assert again.expires_at == clock.now() + cp.settings.work_lease_seconds
    assert leases.expire_leases(cp.store) == []  # the new lease has not run out already
    held = item(cp, work["work_id"])
    assert (held["state"], held["node_id"], held["attempts"]) == ("leased", second.node_id, 2)
    assert lease["lease_id"] != again.lease_id


def test_an_item_fails_once_its_attempts_are_spent(clocked_control_plane, clock):
    cp = clocked_control_plane
    node = WorkNode(cp, "gpu-1").ready()
    work = submit(cp, max_attempts=1)
    node.lease()
    clock.advance(cp.settings.work_lease_seconds + 1)
    failed = item(cp, work["work_id"])
    assert failed["state"] == "failed"
    assert failed["error"]["code"] == LEASE_EXPIRED
    node.ready()
    assert node.claim().status_code == 204


def test_the_same_idempotency_key_fifty_times_at_once_yields_one_item(control_plane):
    cp = control_plane
    barrier = threading.Barrier(50)
    answers = []

    def send():
        barrier.wait()
        response = cp.admin(
            "POST", WORK, json={"capability": "smoke", "idempotency_key": "nightly-smoke-1"}
        )
        answers.append((response.status_code, response.json()["work_id"]))

    threads = [threading.Thread(target=send) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(status for status, _ in answers) == [200] * 49 + [201]
    assert len({work_id for _, work_id in answers}) == 1
    assert len(cp.admin("GET", WORK).json()["work"]) == 1
    assert [e["action"] for e in work_events(cp)] == ["work.submitted"]


def test_cancel_queued_leased_and_finished_items(sqlite_control_plane):
    cp = sqlite_control_plane
    node = WorkNode(cp, "gpu-1").ready()
    queued = submit(cp)
    cancelled = cp.admin("POST", f"{WORK}/{queued['work_id']}/cancel").json()
    assert cancelled["state"] == "cancelled"
    leased = submit(cp)
    lease = node.lease()
    assert lease["work_id"] == leased["work_id"]
    assert cp.admin("POST", f"{WORK}/{leased['work_id']}/cancel").json()["state"] == "cancelled"
    assert error_code(node.renew(lease)) == LEASE_LOST
    assert error_code(node.complete(lease)) == LEASE_LOST
    finished = submit(cp)
    assert node.complete(node.lease()).status_code == 200
    refused = cp.admin("POST", f"{WORK}/{finished['work_id']}/cancel")
    assert (refused.status_code, error_code(refused)) == (409, WORK_FINISHED)
    states = {i["work_id"]: i["state"] for i in cp.admin("GET", WORK).json()["work"]}
    assert states == {
        queued["work_id"]: "cancelled",
        leased["work_id"]: "cancelled",
        finished["work_id"]: "succeeded",
    }
    assert [i["work_id"] for i in cp.admin("GET", f"{WORK}?state=cancelled").json()["work"]] == [
        leased["work_id"],
        queued["work_id"],
    ]


def test_decommission_and_revocation_return_the_nodes_leases(control_plane):
    cp = control_plane
    first, second = WorkNode(cp, "gpu-1").ready(), WorkNode(cp, "gpu-2").ready()
    one, two = submit(cp), submit(cp)
    assert first.lease()["work_id"] == one["work_id"]
    assert second.lease()["work_id"] == two["work_id"]

    revoked = cp.admin("DELETE", f"{NODES}/{first.node_id}/credential").json()
    assert revoked["leases_returned"] == [one["work_id"]]
    assert item(cp, one["work_id"])["state"] == "queued"
    assert item(cp, one["work_id"])["attempts"] == 0

    preview = _decommission(cp, second)
    assert preview["effects"]["leases_returned"] == [two["work_id"]]
    assert item(cp, two["work_id"])["state"] == "queued"
    reasons = [
        e["detail"]["reason"] for e in work_events(cp) if e["action"] == "work.lease_returned"
    ]
    assert reasons == ["credential revoked", "decommissioned"]


def test_submit_refuses_bad_input_and_changes_nothing(sqlite_control_plane):
    cp = sqlite_control_plane
    cases = [
        ({"capability": "teleport"}, "FIELD_CHOICE"),
        ({"capability": "smoke", "input": {"matrix_size": 100000}}, "FIELD_RANGE"),
        ({"capability": "smoke", "input": {"surprise": 1}}, "FIELD_UNKNOWN"),
        ({"capability": "container", "input": {"image": "x:1"}}, "FIELD_REQUIRED"),
        (
            {
                "capability": "container",
                "input": {"image": "x:1", "image_id": "sha256:" + "z" * 64},
            },
            "FIELD_FORMAT",
        ),
        ({"capability": "smoke", "constraints": {"gpu_count": -1}}, "FIELD_RANGE"),
        ({"capability": "smoke", "timeout_seconds": 0}, "FIELD_RANGE"),
    ]
    for body, code in cases:
        response = cp.admin("POST", WORK, json=body)
        assert (response.status_code, error_code(response)) == (400, code), body
    assert cp.admin("GET", WORK).json()["work"] == []
    assert cp.admin("GET", f"{WORK}/nope").status_code == 404
    assert cp.admin("GET", f"{WORK}?state=bogus").status_code == 400


def test_metrics_show_queue_depth_claims_expiries_and_completion_time(clocked_control_plane, clock):
    cp = clocked_control_plane
    node = WorkNode(cp, "gpu-1").ready()
    for _ in range(3):
        submit(cp, max_attempts=2)
    assert node.complete(node.lease()).status_code == 200
    node.lease()  # left to expire
    clock.advance(cp.settings.work_lease_seconds + 1)
    node.ready()
    node.lease()  # settles the expiry first, then leases one of the two queued items
    text = cp.admin("GET", "/metrics").text.splitlines()
    for line in (
        'modelforge_work_items{state="queued"} 1.0',
        'modelforge_work_items{state="leased"} 1.0',
        'modelforge_work_items{state="succeeded"} 1.0',
        'modelforge_work_claims_total{result="leased"} 3.0',
        "modelforge_work_lease_expiries_total 1.0",
        'modelforge_work_completion_seconds_count{outcome="succeeded"} 1.0',
    ):
        assert line in text, line


def _cli(cp, *args: str):
    return run_cli("work", *args, env=store_env(cp.settings))


def test_the_work_cli_submits_lists_shows_and_cancels(sqlite_control_plane):
    import json

    cp = sqlite_control_plane
    refused = _cli(cp, "submit", "container", "--input", '{"image": "x:1"}')
    assert refused.returncode == 2
    assert "input.image_id" in refused.stderr and "FIELD_REQUIRED" in refused.stderr
    queued = json.loads(
        _cli(
            cp, "submit", "smoke", "--gpu-count", "2", "--min-gpu-memory", "40GiB", "--json"
        ).stdout
    )
    assert queued["constraints"] == {
        "gpu_count": 2,
        "min_gpu_memory_bytes": 40 * GIB,
        "gpu_name": None,
        "node_ids": None,
    }
    listed = json.loads(_cli(cp, "list", "--state", "queued", "--json").stdout)
    assert [item["work_id"] for item in listed["work"]] == [queued["work_id"]]
    assert "queued" in _cli(cp, "show", queued["work_id"]).stdout
    # A unique prefix names the item, as node ids do; a miss says what the CLI lists them with.
    assert queued["work_id"] in _cli(cp, "show", queued["work_id"][:8]).stdout
    missing = _cli(cp, "show", "no-such-item")
    assert missing.returncode == EXIT_NOT_FOUND and "Traceback" not in missing.stderr
    assert "modelforge work list" in missing.stderr and "/api/v1" not in missing.stderr
    cancelled = _cli(cp, "cancel", queued["work_id"][:8])
    assert (
        cancelled.returncode == 0 and f"Work {queued['work_id']} is cancelled" in cancelled.stdout
    )
    actor = [e for e in work_events(cp) if e["action"] == "work.cancelled"][0]["actor"]
    assert actor == "cli"
    # No node was enrolled: the submit says the item will wait, instead of waiting silently.
    lonely = _cli(cp, "submit", "smoke", "--json")
    assert "no enrolled node's runtime worker offers 'smoke' now" in lonely.stderr
    assert _cli(cp, "cancel", json.loads(lonely.stdout)["work_id"]).returncode == 0
    node = WorkNode(cp, "gpu-1").ready()
    cp.heartbeats.flush()  # the CLI reads the store; the server writes heartbeats in batches
    offered = _cli(cp, "submit", "smoke", "--json")
    assert "offers" not in offered.stderr
    assert _cli(cp, "cancel", json.loads(offered.stdout)["work_id"]).returncode == 0
    done = submit(cp)
    assert node.complete(node.lease()).status_code == 200
    again = _cli(cp, "cancel", done["work_id"])
    assert again.returncode == 1 and "WORK_FINISHED" in again.stderr
