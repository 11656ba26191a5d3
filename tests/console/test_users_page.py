"""The Users page in a real headless Chromium: an admin adds an operator, signs in as it (by
user name), and the operator's refused change shows ROLE_FORBIDDEN; the last admin cannot be
demoted; a user disabled from the page cannot sign in."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.harness.console_client import set_password
from tests.harness.control_plane import make_settings, serve

from .conftest import sign_in

pytestmark = pytest.mark.browser
PASSWORD = "a long enough password"


@pytest.fixture
def plane(tmp_path):
    with serve(make_settings(tmp_path / "state")) as cp:
        set_password(cp)
        yield cp


def sign_in_as(page, url: str, user: str, password: str) -> None:
    page.goto(url + "/console/sign-in")
    page.get_by_test_id("login-user").fill(user)
    page.get_by_test_id("login-password").fill(password)
    page.get_by_test_id("login-submit").click()


def test_add_an_operator_sign_in_as_it_and_see_what_its_role_may_not_do(browser, plane):
    cp = plane
    page = browser.new_page()
    sign_in(page, cp.url)
    page.locator("header nav").get_by_role("link", name="Users").click()
    page.wait_for_url(f"{cp.url}/console/users")
    expect(page.get_by_test_id("me")).to_have_text("admin")

    # The last admin keeps its role: the refusal is shown, nothing changes.
    admin_row = page.locator('[data-testid="user-row"][data-user="admin"]')
    admin_row.get_by_test_id("user-row-role").select_option("viewer")
    expect(page.get_by_test_id("users-error")).to_contain_text("last enabled admin")
    expect(admin_row).to_have_attribute("data-role", "admin")

    page.get_by_test_id("user-name").fill("alice")
    page.get_by_test_id("user-role").select_option("operator")
    page.get_by_test_id("user-password").fill(PASSWORD)
    page.get_by_test_id("user-submit").click()
    alice = page.locator('[data-testid="user-row"][data-user="alice"]')
    expect(alice).to_have_attribute("data-role", "operator")

    other = browser.context.browser.new_context().new_page()  # a browser of her own
    sign_in_as(other, cp.url, "alice", PASSWORD)
    other.wait_for_url(cp.url + "/console/")
    other.goto(cp.url + "/console/users")
    expect(other.get_by_test_id("me")).to_have_text("alice")
    own_row = other.locator('[data-testid="user-row"][data-user="alice"]')
    own_row.get_by_test_id("user-toggle").click()
    expect(other.get_by_test_id("users-error")).to_contain_text("users.write needs the role admin")

    # Disabled by the admin: alice's next sign-in is refused like a wrong password.
    alice.get_by_test_id("user-toggle").click()
    expect(alice).to_have_attribute("data-state", "disabled")
    third = browser.context.browser.new_context().new_page()
    sign_in_as(third, cp.url, "alice", PASSWORD)
    expect(third.get_by_test_id("login-error")).to_have_text("Wrong user name or password.")
