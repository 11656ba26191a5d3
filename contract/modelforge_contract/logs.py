"""Logging for every ModelForge program, configured once by its CLI: each record passes
through the secret mask, tracebacks included. Standard library only."""

from __future__ import annotations

import logging
import sys

from . import mask_secrets


class MaskSecrets(logging.Filter):
    """Replace anything shaped like a ModelForge secret by its non-secret prefix (``mfc_3f9a…``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            # Render the traceback now so it is masked too, then drop the raw one.
            message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            record.exc_info, record.exc_text = None, None
        record.msg, record.args = mask_secrets(message), None
        return True


def configure_logging(level: str, fmt: str = "%(asctime)s %(levelname)s %(message)s") -> None:
    """One stderr handler on the root logger, with the mask."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(MaskSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
