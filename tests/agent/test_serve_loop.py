"""The serve loop's own pacing, without a control plane: a loop that cannot fetch (its worker
is down) waits its tick instead of spinning (782 CPU ticks per 10 s were seen)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from modelforge_node_agent.serve import IDLE_TICK_SECONDS, ServeLoop
from modelforge_node_agent.settings import load_settings

# Waits that return at once before the test calls it a spin (the loop would never stop).
SPIN = 1000


class Pacer(threading.Event):
    """The loop's stop event: each wait is counted and returns at once; the third stops it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if len(self.waits) >= 3:
            self.set()
        return self.is_set()


class Wanted(threading.Event):
    """The loop's fetch event: counts the waits made while it is set (each returns at once)."""

    def __init__(self, stop: Pacer) -> None:
        super().__init__()
        self.stop, self.spins = stop, 0

    def wait(self, timeout: float | None = None) -> bool:
        if self.is_set():
            self.spins += 1
            if self.spins >= SPIN:
                self.stop.set()
            return True
        return super().wait(0)


def test_a_loop_whose_worker_is_down_waits_its_tick_instead_of_spinning(tmp_path):
    settings = load_settings(
        {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:9",
            "MODELFORGE_AGENT_STATE_VOLUME": str(tmp_path / "state"),
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
        }
    )
    down = SimpleNamespace(current=lambda: SimpleNamespace(usable=False))
    stop = Pacer()
    loop = ServeLoop(settings, "n" * 16, client=None, watch=down, stop=stop, refuse=print)
    loop._fetch = Wanted(stop)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert loop._fetch.spins == 0  # never waited on the event it had not cleared
    assert loop._fetch.is_set()  # the fetch still waits for the worker
    assert stop.waits == [IDLE_TICK_SECONDS] * 3  # each turn waited the idle tick
