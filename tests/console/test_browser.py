"""The console in a real headless Chromium against a real control plane on a loopback port."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from playwright.sync_api import expect

from modelforge_appliance.fleet.node_agent_image import RECREATE_COMMAND
from modelforge_appliance.fleet.telemetry import TelemetryHistory
from modelforge_appliance.identity.enrollment import WORKER_SOCKET, worker_command
from modelforge_appliance.identity.join_commands import INSTALL_TYPES, checkout_worker_command
from modelforge_contract import READINESS_CHECKS, __version__
from tests.harness.agent_process import wait_until
from tests.harness.console_client import PASSWORD, set_password
from tests.harness.control_plane import make_settings, serve
from tests.harness.manifest_entries import sample_config
from tests.harness.seeded_fleet import add_nodes, add_telemetry_hour

from .conftest import CHROMIUM_ARGS, artifacts_dir, served_process, sign_in

pytestmark = pytest.mark.browser

STORAGE_DUMP = """async () => {
  const dump = (s) => Object.keys(s).map((k) => `${k}=${s.getItem(k)}`).join("\\n");
  const databases = indexedDB.databases ? await indexedDB.databases() : [];
  const fields = [...document.querySelectorAll("input, textarea, select")].map((f) => f.value);
  return {
    local: dump(localStorage),
    session: dump(sessionStorage),
    indexeddb: JSON.stringify(databases),
    cookie: document.cookie,
    url: location.href,
    text: document.body.innerText,
    fields: fields.join("\\n"),
  };
}"""


def assert_token_gone_from_browser(page, context, token: str, urls: list[str]) -> None:
    assert token not in page.content()
    found = page.evaluate(STORAGE_DUMP)
    for place, content in found.items():
        assert token not in content, f"the token is still in {place}"
    assert found["indexeddb"] == "[]" and found["local"] == "" and found["session"] == ""
    assert all(token not in cookie["value"] for cookie in context.cookies())
    assert all(token not in url for url in urls), "the token reached a URL"
    history_length = page.evaluate("history.length")
    assert history_length <= len(urls) + 1


def watch_urls(page) -> list[str]:
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    page.on("framenavigated", lambda frame: urls.append(frame.url))
    return urls


def open_wizard_and_mint(
    page, name: str = "GPU Node", expiry: str = "900", mode: str = "cpu"
) -> str:
    page.get_by_test_id("enroll-open").click()
    page.get_by_test_id("enroll-name").fill(name)
    page.get_by_test_id("enroll-expiry").select_option(expiry)
    page.get_by_test_id("enroll-accelerator").select_option(mode)
    page.get_by_test_id("enroll-submit").click()
    page.get_by_test_id("enroll-reveal").click()
    token = page.get_by_test_id("enroll-token").text_content()
    assert token.startswith("mfe_"), token
    page.get_by_test_id("enroll-reveal").click()  # hidden again
    assert page.get_by_test_id("enroll-token").text_content() != token
    return token


def agent_on_path(tmp_path: Path) -> Path:
    """The node's `modelforge-node-agent` and `modelforge-runtime-worker` commands: the real
    agent and worker, as a checkout runs them."""
    bin_dir = tmp_path / "node-bin"
    bin_dir.mkdir()
    for name, module in (
        ("modelforge-node-agent", "modelforge_node_agent.main"),
        ("modelforge-runtime-worker", "modelforge_worker"),
    ):
        command = bin_dir / name
        command.write_text(f'#!/bin/sh\nexec {sys.executable} -m {module} "$@"\n')
        command.chmod(0o755)
    return bin_dir


def test_the_wizard_enrolls_a_real_agent_and_the_token_is_left_nowhere(browser, tmp_path):
    with served_process(tmp_path) as served:
        page = browser.new_page()
        urls = watch_urls(page)
        sign_in(page, served.url)
        page.get_by_test_id("enroll-open").click()
        assert page.get_by_test_id("enroll-origin").text_content() == served.url
        assert "production_eligible=false" in page.get_by_test_id("enroll-dialog").inner_text()
        options = (
            page.get_by_test_id("enroll-expiry")
            .locator("option")
            .evaluate_all("(options) => options.map((o) => o.value)")
        )
        assert options == ["300", "900", "3600", "86400"]
        browser.screenshot(page, "wizard-1-token")
        page.get_by_test_id("enroll-close").click()

        token = open_wizard_and_mint(page, name="Rack 3 GPU")
        env_file = page.get_by_test_id("enroll-env").text_content()
        start_command = page.get_by_test_id("enroll-start-command").text_content()
        assert token not in env_file and token not in start_command
        assert "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu" in env_file
        browser.screenshot(page, "wizard-2-settings")

        page.locator('[data-step-button="image"]').click()
        entry = {
            "tag": f"modelforge-node-agent:{__version__}",
            "architecture": "amd64",
            "os": "linux",
            "rootfs_layers": ["sha256:" + "a" * 64],
            "labels": {
                "org.opencontainers.image.title": "modelforge-node-agent",
                "org.opencontainers.image.version": __version__,
                "org.opencontainers.image.revision": "0" * 40,
                "org.opencontainers.image.created": "2026-11-29T00:00:00Z",
                "org.opencontainers.image.source": "https://modelforge.invalid/source",
                "org.opencontainers.image.licenses": "Apache-2.0",
                "io.modelforge.agent-protocol": "1",
            },
            "config": sample_config(),
            "image_id": "sha256:" + "f" * 64,
        }
        page.get_by_test_id("manifest-entry").fill(json.dumps(entry, indent=2))
        page.get_by_test_id("manifest-check").click()
        page.get_by_test_id("manifest-result").locator("[data-accepted]").wait_for()
        browser.screenshot(page, "wizard-3-image")

        # The node: real bash runs the wizard's worker command and start command beside its
        # env file. The env file's host paths (state directory, worker socket) are changed for
        # this unprivileged test, in the env file and the worker command alike.
        node_dir = tmp_path / "node"
        node_dir.mkdir()
        state = tmp_path / "agent-state"
        socket_path = tmp_path / "worker.sock"
        (node_dir / "modelforge-node.env").write_text(
            env_file.replace(
                "MODELFORGE_AGENT_STATE_VOLUME=/var/lib/modelforge-node-agent",
                f"MODELFORGE_AGENT_STATE_VOLUME={state}",
            ).replace(WORKER_SOCKET, str(socket_path))
        )
        assert (
            f"MODELFORGE_AGENT_WORKER_SOCKET={socket_path}"
            in (node_dir / "modelforge-node.env").read_text()
        )
        wizard_worker = page.get_by_test_id("enroll-worker-command").text_content()
        assert wizard_worker.count(WORKER_SOCKET) == 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "NVIDIA_"))}
        env["PATH"] = f"{agent_on_path(tmp_path)}:{env['PATH']}"
        agent_log = tmp_path / "agent.log"
        worker_log = tmp_path / "worker.log"
        with agent_log.open("w") as log, worker_log.open("w") as wlog:
            worker = subprocess.Popen(
                ["bash", "-c", wizard_worker.replace(WORKER_SOCKET, str(socket_path))],
                cwd=node_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=wlog,
                stderr=subprocess.STDOUT,
            )
            agent = subprocess.Popen(
                ["bash", "-c", start_command],
                cwd=node_dir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                agent.stdin.write(token + "\n")
                agent.stdin.close()
                admin = {"X-ModelForge-Admin-Token": served.admin_token}

                def online_node():
                    fleet = requests.get(
                        f"{served.url}/api/v1/admin/hardware/nodes", headers=admin, timeout=10
                    ).json()["nodes"]
                    ready = [n for n in fleet if n["liveness"] == "online" and n["inventory_at"]]
                    return ready[0] if ready else None

                node = wait_until(
                    online_node, timeout=60, what=f"the agent to enroll ({agent_log})"
                )
                assert node["display_name"] == "Rack 3 GPU" and node["production_eligible"] is False

                def ready():
                    readiness = requests.get(
                        f"{served.url}/api/v1/admin/hardware/nodes/{node['node_id']}/readiness",
                        headers=admin,
                        timeout=10,
                    ).json()
                    return readiness if readiness["ready"] else None

                wait_until(ready, timeout=60, what=f"READY ({agent_log}, {worker_log})")

                page.locator('[data-step-button="readiness"]').click()
                page.get_by_test_id("enroll-readiness").click()
                result = page.get_by_test_id("readiness-result")
                result.locator("[data-node-id]").wait_for()
                assert (
                    result.locator("[data-node-id]").get_attribute("data-node-id")
                    == node["node_id"]
                )
                names = result.locator("[data-check]").evaluate_all(
                    "(items) => items.map((i) => i.getAttribute('data-check'))"
                )
                assert names == list(READINESS_CHECKS)
                assert "is ready." in result.inner_text()
                assert result.locator('[data-check="worker"].ok').count() == 1
                assert page.get_by_test_id("enroll-recreate").is_visible()
                assert RECREATE_COMMAND in page.get_by_test_id("enroll-recreate").inner_text()
                browser.screenshot(page, "wizard-4-readiness")
                assert_token_gone_from_browser(
                    page, browser.context, token, urls
                )  # readiness cleared it

                page.get_by_test_id("enroll-close").click()
                assert_token_gone_from_browser(page, browser.context, token, urls)
                page.locator(
                    f'[data-testid="node-row"][data-node-id="{node["node_id"]}"]'
                ).wait_for()
            finally:
                for process in (agent, worker):
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
                        process.wait(timeout=15)
        assert token not in agent_log.read_text() + worker_log.read_text()
    # After the control plane stopped: neither its log nor its store holds the token.
    places = {"server log": served.log_path.read_bytes()}
    places |= {p.name: p.read_bytes() for p in served.state_dir.iterdir() if p.is_file()}
    assert "modelforge.sqlite3" in places
    for name, content in places.items():
        assert token.encode() not in content, f"the token is in {name}"
        assert token.split("_", 2)[2].encode() not in content, (
            f"the token's secret part is in {name}"
        )


def assert_token_gone_from_server(cp, caplog, token: str) -> None:
    """Neither the control plane's log (captured at DEBUG) nor its SQLite files hold it."""
    cp.heartbeats.flush()
    assert token not in caplog.text and token.split("_", 2)[2] not in caplog.text
    state = Path(cp.store.sqlite_path).parent
    for path in state.iterdir():
        if path.is_file():
            data = path.read_bytes()
            assert token.split("_", 2)[2].encode() not in data, f"the token is in {path.name}"


def test_revoking_the_unused_token_clears_it(browser, sqlite_control_plane, caplog):
    caplog.set_level(logging.DEBUG)
    cp = sqlite_control_plane
    set_password(cp)
    page = browser.new_page()
    urls = watch_urls(page)
    sign_in(page, cp.url)
    token = open_wizard_and_mint(page)
    page.get_by_test_id("enroll-revoke").click()
    expect(page.get_by_test_id("enroll-token")).to_have_attribute("data-cleared", "revoked")
    assert_token_gone_from_browser(page, browser.context, token, urls)
    [row] = cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]
    assert row["state"] == "revoked"
    assert cp.enroll(token).status_code == 410
    assert_token_gone_from_server(cp, caplog, token)


def test_checking_readiness_before_the_agent_enrolled_keeps_the_token(
    browser, sqlite_control_plane
):
    """Pressing Check too early must not cost the operator the token: it stays while the
    enrollment is pending, and goes once a node has enrolled with it."""
    cp = sqlite_control_plane
    set_password(cp)
    page = browser.new_page()
    sign_in(page, cp.url)
    token = open_wizard_and_mint(page)
    page.locator('[data-step-button="readiness"]').click()
    page.get_by_test_id("enroll-readiness").click()
    result = page.get_by_test_id("readiness-result")
    result.locator('[data-enrollment-state="pending"]').wait_for()
    assert page.get_by_test_id("enroll-token").get_attribute("data-cleared") is None
    page.locator('[data-step-button="settings"]').click()
    page.get_by_test_id("enroll-reveal").click()
    assert page.get_by_test_id("enroll-token").text_content() == token  # still there
    page.get_by_test_id("enroll-reveal").click()

    assert cp.enroll(token).status_code == 201  # a node enrolls with it
    page.locator('[data-step-button="readiness"]').click()
    page.get_by_test_id("enroll-readiness").click()
    result.locator("[data-node-id]").wait_for()
    expect(page.get_by_test_id("enroll-token")).to_have_attribute("data-cleared", "readiness")
    assert token not in page.content()


def test_reaching_the_expiry_clears_the_token(browser, sqlite_control_plane, caplog):
    caplog.set_level(logging.DEBUG)
    cp = sqlite_control_plane
    set_password(cp)
    page = browser.new_page()
    page.clock.install()  # the page's timers move only when the test says so
    urls = watch_urls(page)
    sign_in(page, cp.url)
    token = open_wizard_and_mint(page, expiry="300")
    page.get_by_test_id("enroll-reveal").click()
    page.clock.run_for(299_000)
    assert page.get_by_test_id("enroll-token").text_content() == token  # not yet
    page.clock.run_for(2_000)
    assert page.get_by_test_id("enroll-countdown").text_content() == "expired"
    assert_token_gone_from_browser(page, browser.context, token, urls)
    assert_token_gone_from_server(cp, caplog, token)


def test_pasted_manifest_entries_are_checked_field_by_field(browser, tmp_path):
    release = "1.3.0-rc.1"
    expected = {
        "tag": f"modelforge-node-agent:{release}",
        "architecture": "amd64",
        "os": "linux",
        "rootfs_layers": ["sha256:" + "1" * 64, "sha256:" + "2" * 64],
        "labels": {
            "org.opencontainers.image.title": "modelforge-node-agent",
            "org.opencontainers.image.version": release,
            "org.opencontainers.image.revision": "a" * 40,
            "org.opencontainers.image.created": "2026-11-01T00:00:00Z",
            "org.opencontainers.image.source": "https://modelforge.invalid/source",
            "org.opencontainers.image.licenses": "Apache-2.0",
            "io.modelforge.agent-protocol": "1",
        },
        "config": sample_config(),
        "image_id": "sha256:" + "3" * 64,
    }
    manifest = tmp_path / f"modelforge-{release}-manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "schema": 2,
                "version": release,
                "revision": "a" * 40,
                "created": "2026-11-01T00:00:00Z",
                "images": {"modelforge-node-agent": expected},
            }
        )
    )
    settings = replace(make_settings(tmp_path / "state"), release_manifest=manifest)
    with serve(settings) as cp:
        set_password(cp)
        page = browser.new_page()
        sign_in(page, cp.url)
        open_wizard_and_mint(page)
        page.locator('[data-step-button="image"]').click()

        def check(entry: dict) -> str:
            page.get_by_test_id("manifest-entry").fill(json.dumps(entry))
            page.get_by_test_id("manifest-check").click()
            result = page.get_by_test_id("manifest-result")
            result.locator("p").first.wait_for()
            return result.inner_text()

        wrong_tag = {**expected, "tag": "modelforge-node-agent:1.3.0"}
        missing_label = {
            **expected,
            "labels": {k: v for k, v in expected["labels"].items() if "licenses" not in k},
        }
        changed_layer = {
            **expected,
            "rootfs_layers": [expected["rootfs_layers"][0], "sha256:" + "9" * 64],
        }
        wrong_arch = {**expected, "architecture": "arm64"}
        root_user = {**expected, "config": {**expected["config"], "User": "0:0"}}
        for entry, field in (
            (root_user, "config.User"),
            (wrong_tag, "tag"),
            (missing_label, "labels.org.opencontainers.image.licenses"),
            (changed_layer, "rootfs_layers[1]"),
            (wrong_arch, "architecture"),
        ):
            text = check(entry)
            assert "Rejected" in text and field in text, (field, text)
            assert (
                page.get_by_test_id("manifest-result").locator(f'[data-field="{field}"]').count()
                == 1
            )
        assert "Not JSON" in check_raw(page, "{not json")
        text = check({**expected, "image_id": "sha256:" + "4" * 64})
        assert "Accepted" in text and "image_id ignored" in text
        script = page.locator('[data-command="start_script"]').text_content()
        assert f"image=modelforge-node-agent:{release}\n" in script
        assert "no_pull=(--pull never)" in script
        # The wizard sent the mode it minted with (cpu): the CPU worker, no GPUs reserved.
        compose = page.locator('[data-command="compose_file"]').text_content()
        assert f"image: modelforge-runtime-worker-cpu:{release}\n" in compose
        assert "driver: nvidia" not in compose


def check_raw(page, text: str) -> str:
    page.get_by_test_id("manifest-entry").fill(text)
    page.get_by_test_id("manifest-check").click()
    return page.get_by_test_id("manifest-result").inner_text()


def test_sign_in_wrong_password_throttling_expiry_and_sign_out(
    browser, clocked_control_plane, clock
):
    cp = clocked_control_plane
    page = browser.new_page()
    page.goto(cp.url + "/console/")
    assert page.get_by_test_id("password-unset").is_visible()
    assert "modelforge admin-password set" in page.content()
    set_password(cp)
    page.reload()
    browser.screenshot(page, "sign-in")
    for attempt in range(5):
        page.get_by_test_id("login-password").fill(f"wrong password {attempt}")
        page.get_by_test_id("login-submit").click()
        page.get_by_test_id("login-error").filter(
            has_text="Wrong user name or password."
        ).wait_for()
        page.evaluate("document.getElementById('sign-in-error').textContent = ''")
    page.get_by_test_id("login-password").fill(PASSWORD)
    page.get_by_test_id("login-submit").click()
    page.get_by_test_id("login-error").filter(has_text="too many failed sign-ins").wait_for()
    clock.advance(30)
    sign_in(page, cp.url)
    assert page.get_by_test_id("logout").is_visible()

    # The session expires while the page is open: its next refresh goes to the sign-in page.
    clock.advance(cp.settings.session_idle_seconds + 1)
    page.wait_for_url(cp.url + "/console/sign-in", timeout=30_000)

    sign_in(page, cp.url)
    page.get_by_test_id("logout").click()
    page.wait_for_url(cp.url + "/console/sign-in")
    page.goto(cp.url + "/console/")
    assert page.url == cp.url + "/console/sign-in"
    assert page.context.cookies() == [] or all(c["value"] == "" for c in page.context.cookies())


def test_the_hardware_page_renders_and_refreshes_1000_nodes(browser, sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    node_ids = add_nodes(cp.store, 1000)
    page = browser.new_page()
    sign_in(page, cp.url)
    rows = page.get_by_test_id("node-row")
    expect(rows).to_have_count(1000)
    first = page.evaluate("({...document.body.dataset})")
    assert rows.nth(0).get_attribute("data-node-id") == node_ids[0]
    assert page.get_by_test_id("alert").count() > 0  # stale and offline nodes raise alerts
    browser.screenshot(page, "hardware-1000-nodes")

    # A change on the control plane shows up in place, without a reload.
    page.evaluate("window.__sameDocument = true")
    target = node_ids[500]
    row = page.locator(f'[data-testid="node-row"][data-node-id="{target}"]')
    assert row.locator('[data-field="cordoned"]').text_content() == "no"
    assert cp.admin("POST", f"/api/v1/admin/hardware/nodes/{target}/cordon").status_code == 200
    # The next periodic refresh (every few seconds) brings it, in place.
    expect(row.locator('[data-field="cordoned"]')).to_have_text("yes", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    assert rows.count() == 1000
    # Measured, not asserted (bench/console.py reports them on a quiet machine).
    later = page.evaluate("({...document.body.dataset})")
    (artifacts_dir() / "hardware-1000-nodes.json").write_text(
        json.dumps({"nodes": 1000, "first": first, "later": later}, indent=1)
    )


def test_a_node_page_shows_charts_and_runs_its_actions(browser, tmp_path):
    from modelforge_appliance.core.clock import ManualClock

    clock = ManualClock(time.time())
    settings = make_settings(tmp_path / "state")
    with serve(settings, clock) as cp:
        set_password(cp)
        [node_id] = add_nodes(cp.store, 1, gpus=4)
        add_telemetry_hour(TelemetryHistory(cp.store, settings), clock, node_id, gpus=4)
        page = browser.new_page()
        sign_in(page, cp.url)
        page.get_by_test_id("node-row").first.locator("a").click()
        page.wait_for_url(f"{cp.url}/console/nodes/{node_id}")
        expect(page.get_by_test_id("node-charts")).to_have_attribute("data-charted-gpus", "4")
        assert page.locator("#charts canvas").count() == 16  # 4 GPUs × 4 metrics
        assert page.get_by_test_id("node-readiness").locator("[data-check]").count() == len(
            READINESS_CHECKS
        )
        browser.screenshot(page, "node-page")
        page.get_by_test_id("node-charts").locator(".gpu").first.scroll_into_view_if_needed()
        browser.screenshot(page, "node-page-charts")

        # The first node of the test fleet starts cordoned.
        page.get_by_test_id("node-uncordon").click()
        expect(page.get_by_test_id("node-cordon")).to_be_enabled()
        page.get_by_test_id("node-cordon").click()
        expect(page.get_by_test_id("node-uncordon")).to_be_enabled()
        page.get_by_test_id("decommission-preview").click()
        effects = page.get_by_test_id("decommission-effects")
        effects.filter(has_text="free hostname gpu-0000").wait_for()
        page.get_by_test_id("decommission-execute").click()
        page.get_by_test_id("node-liveness").filter(has_text="decommissioned").wait_for()
        audit = page.get_by_test_id("node-audit")
        audit.filter(has_text="node.decommissioned").wait_for()
        assert "node.cordoned" in audit.inner_text() and "node.uncordoned" in audit.inner_text()
        node = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node_id}").json()
        assert node["liveness"] == "decommissioned"


def test_the_wizard_shows_every_command_field_the_mint_answer_carries(
    browser, sqlite_control_plane
):
    """Another part of the house adds install-specific commands to the mint answer
    (``join_commands``); the wizard renders whatever it finds, without knowing their count."""
    cp = sqlite_control_plane
    set_password(cp)
    page = browser.new_page()
    extra = {
        "join_commands": [
            {
                "install_type": "agent pyz under systemd",
                "command": "sudo modelforge-node-agent join",
            },
            {"install_type": "checkout", "command": "scripts/run-agent join"},
            {
                "install_type": "container",
                "command": "docker run --rm -it modelforge-node-agent join",
            },
        ],
        "doctor_command": "modelforge-node-agent --preflight",
    }

    def add_fields(route):
        answer = route.fetch()
        body = answer.json()
        route.fulfill(response=answer, json={**body, **extra})

    page.route("**/api/v1/admin/node-enrollments", add_fields)
    sign_in(page, cp.url)
    open_wizard_and_mint(page)
    blocks = page.get_by_test_id("enroll-command")
    expect(blocks).to_have_count(5)  # and the real answer's checkout worker command
    text = page.get_by_test_id("enroll-more-commands").inner_text()
    for item in extra["join_commands"]:
        assert item["install_type"] in text and item["command"] in text
    assert "modelforge-node-agent --preflight" in text
    assert "Doctor command" in text  # a key without a title, as words
    page.get_by_test_id("enroll-close").click()
    expect(blocks).to_have_count(0)


def test_the_wizard_shows_the_real_join_commands_for_the_chosen_mode(browser, sqlite_control_plane):
    """The mint answer's own join_commands (one per install type) render as command blocks,
    for the accelerator mode chosen in the wizard, and none of them holds the token."""
    cp = sqlite_control_plane
    set_password(cp)
    page = browser.new_page()
    sign_in(page, cp.url)
    token = open_wizard_and_mint(page, mode="cpu")
    blocks = page.get_by_test_id("enroll-command")
    expect(blocks).to_have_count(4)
    titles = blocks.locator("h3").all_text_contents()
    assert titles == [
        f"Join command: {INSTALL_TYPES[kind]}" for kind in ("systemd", "checkout", "container")
    ] + ["Runtime Worker for the checkout's join command (start it first)"]
    text = page.get_by_test_id("enroll-more-commands").inner_text()
    assert "join commands" not in text.lower()  # no raw keys
    assert text.count(f"join {cp.url} --accelerator cpu --token-file -") == 3
    assert checkout_worker_command("cpu") in text
    assert "--gpus" not in text and token not in text
    env_file = page.get_by_test_id("enroll-env").text_content()
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu" in env_file
    # The worker for the start command, on the socket the env file gives the agent.
    worker = page.get_by_test_id("enroll-worker-command").text_content()
    assert worker == worker_command("cpu")
    assert f"MODELFORGE_AGENT_WORKER_SOCKET={WORKER_SOCKET}" in env_file
    page.get_by_test_id("enroll-close").click()
    expect(blocks).to_have_count(0)


def test_sign_in_works_with_javascript_off_and_never_puts_the_password_in_a_url(
    chromium_executable, sqlite_control_plane
):
    """With JavaScript off (or sign_in.js failing to load) the form was submitted as a GET,
    ?password=… landing in the proxy's access log. The page has no script now: the form
    posts itself."""
    from playwright.sync_api import sync_playwright

    cp = sqlite_control_plane
    set_password(cp)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=chromium_executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = chromium.new_context(java_script_enabled=False)
            page = context.new_page()
            sent = []
            page.on("request", lambda request: sent.append((request.method, request.url)))
            page.goto(cp.url + "/console/")
            page.get_by_test_id("login-password").fill("not the password")
            page.get_by_test_id("login-submit").click()
            page.get_by_test_id("login-error").filter(
                has_text="Wrong user name or password."
            ).wait_for()
            page.get_by_test_id("login-password").fill(PASSWORD)
            page.get_by_test_id("login-submit").click()
            page.wait_for_url(cp.url + "/console/")
            assert page.get_by_test_id("login-password").count() == 0
        finally:
            chromium.close()
    posts = [url for method, url in sent if method == "POST"]
    assert posts == [cp.url + "/console/sign-in"] * 2
    assert not [url for _, url in sent if "password" in url.split("/console/")[-1]]
