"""Hardware is trusted on first use and later changes wait for an administrator (issue 21).

Tried with one enrolled credential, a ``cpu`` node published 8 H100s (a UUID listed twice
counted twice) and then claimed GPU work, and a node whose GPUs changed was placed on them at
once. Now a cpu node's accelerators and a repeated UUID are refused with nothing stored, and
a node's first accelerators are its accepted ones: later different ones take it out of
placement, with an alert and a readiness check naming the difference, until an
administrator accepts them (API or CLI, audited).
"""

from __future__ import annotations

import pytest

from modelforge_appliance.store.database import open_database
from modelforge_contract import (
    HARDWARE_NOT_PENDING,
    HARDWARE_PENDING_CHANGED,
    HEADER_CLAIM_REASON,
    INVENTORY_ACCELERATORS_ON_CPU,
    INVENTORY_GPU_DUPLICATE,
    TELEMETRY_GPU_UNKNOWN,
)
from tests.harness.control_plane import error_code, run_cli, serve, store_env
from tests.harness.old_schema import downgrade
from tests.harness.scripted_node import GIB, WorkNode, gpu, item, submit

NODES = "/api/v1/admin/hardware/nodes"
ONE_GPU = {"constraints": {"gpu_count": 1}}


def view(cp, node_id: str) -> dict:
    answer = cp.admin("GET", f"{NODES}/{node_id}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def hardware_check(cp, node_id: str) -> dict:
    answer = cp.admin("GET", f"{NODES}/{node_id}/readiness").json()
    return next(check for check in answer["checks"] if check["name"] == "hardware")


def alerts(cp, kind: str) -> list[dict]:
    every = cp.admin("GET", "/api/v1/admin/alerts").json()["alerts"]
    return [alert for alert in every if alert["kind"] == kind]


def reason(response) -> tuple:
    return response.status_code, response.headers.get(HEADER_CLAIM_REASON)


def events(cp, node_id: str, action: str) -> list[dict]:
    page = cp.admin("GET", f"/api/v1/admin/audit-events?limit=500&node_id={node_id}").json()
    return [event for event in page["events"] if event["action"] == action]


def telemetry(node: WorkNode, gpus: list[dict]):
    samples = [
        {
            "uuid": g["uuid"],
            "index": g["index"],
            "utilization_gpu_percent": 1,
            "memory_used_bytes": 0,
            "temperature_c": 30,
            "power_w": 60.0,
        }
        for g in gpus
    ]
    body = {"node_id": node.node_id, "samples": samples}
    return node.cp.agent("POST", "/api/v1/agent/telemetry", node.credential, json=body)


def test_a_cpu_node_publishing_accelerators_is_refused_and_gets_no_gpu_work(control_plane):
    cp = control_plane
    node = WorkNode(cp, "cpu-box", mode="cpu")
    node.heartbeat()
    h100s = [gpu(index) for index in range(8)]
    refused = node.publish(h100s)
    assert refused.status_code == 400, refused.text
    assert error_code(refused) == INVENTORY_ACCELERATORS_ON_CPU
    assert "accelerators" in refused.json()["error"]["message"]
    stored = view(cp, node.node_id)
    assert (stored["accelerators"], stored["inventory_at"]) == ([], None)
    work_id = submit(cp, **ONE_GPU)["work_id"]
    assert reason(node.claim()) == (204, "inventory_age")  # nothing it sent was taken
    assert node.publish([]).status_code == 200  # its true inventory
    assert reason(node.claim()) == (204, "no_fitting_item")
    assert item(cp, work_id)["state"] == "queued"


def test_an_inventory_naming_one_gpu_twice_is_refused(control_plane):
    cp = control_plane
    fresh = WorkNode(cp, "gpu-twice")
    fresh.heartbeat()
    refused = fresh.publish([gpu(0), gpu(1), gpu(0)])
    assert refused.status_code == 400 and error_code(refused) == INVENTORY_GPU_DUPLICATE
    assert "accelerators[2].uuid" in refused.json()["error"]["message"]
    assert view(cp, fresh.node_id)["inventory_at"] is None  # it never counts twice

    known = WorkNode(cp, "gpu-known").ready()
    before = view(cp, known.node_id)
    again = known.publish([gpu(0), gpu(1), gpu(1)])
    assert again.status_code == 400 and error_code(again) == INVENTORY_GPU_DUPLICATE
    after = view(cp, known.node_id)
    assert (after["accelerators"], after["inventory_at"], after["hardware"]) == (
        before["accelerators"],
        before["inventory_at"],
        before["hardware"],
    )


def _swap_uuid(gpus):
    return [gpus[0], {**gpus[1], "uuid": "GPU-swapped-in"}]


# name: (what the node publishes instead of GPUs 0 and 1, the difference it makes)
CHANGES = {
    "gpu added": (
        lambda gpus: [*gpus, gpu(2)],
        {"appeared": [gpu(2)["uuid"]], "vanished": [], "changed": []},
    ),
    "gpu vanished": (
        lambda gpus: gpus[:1],
        {"appeared": [], "vanished": [gpu(1)["uuid"]], "changed": []},
    ),
    "uuid changed": (
        _swap_uuid,
        {"appeared": ["GPU-swapped-in"], "vanished": [gpu(1)["uuid"]], "changed": []},
    ),
    "memory changed": (
        lambda gpus: [gpus[0], {**gpus[1], "memory_total_bytes": 40 * GIB}],
        {"appeared": [], "vanished": [], "changed": [(gpu(1)["uuid"], "memory_total_bytes")]},
    ),
    "name changed": (
        lambda gpus: [gpus[0], {**gpus[1], "name": "NVIDIA A100-SXM4-80GB"}],
        {"appeared": [], "vanished": [], "changed": [(gpu(1)["uuid"], "name")]},
    ),
}


def _named(difference: dict) -> dict:
    return {
        "appeared": [g["uuid"] for g in difference["appeared"]],
        "vanished": [g["uuid"] for g in difference["vanished"]],
        "changed": [(c["uuid"], c["field"]) for c in difference["changed"]],
    }


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_changed_inventory_holds_the_node_until_an_admin_accepts_it(control_plane, change):
    cp = control_plane
    edit, expected = CHANGES[change]
    node = WorkNode(cp, "gpu-changed").ready()
    accepted = [g["uuid"] for g in node.gpus]
    submit(cp, **ONE_GPU)
    held = node.lease()  # leased before the change
    published = edit(node.gpus)
    assert node.publish(published).status_code == 200
    waiting = submit(cp, **ONE_GPU)["work_id"]

    # Out of placement: the queued GPU item is not leased to it.
    assert reason(node.claim()) == (204, "hardware")
    assert item(cp, waiting)["state"] == "queued"
    # What it held is left to finish.
    assert node.renew(held).status_code == 200
    assert node.complete(held).status_code == 200

    shown = view(cp, node.node_id)
    assert [g["uuid"] for g in shown["accelerators"]] == accepted
    hardware = shown["hardware"]
    assert hardware["pending"] and hardware["published"] == published
    assert _named(hardware["difference"]) == expected
    named = expected["appeared"] + expected["vanished"] + [u for u, _ in expected["changed"]]
    check = hardware_check(cp, node.node_id)
    assert not check["ok"]
    assert all(uuid in check["detail"] for uuid in named), check["detail"]
    assert f"modelforge nodes accept-hardware {node.node_id}" in check["next_step"]
    [alert] = alerts(cp, "hardware_changed")
    assert alert["node_id"] == node.node_id and alert["severity"] == "warning"
    assert all(uuid in alert["message"] for uuid in named), alert["message"]

    # Another publication since the admin looked: the old digest accepts nothing.
    again = [*published, gpu(9)]
    assert node.publish(again).status_code == 200
    stale = cp.admin(
        "POST", f"{NODES}/{node.node_id}/accept-hardware", json={"digest": hardware["digest"]}
    )
    assert stale.status_code == 409 and error_code(stale) == HARDWARE_PENDING_CHANGED
    assert reason(node.claim()) == (204, "hardware")
    assert node.publish(published).status_code == 200

    answer = cp.admin(
        "POST", f"{NODES}/{node.node_id}/accept-hardware", json={"digest": hardware["digest"]}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["accelerators"] == published and body["hardware"]["pending"] is False
    assert _named(body["accepted"]) == expected
    [event] = events(cp, node.node_id, "node.hardware_accepted")
    assert event["actor"].startswith("admin:")
    assert _named(event["detail"]) == expected
    assert event["detail"]["accelerators"] == len(published)

    assert hardware_check(cp, node.node_id)["ok"]
    assert alerts(cp, "hardware_changed") == []
    lease = node.lease()  # placement resumes
    assert lease["work_id"] == waiting
    refused = cp.admin("POST", f"{NODES}/{node.node_id}/accept-hardware")
    assert refused.status_code == 409 and error_code(refused) == HARDWARE_NOT_PENDING


def test_the_cli_shows_the_change_asks_and_accepts_it_audited(control_plane):
    cp = control_plane
    node = WorkNode(cp, "gpu-cli").ready()
    assert node.publish([*node.gpus, gpu(2)]).status_code == 200
    waiting = submit(cp, **{"constraints": {"gpu_count": 3}})["work_id"]
    env = store_env(cp.settings)

    shown = run_cli("nodes", "show", node.node_id, env=env, check=True)
    assert "CHANGED" in shown.stdout and gpu(2)["uuid"] in shown.stdout
    declined = run_cli("nodes", "accept-hardware", node.node_id, env=env, stdin="n\n")
    assert declined.returncode == 1, declined.stderr
    assert f"{gpu(2)['uuid']} appeared" in declined.stdout
    assert view(cp, node.node_id)["hardware"]["pending"]
    assert run_cli("nodes", "accept-hardware", node.node_id, "--json", env=env).returncode != 0

    done = run_cli("nodes", "accept-hardware", node.node_id, env=env, stdin="y\n", check=True)
    assert "3 accelerator(s) accepted" in done.stdout
    [event] = events(cp, node.node_id, "node.hardware_accepted")
    assert event["actor"] == "cli" and _named(event["detail"])["appeared"] == [gpu(2)["uuid"]]
    assert node.lease()["work_id"] == waiting  # three GPUs now, as accepted

    again = run_cli("nodes", "accept-hardware", node.node_id, "--yes", env=env)
    assert again.returncode == 2 and "no hardware change waiting" in again.stderr


def test_telemetry_names_only_gpus_of_the_accepted_inventory(control_plane):
    cp = control_plane
    node = WorkNode(cp, "gpu-telemetry").ready()
    assert telemetry(node, node.gpus).status_code == 200
    grown = [*node.gpus, gpu(2)]
    assert node.publish(grown).status_code == 200  # waits for an administrator
    refused = telemetry(node, grown)
    assert refused.status_code == 400 and error_code(refused) == TELEMETRY_GPU_UNKNOWN
    assert "samples[2]" in refused.json()["error"]["message"]
    assert telemetry(node, node.gpus).status_code == 200  # the accepted ones still report
    assert cp.admin("POST", f"{NODES}/{node.node_id}/accept-hardware").status_code == 200
    assert telemetry(node, grown).status_code == 200


def test_an_inventory_like_the_accepted_one_again_ends_the_hold(control_plane):
    cp = control_plane
    node = WorkNode(cp, "gpu-flaky").ready()
    assert node.publish(node.gpus[:1]).status_code == 200  # a GPU fell off the bus
    assert reason(node.claim()) == (204, "hardware")
    # It is back; a driver update on the way changes nothing that identifies the GPUs.
    updated = [{**g, "driver_version": "560.28.03", "index": 1 - g["index"]} for g in node.gpus]
    assert node.publish(updated).status_code == 200
    shown = view(cp, node.node_id)
    assert shown["hardware"]["pending"] is False
    assert shown["accelerators"] == updated
    assert alerts(cp, "hardware_changed") == []
    submit(cp, **ONE_GPU)
    assert node.claim().status_code == 200


def test_a_node_from_before_the_upgrade_keeps_its_inventory_as_its_baseline(settings):
    with serve(settings) as cp:
        node = WorkNode(cp, "gpu-old").ready()
    db = open_database(settings.database_url)
    downgrade(db, 8)  # as the release before hardware baselines left it
    db.close()
    with serve(settings) as cp:  # migrates
        node.cp = cp
        shown = view(cp, node.node_id)
        assert [g["uuid"] for g in shown["accelerators"]] == [g["uuid"] for g in node.gpus]
        assert shown["hardware"]["pending"] is False
        node.heartbeat()
        assert node.publish([*node.gpus, gpu(2)]).status_code == 200
        difference = view(cp, node.node_id)["hardware"]["difference"]
        assert _named(difference)["appeared"] == [gpu(2)["uuid"]]
        assert reason(node.claim()) == (204, "hardware")
