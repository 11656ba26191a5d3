"""Look-alike names are caught (issue 21).

Tried with enrollment tokens, hostnames with a zero-width space, a soft hyphen, a
non-breaking hyphen (U+2011) or a Cyrillic ``о`` were accepted beside ``gpu-node-01``, read
exactly like it in the console, and raised no ``hostname_conflict``. Now names refuse format
characters like control characters (a field-named 400, nothing stored), and hostnames and
display names are compared after confusable folding (core/lookalike.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from modelforge_appliance.core.lookalike import lookalike_key, skeleton
from modelforge_appliance.store.tables import Node
from modelforge_contract import FIELD_TYPE
from tests.harness.control_plane import error_code, new_identity, run_cli, store_env

BASE = "gpu-node-01"
# The reviewer's four look-alikes of BASE.
LOOKALIKES = {
    "zero-width space": "gpu\u200b-node-01",
    "soft hyphen": "gpu-\u00adnode-01",
    "non-breaking hyphen": "gpu\u2011node-01",
    "cyrillic o": "gpu-n\u043ede-01",
}
REFUSED = {"zero-width space", "soft hyphen"}  # format characters (category Cf)
FORMAT_CHARACTERS = {
    "zero-width space": "\u200b",
    "soft hyphen": "\u00ad",
    "zero-width joiner": "\u200d",
    "word joiner": "\u2060",
    "byte order mark": "\ufeff",
    "left-to-right isolate": "\u2066",
    "line separator": "\u2028",
}


def enroll(cp, hostname: str, name: str = "GPU Node"):
    return cp.enroll(cp.mint(name)["token"], hostname=hostname, identity=new_identity())


def conflicts(cp) -> list[dict]:
    every = cp.admin("GET", "/api/v1/admin/alerts").json()["alerts"]
    return [alert for alert in every if alert["kind"] == "hostname_conflict"]


def node_count(cp) -> int:
    return len(cp.admin("GET", "/api/v1/admin/hardware/nodes").json()["nodes"])


VENDOR = Path(__file__).resolve().parents[2] / "appliance/modelforge_appliance/core/vendor"


def test_the_confusables_data_is_unicodes_file_as_recorded():
    [library] = json.loads((VENDOR / "VENDORED.json").read_text())["libraries"]
    assert set(library["files"]) == {p.name for p in VENDOR.iterdir()} - {"VENDORED.json"}
    for name, record in library["files"].items():
        data = (VENDOR / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == record["sha256"], f"{name} changed"
    assert b"# Version: 13.0.0" in (VENDOR / "confusables.txt").read_bytes()[:400]


def test_the_skeleton_folds_what_the_reviewer_used_and_keeps_other_names_apart():
    for variant in LOOKALIKES.values():
        assert lookalike_key(variant) == lookalike_key(BASE), ascii(variant)
    assert skeleton("\u2010") == "-"  # U+2011 is U+2010 after NFKC, whose prototype is '-'
    assert lookalike_key("GPU-NODE-01") == lookalike_key("ｇｐｕ-node-0l") == lookalike_key(BASE)
    for other in ("gpu-node-02", "gpu-node-1", "gpu-nodes-01", "gpu-node-01.lan"):
        assert lookalike_key(other) != lookalike_key(BASE), other


@pytest.mark.parametrize("character", FORMAT_CHARACTERS, ids=list(FORMAT_CHARACTERS))
def test_format_characters_in_names_are_refused_naming_the_field(control_plane, character):
    cp = control_plane
    char = FORMAT_CHARACTERS[character]
    minted = cp.mint("GPU Node")
    refused = cp.enroll(minted["token"], hostname=f"gpu{char}-01", identity=new_identity())
    assert refused.status_code == 400 and error_code(refused) == FIELD_TYPE
    message = refused.json()["error"]["message"]
    assert message.startswith("hostname:") and f"U+{ord(char):04X}" in message
    assert node_count(cp) == 0  # nothing stored: the token still enrolls a node
    states = {
        e["enrollment_id"]: e["state"]
        for e in cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]
    }
    assert states[minted["enrollment_id"]] == "pending"
    before = len(states)
    named = cp.admin(
        "POST",
        "/api/v1/admin/node-enrollments",
        json={"display_name": f"Rack{char} 1", "expires_in_seconds": 900},
    )
    assert named.status_code == 400 and error_code(named) == FIELD_TYPE
    assert named.json()["error"]["message"].startswith("display_name:")
    after = cp.admin("GET", "/api/v1/admin/node-enrollments").json()["enrollments"]
    assert len(after) == before


@pytest.mark.parametrize("variant", LOOKALIKES, ids=list(LOOKALIKES))
def test_lookalike_hostnames_raise_hostname_conflict(control_plane, variant):
    cp = control_plane
    hostname = LOOKALIKES[variant]
    first = enroll(cp, BASE, "rack one")
    assert first.status_code == 201
    assert conflicts(cp) == []
    if variant in REFUSED:
        refused = enroll(cp, hostname, "rack two")
        assert refused.status_code == 400 and error_code(refused) == FIELD_TYPE
        # A store may hold such a name from before this release refused it.
        second = enroll(cp, "gpu-placeholder", "rack two").json()["node_id"]
        with cp.store.write():
            Node.update(hostname=hostname).where(Node.node_id == second).execute()
    else:
        answer = enroll(cp, hostname, "rack two")
        assert answer.status_code == 201, answer.text
        second = answer.json()["node_id"]
    [alert] = conflicts(cp)
    assert set(alert["node_ids"]) == {first.json()["node_id"], second}
    assert alert["severity"] == "warning"
    # The message writes both names so the difference shows (ascii escapes, never raw).
    assert ascii(hostname) in alert["message"] and ascii(BASE) in alert["message"]


def test_lookalike_display_names_conflict_and_one_name_twice_does_not(control_plane):
    cp = control_plane
    assert enroll(cp, "gpu-a", "Rack 1 GPU").status_code == 201
    assert enroll(cp, "gpu-b", "Rack 1 GPU").status_code == 201  # the admin's own choice
    assert enroll(cp, "gpu-c", "Other").status_code == 201
    assert conflicts(cp) == []
    impostor = enroll(cp, "gpu-d", "Rack 1 G\u0420U").json()["node_id"]  # Cyrillic Р
    [alert] = conflicts(cp)
    assert impostor in alert["node_ids"] and len(alert["node_ids"]) == 3
    assert "display names that look alike" in alert["message"]
    assert ascii("Rack 1 G\u0420U") in alert["message"]

    env = store_env(cp.settings)
    run_cli("nodes", "rename", impostor, "Rack 4 GPU", env=env, check=True)
    assert conflicts(cp) == []
    refused = run_cli("nodes", "rename", impostor, "Rack\u200b 1 GPU", env=env)
    assert refused.returncode == 2 and "display_name" in refused.stderr
    assert "U+200B" in refused.stderr
