"""Telemetry: the latest publication of each node, and per-GPU history for the console's charts.

History is kept for ``MODELFORGE_TELEMETRY_RETENTION_SECONDS``. Pruning rides on the
publications themselves and deletes at most ``PRUNE_BATCH_ROWS`` rows per transaction, so
no request ever waits behind one huge DELETE; while a batch comes back full the next
publication prunes again, so the table converges back to its retention window.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ..core.clock import isoformat
from ..core.settings import Settings
from ..identity.credentials import Caller
from ..store.database import Store
from ..store.tables import GpuSample, Node
from .nodes import mark_credential_used, source_update

log = logging.getLogger(__name__)

PRUNE_BATCH_ROWS = 2000
PRUNE_EVERY_SECONDS = 60.0
DEFAULT_WINDOW_SECONDS = 3600
# The charted values of a sample, as the agent publishes them (validation.SAMPLE_FIELDS).
CHARTED = (
    "utilization_gpu_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
)


class TelemetryHistory:
    """Records publications and answers history; one per app (it remembers when it pruned)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.retention_seconds = settings.telemetry_retention_seconds
        self._next_prune_at = 0.0
        self._lock = threading.Lock()

    def record(
        self, caller: Caller, samples: list[dict[str, Any]], source_address: str | None = None
    ) -> float:
        """Keep the node's latest telemetry and append every sample to the history."""
        now = self.store.clock.now()
        rows = [
            {
                "node_id": caller.node_id,
                "gpu_uuid": sample["uuid"],
                "gpu_index": sample["index"],
                "at": now,
                **{name: sample.get(name) for name in CHARTED},
            }
            for sample in samples
        ]
        latest = json.dumps({"samples": samples}, sort_keys=True, separators=(",", ":"))
        with self.store.write():
            Node.update(telemetry=latest, telemetry_at=now, **source_update(source_address)).where(
                Node.node_id == caller.node_id
            ).execute()
            GpuSample.insert_many(rows).execute()
            mark_credential_used(caller, now)
        self.prune_if_due(now)
        return now

    def prune_if_due(self, now: float) -> int:
        """Delete one bounded batch of expired samples when it is time; return how many."""
        with self._lock:
            if now < self._next_prune_at:
                return 0
            # Claimed before deleting, so concurrent publications do not all prune at once.
            self._next_prune_at = now + PRUNE_EVERY_SECONDS
        deleted = prune_batch(self.store, now - self.retention_seconds)
        if deleted >= PRUNE_BATCH_ROWS:
            with self._lock:  # more is waiting: the next publication prunes again
                self._next_prune_at = now
        if deleted:
            log.debug("pruned %d telemetry samples", deleted)
        return deleted


def prune_batch(store: Store, older_than: float, limit: int = PRUNE_BATCH_ROWS) -> int:
    """Delete at most ``limit`` samples taken before ``older_than``, oldest first."""
    with store.write():
        oldest = (
            GpuSample.select(GpuSample.id)
            .where(GpuSample.at < older_than)
            .order_by(GpuSample.at)
            .limit(limit)
        )
        return GpuSample.delete().where(GpuSample.id.in_(oldest)).execute()


def prune_all(store: Store, older_than: float) -> int:
    """Prune until nothing older is left, one bounded transaction at a time."""
    total = 0
    while True:
        deleted = prune_batch(store, older_than)
        total += deleted
        if deleted < PRUNE_BATCH_ROWS:
            return total


# The chart query runs on every node page refresh: one indexed range read, no model objects.
_HISTORY_SQL = (
    "SELECT gpu_uuid, gpu_index, at, utilization_gpu_percent, memory_used_bytes, "
    "memory_total_bytes, temperature_c, power_w FROM gpu_sample "
    "WHERE node_id = ? AND at >= ? ORDER BY at, id"
)


def history(store: Store, node_id: str, since: float) -> dict[str, Any]:
    """Samples of every GPU of the node taken at or after ``since`` (docs/architecture.md §7a)."""
    with store.connection():
        rows = store.db.execute_sql(
            _HISTORY_SQL.replace("?", store.db.param), (node_id, since)
        ).fetchall()
    gpus: dict[str, dict[str, Any]] = {}
    stamps: dict[float, str | None] = {}  # every GPU of a publication shares its time
    for uuid, index, at, *values in rows:
        gpu = gpus.get(uuid)
        if gpu is None:
            gpu = gpus[uuid] = {"uuid": uuid, "index": index, "samples": []}
        gpu["index"] = index
        stamp = stamps.get(at)
        if stamp is None:
            stamp = stamps[at] = isoformat(at)
        gpu["samples"].append({"at": stamp, **dict(zip(CHARTED, values, strict=True))})
    return {
        "node_id": node_id,
        "since": isoformat(since),
        "gpus": sorted(gpus.values(), key=lambda gpu: (gpu["index"], gpu["uuid"])),
    }
