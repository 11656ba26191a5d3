"""Browser fixtures: Debian's chromium driven by Playwright, a fresh profile per test.

Every console message of type error (CSP violations among them) and every uncaught page
error fails the test that caused it. Screenshots go to the artefacts directory
($MF_TEST_ARTIFACTS, default tests/artifacts/).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.console_client import PASSWORD
from tests.harness.control_plane import clean_env, run_cli, serving

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("MF_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Browser:
    context: object  # playwright BrowserContext
    problems: list[str]

    def new_page(self):
        page = self.context.new_page()
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on("console", self._console)
        return page

    def _console(self, message) -> None:
        if message.type != "error":
            return
        url = (message.location or {}).get("url", "")
        # Refusals the page handles itself (a rejected entry, a wrong password) are logged by
        # Chromium as failed loads; anything else (CSP violations, script errors) is a failure.
        handled = "/api/v1/" in url or url.endswith(("/console/sign-in", "/console/sign-out"))
        if message.text.startswith("Failed to load resource") and handled:
            return
        self.problems.append(f"console {message.type}: {message.text} ({url})")

    def screenshot(self, page, name: str) -> Path:
        path = artifacts_dir() / f"{name}.png"
        page.screenshot(path=str(path), full_page=False)
        return path


@pytest.fixture
def browser(chromium_executable, tmp_path) -> Iterator[Browser]:
    """A headless chromium with a fresh user-data dir; fails the test on console errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=chromium_executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 860},
        )
        context.set_default_timeout(20_000)
        watcher = Browser(context, [])
        try:
            yield watcher
        finally:
            context.close()
    assert watcher.problems == [], "\n".join(watcher.problems)


def sign_in(page, url: str, password: str = PASSWORD) -> None:
    page.goto(url + "/console/")
    page.get_by_test_id("login-password").fill(password)
    page.get_by_test_id("login-submit").click()
    page.wait_for_url(url + "/console/")


@dataclass
class ServedProcess:
    """``modelforge serve`` as its own process, logging at DEBUG into a file."""

    url: str
    admin_token: str
    state_dir: Path
    log_path: Path
    process: subprocess.Popen


@contextlib.contextmanager
def served_process(tmp_path: Path) -> Iterator[ServedProcess]:
    state = tmp_path / "state"
    env = clean_env(MODELFORGE_STATE_DIR=str(state), MODELFORGE_LOG_LEVEL="DEBUG")
    admin_token = json.loads(run_cli("init", "--json", env=env, check=True).stdout)["admin_token"]
    run_cli("admin-password", "set", env=env, stdin=PASSWORD + "\n", check=True)
    log_path = tmp_path / "serve.log"
    with serving(env, log_path) as (url, process):
        yield ServedProcess(url, admin_token, state, log_path, process)
