"""Logging for every ModelForge program, configured once by its CLI: each record passes
through the secret mask, tracebacks included. Standard library only."""

from __future__ import annotations

import logging
import sys
import threading
from types import TracebackType

from . import mask_secrets

log = logging.getLogger("modelforge")


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


def _uncaught(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    """sys.excepthook: an uncaught exception is logged (masked), never printed raw."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, trace)
        return
    log.critical("uncaught %s", kind.__name__, exc_info=(kind, error, trace))


def _uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: a thread that dies says so through the mask, not on raw stderr."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    log.critical(
        "thread %s stopped by an uncaught %s",
        name,
        args.exc_type.__name__,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def configure_logging(level: str, fmt: str = "%(asctime)s %(levelname)s %(message)s") -> None:
    """One stderr handler on the root logger, with the mask; uncaught exceptions, in the main
    thread or any other, are logged through it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(MaskSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    sys.excepthook = _uncaught
    threading.excepthook = _uncaught_in_thread
