"""The Unraid template names only real settings, and its defaults start a control plane."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from modelforge_appliance.core.settings import KNOWN_NAMES, load_settings, parse_listen

from .conftest import ROOT

TEMPLATE = ROOT / "packaging" / "unraid" / "modelforge-control-plane.xml"


def template() -> ET.Element:
    # Our own file from the repository, not untrusted input.
    return ET.parse(TEMPLATE).getroot()  # noqa: S314


def configs() -> list[ET.Element]:
    return template().findall("Config")


def test_template_variables_are_known_settings_whose_defaults_validate():
    variables = {
        c.get("Target"): (c.text or c.get("Default") or "")
        for c in configs()
        if c.get("Type") == "Variable"
    }
    assert set(variables) <= KNOWN_NAMES, set(variables) - KNOWN_NAMES
    settings = load_settings({name: value for name, value in variables.items() if value})
    assert str(settings.state_dir) == "/var/lib/modelforge"


def test_template_maps_appdata_to_the_state_dir_and_the_listen_port():
    by_type: dict[str, list[ET.Element]] = {}
    for config in configs():
        by_type.setdefault(config.get("Type"), []).append(config)
    path, models = by_type["Path"]
    assert path.text == "/mnt/user/appdata/modelforge"
    # A models folder to import from, read-only, at the path the docs name.
    assert (models.get("Name"), models.get("Target"), models.get("Mode")) == (
        "Models",
        "/models",
        "ro",
    )
    assert (
        "modelforge models import qwen /models/"
        in (ROOT / "docs" / "install-unraid.md").read_text()
    )
    state_dir = next(c for c in by_type["Variable"] if c.get("Target") == "MODELFORGE_STATE_DIR")
    assert path.get("Target") == state_dir.text
    (port,) = by_type["Port"]
    listen = next(c for c in by_type["Variable"] if c.get("Target") == "MODELFORGE_LISTEN")
    assert int(port.get("Target")) == parse_listen(listen.text)[1]
    root = template()
    assert root.findtext("Name") == "modelforge-control-plane"
    assert "--cap-drop ALL" in root.findtext("ExtraParams")


def test_template_console_runs_a_program_the_image_has():
    # The image is chiselled (docs/architecture.md §7): no shell, so Unraid's Console entry (<Shell>)
    # runs the CLI itself, as every docker exec in docs/install-unraid.md does.
    shell = template().findtext("Shell")
    assert shell == "modelforge"
    assert (
        f"docker exec modelforge-control-plane {shell} "
        in (ROOT / "docs" / "install-unraid.md").read_text()
    )
