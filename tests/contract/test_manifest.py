"""The release manifest's entry checks, shared by the release verifiers and the console."""

from __future__ import annotations

import copy
import json

import pytest

from modelforge_contract import PROTOCOL_VERSION
from modelforge_contract.manifest import (
    LABEL_AGENT_PROTOCOL,
    LABEL_SOURCE,
    LABEL_VERSION,
    NODE_AGENT_IMAGE,
    REQUIRED_LABELS,
    ManifestError,
    entry_differences,
    entry_problems,
    parse_manifest,
)
from tests.harness.manifest_entries import sample_config

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

VERSION = "1.3.0-rc.1"


def agent_entry() -> dict:
    labels = {label: "x" for label in REQUIRED_LABELS}
    labels[LABEL_VERSION] = VERSION
    labels[LABEL_AGENT_PROTOCOL] = str(PROTOCOL_VERSION)
    return {
        "tag": f"{NODE_AGENT_IMAGE}:{VERSION}",
        "architecture": "amd64",
        "os": "linux",
        "rootfs_layers": ["sha256:" + "a" * 64, "sha256:" + "b" * 64],
        "labels": labels,
        "config": sample_config(),
        "image_id": "sha256:" + "c" * 64,
    }


def test_a_well_formed_entry_has_no_problems():
    assert entry_problems(NODE_AGENT_IMAGE, agent_entry(), VERSION) == []


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda e: e.update(tag=f"{NODE_AGENT_IMAGE}:latest"), "tag"),
        (lambda e: e.update(tag=f"{NODE_AGENT_IMAGE}:1.3.0"), "tag"),
        (lambda e: e.update(tag="other:1.3.0-rc.1"), "tag"),
        (lambda e: e.update(architecture="arm"), "architecture"),
        (lambda e: e.update(os="windows"), "os"),
        (lambda e: e.update(rootfs_layers=[]), "rootfs_layers"),
        (lambda e: e["rootfs_layers"].__setitem__(1, "sha256:zz"), "rootfs_layers[1]"),
        (lambda e: e["labels"].pop(REQUIRED_LABELS[0]), f"labels.{REQUIRED_LABELS[0]}"),
        (lambda e: e["labels"].update({LABEL_VERSION: "1.2.0"}), f"labels.{LABEL_VERSION}"),
        (
            lambda e: e["labels"].update({LABEL_AGENT_PROTOCOL: "99"}),
            f"labels.{LABEL_AGENT_PROTOCOL}",
        ),
        (lambda e: e.update(image_id="abc"), "image_id"),
        (
            lambda e: e["labels"].update({LABEL_SOURCE: "/home/me/modelforge"}),
            f"labels.{LABEL_SOURCE}",
        ),
        (lambda e: e.pop("config"), "config"),
        (lambda e: e["config"].pop("User"), "config.User"),
        (lambda e: e["config"].update(User=0), "config.User"),
        (lambda e: e["config"].update(Cmd="python3 -m x"), "config.Cmd"),
        (lambda e: e["config"].update(Healthcheck=["CMD"]), "config.Healthcheck"),
        (lambda e: e["config"].update(Shell=["/bin/sh"]), "config.Shell"),
    ],
)
def test_each_malformed_field_is_named(mutate, field):
    entry = agent_entry()
    mutate(entry)
    assert field in [p.field for p in entry_problems(NODE_AGENT_IMAGE, entry, VERSION)]


@pytest.mark.parametrize("source", ["https://github.com/modelforge/modelforge", None])
def test_the_source_label_is_a_url_or_absent(source):
    entry = agent_entry()
    if source is None:
        entry["labels"].pop(LABEL_SOURCE, None)
    else:
        entry["labels"][LABEL_SOURCE] = source
    assert entry_problems(NODE_AGENT_IMAGE, entry, VERSION) == []


def test_differences_ignore_the_image_id_and_name_every_changed_field():
    expected = agent_entry()
    rewritten = copy.deepcopy(expected)
    rewritten["image_id"] = "sha256:" + "d" * 64
    assert entry_differences(expected, rewritten) == []

    changed = copy.deepcopy(expected)
    changed["rootfs_layers"][0] = "sha256:" + "e" * 64
    changed["labels"]["extra"] = "y"
    changed["architecture"] = "arm64"
    fields = [p.field for p in entry_differences(expected, changed)]
    assert fields == ["architecture", "rootfs_layers[0]", "labels.extra"]


def test_a_whole_manifest_parses_or_names_the_image_and_field():
    manifest = {
        "schema": 2,
        "version": VERSION,
        "revision": "0" * 40,
        "created": "2026-11-29T00:00:00Z",
        "images": {NODE_AGENT_IMAGE: agent_entry()},
    }
    assert parse_manifest(json.dumps(manifest))["version"] == VERSION
    manifest["images"][NODE_AGENT_IMAGE]["os"] = "plan9"
    with pytest.raises(ManifestError, match=rf"images\.{NODE_AGENT_IMAGE}\.os"):
        parse_manifest(json.dumps(manifest))
    with pytest.raises(ManifestError, match="not JSON"):
        parse_manifest("{")


def test_a_manifest_error_lists_each_problem_with_its_image_and_field():
    entry = agent_entry()
    entry["os"] = "plan9"
    del entry["labels"][LABEL_VERSION]
    manifest = {"schema": 2, "version": VERSION, "images": {NODE_AGENT_IMAGE: entry, "other": {}}}
    with pytest.raises(ManifestError) as caught:
        parse_manifest(json.dumps(manifest))
    found = {(image, problem.field) for image, problem in caught.value.problems}
    assert (NODE_AGENT_IMAGE, "os") in found
    assert (NODE_AGENT_IMAGE, f"labels.{LABEL_VERSION}") in found
    assert ("other", "") in found  # not an image of a release
    with pytest.raises(ManifestError) as caught:
        parse_manifest("[]")
    assert caught.value.problems == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("User", "0:0"),
        ("Cmd", ["python3", "-c", "print(open('/proc/self/environ').read())"]),
        ("Entrypoint", ["/bin/sh", "-c"]),
        ("Env", ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "PYTHONSTARTUP=/tmp/x.py"]),
        ("WorkingDir", "/tmp"),
        ("Volumes", {"/data": {}}),
        ("ExposedPorts", {"22/tcp": {}}),
        ("Healthcheck", {"Test": ["CMD", "true"]}),
        ("StopSignal", "SIGKILL"),
    ],
)
def test_every_runtime_field_is_bound_and_named_with_both_values(field, value):
    expected = agent_entry()
    changed = copy.deepcopy(expected)
    changed["config"][field] = value
    problems = entry_differences(expected, changed)
    assert [p.field for p in problems] == [f"config.{field}"]
    assert repr(expected["config"][field]) in problems[0].message
    assert repr(value) in problems[0].message


def test_an_empty_runtime_value_is_the_same_as_an_absent_one():
    expected = agent_entry()
    changed = copy.deepcopy(expected)
    changed["config"].update(Entrypoint=[], Volumes={}, StopSignal="")
    assert entry_differences(expected, changed) == []


def test_a_schema_1_manifest_is_refused_because_it_binds_no_configuration():
    entry = agent_entry()
    del entry["config"]
    manifest = {"schema": 1, "version": VERSION, "images": {NODE_AGENT_IMAGE: entry}}
    with pytest.raises(ManifestError, match="schema 1 does not bind"):
        parse_manifest(json.dumps(manifest))
