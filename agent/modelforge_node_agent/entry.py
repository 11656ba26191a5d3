"""The ``modelforge-node-agent`` console script: the agent, or one line naming the missing
extra (``.venv/bin/modelforge-node-agent`` in a virtualenv made with ``[appliance]`` only)."""

from __future__ import annotations

from modelforge_contract.extras import exit_if_extra_missing

# Top-level modules of the agent extra (pyproject.toml) and what requests pulls in.
EXTRA_MODULES = frozenset(
    {"requests", "urllib3", "certifi", "idna", "charset_normalizer", "pynvml"}
)


def main() -> None:
    try:
        from .main import main as agent
    except ModuleNotFoundError as exc:
        exit_if_extra_missing(exc, "modelforge-node-agent", "agent", EXTRA_MODULES)
    agent()
