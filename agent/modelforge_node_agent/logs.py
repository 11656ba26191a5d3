"""The agent's logging: the shared masked setup, with urllib3 kept quiet."""

from __future__ import annotations

import logging

from modelforge_contract.logs import configure_logging as _configure


def configure_logging(level: str = "INFO") -> None:
    _configure(level)
    # urllib3 logs full URLs and retries at DEBUG; the agent's own lines say what matters.
    logging.getLogger("urllib3").setLevel(max(logging.getLevelName(level), logging.INFO))
