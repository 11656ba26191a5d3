"""Heartbeats are accepted in memory and written to the store together, once a second.

A heartbeat only moves timestamps, so batching it is safe: a crash loses at most the
heartbeats accepted within one flush interval before the newest acknowledged one (far
below the heartbeat interval), never an identity or a credential — enrollment and
credential changes are still written in their own transactions before they are answered.
Readers of liveness flush first, so an answer never lags behind a heartbeat that was
acknowledged.

The bound is kept by a deadline, not by the flusher thread's luck: a heartbeat is not
acknowledged while an older one, accepted more than one interval before it, is still
unwritten — the request that finds one overdue writes the batch itself before it
answers. So a starved or stalled flusher thread (a busy 2-core host, a long GC pause)
makes heartbeat answers slower, never the promise weaker. The thread only keeps the
store fresh while heartbeats are quiet.

A node heartbeating faster than its interval allows costs no write: each node may have a
heartbeat written every half interval (a token bucket with a burst of ``WRITE_BURST``, in
memory), and one beyond that is answered as usual without being held for the store. An
agent keeping its interval is never affected; a flooding one has its stored heartbeat at
most half an interval behind its newest, so it still reads online while it heartbeats.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import peewee as pw

from ..core.rates import TokenBuckets
from ..identity.credentials import Caller
from ..store.database import Store

log = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 1.0
# Heartbeats of one node written back to back before the half-interval spacing applies
# (an agent restarting, retrying, or following a changed interval).
WRITE_BURST = 5

# Timestamps only move forward, whatever order flushes and requests interleave in.
_NODES_SQL = (
    "UPDATE node SET last_heartbeat_at = ?, agent_version = ?, protocol_version = ?, "
    "health = ? WHERE node_id = ? AND (last_heartbeat_at IS NULL OR last_heartbeat_at <= ?)"
)
_CREDENTIALS_SQL = (
    "UPDATE credential SET last_used_at = ? WHERE credential_id = ? "
    "AND (last_used_at IS NULL OR last_used_at < ?)"
)


@dataclass(frozen=True)
class Heartbeat:
    credential_id: str
    at: float
    agent_version: str
    protocol: int
    health: str  # JSON


class HeartbeatBuffer:
    """The newest accepted heartbeat of each node, not yet in the store."""

    def __init__(
        self,
        store: Store,
        interval: float = FLUSH_INTERVAL_SECONDS,
        heartbeat_interval: float = 10.0,
    ) -> None:
        self.store = store
        self.interval = interval
        self._writes = TokenBuckets(2.0 / heartbeat_interval, WRITE_BURST, store.clock)
        self._pending: dict[str, Heartbeat] = {}
        # The oldest acceptance time not yet known to be in the store: pending, or taken
        # by a flush that has not committed. None when everything accepted is written.
        self._oldest_unwritten: float | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(
        self, caller: Caller, *, agent_version: str, protocol: int, health: dict
    ) -> tuple[float, bool]:
        """Accept a heartbeat at the control plane's time; return that time, and whether it
        is held for the store (False: the node heartbeats faster than it is written).

        Returns only once every heartbeat accepted more than ``interval`` before this one
        is in the store (flushing here if the flusher thread has not): the deadline that
        bounds what a crash can lose. A store that does not answer raises, so the
        heartbeat is not acknowledged.
        """
        held = not self._writes.take(caller.node_id)
        health_json = json.dumps(health, sort_keys=True, separators=(",", ":")) if held else ""
        with self._lock:
            # Taken under the lock, so acceptance times rise in the order beats are held.
            at = self.store.clock.now()
            if held:
                self._pending[caller.node_id] = Heartbeat(
                    caller.credential_id, at, agent_version, protocol, health_json
                )
                if self._oldest_unwritten is None:
                    self._oldest_unwritten = at
            overdue = self._oldest_unwritten is not None and (
                self._oldest_unwritten <= at - self.interval
            )
        if overdue:
            self.flush_overdue(at)
        return at, held

    def flush_overdue(self, at: float) -> None:
        """Flush until nothing accepted ``interval`` or more before ``at`` is unwritten."""
        while True:
            self.flush()
            with self._lock:
                oldest = self._oldest_unwritten
            if oldest is None or oldest > at - self.interval:
                return

    def pending(self, node_id: str) -> tuple[float, str] | None:
        """The node's accepted heartbeat not yet written: (time, health JSON), or None."""
        with self._lock:
            beat = self._pending.get(node_id)
        return (beat.at, beat.health) if beat is not None else None

    def flush(self) -> int:
        """Write every pending heartbeat in one transaction; return how many."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return 0
            try:
                self._write(batch)
            except (pw.OperationalError, pw.InterfaceError):
                with self._lock:  # the store is away: keep them for the next flush
                    self._pending = {**batch, **self._pending}
                raise
            except Exception as exc:
                # Never let one bad batch block every later one: drop it, loudly.
                log.error(
                    "dropped %d heartbeat(s) the store refused: %s", len(batch), type(exc).__name__
                )
            finally:
                with self._lock:
                    self._oldest_unwritten = min(
                        (beat.at for beat in self._pending.values()), default=None
                    )
            return len(batch)

    def _write(self, batch: dict[str, Heartbeat]) -> None:
        p = self.store.db.param
        nodes, credentials = _NODES_SQL.replace("?", p), _CREDENTIALS_SQL.replace("?", p)
        with self.store.write():
            cursor = self.store.db.cursor()
            cursor.executemany(
                nodes,
                [
                    (b.at, b.agent_version, b.protocol, b.health, node_id, b.at)
                    for node_id, b in batch.items()
                ],
            )
            cursor.executemany(credentials, [(b.at, b.credential_id, b.at) for b in batch.values()])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception as exc:  # the store may be briefly unavailable; retry next turn
                log.error("writing heartbeats failed: %s", type(exc).__name__)

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="heartbeat-flush", daemon=True)
        thread.start()
        # Set once running, so a stop() racing with start() never joins an unstarted thread
        # (a flusher started after stop() sees the stop event and ends at once).
        self._thread = thread

    def stop(self) -> None:
        """Stop the flusher and write what is pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
