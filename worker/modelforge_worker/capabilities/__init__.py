"""What the worker can run. Each capability takes the item's input and a ``RunContext`` and
returns an ``Outcome``; a ``CapabilityFailure`` becomes a failed outcome with its code."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import (
    CAPABILITY_UNKNOWN,
    WORK_FAILED,
    WORK_LOG_TAIL_MAX_CHARS,
    WORK_SUCCEEDED,
    WORK_TIMED_OUT,
)

log = logging.getLogger(__name__)

# The control plane takes newlines, carriage returns and tabs in a log tail, no other
# control character (terminal escapes from a container would be refused).
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def clean_log(text: str) -> str:
    """The last WORK_LOG_TAIL_MAX_CHARS characters, with control characters made visible."""
    return _UNPRINTABLE.sub("\ufffd", text)[-WORK_LOG_TAIL_MAX_CHARS:]


class CapabilityFailure(Exception):
    """The capability ran and failed (or could not start): a failed outcome, not a crash."""

    def __init__(self, code: str, message: str, *, result: dict | None = None, log: str = ""):
        super().__init__(message)
        self.code, self.message, self.result, self.log = code, message, result, log


@dataclass
class RunContext:
    work_id: str | None
    timeout_seconds: float
    accelerator_mode: str
    started: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return self.timeout_seconds - (time.monotonic() - self.started)

    def check_time(self) -> None:
        """Raise the timeout failure once the item's time is up (cooperative)."""
        if self.remaining() <= 0:
            raise CapabilityFailure(
                WORK_TIMED_OUT, f"the run exceeded its {self.timeout_seconds:g}s timeout"
            )


@dataclass
class Outcome:
    outcome: str
    result: dict[str, Any] | None
    log_tail: str
    error: dict[str, str] | None = None

    def view(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "result": self.result,
            "log_tail": clean_log(self.log_tail),
            "error": self.error,
        }


Runner = Callable[[dict[str, Any], RunContext], Outcome]


def runners() -> dict[str, Runner]:
    from . import container, smoke

    return {"smoke": smoke.run, "container": container.run}


def run_capability(name: str, given: dict[str, Any], context: RunContext) -> Outcome:
    runner = runners().get(name)
    if runner is None:
        return failed(
            CapabilityFailure(CAPABILITY_UNKNOWN, f"this worker has no capability {name!r}")
        )
    try:
        return runner(given, context)
    except CapabilityFailure as failure:
        return failed(failure)


def failed(failure: CapabilityFailure) -> Outcome:
    return Outcome(
        WORK_FAILED,
        failure.result,
        failure.log,
        {"code": failure.code, "message": failure.message[:1000]},
    )


def succeeded(result: dict[str, Any], log_tail: str = "") -> Outcome:
    return Outcome(WORK_SUCCEEDED, result, log_tail)
