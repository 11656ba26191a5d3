"""The console's node page holds a hardware change for an administrator (issue 21): it names
the difference, and Accept hardware accepts exactly what it shows, with the session's CSRF
token like every other console action; what a node sent stays text."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from modelforge_contract import CSRF_TOKEN_INVALID, HARDWARE_PENDING_CHANGED
from tests.harness.console_client import ConsoleClient, set_password
from tests.harness.control_plane import error_code
from tests.harness.scripted_node import WorkNode, gpu

from .conftest import sign_in

NODES = "/admin/hardware/nodes"
HOSTILE_UUID = '<img src=x onerror="window.__pwned=1">'


def changed_node(cp) -> WorkNode:
    node = WorkNode(cp, "gpu-grown").ready()
    grown = [*node.gpus, {**gpu(2), "uuid": HOSTILE_UUID}]
    assert node.publish(grown).status_code == 200
    return node


def test_accepting_hardware_needs_the_csrf_token_and_the_digest_shown(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    node = changed_node(cp)
    client = ConsoleClient(cp)
    assert client.sign_in().status_code == 200
    digest = client.api("GET", f"{NODES}/{node.node_id}").json()["hardware"]["digest"]
    path = f"{NODES}/{node.node_id}/accept-hardware"

    forged = client.api("POST", path, csrf=False, json={"digest": digest})
    assert forged.status_code == 403 and error_code(forged) == CSRF_TOKEN_INVALID
    assert client.api("GET", f"{NODES}/{node.node_id}").json()["hardware"]["pending"]
    stale = client.api("POST", path, json={"digest": "0" * 16})
    assert stale.status_code == 409 and error_code(stale) == HARDWARE_PENDING_CHANGED
    done = client.api("POST", path, json={"digest": digest})
    assert done.status_code == 200, done.text
    assert len(done.json()["accelerators"]) == 3
    audit = client.api("GET", f"/admin/audit-events?node_id={node.node_id}").json()["events"]
    [event] = [e for e in audit if e["action"] == "node.hardware_accepted"]
    assert event["actor"].startswith("console:")


@pytest.mark.browser
def test_the_node_page_shows_the_change_and_accepts_it(browser, sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    node = changed_node(cp)
    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/nodes/{node.node_id}")
    panel = page.get_by_test_id("hardware-change")
    expect(panel).to_be_visible()
    difference = page.get_by_test_id("hardware-difference")
    expect(difference).to_contain_text(f"appeared: {HOSTILE_UUID}")
    assert page.locator("#hardware-change img").count() == 0  # the node's string stays text
    hardware = page.locator('[data-check="hardware"]')
    expect(hardware).to_have_class("failing")
    browser.screenshot(page, "node-page-hardware-change")

    page.get_by_test_id("accept-hardware").click()
    expect(panel).to_be_hidden()
    expect(hardware).to_have_class("ok")
    page.get_by_test_id("node-audit").filter(has_text="node.hardware_accepted").wait_for()
    assert page.evaluate("window.__pwned") is None
    shown = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node.node_id}").json()
    assert [g["uuid"] for g in shown["accelerators"]][-1] == HOSTILE_UUID
    assert shown["hardware"]["pending"] is False
