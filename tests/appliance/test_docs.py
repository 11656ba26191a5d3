"""docs/api.md documents every route and every error code the contract defines."""

from __future__ import annotations

import re
from pathlib import Path

import modelforge_contract as contract
from modelforge_appliance.api import make_app

from ..support import make_settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_route_is_documented(tmp_path):
    text = (ROOT / "docs" / "api.md").read_text()
    app = make_app(make_settings(tmp_path), store=_NoStore())
    for route in app.routes:
        documented = re.sub(r"<(\w+)(?::[^>]*)?>", r"{\1}", route.rule)
        assert f"`{route.method} {documented}`" in text, f"{route.method} {route.rule}"


def test_every_error_code_is_documented():
    text = (ROOT / "docs" / "api.md").read_text()
    codes = {
        value
        for name, value in vars(contract).items()
        if isinstance(value, str) and name.isupper() and value == name and "_" in name
    }
    codes -= {"TOO_OLD", "TOO_NEW", "COMPATIBLE", "UNKNOWN"}  # answers, not error codes
    codes -= {c for c in codes if c.startswith(("PATH_", "HEADER_", "KIND_"))}
    assert "CREDENTIAL_REVOKED" in codes
    missing = sorted(code for code in codes if f"`{code}`" not in text)
    assert missing == []


class _NoStore:
    """make_app only keeps the store for handlers; listing routes calls none."""

    clock = None


def test_readme_shows_console_screenshots_that_exist():
    text = (ROOT / "README.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\((docs/images/[^)]+\.png)\)", text)
    assert len(images) >= 2, images
    for image in images:
        data = (ROOT / image).read_bytes()
        assert data.startswith(b"\x89PNG"), image
    assert "docs/console.md" in text


def test_console_settings_and_routes_are_in_the_console_doc():
    text = (ROOT / "docs" / "console.md").read_text()
    for name in (
        "MODELFORGE_CONSOLE_SESSION_IDLE_SECONDS",
        "MODELFORGE_CONSOLE_SESSION_MAX_SECONDS",
        "MODELFORGE_TELEMETRY_RETENTION_SECONDS",
        "MODELFORGE_RELEASE_MANIFEST",
        "modelforge admin-password set",
        "--no-build --pull never",
    ):
        assert name in text, name
