"""The ``modelforge-node-agent`` console script: the agent, or one line naming the missing
extra (``.venv/bin/modelforge-node-agent`` in a virtualenv made with ``[appliance]`` only)."""

from __future__ import annotations

import sys

from modelforge_contract import EXIT_USAGE

# Top-level modules of the agent extra (pyproject.toml) and what requests pulls in.
EXTRA_MODULES = frozenset(
    {"requests", "urllib3", "certifi", "idna", "charset_normalizer", "pynvml"}
)


def main() -> None:
    try:
        from .main import main as agent
    except ModuleNotFoundError as exc:
        module = (exc.name or "").split(".")[0]
        if module not in EXTRA_MODULES:
            raise
        print(
            f"modelforge-node-agent: the agent extra is not installed (no module named "
            f"{module!r}); install it with: pip install 'modelforge[agent]' (from a checkout: "
            "pip install -e '.[agent]')",
            file=sys.stderr,
        )
        sys.exit(EXIT_USAGE)
    agent()
