"""Every console page carries the strict headers and has no inline script or style.

Each page is fetched over HTTP as a signed-in browser would and parsed: no <script>
without src, no <style>, no style= or on*= attribute, no javascript: URL; every script
and stylesheet comes from /console/static/.
"""

from __future__ import annotations

import hashlib
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from modelforge_appliance.web.http import CONTENT_SECURITY_POLICY
from tests.harness.console_client import ConsoleClient, set_password

STATIC = Path(__file__).resolve().parents[2] / "appliance/modelforge_appliance/console/static"


class InlineFinder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.sources: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.problems.append(f"<{tag} {name}=…>")
            if name == "style":
                self.problems.append(f"<{tag} style=…>")
            if value and value.strip().lower().startswith("javascript:"):
                self.problems.append(f"<{tag} {name}=javascript:…>")
        if tag == "style":
            self.problems.append("<style>")
        if tag == "script":
            if not attributes.get("src"):
                self.problems.append("<script> without src")
            else:
                self.sources.append(attributes["src"])
            self._in_script = True
        if tag == "link" and attributes.get("rel") == "stylesheet":
            self.sources.append(attributes.get("href", ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.problems.append("<script> with a body")


def check_page(response) -> None:
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert (
        "script-src 'self'" in CONTENT_SECURITY_POLICY
        and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    )
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Referrer-Policy"] == "no-referrer"
    assert response.headers["Cache-Control"] == "no-store"
    finder = InlineFinder()
    finder.feed(response.text)
    assert finder.problems == [], f"{response.url}: {finder.problems}"
    assert all(src.startswith("/console/static/") for src in finder.sources), finder.sources


def test_every_page_has_the_strict_headers_and_no_inline_code(sqlite_control_plane):
    cp = sqlite_control_plane
    client = ConsoleClient(cp)
    unset = client.http.get(cp.url + "/console/sign-in", timeout=30)
    check_page(unset)
    set_password(cp)
    check_page(client.http.get(cp.url + "/console/sign-in", timeout=30))
    client.sign_in()
    node_id = cp.enroll(cp.mint()["token"]).json()["node_id"]
    pages = {
        "/console/": 200,
        f"/console/nodes/{node_id}": 200,
        "/console/nodes/no-such-node": 404,
    }
    for path, status in pages.items():
        response = client.http.get(cp.url + path, timeout=30)
        assert response.status_code == status, path
        check_page(response)
    # Errors, static files and the JSON API carry the same headers.
    for path in ("/console/static/console.js", "/nope", "/api/v1/admin/alerts"):
        answer = client.http.get(cp.url + path, timeout=30)
        assert answer.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY, path
        assert answer.headers["X-Content-Type-Options"] == "nosniff", path


def test_the_root_sends_browsers_to_the_console(sqlite_control_plane):
    cp = sqlite_control_plane
    client = ConsoleClient(cp)
    response = client.http.get(cp.url + "/", allow_redirects=False, timeout=30)
    assert response.status_code == 303 and response.headers["Location"] == "/console/"


def test_no_script_or_stylesheet_uses_inline_code_or_eval():
    for path in STATIC.glob("*.js"):
        text = path.read_text()
        for forbidden in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "eval(",
            "new Function",
            "document.write",
        ):
            assert forbidden not in text, f"{path.name} uses {forbidden}"
        for forbidden in ("localStorage", "sessionStorage", "indexedDB", "document.cookie"):
            assert forbidden not in text, f"{path.name} touches {forbidden}"


VENDORED = json.loads((STATIC / "vendor" / "VENDORED.json").read_text())["libraries"]


@pytest.mark.parametrize("library", VENDORED, ids=lambda library: library["name"])
def test_vendored_files_match_their_recorded_hashes(library):
    assert library["version"] and library["license"] and library["npm_tarball_sha512"]
    for name, record in library["files"].items():
        data = (STATIC / "vendor" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == record["sha256"], f"{name} changed"


def test_every_vendored_file_is_recorded():
    recorded = {name for library in VENDORED for name in library["files"]}
    on_disk = {path.name for path in (STATIC / "vendor").iterdir()} - {"VENDORED.json"}
    assert on_disk == recorded
