"""Logging, configured once by the CLI; every record passes through the secret mask."""

from __future__ import annotations

import logging
import sys

from modelforge_contract import mask_secrets


class MaskSecrets(logging.Filter):
    """Replace anything shaped like a ModelForge secret by its non-secret prefix."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(MaskSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
