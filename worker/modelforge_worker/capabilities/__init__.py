"""What the worker can run. Each capability takes the item's input and a ``RunContext`` and
returns an ``Outcome``; a ``CapabilityFailure`` becomes a failed outcome with its code."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import (
    CAPABILITY_UNKNOWN,
    RUN_CANCELLED,
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


def remove_container(container: Any) -> None:
    """Remove ``container`` (running or not). One already gone (its own run removed it
    meanwhile) counts as removed; any other failure is logged with the container's name,
    so a leftover is named for the operator."""
    from docker.errors import NotFound

    try:
        container.remove(force=True)
    except NotFound:
        pass
    except Exception as exc:
        log.error("could not remove container %s: %s", container.name, type(exc).__name__)


def remove_labelled(client: Any, label: str) -> int:
    """Remove every container labelled ``label`` ("key=value"); how many were found. The
    SDK inspects each container it lists, so one removed between the list and its look is
    left out (ignore_removed) instead of raising NotFound."""
    found = client.containers.list(all=True, ignore_removed=True, filters={"label": label})
    for container in found:
        remove_container(container)
    return len(found)


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
    gpus: tuple[str, ...] = ()  # the UUIDs the item's lease holds (none: it holds no GPU)
    started: float = field(default_factory=time.monotonic)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _stoppers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def remaining(self) -> float:
        return self.timeout_seconds - (time.monotonic() - self.started)

    def check_time(self) -> None:
        """Raise the timeout (or cancel) failure once the item's time is up (cooperative)."""
        if self.cancelled:
            raise cancelled_failure()
        if self.remaining() <= 0:
            raise CapabilityFailure(
                WORK_TIMED_OUT, f"the run exceeded its {self.timeout_seconds:g}s timeout"
            )

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the run: every stopper registered so far is called, later ones at once."""
        with self._lock:
            self._cancelled.set()
            stoppers, self._stoppers = self._stoppers, []
        for stop in stoppers:
            _call_stopper(stop)

    def on_cancel(self, stop: Callable[[], None]) -> None:
        """Call ``stop`` when the run is cancelled (now, when it already is)."""
        with self._lock:
            if not self._cancelled.is_set():
                self._stoppers.append(stop)
                return
        _call_stopper(stop)


def _call_stopper(stop: Callable[[], None]) -> None:
    try:
        stop()
    except Exception as exc:  # the run still ends at its timeout; the operator hears why not now
        log.error("could not stop a cancelled run: %s", type(exc).__name__)


def cancelled_failure(**extra: Any) -> CapabilityFailure:
    return CapabilityFailure(RUN_CANCELLED, "the run was cancelled and stopped", **extra)


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
