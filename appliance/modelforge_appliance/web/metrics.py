"""Prometheus metrics of one control plane, served at ``GET /metrics`` to admins.

Each app has its own registry, so several apps in one process (tests) never share
counters. Nodes by liveness are computed at scrape time, like every other liveness.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from modelforge_contract import LIVENESS_STATES
from modelforge_contract.deployments import SERVER_STATES
from modelforge_contract.models import REPLICA_STATES

from ..core.settings import Settings
from ..deployments import servers
from ..fleet.nodes import liveness_of
from ..models import replicas
from ..store.database import Store
from ..store.tables import Node
from ..work import items

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _NodesByLiveness(Collector):
    def __init__(self, store: Store, settings: Settings) -> None:
        self.store, self.settings = store, settings

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "modelforge_nodes", "Nodes by liveness, computed at scrape time.", labels=["liveness"]
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Names only: registering must not query the store."""
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.store.connection():
            rows = list(Node.select(Node.last_heartbeat_at, Node.decommissioned_at))
        now = self.store.clock.now()
        tally = Tally(liveness_of(row, now, self.settings) for row in rows)
        family = self._family()
        for state in LIVENESS_STATES:
            family.add_metric([state], tally.get(state, 0))
        yield family


class _WorkByState(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "modelforge_work_items", "Work items by state (queue depth).", labels=["state"]
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for state, count in items.counts_by_state(self.store).items():
            family.add_metric([state], count)
        yield family


class _ReplicasByState(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "modelforge_model_replicas",
            "Model replicas by stored state (a present one not measured since its node's "
            "enrollment or a restore is shown pending in the API).",
            labels=["state"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        counts = replicas.replica_counts(self.store)
        for state in REPLICA_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


class _ServersByState(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "modelforge_deployment_servers",
            "Deployment servers by state (docs/deployments.md).",
            labels=["state"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        counts = servers.server_counts(self.store)
        for state in SERVER_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


class Metrics:
    """The counters the web layer moves, and the registry that exposes them."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self.heartbeats = Counter(
            "modelforge_heartbeats_received",
            "Heartbeats accepted from agents.",
            registry=self.registry,
        )
        self.heartbeats_unwritten = Counter(
            "modelforge_heartbeats_unwritten",
            "Heartbeats answered without a store write: the node heartbeated faster than "
            "every half interval.",
            registry=self.registry,
        )
        self.telemetry_dropped = Counter(
            "modelforge_telemetry_dropped_samples",
            "Telemetry samples dropped, by node: published faster than "
            "MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS allows (a node appears once it has "
            "dropped one).",
            ["node_id"],
            registry=self.registry,
        )
        self.enrollments = Counter(
            "modelforge_enrollment_outcomes",
            "Enrollment attempts by outcome code.",
            ["code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "modelforge_request_duration_seconds",
            "Time to answer a request, by route.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        # The client API relayed over agents' tunnels (issue 26), by deployment.
        self.relay_requests = Counter(
            "modelforge_relay_requests",
            "Client requests relayed to a deployment's server, by deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.relay_key_requests = Counter(
            "modelforge_relay_key_requests",
            "Client requests by API key id (never the key).",
            ["key_id"],
            registry=self.registry,
        )
        self.relay_errors = Counter(
            "modelforge_relay_errors",
            "Relayed requests that ended in an error, by deployment and code.",
            ["deployment", "code"],
            registry=self.registry,
        )
        self.relay_failovers = Counter(
            "modelforge_relay_failovers",
            "Relayed requests sent once more, to another running server of their deployment, "
            "because their server was lost before the answer's head: by deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.relay_cold_starts = Counter(
            "modelforge_relay_cold_starts",
            "Client requests that found their deployment unloaded (idle) and were held while "
            "it started: by deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.relay_seconds = Histogram(
            "modelforge_relay_duration_seconds",
            "Time from a relayed request to its last byte, by deployment.",
            ["deployment"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0),
        )
        self.relay_tokens = Counter(
            "modelforge_relay_tokens",
            "Tokens of relayed answers, where the runtime reports them (its usage): by "
            "deployment and kind (prompt, completion).",
            ["deployment", "kind"],
            registry=self.registry,
        )
        self.relay_tunnel_errors = Counter(
            "modelforge_relay_tunnel_protocol_errors",
            "Tunnels closed for a frame that broke the tunnel contract.",
            registry=self.registry,
        )
        # Set by the server that serves this app (server.create_server).
        self.connections_open = Gauge(
            "modelforge_connections_open",
            "Client connections open now.",
            registry=self.registry,
        )
        self.requests_queued = Gauge(
            "modelforge_requests_queued",
            "Requests received and waiting for a worker thread (MODELFORGE_THREADS).",
            registry=self.registry,
        )
        self.buffered_bytes = Gauge(
            "modelforge_buffered_request_bytes",
            "Bytes of unfinished requests held in memory now (MODELFORGE_MAX_BUFFERED_BYTES "
            "bounds it).",
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "modelforge_connections_closed",
            "Connections the control plane closed or refused: idle too long (idle), a request "
            "not received within MODELFORGE_REQUEST_TIMEOUT_SECONDS (request_timeout), the "
            "oldest idle ones at the connection limit (evicted), a body past the buffered "
            "bound (buffer_full), an address past its share (per_address), an agent tunnel "
            "past the front's cap (tunnels_full).",
            ["reason"],
            registry=self.registry,
        )
        self.work_claims = Counter(
            "modelforge_work_claims",
            "Claims by agents: 'leased', or the reason nothing was leased.",
            ["result"],
            registry=self.registry,
        )
        self.lease_expiries = Counter(
            "modelforge_work_lease_expiries",
            "Leases that expired without a completion.",
            registry=self.registry,
        )
        self.work_completion = Histogram(
            "modelforge_work_completion_seconds",
            "Time from submission to completion of a work item, by outcome.",
            ["outcome"],
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
        )
        self.blob_bytes_served = Counter(
            "modelforge_blob_bytes_served",
            "Bytes of model blobs served to agents from the seed cache (GET /agent/blobs).",
            registry=self.registry,
        )
        self.registry.register(_NodesByLiveness(store, settings))
        self.registry.register(_WorkByState(store))
        self.registry.register(_ReplicasByState(store))
        self.registry.register(_ServersByState(store))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
