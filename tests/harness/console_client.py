"""Shared parts of the console tests: a signed-in HTTP session, the admin password."""

from __future__ import annotations

import re

import requests

from modelforge_appliance.identity import sessions
from modelforge_appliance.store import audit
from modelforge_contract import HEADER_CSRF_TOKEN

from .control_plane import ControlPlane

PASSWORD = "correct horse battery staple"


def set_password(cp: ControlPlane, password: str = PASSWORD) -> None:
    sessions.set_admin_password(cp.store, password, audit.CLI_ACTOR)


def csrf_of(page_html: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', page_html)
    assert match, "the page carries no CSRF token"
    return match.group(1)


class ConsoleClient:
    """A requests session signed in the way the console's sign-in page does it."""

    def __init__(self, cp: ControlPlane, headers: dict[str, str] | None = None) -> None:
        self.cp = cp
        self.http = requests.Session()
        self.http.headers.update(headers or {})
        self.csrf = ""

    def sign_in(self, password: str = PASSWORD) -> requests.Response:
        response = self.http.post(
            self.cp.url + "/console/sign-in", json={"password": password}, timeout=30
        )
        if response.ok:
            self.csrf = csrf_of(self.http.get(self.cp.url + "/console/", timeout=30).text)
        return response

    def api(self, method: str, path: str, csrf: bool = True, **kwargs) -> requests.Response:
        headers = kwargs.pop("headers", {})
        if csrf:
            headers[HEADER_CSRF_TOKEN] = self.csrf
        return self.http.request(
            method, self.cp.url + "/api/v1" + path, headers=headers, timeout=30, **kwargs
        )
