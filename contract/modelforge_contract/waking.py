"""Waking a task that waits on an event loop: from the loop itself, or from another thread.
The control plane's relay (a tunnel's frames, an HTTP tunnel's uploads) and the node
agent's relayed requests (its tunnel's reader thread) both wait this way. Standard library
only."""

from __future__ import annotations

import asyncio
import contextlib


class Waker:
    """An event a task on ``loop`` waits on and any thread sets. Made on the loop, or
    given it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.event = asyncio.Event()  # bound to the loop that first waits on it

    def wake(self) -> None:
        """From any thread: the waiting side looks again (at once on the loop itself,
        through the loop's queue from another thread)."""
        if running_loop() is self.loop:
            self.event.set()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> None:
        """On the loop: until woken, or ``timeout`` seconds. Not ``asyncio.wait_for``: before
        CPython 3.12 it can swallow a cancellation that comes as the wait ends."""
        timer = self.loop.call_later(max(timeout, 0.0), self.event.set)
        try:
            await self.event.wait()
        finally:
            timer.cancel()
            self.event.clear()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running on this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not on a loop: another thread
        return None
