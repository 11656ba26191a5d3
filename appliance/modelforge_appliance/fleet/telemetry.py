"""Telemetry: the latest publication of each node, and per-GPU history for the console's charts.

What one node may cost the store is bounded three ways:

- **Rate.** A node's publications are kept at most once per
  ``MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS``, with a burst of ``TELEMETRY_BURST`` (a token
  bucket in memory, per node). A faster one is answered (``"stored": false``) but not
  written: it is counted, and the flood is recorded in ``telemetry_flood`` once when it
  begins; its later drops ride on the node's next kept publication, in the same
  transaction, so a flood costs no write of its own. A ``telemetry_flood`` alert lasts while
  the last drop is younger than ``flood_clear_seconds``.
- **Age.** History is kept for ``MODELFORGE_TELEMETRY_RETENTION_SECONDS``. Pruning rides on
  the publications themselves and deletes at most ``PRUNE_BATCH_ROWS`` rows per
  transaction, so no request ever waits behind one huge DELETE; while a batch comes back
  full the next publication prunes again, so the table converges back to its window.
- **Size.** At most ``MODELFORGE_TELEMETRY_MAX_SAMPLES_PER_NODE`` samples per node. Each
  node's count is kept in memory as an upper estimate (rows written since it was last
  counted), so a publication costs no count; only when the estimate passes the cap is the
  node counted, and when really over it its oldest samples are deleted down to nine tenths
  of the cap. After a start the estimate begins at nine tenths, so a node is counted within
  a tenth of the cap of new samples, and never holds more than the cap and that tenth.

Telemetry must name the GPUs of the node's accepted inventory, each once: anything else is
refused before anything is counted or written.

The history answer is down-sampled in the store: at most ``HISTORY_MAX_POINTS`` points per
GPU (the mean of each equal slice of the asked window), for at most ``HISTORY_MAX_GPUS``
GPUs, whatever a node sent.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import peewee as pw

from modelforge_contract import TELEMETRY_GPU_DUPLICATE, TELEMETRY_GPU_UNKNOWN

from ..core.clock import isoformat
from ..core.errors import Invalid
from ..core.rates import TokenBuckets
from ..core.settings import Settings
from ..identity.credentials import Caller
from ..store.database import Store
from ..store.tables import GpuSample, Node, TelemetryFlood
from .nodes import mark_credential_used, source_update

log = logging.getLogger(__name__)

PRUNE_BATCH_ROWS = 2000
PRUNE_EVERY_SECONDS = 60.0
DEFAULT_WINDOW_SECONDS = 3600
# Publications one node may send back to back before the minimum interval applies: a
# republish the control plane asked for, an agent restart, a late one catching up.
TELEMETRY_BURST = 3
# A flood alert clears once no publication was dropped for this long (or two intervals).
FLOOD_CLEAR_SECONDS = 60.0
# The history answer's bounds: 360 points is one per 10 s over the console's hour.
HISTORY_MAX_POINTS = 360
HISTORY_MAX_GPUS = 64  # the most accelerators an inventory may list
# The charted values of a sample, as the agent publishes them (validation.SAMPLE_FIELDS).
CHARTED = (
    "utilization_gpu_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
)
_WHOLE = frozenset(CHARTED) - {"power_w"}  # integers as published; their means are rounded


@dataclass(frozen=True)
class Publication:
    at: float
    stored: bool  # False: dropped for coming too fast


@dataclass
class _Flood:
    """A node's drops not yet in the store, and when its present flood began."""

    since: float
    last_dropped_at: float
    publications: int = 0
    samples: int = 0


def flood_clear_seconds(settings: Settings) -> float:
    return max(FLOOD_CLEAR_SECONDS, 2.0 * settings.telemetry_min_interval_seconds)


class TelemetryHistory:
    """Records publications and answers history; one per app (its rates and counts are
    in memory)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.retention_seconds = settings.telemetry_retention_seconds
        self.max_samples = settings.telemetry_max_samples_per_node
        self.clear_seconds = flood_clear_seconds(settings)
        self._rate = TokenBuckets(
            1.0 / settings.telemetry_min_interval_seconds, TELEMETRY_BURST, store.clock
        )
        self._next_prune_at = 0.0
        self._floods: dict[str, _Flood] = {}
        self._estimates: dict[str, int] = {}  # node id -> at least its stored samples
        self._lock = threading.Lock()

    def publish(
        self, caller: Caller, samples: list[dict[str, Any]], source_address: str | None = None
    ) -> Publication:
        """Check the samples against the inventory, then keep them or drop them for the rate."""
        check_gpus(self.store, caller.node_id, samples)
        if self._rate.take(caller.node_id):
            return Publication(self._dropped(caller.node_id, len(samples)), False)
        return Publication(self.record(caller, samples, source_address), True)

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
        unwritten = self._take_unwritten(caller.node_id)
        try:
            with self.store.write():
                Node.update(
                    telemetry=latest, telemetry_at=now, **source_update(source_address)
                ).where(Node.node_id == caller.node_id).execute()
                GpuSample.insert_many(rows).execute()
                mark_credential_used(caller, now)
                if unwritten is not None:
                    _add_drops(caller.node_id, unwritten, now - self.clear_seconds)
        except BaseException:
            self._give_back(caller.node_id, unwritten)
            raise
        self.prune_if_due(now)
        self._keep_under_cap(caller.node_id, len(rows))
        return now

    # -- floods ------------------------------------------------------------------

    def _dropped(self, node_id: str, samples: int) -> float:
        """Count a dropped publication; the first of a flood is written at once."""
        now = self.store.clock.now()
        with self._lock:
            flood = self._floods.get(node_id)
            begins = flood is None or now - flood.last_dropped_at >= self.clear_seconds
            if flood is None:
                flood = self._floods[node_id] = _Flood(since=now, last_dropped_at=now)
            elif begins:
                flood.since = now
            flood.last_dropped_at = now
            flood.publications += 1
            flood.samples += samples
        if begins:
            log.warning(
                "node %s publishes telemetry faster than it is kept; dropping the surplus",
                node_id,
            )
            unwritten = self._take_unwritten(node_id)
            try:
                with self.store.write():
                    _add_drops(node_id, unwritten, now - self.clear_seconds)
            except BaseException:
                self._give_back(node_id, unwritten)
                raise
        return now

    def _take_unwritten(self, node_id: str) -> _Flood | None:
        """The node's drops not yet written, now owed by the caller's transaction."""
        with self._lock:
            flood = self._floods.get(node_id)
            if flood is None or not flood.publications:
                return None
            taken = _Flood(flood.since, flood.last_dropped_at, flood.publications, flood.samples)
            flood.publications = flood.samples = 0
            return taken

    def _give_back(self, node_id: str, taken: _Flood | None) -> None:
        """The transaction that owed them failed: they wait for the next one."""
        if taken is None:
            return
        with self._lock:
            flood = self._floods[node_id]
            flood.publications += taken.publications
            flood.samples += taken.samples

    def dropped(self, node_id: str) -> dict[str, Any]:
        """What the node's floods cost it, written or not (the node's detail shows it)."""
        with self.store.connection():
            row = TelemetryFlood.get_or_none(TelemetryFlood.node_id == node_id)
        with self._lock:
            flood = self._floods.get(node_id)
            pending = (flood.publications, flood.samples) if flood else (0, 0)
            last = flood.last_dropped_at if flood else None
            since = flood.since if flood else None
        if row is not None:
            last = row.last_dropped_at if last is None else max(last, row.last_dropped_at)
            since = row.since if since is None else since
        flooding = last is not None and self.store.clock.now() - last < self.clear_seconds
        return {
            "publications": (row.dropped_publications if row else 0) + pending[0],
            "samples": (row.dropped_samples if row else 0) + pending[1],
            "last_at": isoformat(last),
            "flooding_since": isoformat(since) if flooding else None,
        }

    # -- retention -------------------------------------------------------------------

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

    def _keep_under_cap(self, node_id: str, written: int) -> int:
        """Delete the node's oldest samples when it holds more than the cap; return how many."""
        cap = self.max_samples
        keep = cap - cap // 10
        with self._lock:
            estimate = self._estimates.get(node_id, keep) + written
            self._estimates[node_id] = estimate
        if estimate <= cap:
            return 0
        count = count_samples(self.store, node_id)
        deleted = trim_node(self.store, node_id, keep) if count > cap else 0
        with self._lock:
            self._estimates[node_id] = count - deleted
        if deleted:
            log.info(
                "node %s held %d telemetry samples; deleted its %d oldest", node_id, count, deleted
            )
        return deleted


def check_gpus(store: Store, node_id: str, samples: list[dict[str, Any]]) -> None:
    """400 unless every sample names a GPU of the node's accepted inventory, each once: the
    accelerators its ``inventory`` holds, never those waiting for an administrator
    (fleet/hardware.py)."""
    with store.connection():
        inventory = Node.select(Node.inventory).where(Node.node_id == node_id).scalar()
    known = (
        {a.get("uuid") for a in json.loads(inventory).get("accelerators", [])}
        if inventory
        else set()
    )
    seen: set[str] = set()
    for position, sample in enumerate(samples):
        uuid = sample["uuid"]
        if uuid not in known:
            raise Invalid(
                f"samples[{position}].uuid is not a GPU of this node's accepted inventory",
                code=TELEMETRY_GPU_UNKNOWN,
                next_step="Publish the inventory first; telemetry names only its GPUs, and a "
                "GPU that changed only once an administrator accepts it "
                "(modelforge nodes accept-hardware).",
            )
        if uuid in seen:
            raise Invalid(
                f"samples[{position}].uuid repeats a GPU of this publication",
                code=TELEMETRY_GPU_DUPLICATE,
                next_step="Send one sample per GPU.",
            )
        seen.add(uuid)


def _add_drops(node_id: str, drops: _Flood, ended_before: float) -> None:
    """Add drops to the node's flood record (inside the caller's transaction). A record
    whose last drop is older than ``ended_before`` belonged to an earlier flood: this one
    begins at ``drops.since``."""
    TelemetryFlood.insert(
        node_id=node_id,
        dropped_publications=drops.publications,
        dropped_samples=drops.samples,
        since=drops.since,
        last_dropped_at=drops.last_dropped_at,
    ).on_conflict(
        conflict_target=[TelemetryFlood.node_id],
        update={
            TelemetryFlood.dropped_publications: TelemetryFlood.dropped_publications
            + drops.publications,
            TelemetryFlood.dropped_samples: TelemetryFlood.dropped_samples + drops.samples,
            TelemetryFlood.since: pw.Case(
                None,
                [(TelemetryFlood.last_dropped_at < ended_before, drops.since)],
                TelemetryFlood.since,
            ),
            TelemetryFlood.last_dropped_at: pw.Case(
                None,
                [(TelemetryFlood.last_dropped_at < drops.last_dropped_at, drops.last_dropped_at)],
                TelemetryFlood.last_dropped_at,
            ),
        },
    ).execute()


def active_floods(store: Store, settings: Settings) -> list[TelemetryFlood]:
    """The flood records of nodes that dropped a publication within the clearing time."""
    since = store.clock.now() - flood_clear_seconds(settings)
    with store.connection():
        return list(
            TelemetryFlood.select()
            .where(TelemetryFlood.last_dropped_at >= since)
            .order_by(TelemetryFlood.node_id)
        )


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


def count_samples(store: Store, node_id: str) -> int:
    with store.connection():
        return GpuSample.select().where(GpuSample.node_id == node_id).count()


def trim_node(store: Store, node_id: str, keep: int, limit: int = PRUNE_BATCH_ROWS) -> int:
    """Delete the node's oldest samples until about ``keep`` are left, ``limit`` rows per
    transaction: every publication before the one holding the ``keep``-th newest sample."""
    mine = GpuSample.node_id == node_id
    with store.connection():
        cut = (
            GpuSample.select(GpuSample.at)
            .where(mine)
            .order_by(GpuSample.at.desc())
            .offset(keep - 1)
            .limit(1)
            .scalar()
        )
    if cut is None:
        return 0
    total = 0
    while True:
        with store.write():
            oldest = (
                GpuSample.select(GpuSample.id)
                .where(mine & (GpuSample.at < cut))
                .order_by(GpuSample.at)
                .limit(limit)
            )
            deleted = GpuSample.delete().where(GpuSample.id.in_(oldest)).execute()
        total += deleted
        if deleted < limit:
            return total


# The chart query runs on every node page refresh: one indexed range read, grouped in the
# store into equal slices of the window, so the answer's size never depends on what a node
# sent. A publication's GPUs share its time, so their points share it too.
_HISTORY_SQL = (
    "SELECT gpu_uuid, MAX(gpu_index), MAX(at), AVG(utilization_gpu_percent), "
    "AVG(memory_used_bytes), MAX(memory_total_bytes), AVG(temperature_c), AVG(power_w) "
    "FROM gpu_sample WHERE node_id = ? AND at >= ? GROUP BY gpu_uuid, {slice} ORDER BY 3, 1"
)
_SLICE = {  # which slice of the window a sample falls in, 0 … points - 1
    "sqlite": "MIN(CAST((at - ?) / ? AS INTEGER), ?)",
    "postgresql": "LEAST(FLOOR((at - ?) / ?), ?)",
}


def history(
    store: Store, node_id: str, since: float, points: int = HISTORY_MAX_POINTS
) -> dict[str, Any]:
    """Each GPU's samples taken at or after ``since`` (docs/architecture.md §7a), at most
    ``points`` per GPU: where a slice of the window holds several, their mean."""
    now = store.clock.now()
    width = max(now - since, 1.0) / points
    kind = "sqlite" if isinstance(store.db, pw.SqliteDatabase) else "postgresql"
    sql = _HISTORY_SQL.format(slice=_SLICE[kind]).replace("?", store.db.param)
    with store.connection():
        rows = store.db.execute_sql(sql, (node_id, since, since, width, points - 1)).fetchall()
    gpus: dict[str, dict[str, Any]] = {}
    stamps: dict[float, str | None] = {}  # every GPU of a publication shares its time
    for uuid, index, at, *values in rows:
        gpu = gpus.get(uuid)
        if gpu is None:
            gpu = gpus[uuid] = {"uuid": uuid, "index": index, "samples": [], "newest": at}
        gpu["index"], gpu["newest"] = index, at
        stamp = stamps.get(at)
        if stamp is None:
            stamp = stamps[at] = isoformat(at)
        gpu["samples"].append({"at": stamp, **_point(values)})
    # GPUs that left the inventory keep their history: the most recently seen are answered.
    shown = sorted(gpus.values(), key=lambda gpu: gpu["newest"], reverse=True)[:HISTORY_MAX_GPUS]
    for gpu in shown:
        del gpu["newest"]
    return {
        "node_id": node_id,
        "since": isoformat(since),
        "max_points": points,
        "slice_seconds": round(width, 3),
        "gpus_left_out": len(gpus) - len(shown),
        "gpus": sorted(shown, key=lambda gpu: (gpu["index"], gpu["uuid"])),
    }


def _point(values: list[Any]) -> dict[str, Any]:
    """One point's values as JSON numbers (PostgreSQL's means are decimals)."""
    point: dict[str, Any] = {}
    for name, value in zip(CHARTED, values, strict=True):
        if value is not None:
            value = round(float(value)) if name in _WHOLE else float(value)
        point[name] = value
    return point
