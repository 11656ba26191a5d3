"""The Models page in a real headless Chromium, against a real control plane on a loopback port.

Models are imported through the admin API (the cache and store are real); nodes are driven
through the agent API step by step: an enrolled node that heartbeats and publishes its
inventory's ``models`` report, so every replica state the page shows is one the test caused.
The control plane's clock stands still (ManualClock): no node goes stale while the browser
works, however slow the machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect

from modelforge_appliance.core.clock import ManualClock
from modelforge_contract.models import DISK_FULL
from tests.harness.console_client import set_password
from tests.harness.control_plane import ControlPlane, make_settings, serve
from tests.harness.hub_stand_in import HubStandIn
from tests.harness.scripted_node import WorkNode

from .conftest import sign_in

pytestmark = pytest.mark.browser

HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1">'
MIB = 2**20
# Bounds a failure only: the page polls replicas every 1.5 s while one moves.
MOVED = 20_000


@pytest.fixture
def still_plane(tmp_path) -> Iterator[ControlPlane]:
    with serve(make_settings(tmp_path / "state"), ManualClock(time.time())) as cp:
        set_password(cp)
        yield cp


class ReportingNode(WorkNode):
    """A CPU node that is online and reports its models in its inventory."""

    def __init__(self, cp: ControlPlane, hostname: str, online: bool = True) -> None:
        super().__init__(cp, hostname, gpus=[], mode="cpu")
        if online:
            self.heartbeat()
            self.inventory()
            cp.heartbeats.flush()

    def report(self, *models: dict) -> None:
        body = {
            "node_id": self.node_id,
            "agent_version": "0.1.0",
            "accelerators": [],
            "models": list(models),
        }
        answer = self.cp.agent("PUT", "/api/v1/agent/inventory", self.credential, json=body)
        assert answer.status_code == 200, answer.text


def entry(digest: str, state: str, done: int, total: int, error: dict | None = None) -> dict:
    return {
        "digest": digest,
        "state": state,
        "bytes_done": done,
        "bytes_total": total,
        "error": error,
    }


def import_model(cp: ControlPlane, tmp_path, name: str) -> dict:
    folder = tmp_path / name
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"\x01" * (3 * MIB))
    (folder / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    answer = cp.admin(
        "POST", "/api/v1/admin/models", json={"name": name, "source": {"path": str(folder)}}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


def replica_states(cp: ControlPlane, name: str) -> dict[str, str]:
    answer = cp.admin("GET", f"/api/v1/admin/models/{name}/replicas")
    assert answer.status_code == 200, answer.text
    return {r["node_id"]: r["state"] for r in answer.json()["replicas"]}


def assert_nothing_injected(page) -> None:
    assert page.evaluate("document.body.dataset.pwned") is None
    assert page.locator("main img, main script").count() == 0


def test_the_models_page_hints_at_the_cli_import_when_no_model_exists(browser, still_plane):
    cp = still_plane
    page = browser.new_page()
    sign_in(page, cp.url)
    page.locator("header nav").get_by_role("link", name="Models").click()
    page.wait_for_url(f"{cp.url}/console/models")
    hint = page.get_by_test_id("models-empty")
    expect(hint).to_be_visible()
    expect(page.get_by_test_id("models-import-hint")).to_have_text(
        "modelforge models import NAME PATH"
    )
    assert page.get_by_test_id("model-card").count() == 0
    expect(page.get_by_test_id("models-error")).to_have_text("")


def test_replicate_from_the_page_the_bar_moves_to_present_a_failure_shows_its_code_and_remove(
    browser, still_plane, tmp_path
):
    cp = still_plane
    model = import_model(cp, tmp_path, "tiny-llm")
    digest, total = model["digest"], model["size_bytes"]
    alpha = ReportingNode(cp, "cpu-alpha")
    beta = ReportingNode(cp, "cpu-beta")
    silent = ReportingNode(cp, "cpu-silent", online=False)  # enrolled, never heard from
    silent_liveness = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{silent.node_id}").json()[
        "liveness"
    ]
    assert silent_liveness != "online"

    page = browser.new_page()
    requests_made: list[tuple[str, str, str | None]] = []
    page.on(
        "request",
        lambda r: requests_made.append((r.method, r.url, r.headers.get("x-csrf-token"))),
    )
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/models")
    card = page.locator('[data-testid="model-card"][data-model="tiny-llm"]')
    expect(card.get_by_test_id("model-revision")).to_have_text("r1")
    shown = card.get_by_test_id("model-digest")
    assert shown.get_attribute("title") == digest  # whole on hover
    assert shown.get_attribute("data-digest") == digest
    assert shown.text_content() == digest[: len("sha256:") + 12] + "…"
    assert card.get_by_test_id("model-size").get_attribute("data-bytes") == str(total)
    assert card.get_by_test_id("model-size").text_content() == "3.0 MiB"
    expect(card.get_by_test_id("replicas-none")).to_be_visible()
    expect(page.get_by_test_id("models-empty")).to_be_hidden()
    expect(page.get_by_test_id("model-list")).to_have_attribute("data-polling", "idle")

    # The picker: online nodes can be chosen, the silent one is shown disabled with its liveness.
    card.get_by_test_id("replicate-open").click()
    picker = card.get_by_test_id("replicate-picker")
    expect(picker).to_be_visible()
    box = {
        n.node_id: picker.locator(f'[data-testid="replicate-node"][data-node-id="{n.node_id}"]')
        for n in (alpha, beta, silent)
    }
    expect(box[alpha.node_id]).to_be_enabled()
    expect(box[beta.node_id]).to_be_enabled()
    expect(box[silent.node_id]).to_be_disabled()
    silent_label = picker.locator(f'label:has([data-node-id="{silent.node_id}"])')
    assert silent_label.get_by_test_id("replicate-node-why").text_content() == (
        f" — {silent_liveness}"
    )
    box[alpha.node_id].check()
    box[beta.node_id].check()
    picker.get_by_test_id("replicate-submit").click()
    expect(picker).to_be_hidden()
    rows = card.get_by_test_id("replica-row")
    expect(rows).to_have_count(2)
    row_a = card.locator(f'[data-testid="replica-row"][data-node-id="{alpha.node_id}"]')
    row_b = card.locator(f'[data-testid="replica-row"][data-node-id="{beta.node_id}"]')
    expect(row_a).to_have_attribute("data-state", "pending")
    # Each replica names its node as the fleet does (its enrolled name), linking to its page.
    expect(row_a.locator("a")).to_have_text("cpu-alpha")
    expect(row_a.locator("a")).to_have_attribute("href", f"/console/nodes/{alpha.node_id}")
    expect(page.get_by_test_id("model-list")).to_have_attribute("data-polling", "fast")
    assert replica_states(cp, "tiny-llm") == {alpha.node_id: "pending", beta.node_id: "pending"}
    posts = [r for r in requests_made if r[0] == "POST" and r[1].endswith("/replicas")]
    assert len(posts) == 1 and posts[0][2]  # sent with the page's CSRF token

    # Alpha downloads: the bar follows each report without a reload, then it is present.
    bar = row_a.get_by_test_id("replica-progress")
    seen_values = []
    for done in (total // 3, 2 * total // 3):
        alpha.report(entry(digest, "downloading", done, total))
        expect(row_a).to_have_attribute("data-state", "downloading", timeout=MOVED)
        expect(bar).to_have_attribute("value", str(done), timeout=MOVED)
        assert bar.get_attribute("max") == str(total)
        seen_values.append(int(bar.get_attribute("value")))
    assert seen_values == sorted(seen_values) and seen_values[0] < seen_values[1] < total
    browser.screenshot(page, "models-downloading")
    alpha.report(entry(digest, "present", total, total))
    expect(row_a).to_have_attribute("data-state", "present", timeout=MOVED)
    expect(bar).to_have_attribute("value", str(total))

    # Beta fails: its code and message show, as text.
    beta.report(
        entry(digest, "failed", MIB, total, {"code": DISK_FULL, "message": f"disk full {HOSTILE}"})
    )
    expect(row_b).to_have_attribute("data-state", "failed", timeout=MOVED)
    error = row_b.get_by_test_id("replica-error")
    expect(error).to_have_attribute("data-code", DISK_FULL)
    assert error.text_content() == f"{DISK_FULL} disk full {HOSTILE}"
    # Nothing moves any more: the fast polling stops.
    expect(page.get_by_test_id("model-list")).to_have_attribute("data-polling", "idle")
    assert_nothing_injected(page)
    browser.screenshot(page, "models-replicas")

    # A failed replica can be chosen again (a retry); a present one cannot.
    card.get_by_test_id("replicate-open").click()
    expect(box[beta.node_id]).to_be_enabled()
    expect(box[alpha.node_id]).to_be_disabled()
    picker.get_by_test_id("replicate-cancel").click()
    expect(picker).to_be_hidden()

    # Remove asks for a second click, then the replica is removing until alpha stops reporting.
    remove = row_a.get_by_test_id("replica-remove")
    remove.click()
    expect(remove).to_have_text("Click again to remove")
    assert replica_states(cp, "tiny-llm")[alpha.node_id] == "present"
    remove.click()
    expect(row_a).to_have_attribute("data-state", "removing")
    assert replica_states(cp, "tiny-llm")[alpha.node_id] == "removing"
    deletes = [r for r in requests_made if r[0] == "DELETE"]
    assert len(deletes) == 1 and alpha.node_id in deletes[0][1] and deletes[0][2]
    expect(page.get_by_test_id("model-list")).to_have_attribute("data-polling", "fast")
    alpha.report()  # the files are gone from alpha: the row goes
    expect(row_a).to_have_count(0, timeout=MOVED)
    expect(rows).to_have_count(1)
    expect(page.get_by_test_id("model-list")).to_have_attribute("data-polling", "idle")

    events = cp.admin("GET", "/api/v1/admin/audit-events?limit=50").json()["events"]
    actions = {e["action"]: e["actor"] for e in events if e["action"].startswith("model.")}
    assert actions["model.replicated"].startswith("console:")
    assert actions["model.replica_removed"].startswith("console:")

    html = page.content()
    for secret in (cp.admin_token, alpha.credential, beta.credential, silent.credential):
        assert secret not in html


def test_the_digest_copies_whole_and_a_replicate_refusal_leaves_nothing_replicated(
    browser, still_plane, tmp_path
):
    cp = still_plane
    digest = import_model(cp, tmp_path, "tiny-llm")["digest"]
    node = ReportingNode(cp, "cpu-gone")
    browser.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=cp.url)
    page = browser.new_page()
    sign_in(page, cp.url)
    page.goto(f"{cp.url}/console/models")
    card = page.locator('[data-testid="model-card"][data-model="tiny-llm"]')
    card.get_by_test_id("model-copy-digest").click()
    expect(card.get_by_test_id("model-copy-digest")).to_have_text("copied")
    assert page.evaluate("navigator.clipboard.readText()") == digest
    card.get_by_test_id("replicate-open").click()
    choice = card.locator(f'[data-testid="replicate-node"][data-node-id="{node.node_id}"]')
    choice.check()
    # Between opening the picker and submitting, the node is decommissioned elsewhere.
    preview = cp.admin("POST", f"/api/v1/admin/hardware/nodes/{node.node_id}/decommission/preview")
    assert preview.status_code == 200, preview.text
    done = cp.admin(
        "POST",
        f"/api/v1/admin/hardware/nodes/{node.node_id}/decommission/execute",
        json={"confirmation": preview.json()["confirmation"]},
    )
    assert done.status_code == 200, done.text
    card.get_by_test_id("replicate-submit").click()
    expect(card.get_by_test_id("replicate-error")).to_contain_text("cpu-gone")
    assert replica_states(cp, "tiny-llm") == {}
    expect(card.get_by_test_id("replicas-none")).to_be_visible()


def test_the_pull_form_pulls_one_quantisation_shows_its_bar_and_lists_the_model(
    browser, tmp_path, tiny_gguf
):
    """The "Pull from a hub" form against the hub's stand-in on loopback: a refusal shows its
    code and next step, and a pull by --include ends done with the model on the page."""
    gguf = Path(tiny_gguf).read_bytes()
    with HubStandIn() as hub:
        hub.add_repo(
            "tiny-org/tiny-GGUF",
            {"tiny-Q4_K_M.gguf": gguf, "tiny-Q8_0.gguf": gguf + b"\x00" * 4096},
        )
        settings = make_settings(tmp_path / "state", hub_endpoint=hub.url)
        with serve(settings, ManualClock(time.time())) as cp:
            set_password(cp)
            page = browser.new_page()
            sign_in(page, cp.url)
            page.goto(f"{cp.url}/console/models")
            form = page.get_by_test_id("pull-form")
            # A repository the hub does not have: refused at once, with what to do.
            page.get_by_test_id("pull-name").fill("nothing")
            page.get_by_test_id("pull-repo").fill("tiny-org/" + HOSTILE)
            page.get_by_test_id("pull-submit").click()
            expect(page.get_by_test_id("pull-error")).to_contain_text("is not a repository")
            assert_nothing_injected(page)
            page.get_by_test_id("pull-name").fill("nothing")
            page.get_by_test_id("pull-repo").fill("tiny-org/no-such-repo")
            page.get_by_test_id("pull-submit").click()
            refused = page.get_by_test_id("pull-error")
            expect(refused).to_contain_text("has no repository tiny-org/no-such-repo")
            expect(refused).to_contain_text("Check the name")  # its next step
            # One quantisation of the repository.
            page.get_by_test_id("pull-name").fill("tiny-q4")
            page.get_by_test_id("pull-repo").fill("hf://tiny-org/tiny-GGUF")
            page.get_by_test_id("pull-include").fill("*Q4_K_M.gguf")
            page.get_by_test_id("pull-submit").click()
            row = page.get_by_test_id("pull-row").filter(has_text="tiny-q4")
            expect(row).to_have_attribute("data-state", "done", timeout=MOVED)
            bar = row.get_by_test_id("pull-progress")
            expect(bar).to_have_attribute("data-bytes-done", str(len(gguf)))
            expect(page.get_by_test_id("pull-error")).to_have_text("")
            card = page.get_by_test_id("model-card").filter(has_text="tiny-q4")
            expect(card).to_be_visible(timeout=MOVED)
            assert list(hub.served) == ["tiny-Q4_K_M.gguf"]  # the other quantisation: never
            expect(form.get_by_test_id("pull-name")).to_have_value("")  # the form was reset
