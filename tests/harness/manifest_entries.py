"""A node-agent image's runtime configuration as a manifest entry binds it (schema 2), for
tests that write entries by hand."""

from __future__ import annotations

from typing import Any


def sample_config() -> dict[str, Any]:
    """What modelforge-release records for the node-agent image (a fresh copy)."""
    return {
        "User": "65532:65532",
        "Entrypoint": None,
        "Cmd": ["python3", "-m", "modelforge_node_agent.main"],
        "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
        "WorkingDir": "/",
        "Volumes": None,
        "ExposedPorts": None,
        "Healthcheck": None,
        "StopSignal": None,
    }
