"""The API keys page in a real headless Chromium, against a real control plane: a key minted
with limits (its secret shown once, then gone from the page), a refusal with its next step,
usage per key with the chart per day, and a revocation."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_appliance.relay.limits import UsageBook
from tests.harness.console_client import set_password
from tests.harness.control_plane import make_settings, serve

from .conftest import sign_in

pytestmark = pytest.mark.browser


@pytest.fixture
def plane(tmp_path):
    with serve(make_settings(tmp_path / "state")) as cp:
        set_password(cp)
        yield cp


def test_mint_a_limited_key_see_its_usage_per_day_and_revoke_it(browser, plane):
    cp = plane
    used, _ = create_api_key(cp.store, "batch job", "tests")
    book = UsageBook(cp.store)
    for _ in range(3):
        book.add(used["key_id"], "svc", prompt=10, completion=20)
    book.flush()

    page = browser.new_page()
    sign_in(page, cp.url)
    page.locator("header nav").get_by_role("link", name="API keys").click()
    page.wait_for_url(f"{cp.url}/console/keys")

    # What the key used, by key and on the chart of days.
    row = page.locator(f'[data-testid="usage-row"][data-key-id="{used["key_id"]}"]')
    expect(row.get_by_test_id("usage-requests")).to_have_text("3")
    expect(row.get_by_test_id("usage-prompt")).to_have_text("30")
    expect(row.get_by_test_id("usage-completion")).to_have_text("60")
    expect(page.get_by_test_id("usage-chart")).to_have_attribute("data-days", "1")
    assert page.locator("#usage-chart canvas").count() >= 1

    # A refusal says what is wrong and mints nothing.
    page.get_by_test_id("key-name").fill("kids' tablet")
    page.get_by_test_id("key-expires").fill("yesterday")
    page.get_by_test_id("key-submit").click()
    expect(page.get_by_test_id("key-form-error")).to_contain_text("neither a duration nor a date")
    expect(page.get_by_test_id("key-secret")).to_be_hidden()

    # Minted with limits: the secret once, the limits in its row.
    page.get_by_test_id("key-expires").fill("30d")
    page.get_by_test_id("key-deployments").fill("svc, chat")
    page.get_by_test_id("key-rpm").fill("5")
    page.get_by_test_id("key-tokens").fill("20000")
    page.get_by_test_id("key-submit").click()
    secret = page.get_by_test_id("key-secret-value")
    expect(page.get_by_test_id("key-secret")).to_be_visible()
    shown = secret.inner_text()
    assert shown.startswith("mfk_")
    key_id = shown.split("_")[1]
    minted = page.locator(f'[data-testid="key-row"][data-key-id="{key_id}"]')
    expect(minted.get_by_test_id("key-limits")).to_contain_text(
        "only svc, chat · 5/min · 20000 tokens/day"
    )
    page.get_by_test_id("key-secret-done").click()
    expect(page.get_by_test_id("key-secret")).to_be_hidden()
    assert shown not in page.content()  # the secret left the page

    # Revoked with a second click.
    minted.get_by_test_id("key-revoke").click()
    minted.get_by_test_id("key-revoke").click()
    expect(minted).to_have_attribute("data-state", "revoked")
    expect(page.get_by_test_id("keys-error")).to_have_text("")
