"""Agent settings: every bad value exits 2 naming the variable; --help and the docs list them all."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelforge_contract import EXIT_USAGE
from modelforge_node_agent.settings import SETTINGS, ConfigError, load_settings
from tests.harness.agent_process import agent_env, run_agent

DOCS = Path(__file__).parents[2] / "docs" / "node-agent.md"
TOKEN = "mfe_0123456789abcdef_" + "F" * 43


@pytest.mark.parametrize(
    ("env", "named", "hint"),
    [
        (
            {"MODELFORGE_AGENT_ACCELERATOR_MODE": "gpu"},
            "MODELFORGE_AGENT_ACCELERATOR_MODE",
            "nvidia, cpu, auto",
        ),
        ({"MODELFORGE_AGENT_TLS_VERIFY": "maybe"}, "MODELFORGE_AGENT_TLS_VERIFY", "true or false"),
        (
            {"MODELFORGE_AGENT_IDENTITY_MODE": "ephemeral"},
            "MODELFORGE_AGENT_IDENTITY_MODE",
            "persisted",
        ),
        (
            {"MODELFORGE_AGENT_CONTROL_PLANE_URL": "ftp://x"},
            "MODELFORGE_AGENT_CONTROL_PLANE_URL",
            "http",
        ),
        (
            {"MODELFORGE_AGENT_CONTROL_PLANE_URL": "https://cp:8000/api"},
            "MODELFORGE_AGENT_CONTROL_PLANE_URL",
            "without a path",
        ),
        (
            {"MODELFORGE_AGENT_TELEMETRY_INTERVAL_SECONDS": "0"},
            "MODELFORGE_AGENT_TELEMETRY_INTERVAL_SECONDS",
            "outside",
        ),
        (
            {"MODELFORGE_AGENT_CA_CERT_PATH": "/nonexistent/ca.pem"},
            "MODELFORGE_AGENT_CA_CERT_PATH",
            "readable",
        ),
        (
            {"MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS": "https://10.0.0.5"},
            "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS",
            "bare",
        ),
        (
            {"MODELFORGE_AGENT_CONTROL_PLANE_URLS": "x"},
            "MODELFORGE_AGENT_CONTROL_PLANE_URLS",
            "did you mean MODELFORGE_AGENT_CONTROL_PLANE_URL?",
        ),
        (
            {"MODELFORGE_AGENT_ACCELERATOR": "cpu"},
            "MODELFORGE_AGENT_ACCELERATOR",
            "did you mean MODELFORGE_AGENT_ACCELERATOR_MODE?",
        ),
    ],
)
def test_bad_value_names_the_variable(env, named, hint):
    with pytest.raises(ConfigError) as error:
        load_settings(env)
    assert named in str(error.value) and hint in str(error.value)


def test_placeholder_host_is_refused_with_a_way_out(tmp_path):
    env = agent_env(
        control_plane_url="https://modelforge.example.internal:8000",
        enrollment_token=TOKEN,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
    )
    result = run_agent(env)
    assert result.returncode == EXIT_USAGE
    assert (
        "MODELFORGE_AGENT_CONTROL_PLANE_URL points at modelforge.example.internal" in result.stderr
    )
    assert "set it to the real address" in result.stderr
    assert not (tmp_path / "state").exists()


def test_a_malformed_token_is_refused_without_echoing_it(tmp_path):
    secretish = "not-a-token-" + "x" * 30
    env = agent_env(
        control_plane_url="http://127.0.0.1:9", enrollment_token=secretish, accelerator_mode="cpu"
    )
    result = run_agent(env)
    assert result.returncode == EXIT_USAGE
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" in result.stderr and secretish not in result.stderr


def test_missing_control_plane_url_exits_2(tmp_path):
    result = run_agent(agent_env(accelerator_mode="cpu", state_volume=tmp_path / "s"))
    assert result.returncode == EXIT_USAGE
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL is not set" in result.stderr


def test_defaults_fail_closed_and_verify_tls():
    settings = load_settings({"MODELFORGE_AGENT_CONTROL_PLANE_URL": "https://cp.lan:8443/"})
    assert settings.accelerator_mode == "nvidia"
    assert settings.tls_verify_value is True
    assert settings.control_plane_url == "https://cp.lan:8443"
    assert settings.identity_mode == "persisted"


def test_settings_repr_never_shows_the_token():
    settings = load_settings({"MODELFORGE_AGENT_ENROLLMENT_TOKEN": TOKEN})
    assert TOKEN not in repr(settings)


def test_help_and_docs_explain_every_variable():
    result = run_agent(agent_env(), "--help")
    assert result.returncode == 0
    docs = DOCS.read_text()
    for spec in SETTINGS:
        assert spec.name in result.stdout, spec.name
        assert f"`{spec.name}`" in docs, f"{spec.name} is missing from docs/node-agent.md"
    for code in range(2, 7):
        assert f"\n  {code}  " in result.stdout
