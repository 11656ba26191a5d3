"""The console's Work pages over HTTP, against a real control plane on a loopback port: the
strict headers and no inline code, sign-in before anything, the CSRF token on every action
the pages take, and nothing of an item's env values in what the server renders."""

from __future__ import annotations

from modelforge_contract import HEADER_CSRF_TOKEN, SESSION_COOKIE
from tests.harness.console_client import ConsoleClient, set_password
from tests.harness.control_plane import error_code
from tests.harness.scripted_node import WORK, WorkNode, item, submit

from .test_pages import check_page

SECRET = "s3cret-value-that-must-not-render"
CONTAINER = {
    "image": "registry.lan/job:1",
    "image_id": "sha256:" + "e" * 64,
    "env": {"API_TOKEN": SECRET},
}


def queued_count(cp) -> int:
    return sum(1 for entry in cp.admin("GET", WORK).json()["work"] if entry["state"] == "queued")


def test_the_work_pages_are_strict_shells_that_render_no_item_data(sqlite_control_plane):
    cp = sqlite_control_plane
    set_password(cp)
    client = ConsoleClient(cp)
    client.sign_in()
    work_id = submit(cp, "container", input=CONTAINER)["work_id"]
    pages = {
        "/console/work": 200,
        f"/console/work/{work_id}": 200,
        "/console/work/no-such-item": 404,
        "/console/work/%3Cscript%3Ealert(1)%3C%2Fscript%3E": 404,
    }
    for path, status in pages.items():
        response = client.http.get(cp.url + path, timeout=30)
        assert response.status_code == status, path
        check_page(response)
        assert SECRET not in response.text, path
        assert "<script>alert" not in response.text, path
    listing = client.http.get(cp.url + "/console/work", timeout=30).text
    assert '<a href="/console/work">Work</a>' in listing  # in the navigation
    for state in ("queued", "leased", "succeeded", "failed", "cancelled"):
        assert f'<option value="{state}">' in listing
    detail = client.http.get(cp.url + f"/console/work/{work_id}", timeout=30).text
    assert f'data-work-id="{work_id}"' in detail
    missing = client.http.get(cp.url + "/console/work/%3Cb%3Ex", timeout=30).text
    assert "There is no work item &lt;b&gt;x." in missing


def test_without_a_session_the_work_pages_send_to_sign_in_and_the_api_refuses(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    set_password(cp)
    work_id = submit(cp)["work_id"]
    signed_out = ConsoleClient(cp)
    signed_out.sign_in()
    cookie = signed_out.http.cookies.get(SESSION_COOKIE)
    csrf = signed_out.csrf
    assert signed_out.http.post(
        cp.url + "/console/sign-out", headers={HEADER_CSRF_TOKEN: csrf}, timeout=30
    ).ok
    for cookies in ({}, {SESSION_COOKIE: cookie}):
        stranger = ConsoleClient(cp)
        stranger.http.cookies.update(cookies)
        stranger.csrf = csrf
        for path in ("/console/work", f"/console/work/{work_id}"):
            page = stranger.http.get(cp.url + path, allow_redirects=False, timeout=30)
            assert page.status_code == 303, (path, cookies)
            assert page.headers["Location"] == "/console/sign-in"
        assert stranger.api("GET", "/admin/work").status_code == 401
        refused = stranger.api("POST", "/admin/work", json={"capability": "smoke"})
        assert refused.status_code == 401, refused.text
        assert stranger.api("POST", f"/admin/work/{work_id}/cancel").status_code == 401
    assert item(cp, work_id)["state"] == "queued"
    assert queued_count(cp) == 1


def test_the_work_pages_actions_need_the_sessions_csrf_token(sqlite_control_plane):
    """The Work page submits and cancels through /api/v1/admin/work with the session cookie:
    without the page's CSRF token, or with another session's, nothing changes (403)."""
    cp = sqlite_control_plane
    set_password(cp)
    node = WorkNode(cp, "gpu-csrf")
    client, other = ConsoleClient(cp), ConsoleClient(cp)
    client.sign_in(), other.sign_in()
    assert client.csrf != other.csrf
    body = {"capability": "smoke", "constraints": {"node_ids": [node.node_id]}}
    for headers in ({}, {HEADER_CSRF_TOKEN: other.csrf}, {HEADER_CSRF_TOKEN: "0" * 64}):
        refused = client.api("POST", "/admin/work", csrf=False, headers=headers, json=body)
        assert (refused.status_code, error_code(refused)) == (403, "CSRF_TOKEN_INVALID")
    assert cp.admin("GET", WORK).json()["work"] == []

    submitted = client.api("POST", "/admin/work", json=body)
    assert submitted.status_code == 201, submitted.text
    work_id = submitted.json()["work_id"]
    assert submitted.json()["created_by"].startswith("console:")
    for headers in ({}, {HEADER_CSRF_TOKEN: other.csrf}):
        path = f"/admin/work/{work_id}/cancel"
        refused = client.api("POST", path, csrf=False, headers=headers)
        assert (refused.status_code, error_code(refused)) == (403, "CSRF_TOKEN_INVALID")
        assert item(cp, work_id)["state"] == "queued"
    # Reading needs no token; cancelling with it works.
    assert client.api("GET", f"/admin/work/{work_id}", csrf=False).status_code == 200
    cancelled = client.api("POST", f"/admin/work/{work_id}/cancel")
    assert (cancelled.status_code, cancelled.json()["state"]) == (200, "cancelled")
