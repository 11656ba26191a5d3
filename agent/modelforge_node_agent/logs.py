"""Logging, configured once by the CLI; every record passes through the secret mask."""

from __future__ import annotations

import logging
import sys

from modelforge_contract import mask_secrets


class MaskSecrets(logging.Filter):
    """Replace anything shaped like a ModelForge secret by its non-secret prefix (``mfc_3f9a…``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            # Render the traceback now so it is masked too, then drop the raw one.
            message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            record.exc_info, record.exc_text = None, None
        masked = mask_secrets(message)
        record.msg, record.args = masked, None
        return True


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(MaskSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # urllib3 logs full URLs and retries at DEBUG; the agent's own lines say what matters.
    logging.getLogger("urllib3").setLevel(max(logging.getLevelName(level), logging.INFO))
