"""Waking what waits on the relay's event loop: from the loop itself (a WebSocket tunnel's
frames), or from the threads that feed it (an HTTP tunnel's reader and upload)."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Waker:
    """An event the loop waits on and any thread sets. Made on the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self._thread = threading.get_ident()  # the loop's

    def wake(self) -> None:
        """From any thread: the waiting side looks again (at once from the loop itself, a
        tunnel's frame arriving there; through the loop's queue from another thread)."""
        if threading.get_ident() == self._thread:
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
