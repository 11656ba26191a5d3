"""The Deployments page in a real headless Chromium, against a real control plane on a loopback
port.

Deployments are made through the admin API (``POST /api/v1/admin/deployments``, with its
presence, eligibility and GPU checks); their servers move through the agent API step by step:
enrolled nodes that heartbeat with a worker offering ``llama.cpp``, report the model present
in their inventory, claim serve leases and renew them with the states an agent reports. So
every state the page shows is one the test caused through the real routes and store. The
control plane's clock stands still (ManualClock): no lease expires and no node goes stale
while the browser works, however slow the machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from modelforge_appliance.core.clock import ManualClock
from modelforge_contract.deployments import (
    PATH_AGENT_SERVER_CLAIM,
    PATH_AGENT_SERVER_RENEW,
    RUNTIME_EXITED,
    server_path,
)
from tests.harness.console_client import set_password
from tests.harness.control_plane import ControlPlane, make_settings, serve
from tests.harness.scripted_node import WorkNode, gpu, worker_health

from .conftest import sign_in

pytestmark = pytest.mark.browser

HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1">'
DEPLOYMENTS = "/api/v1/admin/deployments"
# Bounds a failure only: the page polls every 1.5 s while a server starts or stops.
MOVED = 20_000


@pytest.fixture
def still_plane(tmp_path) -> Iterator[ControlPlane]:
    with serve(make_settings(tmp_path / "state"), ManualClock(time.time())) as cp:
        set_password(cp)
        yield cp


class ServingNode(WorkNode):
    """An online node whose worker offers llama.cpp; it reports models and serves leases."""

    def __init__(self, cp: ControlPlane, hostname: str, gpus: list[dict], mode: str) -> None:
        super().__init__(cp, hostname, gpus=gpus, mode=mode)
        self.heartbeat()
        self.inventory()
        cp.heartbeats.flush()

    def heartbeat(self, worker: dict | None = None, status: str = "ok") -> None:
        offered = {**worker_health(), "capabilities": ["smoke", "container", "serve"]}
        super().heartbeat({**offered, "runtimes": ["llama.cpp"]}, status)

    def report_present(self, digest: str, size: int) -> None:
        body = {
            "node_id": self.node_id,
            "agent_version": "0.1.0",
            "accelerators": self.gpus,
            "models": [
                {
                    "digest": digest,
                    "state": "present",
                    "bytes_done": size,
                    "bytes_total": size,
                    "error": None,
                }
            ],
        }
        answer = self.cp.agent("PUT", "/api/v1/agent/inventory", self.credential, json=body)
        assert answer.status_code == 200, answer.text

    def claim_server(self, server_id: str) -> dict:
        path = server_path(PATH_AGENT_SERVER_CLAIM, server_id)
        body = {"node_id": self.node_id}
        answer = self.cp.agent("POST", path, self.credential, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["lease"]

    def renew_server(self, lease: dict, state: str, **extra) -> dict:
        path = server_path(PATH_AGENT_SERVER_RENEW, lease["server_id"])
        body = {"node_id": self.node_id, "lease_id": lease["lease_id"], "state": state, **extra}
        answer = self.cp.agent("POST", path, self.credential, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()


def import_gguf(cp: ControlPlane, tmp_path, name: str) -> dict:
    folder = tmp_path / name
    folder.mkdir()
    # Never loaded: no runtime runs here, the agent's reports stand in for one.
    (folder / "tiny.gguf").write_bytes(b"GGUF" + b"\x00" * 4096)
    answer = cp.admin(
        "POST", "/api/v1/admin/models", json={"name": name, "source": {"path": str(folder)}}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def replicate_present(cp: ControlPlane, model: dict, nodes: list[ServingNode]) -> None:
    """Replicated as an administrator asks, then each node reports it present."""
    asked = cp.admin(
        "POST",
        f"/api/v1/admin/models/{model['name']}/replicas",
        json={"node_ids": [n.node_id for n in nodes]},
    )
    assert asked.status_code == 202, asked.text
    for node in nodes:
        node.report_present(model["digest"], model["size_bytes"])


def deployment(cp: ControlPlane, name: str) -> dict:
    answer = cp.admin("GET", f"{DEPLOYMENTS}/{name}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def server_states(cp: ControlPlane, name: str) -> dict[str, str]:
    return {s["node_id"]: s["state"] for s in deployment(cp, name)["servers"]}


def assert_nothing_injected(page) -> None:
    assert page.evaluate("document.body.dataset.pwned") is None
    assert page.locator("main img, main script").count() == 0


def test_the_deployments_page_shows_the_cli_deploy_when_nothing_is_deployed(browser, still_plane):
    cp = still_plane
    page = browser.new_page()
    sign_in(page, cp.url)
    page.locator("header nav").get_by_role("link", name="Deployments").click()
    page.wait_for_url(f"{cp.url}/console/deployments")
    expect(page.get_by_test_id("deployments-empty")).to_be_visible()
    expect(page.get_by_test_id("deployments-deploy-hint")).to_have_text(
        "modelforge deploy NAME --model M --nodes A,B --runtime llama.cpp"
    )
    assert page.get_by_test_id("deployment-card").count() == 0
    expect(page.get_by_test_id("deployments-error")).to_have_text("")
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "idle")


def test_servers_follow_their_agents_a_failure_shows_as_text_restart_and_stop_confirmed(
    browser, still_plane, tmp_path
):
    cp = still_plane
    model = import_gguf(cp, tmp_path, "tiny-llama")
    alpha = ServingNode(cp, "gpu-alpha", gpus=[gpu(0), gpu(1)], mode="nvidia")
    beta = ServingNode(cp, "cpu-beta", gpus=[], mode="cpu")
    replicate_present(cp, model, [alpha, beta])
    made = cp.admin(
        "POST",
        DEPLOYMENTS,
        json={
            "name": "tiny-chat",
            "model": "tiny-llama",
            "runtime": "llama.cpp",
            "node_ids": [alpha.node_id, beta.node_id],
            "settings": {"context_length": 2048},
        },
    )
    assert made.status_code == 201, made.text
    servers = {s["node_id"]: s for s in made.json()["servers"]}
    assert servers[alpha.node_id]["gpus"] == [gpu(0)["uuid"]]  # one GPU by default, by UUID
    assert servers[beta.node_id]["gpus"] == []

    page = browser.new_page()
    requests_made: list[tuple[str, str, str | None]] = []
    page.on(
        "request",
        lambda r: requests_made.append((r.method, r.url, r.headers.get("x-csrf-token"))),
    )
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/deployments")
    card = page.locator('[data-testid="deployment-card"][data-deployment="tiny-chat"]')
    expect(card.get_by_test_id("deployment-name")).to_have_text("tiny-chat")
    expect(card.get_by_test_id("deployment-model")).to_have_text("tiny-llama@r1")
    assert card.get_by_test_id("deployment-model").get_attribute("title") == model["digest"]
    expect(card.get_by_test_id("deployment-runtime")).to_have_text("llama.cpp")
    expect(card.get_by_test_id("deployment-state")).to_have_text("starting")  # none runs yet
    expect(page.get_by_test_id("deployments-empty")).to_be_hidden()
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "fast")
    # How a client calls it: this control plane's /v1, the deployment's name, a curl line.
    client = card.get_by_test_id("deployment-client")
    client.locator("summary").click()
    expect(client.get_by_test_id("client-base-url")).to_have_text(f"{cp.url}/v1")
    expect(client.get_by_test_id("client-model")).to_have_text("tiny-chat")
    curl = client.get_by_test_id("client-curl").text_content()
    assert curl.startswith(f"curl {cp.url}/v1/chat/completions ")
    assert '"model":"tiny-chat"' in curl and "Bearer $MODELFORGE_API_KEY" in curl

    row = {
        n.node_id: card.locator(f'[data-testid="server-row"][data-node-id="{n.node_id}"]')
        for n in (alpha, beta)
    }
    expect(row[alpha.node_id]).to_have_attribute("data-state", "pending")
    assert row[alpha.node_id].get_by_test_id("server-node").text_content() == "gpu-alpha"
    assert row[beta.node_id].get_by_test_id("server-node").text_content() == "cpu-beta"
    gpus = row[alpha.node_id].get_by_test_id("server-gpus")
    assert gpus.get_attribute("data-gpus") == gpu(0)["uuid"]
    shown_gpu = gpus.locator("code")
    assert shown_gpu.get_attribute("title") == gpu(0)["uuid"]  # whole on hover
    assert shown_gpu.text_content() == gpu(0)["uuid"][:12] + "…"
    assert row[beta.node_id].get_by_test_id("server-gpus").text_content() == "none"
    since = row[alpha.node_id].get_by_test_id("server-since")
    assert since.get_attribute("data-since") == servers[alpha.node_id]["state_since"]
    assert since.get_attribute("title")  # the absolute time on hover
    assert since.text_content().endswith(" ago")

    # Alpha's agent claims and sees its runtime ready; beta's runtime keeps exiting.
    lease_a = alpha.claim_server(servers[alpha.node_id]["server_id"])
    expect(row[alpha.node_id]).to_have_attribute("data-state", "starting", timeout=MOVED)
    assert alpha.renew_server(lease_a, "running")["desired"] == "run"
    expect(row[alpha.node_id]).to_have_attribute("data-state", "running", timeout=MOVED)
    lease_b = beta.claim_server(servers[beta.node_id]["server_id"])
    error = {"code": RUNTIME_EXITED, "message": f"exited with status 1 {HOSTILE}"}
    assert beta.renew_server(lease_b, "failed", restarts=3, error=error)["desired"] == "stop"
    expect(row[beta.node_id]).to_have_attribute("data-state", "failed", timeout=MOVED)
    shown_error = row[beta.node_id].get_by_test_id("server-error")
    expect(shown_error).to_have_attribute("data-code", RUNTIME_EXITED)
    assert shown_error.text_content() == f"{RUNTIME_EXITED} exited with status 1 {HOSTILE}"
    expect(row[beta.node_id].get_by_test_id("server-restarts")).to_have_text("3")
    expect(card.get_by_test_id("deployment-state")).to_have_text("degraded")
    # Nothing moves any more: the fast polling stops.
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "idle")
    assert_nothing_injected(page)
    browser.screenshot(page, "deployments-degraded")

    # Restart: every server back to pending, the failed one with its restarts back.
    card.get_by_test_id("deployment-restart").click()
    expect(row[beta.node_id]).to_have_attribute("data-state", "pending", timeout=MOVED)
    expect(row[alpha.node_id]).to_have_attribute("data-state", "pending")
    expect(row[beta.node_id].get_by_test_id("server-restarts")).to_have_text("0")
    expect(row[beta.node_id].get_by_test_id("server-error")).to_have_count(0)
    assert set(server_states(cp, "tiny-chat").values()) == {"pending"}
    csrf = page.locator('meta[name="csrf-token"]').get_attribute("content")
    restarts = [r for r in requests_made if r[0] == "POST" and r[1].endswith("/restart")]
    assert len(restarts) == 1 and restarts[0][2] == csrf  # the page's CSRF token
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "fast")
    leases = {}
    for node in (alpha, beta):
        leases[node.node_id] = node.claim_server(servers[node.node_id]["server_id"])
        node.renew_server(leases[node.node_id], "running")
    expect(card.get_by_test_id("deployment-state")).to_have_text("running", timeout=MOVED)
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "idle")

    # Stop asks for a second click; then each server is stopping until its agent stopped it.
    stop = card.get_by_test_id("deployment-stop")
    stop.click()
    expect(stop).to_have_text("Click again to stop every server")
    assert set(server_states(cp, "tiny-chat").values()) == {"running"}
    stop.click()
    expect(row[alpha.node_id]).to_have_attribute("data-state", "stopping", timeout=MOVED)
    expect(card.get_by_test_id("deployment-state")).to_have_text("stopping")
    expect(stop).to_be_disabled()
    deletes = [r for r in requests_made if r[0] == "DELETE"]
    assert len(deletes) == 1 and deletes[0][1].endswith(f"{DEPLOYMENTS}/tiny-chat")
    assert deletes[0][2] == csrf
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "fast")
    assert alpha.renew_server(leases[alpha.node_id], "stopped")["state"] == "stopped"
    expect(row[alpha.node_id]).to_have_attribute("data-state", "stopped", timeout=MOVED)
    beta.renew_server(leases[beta.node_id], "stopped")  # the last one: the deployment goes
    expect(card).to_have_count(0, timeout=MOVED)
    expect(page.get_by_test_id("deployments-empty")).to_be_visible()
    assert cp.admin("GET", f"{DEPLOYMENTS}/tiny-chat").status_code == 404

    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=100").json()["events"]
    actions = {e["action"]: e["actor"] for e in events if e["action"].startswith("deployment.")}
    assert actions["deployment.restarted"].startswith("console:")
    assert actions["deployment.stopping"].startswith("console:")
    html = page.content()
    for secret in (cp.admin_token, alpha.credential, beta.credential):
        assert secret not in html


def test_two_deployments_on_one_node_get_disjoint_gpus_and_a_refused_restart_says_why(
    browser, still_plane, tmp_path
):
    cp = still_plane
    model = import_gguf(cp, tmp_path, "tiny-llama")
    nodes = [ServingNode(cp, f"gpu-{n}", gpus=[gpu(0), gpu(1)], mode="nvidia") for n in "ab"]
    first, second = nodes
    replicate_present(cp, model, nodes)
    made = {}
    for name, members in (("tiny-chat", nodes), ("tiny-batch", [first])):
        body = {
            "name": name,
            "model": "tiny-llama",
            "runtime": "llama.cpp",
            "node_ids": [n.node_id for n in members],
            "gpu_count": 1,
            "settings": {"context_length": 4096},
        }
        answer = cp.admin("POST", DEPLOYMENTS, json=body)
        assert answer.status_code == 201, answer.text
        made[name] = {s["node_id"]: s for s in answer.json()["servers"]}
    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/deployments")
    chat = page.locator('[data-testid="deployment-card"][data-deployment="tiny-chat"]')
    batch = page.locator('[data-testid="deployment-card"][data-deployment="tiny-batch"]')
    expect(page.get_by_test_id("deployment-card")).to_have_count(2)

    leases = {}
    for name, node in (("tiny-chat", first), ("tiny-batch", first), ("tiny-chat", second)):
        leases[name, node.node_id] = node.claim_server(made[name][node.node_id]["server_id"])
    first.renew_server(leases["tiny-chat", first.node_id], "running")
    first.renew_server(leases["tiny-batch", first.node_id], "running")
    not_ready = {
        "code": "RUNTIME_NOT_READY",
        "message": "llama-server did not answer GET /health within 600 s",
    }
    second.renew_server(leases["tiny-chat", second.node_id], "failed", error=not_ready)
    expect(chat.get_by_test_id("deployment-state")).to_have_text("degraded", timeout=MOVED)
    expect(batch.get_by_test_id("deployment-state")).to_have_text("running", timeout=MOVED)
    expect(page.get_by_test_id("deployment-list")).to_have_attribute("data-polling", "idle")

    # Two servers on one node, one GPU each: different GPUs, by UUID.
    def gpus_of(card, node) -> str:
        row = card.locator(f'[data-testid="server-row"][data-node-id="{node.node_id}"]')
        return row.get_by_test_id("server-gpus").get_attribute("data-gpus")

    assert {gpus_of(chat, first), gpus_of(batch, first)} == {gpu(0)["uuid"], gpu(1)["uuid"]}
    failed = chat.locator(f'[data-testid="server-row"][data-node-id="{second.node_id}"]')
    expect(failed.get_by_test_id("server-error")).to_have_text(
        "RUNTIME_NOT_READY llama-server did not answer GET /health within 600 s"
    )
    shot = browser.screenshot(page, "console-deployments")
    assert shot.read_bytes().startswith(b"\x89PNG")

    # Stopped elsewhere since the last refresh: the page's Restart is refused, and says why.
    stopped = cp.admin("DELETE", f"{DEPLOYMENTS}/tiny-batch")
    assert stopped.status_code == 200, stopped.text
    batch.get_by_test_id("deployment-restart").click()
    expect(batch.get_by_test_id("deployment-error")).to_contain_text("being stopped")
    expect(batch.get_by_test_id("deployment-state")).to_have_text("stopping")
    expect(batch.get_by_test_id("deployment-restart")).to_be_disabled()
    assert deployment(cp, "tiny-batch")["state"] == "stopping"
    assert deployment(cp, "tiny-chat")["state"] == "degraded"  # the other one untouched


def test_a_node_is_added_from_the_non_members_and_a_member_removed_after_a_second_click(
    browser, still_plane, tmp_path
):
    cp = still_plane
    model = import_gguf(cp, tmp_path, "tiny-llama")
    alpha = ServingNode(cp, "gpu-alpha", gpus=[gpu(0)], mode="nvidia")
    beta = ServingNode(cp, "cpu-beta", gpus=[], mode="cpu")
    silent = WorkNode(cp, "never-heard", gpus=[], mode="cpu")  # enrolled, no heartbeat yet
    replicate_present(cp, model, [alpha, beta])
    body = {"name": "tiny-chat", "model": "tiny-llama", "runtime": "llama.cpp",
            "node_ids": [alpha.node_id]}  # fmt: skip
    made = cp.admin("POST", DEPLOYMENTS, json=body)
    assert made.status_code == 201, made.text
    lease_a = alpha.claim_server(made.json()["servers"][0]["server_id"])
    alpha.renew_server(lease_a, "running")

    page = browser.new_page()
    requests_made: list[tuple[str, str, str | None]] = []
    page.on(
        "request",
        lambda r: requests_made.append((r.method, r.url, r.headers.get("x-csrf-token"))),
    )
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/deployments")
    card = page.locator('[data-testid="deployment-card"][data-deployment="tiny-chat"]')
    expect(card.get_by_test_id("deployment-state")).to_have_text("running")

    # The choices are the nodes that are not members; one never heard from cannot be chosen.
    card.get_by_test_id("deployment-add-node").click()
    select = card.get_by_test_id("add-node-select")
    expect(select).to_be_visible()
    options = select.locator("option")
    expect(options).to_have_count(2)
    values = {o.get_attribute("value"): o for o in options.all()}
    assert set(values) == {beta.node_id, silent.node_id}  # alpha, a member, is not offered
    assert values[silent.node_id].is_disabled() and "pending" in values[silent.node_id].inner_text()
    assert select.input_value() == beta.node_id
    card.get_by_test_id("add-node-submit").click()
    row_b = card.locator(f'[data-testid="server-row"][data-node-id="{beta.node_id}"]')
    expect(row_b).to_have_attribute("data-state", "pending", timeout=MOVED)
    expect(card.get_by_test_id("add-node-picker")).to_be_hidden()
    csrf = page.locator('meta[name="csrf-token"]').get_attribute("content")
    added = [r for r in requests_made if r[0] == "POST" and r[1].endswith("/servers")]
    assert len(added) == 1 and added[0][2] == csrf
    assert set(server_states(cp, "tiny-chat")) == {alpha.node_id, beta.node_id}

    # Beta's runtime exits: backing off, the page says why and when it tries again.
    [server_b] = [s for s in deployment(cp, "tiny-chat")["servers"] if s["node_id"] == beta.node_id]
    lease_b = beta.claim_server(server_b["server_id"])
    error = {"code": RUNTIME_EXITED, "message": f"exited with status 3 {HOSTILE}"}
    beta.renew_server(lease_b, "backoff", restarts=1, error=error, next_attempt_in=30)
    expect(row_b).to_have_attribute("data-state", "backoff", timeout=MOVED)
    expect(row_b.get_by_test_id("server-next-attempt")).to_have_text("in 30 s")
    expect(row_b.get_by_test_id("server-restarts")).to_have_text("1")
    expect(row_b.get_by_test_id("server-error")).to_have_text(
        f"{RUNTIME_EXITED} exited with status 3 {HOSTILE}"
    )
    assert_nothing_injected(page)
    browser.screenshot(page, "deployments-members")

    # Remove asks for a second click; the leased member stops, then its row goes.
    row_a = card.locator(f'[data-testid="server-row"][data-node-id="{alpha.node_id}"]')
    remove = row_a.get_by_test_id("server-remove")
    remove.click()
    expect(remove).to_have_text("Click again to remove gpu-alpha")
    assert server_states(cp, "tiny-chat")[alpha.node_id] == "running"
    remove.click()
    expect(row_a).to_have_attribute("data-state", "stopping", timeout=MOVED)
    expect(row_a.get_by_test_id("server-note")).to_have_text(" leaving")
    expect(row_a.get_by_test_id("server-remove")).to_be_disabled()
    deletes = [r for r in requests_made if r[0] == "DELETE"]
    assert len(deletes) == 1 and deletes[0][2] == csrf
    assert deletes[0][1].endswith(f"{DEPLOYMENTS}/tiny-chat/servers/{alpha.node_id}")
    assert alpha.renew_server(lease_a, "running")["desired"] == "stop"
    alpha.renew_server(lease_a, "stopped")
    expect(row_a).to_have_count(0, timeout=MOVED)
    assert list(server_states(cp, "tiny-chat")) == [beta.node_id]

    # The last member cannot go: the card says why and what to do instead.
    last = row_b.get_by_test_id("server-remove")
    last.click()
    last.click()
    expect(card.get_by_test_id("deployment-error")).to_contain_text("last member")
    expect(card.get_by_test_id("deployment-error")).to_contain_text("modelforge undeploy")
    assert list(server_states(cp, "tiny-chat")) == [beta.node_id]
    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=100").json()["events"]
    actions = {e["action"]: e["actor"] for e in events if e["action"].startswith("deployment.")}
    assert actions["deployment.members_added"].startswith("console:")
    assert actions["deployment.member_removed"].startswith("console:")


def test_a_node_page_lists_the_servers_and_replicas_the_node_holds(browser, still_plane, tmp_path):
    cp = still_plane
    model = import_gguf(cp, tmp_path, "tiny-llama")
    busy = ServingNode(cp, "cpu-busy", gpus=[], mode="cpu")
    spare = ServingNode(cp, "cpu-spare", gpus=[], mode="cpu")
    replicate_present(cp, model, [busy])
    body = {"name": "tiny-chat", "model": "tiny-llama", "runtime": "llama.cpp",
            "node_ids": [busy.node_id]}  # fmt: skip
    made = cp.admin("POST", DEPLOYMENTS, json=body)
    assert made.status_code == 201, made.text
    [server] = made.json()["servers"]
    lease = busy.claim_server(server["server_id"])
    busy.renew_server(lease, "backoff", restarts=2,
                      error={"code": "RUNTIME_EXITED", "message": HOSTILE})  # fmt: skip
    answer = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{busy.node_id}/serving").json()
    assert [(s["deployment"], s["state"]) for s in answer["servers"]] == [("tiny-chat", "backoff")]
    assert [(r["model"], r["state"]) for r in answer["replicas"]] == [("tiny-llama", "present")]
    unknown = cp.admin("GET", "/api/v1/admin/hardware/nodes/no-such-node/serving")
    assert unknown.status_code == 404

    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/nodes/{busy.node_id}")
    row = page.locator('[data-testid="node-server"][data-deployment="tiny-chat"]')
    expect(row).to_have_attribute("data-state", "backoff")
    expect(row).to_contain_text("tiny-llama@r1 · llama.cpp")
    expect(row).to_contain_text("RUNTIME_EXITED")
    expect(row.locator("td").nth(4)).to_have_text("2")
    assert_nothing_injected(page)  # the node's message is text
    held = page.locator('[data-testid="node-replica"][data-model="tiny-llama"]')
    expect(held).to_have_attribute("data-state", "present")
    expect(page.get_by_test_id("node-servers-none")).to_be_hidden()
    # A node that holds nothing says so, pointing at where to change that.
    page.goto(f"{cp.url}/console/nodes/{spare.node_id}")
    expect(page.get_by_test_id("node-servers-none")).to_be_visible()
    expect(page.get_by_test_id("node-replicas-none")).to_be_visible()
    assert page.get_by_test_id("node-server").count() == 0


class HelperNode(ServingNode):
    """A node whose worker can also be a split's helper (it found ggml-rpc-server)."""

    def heartbeat(self, worker: dict | None = None, status: str = "ok") -> None:
        offered = {**worker_health(), "capabilities": ["smoke", "container", "serve"]}
        WorkNode.heartbeat(self, {**offered, "runtimes": ["llama.cpp", "llama.cpp-rpc"]}, status)


def test_a_split_deployment_shows_each_member_s_role_and_share_and_its_members_are_fixed(
    browser, still_plane, tmp_path
):
    cp = still_plane
    model = import_gguf(cp, tmp_path, "tiny-llama")
    main = ServingNode(cp, "big-main", gpus=[], mode="cpu")
    plain = ServingNode(cp, "no-rpc", gpus=[], mode="cpu")
    helper = HelperNode(cp, "big-helper", gpus=[], mode="cpu")
    replicate_present(cp, model, [main])  # the helpers need no copy
    body = {
        "name": "big",
        "model": "tiny-llama",
        "runtime": "llama.cpp",
        "node_ids": [main.node_id],
    }

    # A helper's worker must offer llama.cpp-rpc; nothing is made otherwise.
    refused = cp.admin(
        "POST", DEPLOYMENTS, json={**body, "settings": {"split": [main.node_id, plain.node_id]}}
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "RUNTIME_UNSUPPORTED"
    assert "llama.cpp-rpc" in refused.json()["error"]["message"]
    wrong = cp.admin(
        "POST", DEPLOYMENTS, json={**body, "runtime": "vllm", "settings": {"split": [main.node_id, helper.node_id], "image_id": "sha256:" + "0" * 64}}
    )  # fmt: skip
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "FIELD_FORMAT"
    assert cp.admin("GET", DEPLOYMENTS).json()["deployments"] == []

    made = cp.admin(
        "POST", DEPLOYMENTS, json={**body, "settings": {"split": [main.node_id, helper.node_id]}}
    )
    assert made.status_code == 201, made.text
    roles = {s["node_id"]: s["role"] for s in made.json()["servers"]}
    assert roles == {main.node_id: "main", helper.node_id: "helper"}
    # The helper's agent is asked to run it at once (it loads no file); the main's lists its
    # helper's server id.
    listed = cp.agent("GET", "/api/v1/agent/servers", helper.credential).json()["servers"]
    assert [s["split"] for s in listed] == [{"role": "helper"}]
    # The main server waits for its helper to run, then is listed, with its helpers' ids.
    assert cp.agent("GET", "/api/v1/agent/servers", main.credential).json()["servers"] == []
    helper_server = next(s for s in made.json()["servers"] if s["role"] == "helper")
    generation = cp.agent("GET", "/api/v1/agent/servers", main.credential).json()
    helper.renew_server(helper.claim_server(helper_server["server_id"]), "running")
    again = cp.agent("GET", "/api/v1/agent/servers", main.credential).json()
    assert again["servers_generation"] > generation["servers_generation"]  # told at once
    [entry] = again["servers"]
    assert entry["split"]["role"] == "main"
    assert entry["split"]["helpers"] == [helper_server["server_id"]]

    fixed = cp.admin("POST", f"{DEPLOYMENTS}/big/servers", json={"node_ids": [plain.node_id]})
    assert fixed.status_code == 409 and fixed.json()["error"]["code"] == "SPLIT_FIXED"
    fixed = cp.admin("DELETE", f"{DEPLOYMENTS}/big/servers/{helper.node_id}")
    assert fixed.status_code == 409 and fixed.json()["error"]["code"] == "SPLIT_FIXED"

    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/deployments")
    card = page.locator('[data-testid="deployment-card"][data-deployment="big"]')
    expect(card).to_contain_text("split across 2 nodes")
    shares = made.json()["settings"]["shares"]
    for node, role, share in ((main, "main", shares[0]), (helper, "helper", shares[1])):
        row = card.locator(f'[data-testid="server-row"][data-node-id="{node.node_id}"]')
        expect(row.get_by_test_id("server-role")).to_have_text(
            f" ({role}, {round(share * 100)}% of the layers)"
        )
    assert_nothing_injected(page)
