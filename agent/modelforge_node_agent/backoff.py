"""Retry waits after a failed publication: 1 s, 2 s, 4 s, 8 s, then 16 s, with jitter."""

from __future__ import annotations

import random
from collections.abc import Sequence

BACKOFF_STEPS: tuple[float, ...] = (1, 2, 4, 8, 16)
# Each wait is its step less up to this fraction, so agents that lost the control plane
# together do not all return in the same instant, and no wait ever exceeds the cap.
JITTER = 0.2


def seconds(value: float) -> str:
    return f"{value:g}s"


class Backoff:
    """The wait before the next try; ``reset()`` after a success starts over at the first step."""

    def __init__(self, steps: Sequence[float] = BACKOFF_STEPS, rng: random.Random | None = None):
        if not steps:
            raise ValueError("a backoff needs at least one step")
        self.steps = tuple(steps)
        self.failures = 0
        self._rng = rng or random.Random()

    @property
    def span(self) -> str:
        """The schedule as operators read it in log lines: ``1s…16s``."""
        return f"{seconds(self.steps[0])}…{seconds(self.steps[-1])}"

    def next_step(self) -> tuple[float, float]:
        """(step, wait) for the failure just seen; the step stays at the last one (the cap)."""
        step = self.steps[min(self.failures, len(self.steps) - 1)]
        self.failures += 1
        return step, step * (1 - JITTER * self._rng.random())

    def reset(self) -> None:
        self.failures = 0
