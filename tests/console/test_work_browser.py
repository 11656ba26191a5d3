"""The Work page and the Hardware page's readiness in a real headless Chromium, against a real
control plane on a loopback port; nodes are driven through the agent API step by step
(tests/harness/scripted_node.py), so every state the pages show is one the test caused.

The control plane's clock stands still (ManualClock): no node goes stale and no lease
expires while the browser works, however slow the machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import expect

from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.fleet import nodes
from modelforge_appliance.store import audit
from modelforge_contract import HEADER_CLAIM_REASON
from tests.harness.console_client import set_password
from tests.harness.control_plane import ControlPlane, make_settings, new_identity, serve
from tests.harness.scripted_node import WorkNode, item, submit, work_events

from .conftest import sign_in

pytestmark = pytest.mark.browser

# Rendered as text, these are harmless; parsed as HTML, the first would make an element and
# the second would end the page's markup. The CSP would refuse an injected handler, and the
# fixture fails the test on the console error that refusal logs.
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1">'
HOSTILE_CLOSE = "</dd></dl><script>document.body.dataset.pwned=2</script>"
SECRET = "s3cret-value-that-must-not-render"
IMAGE_ID = "sha256:" + "e" * 64
# Long enough for a page's next periodic refresh (every 5 s, or 3 s); it only bounds a failure.
REFRESHED = 30_000
WORKER = {"reachable": True, "protocol": 1, "version": "0.1.0", "capabilities": ["smoke"]}


@pytest.fixture
def still_plane(tmp_path) -> Iterator[ControlPlane]:
    with serve(make_settings(tmp_path / "state"), ManualClock(time.time())) as cp:
        set_password(cp)
        yield cp


def cpu_node(cp: ControlPlane, hostname: str, name: str, worker: dict | None) -> str:
    """A CPU node that heartbeats (with ``worker`` beside its agent, or none) and publishes
    its inventory: READY with a worker, NOT READY (worker) without."""
    token = cp.mint(name)["token"]
    enrolled = cp.enroll(token, hostname=hostname, identity=new_identity(), accelerator_mode="cpu")
    assert enrolled.status_code == 201, enrolled.text
    node_id, credential = enrolled.json()["node_id"], enrolled.json()["credential"]
    health = {"status": "ok", "gpu_probe": "not_applicable", "worker": worker}
    for method, path, fields in (
        ("POST", "/api/v1/agent/heartbeat", {"health": health}),
        ("PUT", "/api/v1/agent/inventory", {"accelerators": []}),
    ):
        body = {"node_id": node_id, "agent_version": "0.1.0", **fields}
        answer = cp.agent(method, path, credential, json=body)
        assert answer.status_code == 200, answer.text
    cp.heartbeats.flush()
    return node_id


def assert_nothing_injected(page) -> None:
    assert page.evaluate("document.body.dataset.pwned") is None
    assert page.locator("main img, main script").count() == 0


def test_the_hardware_page_hints_when_empty_then_shows_readiness_beside_liveness(
    browser, still_plane
):
    cp = still_plane
    page = browser.new_page()
    sign_in(page, cp.url)
    hint = page.get_by_test_id("fleet-empty")
    expect(hint).to_be_visible()
    assert "Enroll node" in hint.inner_text() and "modelforge enroll" in hint.inner_text()
    browser.screenshot(page, "hardware-empty")

    ready = cpu_node(cp, "cpu-ready", "Ready node", WORKER)
    no_worker = cpu_node(cp, "cpu-no-worker", HOSTILE, None)
    row = page.locator(f'[data-testid="node-row"][data-node-id="{ready}"]')
    other = page.locator(f'[data-testid="node-row"][data-node-id="{no_worker}"]')
    # The next periodic refresh brings both, in place; the hint goes.
    expect(other.locator('[data-field="ready"]')).to_have_text(
        "NOT READY · worker", timeout=REFRESHED
    )
    expect(row.locator('[data-field="ready"]')).to_have_text("READY", timeout=REFRESHED)
    expect(hint).to_be_hidden(timeout=REFRESHED)
    # Both are equally online: only the Ready column tells them apart.
    assert row.get_attribute("data-liveness") == other.get_attribute("data-liveness") == "online"
    assert (row.get_attribute("data-ready"), other.get_attribute("data-ready")) == (
        "ready",
        "not-ready",
    )
    assert other.locator("a").text_content() == HOSTILE
    assert_nothing_injected(page)
    browser.screenshot(page, "hardware-readiness")


def test_audit_details_read_as_key_value_pairs_and_hostile_values_stay_text(browser, still_plane):
    cp = still_plane
    node_id = cpu_node(cp, "cpu-audit", "Audit node", WORKER)
    nodes.rename_node(cp.store, node_id, HOSTILE_CLOSE, audit.CLI_ACTOR)
    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/nodes/{node_id}")
    trail = page.get_by_test_id("node-audit")
    event = trail.locator("tr").filter(has_text="node.renamed")
    event.wait_for()
    pairs = event.locator("dl.kv").evaluate(
        "(dl) => [...dl.children].map((e) => e.tagName + ':' + e.textContent)"
    )
    assert pairs == [
        "DT:display_name",
        f"DD:{HOSTILE_CLOSE}",
        "DT:previous",
        "DD:Audit node",
    ]
    assert "{" not in trail.inner_text()  # no raw JSON left
    assert_nothing_injected(page)


def test_the_work_page_submits_a_smoke_follows_it_and_cancels_a_queued_one(browser, still_plane):
    cp = still_plane
    runner = WorkNode(cp, "gpu-runner").ready()
    idle = WorkNode(cp, "gpu-idle")  # enrolled, never heartbeated: not ready
    page = browser.new_page()
    sign_in(page, cp.url)
    page.locator("header nav").get_by_role("link", name="Work").click()
    page.wait_for_url(f"{cp.url}/console/work")
    expect(page.get_by_test_id("work-status")).to_have_text(
        "No work items yet: submit a smoke above."
    )
    choices = page.get_by_test_id("smoke-node").locator("option")
    expect(choices).to_have_count(2)
    labels = choices.all_text_contents()
    assert any(label.startswith("gpu-runner (gpu-runner)") for label in labels), labels
    assert any("gpu-idle" in label and "NOT READY: connection" in label for label in labels)

    # A smoke to the runner: queued, in the queue, on exactly that node.
    page.get_by_test_id("smoke-node").select_option(runner.node_id)
    page.get_by_test_id("smoke-submit").click()
    link = page.get_by_test_id("smoke-queued-link")
    link.wait_for()
    work_id = link.text_content()
    first = page.locator(f'[data-testid="work-row"][data-work-id="{work_id}"]')
    expect(first).to_have_attribute("data-state", "queued")
    assert item(cp, work_id)["constraints"]["node_ids"] == [runner.node_id]
    submitted = [e for e in work_events(cp) if e["action"] == "work.submitted"]
    assert [e["actor"].split(":")[0] for e in submitted] == ["console"]

    # The idle node does not get it; the runner claims it and completes it with a log.
    refused = idle.claim()
    assert (refused.status_code, refused.headers[HEADER_CLAIM_REASON]) == (204, "not_online")
    lease = runner.lease()
    assert lease["work_id"] == work_id
    expect(first).to_have_attribute("data-state", "leased", timeout=REFRESHED)
    done = runner.complete(
        lease, result={"ok": True, "note": HOSTILE}, log_tail=f"step 1\n{HOSTILE}\n"
    )
    assert done.status_code == 200, done.text
    expect(first).to_have_attribute("data-state", "succeeded", timeout=REFRESHED)
    assert first.locator("td").nth(3).text_content() == "gpu-runner"
    browser.screenshot(page, "work-queue")

    first.get_by_role("link", name=work_id).click()
    page.wait_for_url(f"{cp.url}/console/work/{work_id}")
    expect(page.get_by_test_id("item-state")).to_have_text("succeeded")
    assert page.get_by_test_id("item-log").text_content() == f"step 1\n{HOSTILE}\n"
    result = page.get_by_test_id("item-result").inner_text()
    assert "note" in result and HOSTILE in result
    expect(page.get_by_test_id("item-cancel")).to_be_disabled()
    assert_nothing_injected(page)
    browser.screenshot(page, "work-item")

    # A smoke to the idle node waits, queued: the page says so, and Cancel ends it.
    cp.store.clock.advance(1)  # a second later: the queue lists it first
    page.goto(f"{cp.url}/console/work")
    page.get_by_test_id("smoke-node").select_option(idle.node_id)
    page.get_by_test_id("smoke-submit").click()
    expect(page.get_by_test_id("smoke-queued")).to_contain_text("NOT READY: connection")
    waiting = page.get_by_test_id("smoke-queued-link").text_content()
    assert waiting != work_id
    page.get_by_test_id("smoke-queued-link").click()
    page.wait_for_url(f"{cp.url}/console/work/{waiting}")
    expect(page.get_by_test_id("item-state")).to_have_text("queued")
    page.get_by_test_id("item-cancel").click()
    expect(page.get_by_test_id("item-state")).to_have_text("cancelled")
    expect(page.get_by_test_id("item-cancel")).to_be_disabled()
    assert item(cp, waiting)["state"] == "cancelled"
    cancelled = [e for e in work_events(cp) if e["action"] == "work.cancelled"]
    assert [e["detail"]["work_id"] for e in cancelled] == [waiting]
    assert cancelled[0]["actor"].startswith("console:")

    page.goto(f"{cp.url}/console/work")
    rows = page.get_by_test_id("work-row")
    expect(rows).to_have_count(2)
    assert [row.get_attribute("data-state") for row in rows.all()] == ["cancelled", "succeeded"]
    page.get_by_test_id("work-state").select_option("cancelled")
    expect(rows).to_have_count(1)
    assert rows.first.get_attribute("data-work-id") == waiting


def test_a_work_items_env_values_never_reach_the_page(browser, still_plane):
    cp = still_plane
    container = {
        "image": "registry.lan/job:1",
        "image_id": IMAGE_ID,
        "env": {"API_TOKEN": SECRET, "MODE": "fast"},
        "command": ["run", HOSTILE],
    }
    work_id = submit(cp, "container", input=container)["work_id"]
    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/work/{work_id}")
    expect(page.get_by_test_id("item-state")).to_have_text("queued")
    fields = page.get_by_test_id("item-input").inner_text()
    assert "API_TOKEN, MODE" in fields and "env (names only)" in fields
    assert "registry.lan/job:1" in fields and HOSTILE in fields
    assert SECRET not in page.content() and "fast" not in fields
    assert SECRET not in page.evaluate("document.body.innerText")
    assert_nothing_injected(page)
    page.goto(f"{cp.url}/console/work")
    page.locator(f'[data-testid="work-row"][data-work-id="{work_id}"]').wait_for()
    assert SECRET not in page.content()
