"""Heartbeats are accepted in memory and written to the store together, once a second.

A heartbeat only moves timestamps, so batching it is safe: a crash loses at most one
flush interval of liveness (far below the heartbeat interval), never an identity or a
credential — enrollment and credential changes are still written in their own
transactions before they are answered. Readers of liveness flush first, so an answer
never lags behind a heartbeat that was acknowledged.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import peewee as pw

from .credentials import Caller
from .store import Store

log = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 1.0

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

    def __init__(self, store: Store, interval: float = FLUSH_INTERVAL_SECONDS) -> None:
        self.store = store
        self.interval = interval
        self._pending: dict[str, Heartbeat] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, caller: Caller, *, agent_version: str, protocol: int, health: dict) -> float:
        """Accept a heartbeat at the control plane's time; return that time."""
        at = self.store.clock.now()
        beat = Heartbeat(
            caller.credential_id,
            at,
            agent_version,
            protocol,
            json.dumps(health, sort_keys=True, separators=(",", ":")),
        )
        with self._lock:
            self._pending[caller.node_id] = beat
        return at

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
        self._thread = threading.Thread(target=self._run, name="heartbeat-flush", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the flusher and write what is pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
