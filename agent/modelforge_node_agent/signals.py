"""SIGTERM and SIGINT: stop at once, also in the middle of a blocking call."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger("modelforge_node_agent")


class Stopping(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT so a blocking call there ends at once."""


def install_signal_handlers(stop: threading.Event) -> None:
    def handle(signum: int, _frame: Any) -> None:
        first = not stop.is_set()
        stop.set()
        if first:
            log.info("stopping on %s", signal.Signals(signum).name)
            raise Stopping

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
