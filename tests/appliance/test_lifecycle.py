"""Node lifecycle (issue 4): readiness, revocation, recovery, decommission, cordon, alerts."""

from __future__ import annotations

import logging
import threading

import pytest

from modelforge_appliance.fleet import readiness as readiness_module
from modelforge_appliance.store.tables import Node
from modelforge_contract import (
    CONFIRMATION_INVALID,
    CONFIRMATION_STALE,
    CONFIRMATION_USED,
    CREDENTIAL_NODE_MISMATCH,
    CREDENTIAL_REVOKED,
    NODE_DECOMMISSIONED,
)
from tests.harness.control_plane import error_code, new_identity

from .test_agent_auth import enroll_node

NODES = "/api/v1/admin/hardware/nodes"
ACCELERATOR = {
    "index": 0,
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-4f1c2e7a-0000-0000-0000-000000000001",
    "memory_total_bytes": 85520809984,
    "driver_version": "550.54.15",
    "cuda_version": "12.4",
    "pci_bus_id": "00000000:18:00.0",
    "mig_mode": "disabled",
}
SAMPLE = {
    "uuid": ACCELERATOR["uuid"],
    "index": 0,
    "utilization_gpu_percent": 3,
    "memory_used_bytes": 1048576,
    "temperature_c": 35,
    "power_w": 70.5,
}


WORKER = {"reachable": True, "protocol": 1, "version": "0.1.0", "capabilities": ["smoke"]}


class Agent:
    """What a node agent sends, driven step by step by the test."""

    def __init__(self, cp, mode: str = "nvidia", hostname: str = "gpu-a") -> None:
        self.cp, self.mode, self.hostname = cp, mode, hostname
        self.identity = new_identity()
        self.enroll()

    def enroll(self):
        response = self.cp.enroll(
            self.cp.mint()["token"],
            hostname=self.hostname,
            identity=self.identity,
            accelerator_mode=self.mode,
        )
        assert response.status_code == 201, response.text
        self.node_id = response.json()["node_id"]
        self.credential = response.json()["credential"]
        return response.json()

    def heartbeat(
        self, credential=None, status="ok", gpu_probe="ok", worker=WORKER, message=None, tunnel=None
    ):
        body = {
            "node_id": self.node_id,
            "agent_version": "0.1.0",
            # A compatible runtime worker beside the agent (issue 13), as the agent reports it.
            "health": {"status": status, "gpu_probe": gpu_probe, "worker": worker},
        }
        if message is not None:
            body["health"]["message"] = message
        if tunnel is not None:  # issue 26: the agent's tunnel, up or down
            body["health"]["tunnel"] = tunnel
        return self.cp.agent(
            "POST", "/api/v1/agent/heartbeat", credential or self.credential, json=body
        )

    def inventory(self):
        accelerators = [ACCELERATOR] if self.mode == "nvidia" else []
        body = {"node_id": self.node_id, "agent_version": "0.1.0", "accelerators": accelerators}
        return self.cp.agent("PUT", "/api/v1/agent/inventory", self.credential, json=body)

    def telemetry(self):
        body = {"node_id": self.node_id, "samples": [SAMPLE]}
        return self.cp.agent("POST", "/api/v1/agent/telemetry", self.credential, json=body)

    def publish_all(self):
        for response in (self.heartbeat(), self.inventory(), self.telemetry()):
            assert response.status_code == 200, response.text


def check(answer: dict, name: str) -> dict:
    return next(c for c in answer["checks"] if c["name"] == name)


def readiness(cp, node_id: str) -> dict:
    response = cp.admin("GET", f"{NODES}/{node_id}/readiness")
    assert response.status_code == 200, response.text
    return response.json()


def failing(answer: dict) -> set[str]:
    return {check["name"] for check in answer["checks"] if not check["ok"]}


# -- readiness -------------------------------------------------------------------


def test_a_connected_node_is_not_ready_until_every_check_passes(clocked_control_plane):
    cp = clocked_control_plane
    agent = Agent(cp)
    assert failing(readiness(cp, agent.node_id)) == {
        "connection",
        "inventory_age",
        "agent_health",
        "telemetry_age",
        "worker",
    }
    assert agent.heartbeat().status_code == 200
    assert failing(readiness(cp, agent.node_id)) == {"inventory_age", "telemetry_age"}
    agent.publish_all()
    answer = readiness(cp, agent.node_id)
    assert answer == {**answer, "ready": True, "node_id": agent.node_id}
    assert [c["name"] for c in answer["checks"]] == [
        "connection",
        "inventory_age",
        "hardware",
        "protocol",
        "agent_health",
        "telemetry_age",
        "worker",
        "tunnel",
        "cordoned",
    ]
    # The tunnel: reported down, the node is not ready (no client request reaches it).
    assert agent.heartbeat(tunnel="down").status_code == 200
    down = readiness(cp, agent.node_id)
    assert failing(down) == {"tunnel"} and "reverse-proxy" in check(down, "tunnel")["next_step"]
    assert agent.heartbeat(tunnel="up").status_code == 200
    assert readiness(cp, agent.node_id)["ready"]


def _stale_connection(cp, clock, agent):
    clock.advance(cp.settings.stale_after_seconds)
    agent.inventory(), agent.telemetry()


def _old_inventory(cp, clock, agent):
    clock.advance(cp.settings.inventory_max_age_seconds + 1)
    agent.heartbeat(), agent.telemetry()


def _old_protocol(cp, clock, agent):
    with cp.store.connection():
        Node.update(protocol_version=0).where(Node.node_id == agent.node_id).execute()


def _degraded(cp, clock, agent):
    agent.heartbeat(status="degraded", gpu_probe="failed")


def _old_telemetry(cp, clock, agent):
    clock.advance(cp.settings.telemetry_max_age_seconds + 1)
    agent.heartbeat()


def _new_credential_unused(cp, clock, agent):
    agent.enroll()  # re-enrolled: the heartbeat on record was sent with the old credential


@pytest.mark.parametrize(
    ("break_it", "check", "detail"),
    [
        (_stale_connection, "connection", "stale"),
        (_new_credential_unused, "connection", "current credential"),
        (_old_inventory, "inventory_age", "old"),
        (_old_protocol, "protocol", "TOO_OLD"),
        (_degraded, "agent_health", "degraded"),
        (_old_telemetry, "telemetry_age", "old"),
    ],
)
def test_each_failing_check_names_its_next_step(
    clocked_control_plane, clock, break_it, check, detail
):
    cp = clocked_control_plane
    agent = Agent(cp)
    agent.publish_all()
    assert readiness(cp, agent.node_id)["ready"] is True
    break_it(cp, clock, agent)
    answer = readiness(cp, agent.node_id)
    assert answer["ready"] is False
    failed = [c for c in answer["checks"] if not c["ok"]]
    assert {c["name"] for c in failed} >= {check}
    named = next(c for c in failed if c["name"] == check)
    assert detail in named["detail"]
    assert named["next_step"]


def test_a_node_degraded_by_its_worker_is_told_about_the_worker_not_preflight(
    sqlite_control_plane,
):
    """The agent_health next step always said "run --preflight", even when the cause was
    the runtime worker."""
    cp = sqlite_control_plane
    agent = Agent(cp, mode="cpu")
    unreachable = {  # what the agent reports when nothing answers on the worker socket
        "reachable": False,
        "protocol": None,
        "version": None,
        "capabilities": [],
        "accelerator_mode": None,
        "message": "the runtime worker does not answer on /run/modelforge/worker.sock",
    }
    assert (
        agent.heartbeat(
            status="degraded",
            gpu_probe="not_applicable",
            worker=unreachable,
            message="the runtime worker does not answer on /run/modelforge/worker.sock",
        ).status_code
        == 200
    )
    agent.inventory()
    checks = {c["name"]: c for c in readiness(cp, agent.node_id)["checks"]}
    assert not checks["agent_health"]["ok"] and not checks["worker"]["ok"]
    assert "because of its runtime worker" in checks["agent_health"]["detail"]
    assert checks["agent_health"]["next_step"] == checks["worker"]["next_step"]
    assert "--preflight" not in checks["agent_health"]["next_step"]


@pytest.mark.parametrize(
    ("mode", "gpu_probe", "worker_mode"),
    [("nvidia", "ok", "cpu"), ("cpu", "not_applicable", "nvidia"), ("auto", "ok", "cpu")],
)
def test_a_worker_in_the_wrong_accelerator_mode_is_named_as_the_cause(
    sqlite_control_plane, mode, gpu_probe, worker_mode
):
    """A worker answering compatibly in the wrong mode passed the worker check, and
    agent_health said "run --preflight": the next step now names the worker's setting."""
    cp = sqlite_control_plane
    agent = Agent(cp, mode=mode, hostname=f"gpu-{mode}")
    expected = "cpu" if gpu_probe == "not_applicable" else "nvidia"
    problem = (  # what the agent itself reports (agent/modelforge_node_agent/work.py)
        f"the runtime worker runs in {worker_mode} mode but this node is {expected}: "
        f"set MODELFORGE_WORKER_ACCELERATOR_MODE={expected}"
    )
    worker = {**WORKER, "accelerator_mode": worker_mode, "message": problem}
    answer = agent.heartbeat(status="degraded", gpu_probe=gpu_probe, worker=worker, message=problem)
    assert answer.status_code == 200, answer.text
    checks = {c["name"]: c for c in readiness(cp, agent.node_id)["checks"]}
    assert not checks["worker"]["ok"]
    assert f"runs in {worker_mode} mode" in checks["worker"]["detail"]
    assert f"MODELFORGE_WORKER_ACCELERATOR_MODE={expected}" in checks["worker"]["next_step"]
    assert checks["agent_health"]["next_step"] == checks["worker"]["next_step"]
    assert "--preflight" not in checks["agent_health"]["next_step"]
    # The same worker in the node's own mode passes.
    agent.heartbeat(gpu_probe=gpu_probe, worker={**WORKER, "accelerator_mode": expected})
    assert {c["name"]: c for c in readiness(cp, agent.node_id)["checks"]}["worker"]["ok"]


def test_telemetry_is_not_applicable_to_a_cpu_node(sqlite_control_plane):
    cp = sqlite_control_plane
    agent = Agent(cp, mode="cpu")
    assert agent.heartbeat(gpu_probe="not_applicable").status_code == 200
    assert agent.inventory().status_code == 200
    answer = readiness(cp, agent.node_id)
    telemetry = next(c for c in answer["checks"] if c["name"] == "telemetry_age")
    assert telemetry["ok"] and "not applicable" in telemetry["detail"]
    assert answer["ready"] is True


def test_readiness_is_tied_to_the_exact_node_id(sqlite_control_plane):
    cp = sqlite_control_plane
    ready, other = Agent(cp, mode="cpu"), Agent(cp, mode="cpu", hostname="gpu-b")
    ready.heartbeat(gpu_probe="not_applicable"), ready.inventory()
    assert readiness(cp, ready.node_id)["ready"] is True
    assert readiness(cp, other.node_id)["ready"] is False
    assert cp.admin("GET", f"{NODES}/{ready.node_id[:-1]}x/readiness").status_code == 404


def test_the_node_list_carries_each_nodes_readiness_in_a_fixed_number_of_queries(
    clocked_control_plane, caplog
):
    """The fleet list showed liveness only: a node without its worker was as green as a ready
    one. Each row now carries the readiness its own endpoint answers, and the list costs the
    same number of queries for 3 nodes as for 12 (the fleet can be 5,000)."""
    cp = clocked_control_plane

    def listed() -> dict[str, dict]:
        response = cp.admin("GET", NODES)
        assert response.status_code == 200, response.text
        return {node["node_id"]: node["readiness"] for node in response.json()["nodes"]}

    def queries_of_one_listing() -> int:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="peewee"):
            readiness_module.list_nodes(cp.store, cp.settings)
        here = threading.get_ident()  # not the server's own threads
        return sum(1 for record in caplog.records if record.thread == here)

    ready = Agent(cp, mode="cpu", hostname="ready")
    ready.heartbeat(gpu_probe="not_applicable"), ready.inventory()
    no_worker = Agent(cp, mode="cpu", hostname="no-worker")
    no_worker.heartbeat(gpu_probe="not_applicable", worker=None), no_worker.inventory()
    cordoned = Agent(cp, mode="cpu", hostname="cordoned")
    cordoned.heartbeat(gpu_probe="not_applicable"), cordoned.inventory()
    assert cp.admin("POST", f"{NODES}/{cordoned.node_id}/cordon").status_code == 200
    few = queries_of_one_listing()
    assert few > 0, "the store's queries were not seen"

    reenrolled = Agent(cp, mode="cpu", hostname="reenrolled")
    reenrolled.heartbeat(gpu_probe="not_applicable"), reenrolled.inventory()
    reenrolled.enroll()  # its newest credential has not called yet
    revoked = Agent(cp, mode="cpu", hostname="revoked")
    revoked.heartbeat(gpu_probe="not_applicable"), revoked.inventory()
    assert cp.admin("DELETE", f"{NODES}/{revoked.node_id}/credential").status_code == 200
    retired = Agent(cp, mode="cpu", hostname="retired")
    preview = cp.admin("POST", f"{NODES}/{retired.node_id}/decommission/preview").json()
    confirmation = {"confirmation": preview["confirmation"]}
    executed = cp.admin(
        "POST", f"{NODES}/{retired.node_id}/decommission/execute", json=confirmation
    )
    assert executed.status_code == 200, executed.text
    for n in range(6):
        Agent(cp, hostname=f"pending-{n}")
    assert queries_of_one_listing() == few

    shown = listed()
    assert len(shown) == 12
    for node_id, summary in shown.items():
        answer = readiness(cp, node_id)
        in_order = [check["name"] for check in answer["checks"] if not check["ok"]]
        assert summary == {"ready": answer["ready"], "failing": in_order}, node_id
    assert shown[ready.node_id] == {"ready": True, "failing": []}
    assert shown[no_worker.node_id]["failing"] == ["worker"]
    assert shown[cordoned.node_id]["failing"] == ["cordoned"]
    assert shown[reenrolled.node_id]["failing"] == ["connection"]
    assert shown[revoked.node_id]["failing"][0] == "connection"
    assert shown[retired.node_id]["ready"] is False


# -- the runbook's diagnosis table and its recoveries ------------------------------


def test_revoked_credential_gets_401_and_reenrollment_recovers_the_same_node(control_plane):
    cp = control_plane
    agent = Agent(cp)
    agent.publish_all()
    old = agent.credential
    revoked = cp.admin("DELETE", f"{NODES}/{agent.node_id}/credential")
    assert revoked.json()["revoked"] and revoked.status_code == 200

    refused = agent.heartbeat()
    assert (refused.status_code, error_code(refused)) == (401, CREDENTIAL_REVOKED)
    counts = cp.admin("GET", f"{NODES}/{agent.node_id}/credentials").json()
    assert (counts["active"], counts["revoked"]) == (0, 1)
    assert "digest" not in str(counts)

    node_id = agent.node_id
    assert agent.enroll()["reenrolled"] is True
    assert agent.node_id == node_id
    assert agent.heartbeat().status_code == 200
    assert agent.heartbeat(credential=old).status_code == 401  # revoked stays revoked
    view = cp.admin("GET", f"{NODES}/{node_id}").json()
    assert view["accelerators"] == [ACCELERATOR]  # history and accelerators intact
    history = cp.admin("GET", "/api/v1/admin/audit-events", params={"node_id": node_id}).json()
    assert {"enrollment.claimed", "enrollment.reenrolled"} <= {
        e["action"] for e in history["events"]
    }
    # Inventory is re-collected before the node is ready again.
    assert "inventory_age" in failing(readiness(cp, node_id))
    agent.inventory(), agent.telemetry()
    assert readiness(cp, node_id)["ready"] is True


def test_credential_of_another_node_gets_403(sqlite_control_plane):
    cp = sqlite_control_plane
    a, b = Agent(cp), Agent(cp, hostname="gpu-b")
    refused = a.heartbeat(credential=b.credential)
    assert (refused.status_code, error_code(refused)) == (403, CREDENTIAL_NODE_MISMATCH)


def test_a_silent_agent_goes_stale_then_offline_with_an_alert_that_clears(
    clocked_control_plane, clock
):
    cp = clocked_control_plane
    agent = Agent(cp)
    agent.publish_all()
    last_used = cp.admin("GET", f"{NODES}/{agent.node_id}/credentials").json()
    alerts = lambda: cp.admin("GET", "/api/v1/admin/alerts").json()["alerts"]  # noqa: E731
    assert alerts() == []
    clock.advance(cp.settings.stale_after_seconds)
    assert [(a["kind"], a["severity"]) for a in alerts()] == [("node_stale", "warning")]
    clock.advance(cp.settings.offline_after_seconds - cp.settings.stale_after_seconds)
    assert [(a["kind"], a["node_id"]) for a in alerts()] == [("node_offline", agent.node_id)]
    assert cp.admin("GET", f"{NODES}/{agent.node_id}").json()["liveness"] == "offline"
    # No requests while it was down: the credential was not used since.
    assert cp.admin("GET", f"{NODES}/{agent.node_id}/credentials").json() == last_used
    assert agent.heartbeat().status_code == 200
    assert alerts() == []


# -- decommission ------------------------------------------------------------------


def preview(cp, node_id):
    response = cp.admin("POST", f"{NODES}/{node_id}/decommission/preview")
    assert response.status_code == 200, response.text
    return response.json()


def execute(cp, node_id, confirmation):
    return cp.admin(
        "POST", f"{NODES}/{node_id}/decommission/execute", json={"confirmation": confirmation}
    )


def test_decommission_does_exactly_what_the_preview_said(control_plane):
    cp = control_plane
    old = Agent(cp, hostname="gpu-a")
    old.publish_all()
    replacement = Agent(cp, hostname="gpu-a")  # identity lost: a new node claims the hostname
    kinds = [a["kind"] for a in cp.admin("GET", "/api/v1/admin/alerts").json()["alerts"]]
    assert kinds == ["hostname_conflict"]

    plan = preview(cp, old.node_id)
    credential_id = old.credential.split("_")[1]
    assert plan["effects"] == {
        "credentials_revoked": [credential_id],
        "leases_returned": [],
        "identity_retired": old.identity["identity_id"],
        "hostname_freed": "gpu-a",
    }
    done = execute(cp, old.node_id, plan["confirmation"])
    assert done.status_code == 200, done.text
    assert done.json()["effects"] == plan["effects"]

    assert cp.admin("GET", f"{NODES}/{old.node_id}").json()["liveness"] == "decommissioned"
    refused = old.heartbeat()
    assert (refused.status_code, error_code(refused)) == (403, NODE_DECOMMISSIONED)
    again = cp.enroll(cp.mint()["token"], hostname="gpu-a", identity=old.identity)
    assert (again.status_code, error_code(again)) == (403, NODE_DECOMMISSIONED)
    assert cp.admin("GET", "/api/v1/admin/alerts").json()["alerts"] == []  # hostname is free
    assert replacement.heartbeat().status_code == 200

    chain = cp.admin(
        "GET", "/api/v1/admin/audit-events", params={"node_id": old.node_id, "limit": 3}
    ).json()["events"]
    assert [e["action"] for e in reversed(chain)] == [
        "node.decommission_previewed",
        "credential.revoked",
        "node.decommissioned",
    ]
    assert plan["confirmation"] not in str(chain)

    reused = execute(cp, old.node_id, plan["confirmation"])
    assert (reused.status_code, error_code(reused)) == (409, CONFIRMATION_USED)
    assert cp.admin("POST", f"{NODES}/{old.node_id}/decommission/preview").status_code == 409


def test_stale_foreign_or_expired_confirmations_change_nothing(clocked_control_plane, clock):
    cp = clocked_control_plane
    agent, other = Agent(cp), Agent(cp, hostname="gpu-b")
    before = cp.admin("GET", f"{NODES}/{agent.node_id}/credentials").json()

    foreign = preview(cp, other.node_id)["confirmation"]
    refused = execute(cp, agent.node_id, foreign)
    assert (refused.status_code, error_code(refused)) == (400, CONFIRMATION_INVALID)
    garbage = execute(cp, agent.node_id, "mfd_0123456789abcdef_" + "x" * 43)
    assert error_code(garbage) == CONFIRMATION_INVALID

    stale = preview(cp, agent.node_id)["confirmation"]
    agent.enroll()  # the node changed: a new credential exists that the preview did not list
    refused = execute(cp, agent.node_id, stale)
    assert (refused.status_code, error_code(refused)) == (409, CONFIRMATION_STALE)

    expired = preview(cp, agent.node_id)["confirmation"]
    clock.advance(601)
    refused = execute(cp, agent.node_id, expired)
    assert (refused.status_code, error_code(refused)) == (409, CONFIRMATION_STALE)

    after = cp.admin("GET", f"{NODES}/{agent.node_id}").json()
    assert after["liveness"] != "decommissioned"
    assert cp.admin("GET", f"{NODES}/{agent.node_id}/credentials").json()["active"] == 1
    assert before["active"] == 1


def test_cordon_and_uncordon_are_audited(sqlite_control_plane):
    cp = sqlite_control_plane
    agent = Agent(cp, mode="cpu")
    assert cp.admin("POST", f"{NODES}/{agent.node_id}/cordon").json()["cordoned"] is True
    assert cp.admin("POST", f"{NODES}/{agent.node_id}/cordon").json()["cordoned"] is True
    assert agent.heartbeat(gpu_probe="not_applicable").status_code == 200  # still monitored
    assert cp.admin("POST", f"{NODES}/{agent.node_id}/uncordon").json()["cordoned"] is False
    events = cp.admin(
        "GET", "/api/v1/admin/audit-events", params={"node_id": agent.node_id}
    ).json()["events"]
    assert [e["action"] for e in events[:2]] == ["node.uncordoned", "node.cordoned"]
    assert cp.admin("POST", f"{NODES}/nope/cordon").status_code == 404


def test_decommissioned_nodes_credential_gets_403_not_401(sqlite_control_plane):
    """A decommissioned node's credential was answered 401, as if unknown, though it still
    authenticates: invariant 4 makes that a 403 NODE_DECOMMISSIONED."""
    cp = sqlite_control_plane
    node = enroll_node(cp)
    nodes = "/api/v1/admin/hardware/nodes"
    plan = cp.admin("POST", f"{nodes}/{node['node_id']}/decommission/preview").json()
    cp.admin(
        "POST",
        f"{nodes}/{node['node_id']}/decommission/execute",
        json={"confirmation": plan["confirmation"]},
    )
    refused = cp.heartbeat(node["credential"], node["node_id"])
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "NODE_DECOMMISSIONED")


def test_a_decommissioned_node_cannot_be_uncordoned(sqlite_control_plane, tmp_path):
    """A decommissioned node could be uncordoned (and audited as node.uncordoned), as if it
    could take work again: uncordon is refused 409 NODE_DECOMMISSIONED, while cordon still
    answers."""
    cp = sqlite_control_plane
    node = enroll_node(cp)
    nodes = f"/api/v1/admin/hardware/nodes/{node['node_id']}"
    plan = cp.admin("POST", f"{nodes}/decommission/preview").json()
    executed = cp.admin(
        "POST", f"{nodes}/decommission/execute", json={"confirmation": plan["confirmation"]}
    )
    assert executed.status_code == 200
    refused = cp.admin("POST", f"{nodes}/uncordon")
    assert (refused.status_code, error_code(refused)) == (409, "NODE_DECOMMISSIONED")
    cordon = cp.admin("POST", f"{nodes}/cordon")
    assert cordon.status_code == 200 and cordon.json()["cordoned"] is True
    view = cp.admin("GET", nodes).json()
    assert view["cordoned"] is True and view["liveness"] == "decommissioned"
    actions = [
        e["action"]
        for e in cp.admin(
            "GET", "/api/v1/admin/audit-events", params={"node_id": node["node_id"]}
        ).json()["events"]
    ]
    assert "node.uncordoned" not in actions
