"""The publishing loop: heartbeat, inventory and telemetry, each on its own thread.

Each publication retries transport failures on its own backoff (1 s … 16 s,
reset on success), so a slow or failing one never starves the others. A
refused credential (401/403) or an incompatible protocol (426) is terminal:
the first publication to see one stops them all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from modelforge_contract import (
    EXIT_AGENT_FAILED,
    EXIT_PROTOCOL_INCOMPATIBLE,
    INVENTORY_REFRESH_SECONDS,
    PATH_AGENT_HEARTBEAT,
    PATH_AGENT_INVENTORY,
    PATH_AGENT_TELEMETRY,
    REPUBLISH_INVENTORY,
    REPUBLISH_TELEMETRY,
)

from . import __version__
from .backoff import BACKOFF_STEPS, Backoff, seconds
from .client import (
    HEARTBEAT_INTERVAL_RANGE,
    ControlPlaneClient,
    Refused,
    TransportFailure,
    checked_interval,
    incompatible_message,
    printable,
)
from .identity import NodeState
from .nvidia import PreflightFailure, PreflightResult
from .refusals import AgentExit, credential_refused
from .republish import RepublishRequests
from .settings import AgentSettings
from .work import WorkerWatch

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL = 10
Wait = Callable[[float], bool]  # sleeps; True when the agent is stopping


def call_with_backoff(
    client: ControlPlaneClient,
    method: str,
    path: str,
    make_body: Callable[[], dict[str, Any]],
    *,
    stop: threading.Event,
    wait: Wait,
    steps: Sequence[float] = BACKOFF_STEPS,
    retry_refusal: Callable[[Refused], bool],
    authenticated: bool = True,
) -> dict[str, Any] | None:
    """The answer once a call succeeds; None when stopped; Refused when not to retry."""
    backoff = Backoff(steps)
    while not stop.is_set():
        try:
            return_value = client.call(method, path, make_body(), authenticated=authenticated)
        except TransportFailure as failure:
            problem, code = failure.describe(), None
        except Refused as refusal:
            if not retry_refusal(refusal):
                raise
            problem, code = refusal.describe(), refusal.code
        else:
            if backoff.failures:
                log.info("%s %s succeeded after %d failed tries", method, path, backoff.failures)
            return return_value
        step, delay = backoff.next_step()
        suffix = f"; error code {code}" if code else ""
        log.warning("%s (backoff %s): retry in %s%s", problem, backoff.span, seconds(step), suffix)
        if wait(delay):
            break
    return None


class Health:
    """What the heartbeat says about the agent and its GPU probe (thread-safe)."""

    def __init__(self, gpu_expected: bool, worker: WorkerWatch | None = None) -> None:
        self._lock = threading.Lock()
        self.gpu_expected = gpu_expected
        self.failure: PreflightFailure | None = None
        self.started = time.monotonic()
        self.worker = worker  # the runtime worker beside the agent (issue 13)
        # The tunnel's state, "up" or "down" (issue 26); unset or None: not reported.
        self.tunnel: Callable[[], str | None] | None = None

    def gpu_ok(self) -> None:
        with self._lock:
            if self.failure is not None:
                log.info("NVML reads work again; reporting healthy")
            self.failure = None

    def gpu_failed(self, failure: PreflightFailure) -> None:
        with self._lock:
            if self.failure is None or self.failure.detail != failure.detail:
                log.warning("%s; reporting degraded health, nothing invented", failure)
            self.failure = failure

    def body(self) -> dict[str, Any]:
        with self._lock:
            failure = self.failure
        if not self.gpu_expected:
            probe, preflight = "not_applicable", "not_applicable"
        else:
            probe, preflight = ("failed" if failure else "ok"), "passed"
        body = {
            "status": "degraded" if failure else "ok",
            "gpu_probe": probe,
            "preflight": preflight,
            "message": str(failure)[:500] if failure else None,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
        }
        if self.worker is not None:
            worker = self.worker.current()
            body["worker"] = worker.health()
            if not worker.usable:
                # A node that cannot run work says so rather than looking healthy.
                body["status"] = "degraded"
                body["message"] = (body["message"] or worker.problem or "")[:500]
        tunnel = self.tunnel() if self.tunnel is not None else None
        if tunnel is not None:
            body["tunnel"] = tunnel
        return body


def host_facts(hostname: str | None = None) -> dict[str, Any]:
    """What the inventory says of the host; its name too when ``hostname`` is given."""
    try:
        os_name = platform.freedesktop_os_release().get("PRETTY_NAME") or platform.system()
    except OSError:
        os_name = platform.system()
    facts: dict[str, Any] = {"os": os_name[:200], "kernel": platform.release()[:200]}
    if hostname:
        facts["hostname"] = hostname[:253]
    if os.cpu_count():
        facts["cpu_count"] = os.cpu_count()
    # Not every platform says; the field is optional.
    with contextlib.suppress(ValueError, OSError):
        facts["memory_total_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return facts


def _fingerprint(inventory: dict[str, Any]) -> str:
    """What counts as a change: everything but the free space, which moves all the time."""
    stable = {
        **inventory,
        "storage_roots": [
            {k: v for k, v in root.items() if k != "free_bytes"}
            for root in inventory.get("storage_roots", [])
        ],
    }
    return json.dumps(stable, sort_keys=True)


class Publisher:
    """Runs the three publications until stopped or refused; ``run()`` returns the outcome."""

    def __init__(
        self,
        settings: AgentSettings,
        state: NodeState,
        client: ControlPlaneClient,
        preflight: PreflightResult,
        stop: threading.Event,
        *,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        steps: Sequence[float] = BACKOFF_STEPS,
        wait: Wait | None = None,
        worker: WorkerWatch | None = None,
    ) -> None:
        self.settings, self.state, self.client = settings, state, client
        self.preflight, self.stop, self.steps = preflight, stop, steps
        self.wait: Wait = wait or stop.wait
        self.heartbeat_interval = checked_interval(heartbeat_interval) or DEFAULT_HEARTBEAT_INTERVAL
        self.health = Health(preflight.nvml is not None, worker)
        self.accelerators = list(preflight.accelerators)
        self._outcome: AgentExit | None = None
        self.refused_code: str | None = None
        self._ignored_interval: object = None
        self._lock = threading.Lock()
        self.republish = RepublishRequests()  # what the heartbeat answer asks for again
        # Telemetry names only the GPUs of the inventory the control plane holds: it waits
        # for the first inventory to be accepted.
        self.inventory_published = threading.Event()
        # Models (issue 24): the model loop's report (the inventory's ``models``) and where
        # a heartbeat answer's ``models_generation`` goes; unset, neither is sent or read.
        self.models_report: Callable[[], list[dict[str, Any]]] | None = None
        self.models_generation: Callable[[object], None] | None = None
        # The same for deployments (issue 25): the answer's ``servers_generation``.
        self.servers_generation: Callable[[object], None] | None = None
        # Optional inventory fields the control plane said it takes (its heartbeat answer's
        # ``accepts``): an older one refuses a field it does not know, so none is sent
        # before it says so.
        self.accepts: frozenset[str] = frozenset()

    # -- shared ------------------------------------------------------------------

    def _finish(self, outcome: AgentExit, refused_code: str | None = None) -> None:
        with self._lock:
            if self._outcome is None:
                self._outcome, self.refused_code = outcome, refused_code
        self.stop.set()

    def _publish(
        self, method: str, path: str, make_body: Callable[[], dict[str, Any]]
    ) -> dict[str, Any] | None:
        try:
            return call_with_backoff(
                self.client,
                method,
                path,
                make_body,
                stop=self.stop,
                wait=self.wait,
                steps=self.steps,
                retry_refusal=lambda r: not (r.credential_refused or r.protocol_incompatible),
            )
        except Refused as refusal:
            self.refuse(refusal)
            return None

    def refuse(self, refusal: Refused) -> None:
        """A refused credential (401/403) or protocol (426) stops every publication."""
        log.error("%s", refusal.describe())
        if refusal.protocol_incompatible:
            self._finish(AgentExit(EXIT_PROTOCOL_INCOMPATIBLE, incompatible_message(refusal)))
        else:
            self._finish(credential_refused(refusal.code), refusal.code or "HTTP_REFUSED")

    # -- the three publications ----------------------------------------------------

    def heartbeat_loop(self) -> None:
        body = lambda: {  # noqa: E731 - rebuilt per try so health and uptime are current
            "node_id": self.state.node_id,
            "agent_version": __version__,
            "health": self.health.body(),
        }
        while True:
            sent_at = time.monotonic()
            answer = self._publish("POST", PATH_AGENT_HEARTBEAT, body)
            if answer is None:
                return
            self.republish.ask(answer.get("republish"), sent_at)
            self._take_accepts(answer.get("accepts"))
            if self.models_generation is not None:
                self.models_generation(answer.get("models_generation"))
            if self.servers_generation is not None:
                self.servers_generation(answer.get("servers_generation"))
            self._take_interval(answer.get("heartbeat_interval_seconds"))
            if self.stop.wait(self.heartbeat_interval):
                return

    def _take_accepts(self, value: object) -> None:
        accepts = frozenset(
            item for item in (value if isinstance(value, list) else [])[:64]
            if isinstance(item, str) and len(item) <= 64
        )  # fmt: skip
        if accepts != self.accepts:
            self.accepts = accepts
            if "host.hostname" in accepts:  # the node's name follows this host's at once
                self.republish.ask([REPUBLISH_INVENTORY], time.monotonic())

    def _take_interval(self, value: object) -> None:
        """Follow the control plane's interval, only when it is one an agent can keep."""
        interval = checked_interval(value)
        if interval is not None:
            self.heartbeat_interval = interval
        elif value is not None and value != self._ignored_interval:
            self._ignored_interval = value  # said once, not on every heartbeat
            low, high = HEARTBEAT_INTERVAL_RANGE
            log.warning(
                "ignoring heartbeat_interval_seconds=%s from the control plane (not a number "
                "of seconds in %g..%g); heartbeating every %gs",
                printable(value, 32),
                low,
                high,
                self.heartbeat_interval,
            )

    def read_inventory(self) -> dict[str, Any]:
        nvml = self.preflight.nvml
        accelerators = nvml.read_inventory() if nvml else []
        self.accelerators = accelerators
        roots = []
        for path, role in (
            (self.settings.state_volume, "state"),
            (self.settings.artifacts_dir, "artifacts"),
            (self.settings.quarantine_dir, "quarantine"),
        ):
            try:
                usage = shutil.disk_usage(path)
            except OSError as exc:
                log.warning("cannot measure the %s root: %s", role, exc.strerror)
                continue
            roots.append(
                {
                    "path": str(path),
                    "role": role,
                    "total_bytes": usage.total,
                    "free_bytes": usage.free,
                }
            )
        inventory = {
            "node_id": self.state.node_id,
            "agent_version": __version__,
            "host": host_facts(self.settings.hostname if "host.hostname" in self.accepts else None),
            "accelerators": accelerators,
            "storage_roots": roots,
        }
        if self.models_report is not None:
            inventory["models"] = self.models_report()
        if self.health.worker is not None:
            inventory["worker_version"] = self.health.worker.current().version
        return inventory

    def wake_inventory(self) -> None:
        """Publish the inventory now (a model changed state or moved bytes)."""
        self.republish.ask([REPUBLISH_INVENTORY], time.monotonic())

    def inventory_loop(self) -> None:
        published, published_at = None, float("-inf")
        while True:
            try:
                inventory = self.read_inventory()
            except PreflightFailure as failure:
                self.health.gpu_failed(failure)
                inventory = None
            # On change, and also unchanged once per refresh period, so the control plane
            # sees a fresh measurement (its readiness refuses an inventory that is too old),
            # and at once when the control plane asks (after a restore it has none).
            due = time.monotonic() - published_at >= INVENTORY_REFRESH_SECONDS
            due = self.republish.due(REPUBLISH_INVENTORY, published_at) or due
            if inventory is not None and (due or _fingerprint(inventory) != published):
                if self._publish("PUT", PATH_AGENT_INVENTORY, lambda body=inventory: body) is None:
                    return
                before, published_at = published, time.monotonic()
                published = _fingerprint(inventory)
                self.inventory_published.set()
                # A pull's progress republishes every second: said once, not per second.
                only_models = (
                    before is not None
                    and before != published
                    and _fingerprint({**inventory, "models": None})
                    == _fingerprint({**json.loads(before), "models": None})
                )
                (log.debug if only_models else log.info)(
                    "inventory published: %d accelerator(s)", len(inventory["accelerators"])
                )
            interval = self.settings.inventory_interval_seconds
            if self.republish.wait(REPUBLISH_INVENTORY, self.stop, interval):
                return

    def telemetry_body(self) -> dict[str, Any]:
        samples = self.preflight.nvml.read_telemetry(self.accelerators)
        self.health.gpu_ok()
        return {"node_id": self.state.node_id, "samples": samples}

    def telemetry_loop(self) -> None:
        # The control plane keeps a node's telemetry at most once per its
        # MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS (5 s by default; faster ones are dropped).
        while not self.inventory_published.wait(0.5):
            if self.stop.is_set():
                return
        while True:
            try:
                if self._publish("POST", PATH_AGENT_TELEMETRY, self.telemetry_body) is None:
                    return
            except PreflightFailure as failure:
                # Invariant 9: a failed read is reported as degraded health, never as numbers.
                self.health.gpu_failed(failure)
            interval = self.settings.telemetry_interval_seconds
            if self.republish.wait(REPUBLISH_TELEMETRY, self.stop, interval):
                return
            self.republish.due(REPUBLISH_TELEMETRY, 0.0)  # this turn publishes anyway

    # -- running -------------------------------------------------------------------

    def _guarded(self, loop: Callable[[], None]) -> Callable[[], None]:
        """A loop that fails unexpectedly stops the agent with a non-zero status, so its
        supervisor restarts it: a process that stays up without heartbeating would look
        healthy while its node goes offline."""

        def run() -> None:
            try:
                loop()
            except Exception as exc:
                log.critical(
                    "%s stopped by an unexpected %s",
                    loop.__name__,
                    type(exc).__name__,
                    exc_info=True,
                )
                self._finish(
                    AgentExit(
                        EXIT_AGENT_FAILED,
                        f"{loop.__name__} failed unexpectedly ({type(exc).__name__}); the agent "
                        "exits so that its supervisor restarts it",
                    )
                )

        return run

    def start(self) -> list[threading.Thread]:
        loops = [self.heartbeat_loop, self.inventory_loop]
        if self.preflight.nvml is not None:
            loops.append(self.telemetry_loop)
        threads = [
            threading.Thread(target=self._guarded(loop), name=loop.__name__, daemon=True)
            for loop in loops
        ]
        for thread in threads:
            thread.start()
        return threads

    def run(self, poll: float = 0.2) -> AgentExit | None:
        """Publish until ``stop`` is set; the terminal refusal, if one stopped it."""
        threads = self.start()
        try:
            while not self.stop.wait(poll):
                pass
        finally:
            self.stop.set()
            # Threads blocked in a call are daemons; do not hold up a SIGTERM for them.
            deadline = time.monotonic() + 0.5
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        return self._outcome
