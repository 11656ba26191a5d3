"""The agent's side of the work plane: watch the local runtime worker, claim, run, complete.

The agent asks for work (the control plane never dials a node, invariant 1) only while
its worker answers ``/v1/info`` compatibly and a slot is free. A lease is relayed to the
worker over its unix socket and renewed while the worker runs; the outcome is completed
under the lease. A lost lease (409 ``LEASE_LOST``) means the item is no longer ours: its
result is dropped. When the worker cannot run an item (down, incompatible) the lease is
left to expire, so the item goes back to the queue for a node that can. Log lines name
method, path and status, never a body (invariant 10).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelforge_contract import (
    COMPATIBLE,
    HEADER_CLAIM_REASON,
    HEADER_WORKER_PROTOCOL,
    LEASE_LOST,
    PATH_AGENT_WORK_CLAIM,
    PATH_AGENT_WORK_COMPLETE,
    PATH_AGENT_WORK_RENEW,
    WORK_CANCELLED,
    WORK_TIMEOUT_MAX_SECONDS,
    WORKER_COMPATIBILITY_NEXT_STEPS,
    WORKER_PATH_CANCEL,
    WORKER_PATH_INFO,
    WORKER_PATH_RUN,
    WORKER_PROTOCOL_VERSION,
    work_path,
    worker_compatibility_of,
)

from .backoff import BACKOFF_STEPS, Backoff, seconds
from .client import ControlPlaneClient, Refused, TransportFailure, checked_node_id, printable
from .settings import AgentSettings

log = logging.getLogger(__name__)

INFO_TIMEOUT = 5.0
RUN_GRACE_SECONDS = 30.0  # beyond the item's timeout, for the worker to answer
# A running item's lease is renewed every third of its period, and at least this often: the
# renewal is how the agent learns that an item was cancelled, so a cancel stops a run within
# about this long (docs/work.md).
RENEW_MAX_SECONDS = 5.0
STOP_WAIT_SECONDS = 30.0  # for the worker's run to end once it was told to stop
# What the agent accepts in a lease (anything else is refused, never run).
LEASE_SECONDS_RANGE = (1.0, 86400.0)


# -- the worker, over its unix socket ------------------------------------------------


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except OSError:
            sock.close()
            raise
        self.sock = sock


class WorkerUnavailable(Exception):
    """No usable answer from the worker; the message names method, path and what happened."""


class WorkerClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, dict[str, Any]]:
        connection = _UnixConnection(self.socket_path, timeout)
        headers = {HEADER_WORKER_PROTOCOL: str(WORKER_PROTOCOL_VERSION)}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            raw = response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            raise WorkerUnavailable(f"{type(exc).__name__} on {method} {path}") from None
        finally:
            connection.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise WorkerUnavailable(f"BadResponse on {method} {path} (HTTP {status})")
        return status, answer

    def info(self) -> dict[str, Any]:
        status, answer = self._request("GET", WORKER_PATH_INFO, None, INFO_TIMEOUT)
        if status != 200:
            raise WorkerUnavailable(f"HTTP {status} on GET {WORKER_PATH_INFO}")
        return answer

    def run(self, lease: dict[str, Any]) -> dict[str, Any]:
        body = {
            "capability": lease["capability"],
            "input": lease["input"],
            "timeout_seconds": lease["timeout_seconds"],
            "work_id": lease["work_id"],
            # The GPUs the lease holds, by UUID: the worker gives the run exactly these.
            "gpus": list(lease.get("gpus") or []),
        }
        timeout = lease["timeout_seconds"] + RUN_GRACE_SECONDS
        status, answer = self._request("POST", WORKER_PATH_RUN, body, timeout)
        if status != 200 or answer.get("outcome") not in ("succeeded", "failed"):
            raise WorkerUnavailable(f"HTTP {status} on POST {WORKER_PATH_RUN}")
        return answer

    def cancel(self, work_id: str) -> int:
        """Ask the worker to stop the runs of ``work_id`` (a container is killed); how many."""
        body = {"work_id": work_id}
        status, answer = self._request("POST", WORKER_PATH_CANCEL, body, INFO_TIMEOUT * 6)
        stopped = answer.get("cancelled")
        if status != 200 or isinstance(stopped, bool) or not isinstance(stopped, int):
            raise WorkerUnavailable(f"HTTP {status} on POST {WORKER_PATH_CANCEL}")
        return stopped


LEASE_GPUS_MAX = 64
_GPU_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")  # GPU-…, MIG-…; no comma


def _number_in(value: object, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return float(value)


def checked_lease(lease: dict[str, Any], offered: tuple[str, ...]) -> tuple[dict | None, str]:
    """The lease with the fields the agent uses checked, or None and what is wrong with it.

    A lease comes from the control plane, which the agent does not have to believe: an id
    that could forge a log line or a path, a capability the worker never offered, a timeout
    that is not a number of seconds — any of these and the lease is refused, not run.
    """
    problems = []
    work_id, lease_id = (
        checked_node_id(lease.get("work_id")),
        checked_node_id(lease.get("lease_id")),
    )
    if work_id is None:
        problems.append("work_id is not an id")
    if lease_id is None:
        problems.append("lease_id is not an id")
    capability = lease.get("capability")
    if not isinstance(capability, str) or capability not in offered:
        problems.append("capability is not one this node's worker offers")
    if not isinstance(lease.get("input"), dict):
        problems.append("input is not an object")
    timeout = _number_in(lease.get("timeout_seconds"), 0.001, WORK_TIMEOUT_MAX_SECONDS)
    if timeout is None:
        problems.append(
            f"timeout_seconds is not a number of seconds up to {WORK_TIMEOUT_MAX_SECONDS}"
        )
    lease_seconds = _number_in(lease.get("lease_seconds"), *LEASE_SECONDS_RANGE)
    if lease_seconds is None:
        problems.append("lease_seconds is not a number of seconds")
    attempt = lease.get("attempt")
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)):
        problems.append("attempt is not a whole number")
    gpus = lease.get("gpus") or []
    if (
        not isinstance(gpus, list)
        or len(gpus) > LEASE_GPUS_MAX
        or not all(isinstance(g, str) and _GPU_UUID.fullmatch(g) for g in gpus)
        or len(set(gpus)) != len(gpus)
    ):
        problems.append("gpus is not a list of distinct GPU UUIDs")
    if problems:
        return None, "; ".join(problems)
    checked = {
        **lease,
        "work_id": work_id,
        "lease_id": lease_id,
        "timeout_seconds": timeout,
        "lease_seconds": lease_seconds,
        "gpus": gpus,
    }
    return checked, ""


@dataclass(frozen=True)
class WorkerState:
    """What the worker said at the last check, and whether the agent may claim for it."""

    reachable: bool
    protocol: int | None = None
    version: str | None = None
    capabilities: tuple[str, ...] = ()
    accelerator_mode: str | None = None
    problem: str | None = None  # why it is not usable; None when it is
    runtimes: tuple[str, ...] = ()  # what its serve capability can launch (issue 25)

    @property
    def compatibility(self) -> str:
        return worker_compatibility_of(self.protocol) if self.reachable else "UNKNOWN"

    @property
    def usable(self) -> bool:
        return self.problem is None

    def health(self) -> dict[str, Any]:
        """The heartbeat's ``health.worker``."""
        return {
            "reachable": self.reachable,
            "protocol": self.protocol,
            "version": self.version,
            "capabilities": list(self.capabilities),
            "runtimes": list(self.runtimes),
            "accelerator_mode": self.accelerator_mode,
            "message": self.problem,
        }


def state_from_info(info: dict[str, Any], expected_mode: str) -> WorkerState:
    protocol = info.get("protocol")
    protocol = protocol if isinstance(protocol, int) and not isinstance(protocol, bool) else None
    capabilities = tuple(
        str(c)[:64] for c in (info.get("capabilities") or []) if isinstance(c, str)
    )[:32]
    version = info.get("worker_version")
    mode = info.get("accelerator_mode")
    runtimes = tuple(str(r)[:32] for r in (info.get("runtimes") or []) if isinstance(r, str))[:16]
    state = WorkerState(
        True,
        protocol,
        version[:64] if isinstance(version, str) else None,
        capabilities,
        mode[:16] if isinstance(mode, str) else None,
        runtimes=runtimes,
    )
    answer = state.compatibility
    problem = None
    if answer != COMPATIBLE:
        problem = (
            f"the runtime worker speaks protocol {protocol} ({answer}): "
            f"{WORKER_COMPATIBILITY_NEXT_STEPS[answer]}"
        )
    elif state.accelerator_mode != expected_mode:
        problem = (
            f"the runtime worker runs in {printable(state.accelerator_mode)} mode but this node "
            f"is {expected_mode}: set MODELFORGE_WORKER_ACCELERATOR_MODE={expected_mode}"
        )
    elif not capabilities:
        problem = "the runtime worker offers no capability"
    return WorkerState(**{**state.__dict__, "problem": problem})


class WorkerWatch:
    """Asks the worker for ``/v1/info`` every few seconds; logs when the answer changes."""

    def __init__(
        self,
        settings: AgentSettings,
        expected_mode: str,
        stop: threading.Event,
        on_change: Callable[[WorkerState], None] | None = None,
    ) -> None:
        self.client = WorkerClient(settings.worker_socket)
        self.expected_mode = expected_mode
        self.interval = settings.worker_check_seconds
        self.stop = stop
        self.on_change = on_change  # told each new state (status.json keeps it)
        self._state = WorkerState(False, problem="the runtime worker has not been asked yet")
        self._lock = threading.Lock()

    def current(self) -> WorkerState:
        with self._lock:
            return self._state

    def refresh(self) -> WorkerState:
        try:
            state = state_from_info(self.client.info(), self.expected_mode)
        except WorkerUnavailable as unavailable:
            state = WorkerState(
                False,
                problem=f"the runtime worker on {self.client.socket_path} does not answer "
                f"({unavailable})",
            )
        with self._lock:
            previous, self._state = self._state, state
        if state != previous:
            if state.usable:
                log.info(
                    "runtime worker %s (worker protocol %s, %s mode) offers %s",
                    printable(state.version),
                    state.protocol,
                    printable(state.accelerator_mode),
                    ", ".join(printable(c) for c in state.capabilities),
                )
            else:
                log.warning("%s; not claiming work, reporting degraded health", state.problem)
            if self.on_change is not None:
                self.on_change(state)
        return state

    def run(self) -> None:
        while not self.stop.is_set():
            self.refresh()
            if self.stop.wait(self.interval):
                return

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="worker-watch", daemon=True)
        thread.start()
        return thread


# -- the work loop ------------------------------------------------------------------


@dataclass
class WorkLoop:
    """One thread per slot: claim when the worker is usable, run, renew, complete."""

    settings: AgentSettings
    node_id: str
    client: ControlPlaneClient
    watch: WorkerWatch
    stop: threading.Event
    refuse: Callable[[Refused], None]  # a refused credential or protocol stops the agent
    steps: tuple[float, ...] = BACKOFF_STEPS
    _reason: str | None = field(default=None, init=False)

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.slot, name=f"work-slot-{i}", daemon=True)
            for i in range(self.settings.work_slots)
        ]
        for thread in threads:
            thread.start()
        return threads

    def slot(self) -> None:
        """One slot's thread: the slot loop, started again after anything it did not expect,
        so no answer of the control plane or the worker can leave the node claiming nothing."""
        while not self.stop.is_set():
            try:
                self.slot_loop()
                return
            except Exception as exc:  # logged by type only: its text may quote an answer
                log.error("work slot stopped by %s; claiming again in %s",
                          type(exc).__name__, seconds(self.steps[-1]))  # fmt: skip
                self.stop.wait(self.steps[-1])

    def slot_loop(self) -> None:
        backoff = Backoff(self.steps)
        while not self.stop.is_set():
            state = self.watch.current()
            if not state.usable:
                self.stop.wait(min(self.settings.work_poll_seconds, self.watch.interval))
                continue
            try:
                lease = self.claim(state)
            except (TransportFailure, Refused) as failure:
                if isinstance(failure, Refused) and self._terminal(failure):
                    return
                step, delay = backoff.next_step()
                log.warning(
                    "%s (backoff %s): retry in %s", failure.describe(), backoff.span, seconds(step)
                )
                self.stop.wait(delay)
                continue
            backoff.reset()
            if lease is None:
                self.stop.wait(self.settings.work_poll_seconds)
                continue
            self.execute(lease)

    def _terminal(self, refusal: Refused) -> bool:
        if refusal.credential_refused or refusal.protocol_incompatible:
            self.refuse(refusal)
            return True
        return False

    def claim(self, state: WorkerState) -> dict[str, Any] | None:
        body = {
            "node_id": self.node_id,
            "capabilities": list(state.capabilities),
            # The control plane leases a node at most this many items (or its own maximum).
            "work_slots": self.settings.work_slots,
        }
        # A 429 (claiming too fast) is a Refused like any other: slot_loop backs off.
        answer = self.client.call("POST", PATH_AGENT_WORK_CLAIM, body)
        lease = answer.get("lease")
        if not isinstance(lease, dict):
            reason = (answer.get("headers") or {}).get(HEADER_CLAIM_REASON.lower())
            if reason != self._reason:
                log.info("no work for this node (%s)", printable(reason or "no reason given"))
                self._reason = reason
            return None
        self._reason = None
        checked, problem = checked_lease(lease, state.capabilities)
        if checked is None:
            log.warning(
                "refusing a malformed lease from the control plane (work %s, capability %s): "
                "%s; claiming again in %s",
                printable(lease.get("work_id")),
                printable(lease.get("capability")),
                problem,
                seconds(self.steps[0]),
            )
            self.stop.wait(self.steps[0])
            return None
        log.info(
            "work %s leased: %s, attempt %s, timeout %ss",
            checked["work_id"],
            checked["capability"],
            checked.get("attempt"),
            f"{checked['timeout_seconds']:g}",
        )
        return checked

    def execute(self, lease: dict[str, Any]) -> None:
        """Relay to the worker, renewing until it answers; then complete (or let go)."""
        box: dict[str, Any] = {}
        runner = threading.Thread(
            target=self._relay, args=(lease, box), name=f"run-{lease['work_id']}", daemon=True
        )
        began = time.monotonic()
        runner.start()
        renew_every = max(0.2, min(RENEW_MAX_SECONDS, lease["lease_seconds"] / 3))
        give_up_at = began + lease["timeout_seconds"] + RUN_GRACE_SECONDS
        held = True
        while True:
            runner.join(renew_every)
            if not runner.is_alive() or self.stop.is_set():
                break
            if held and time.monotonic() > give_up_at:
                log.warning("work %s: the worker overran its timeout; letting the lease go",
                            lease["work_id"])  # fmt: skip
                held = False
            if held:
                held = self.renew(lease)
                if not held:
                    self._stop_run(lease, runner)
        if self.stop.is_set() or not held:
            return  # the item is not ours any more (or we are stopping): the lease expires
        if "answer" not in box:
            log.warning(
                "work %s: %s; leaving the lease to expire so another node can run it",
                lease["work_id"],
                box.get("problem", "the worker gave no answer"),
            )
            self.watch.refresh()
            return
        self.complete(lease, box["answer"], time.monotonic() - began)

    def _stop_run(self, lease: dict[str, Any], runner: threading.Thread) -> None:
        """The item is no longer ours: the worker stops its run, and the slot waits for it."""
        try:
            stopped = self.watch.client.cancel(lease["work_id"])
        except WorkerUnavailable as unavailable:
            log.warning("work %s: the runtime worker could not stop its run (%s)",
                        lease["work_id"], unavailable)  # fmt: skip
            return
        runner.join(STOP_WAIT_SECONDS)
        log.info("work %s: the runtime worker stopped %d run(s)%s", lease["work_id"], stopped,
                 "" if not runner.is_alive() else "; it has not answered yet")  # fmt: skip

    def _relay(self, lease: dict[str, Any], box: dict[str, Any]) -> None:
        try:
            box["answer"] = self.watch.client.run(lease)
        except WorkerUnavailable as unavailable:
            box["problem"] = f"the runtime worker did not answer ({unavailable})"

    def renew(self, lease: dict[str, Any]) -> bool:
        """False once the lease is lost; a transport failure is retried at the next turn."""
        path = work_path(PATH_AGENT_WORK_RENEW, lease["work_id"])
        body = {"node_id": self.node_id, "lease_id": lease["lease_id"]}
        try:
            self.client.call("POST", path, body)
        except TransportFailure as failure:
            log.warning("%s: will renew again", failure.describe())
            return True
        except Refused as refusal:
            if self._terminal(refusal):
                return False
            if refusal.code == LEASE_LOST:
                if refusal.details.get("lease_end") == WORK_CANCELLED:
                    log.warning("%s: work %s was cancelled; stopping its run",
                                refusal.describe(), lease["work_id"])  # fmt: skip
                else:
                    log.warning(
                        "%s: lease lost, dropping work %s", refusal.describe(), lease["work_id"]
                    )
                return False
            log.warning("%s: will renew again", refusal.describe())
        return True

    def complete(self, lease: dict[str, Any], answer: dict[str, Any], took: float) -> None:
        path = work_path(PATH_AGENT_WORK_COMPLETE, lease["work_id"])
        body = {
            "node_id": self.node_id,
            "lease_id": lease["lease_id"],
            "outcome": answer["outcome"],
            "result": answer.get("result") if isinstance(answer.get("result"), dict) else None,
            "log_tail": answer.get("log_tail") if isinstance(answer.get("log_tail"), str) else None,
            "error": _error_of(answer.get("error")),
        }
        backoff = Backoff(self.steps)
        deadline = time.monotonic() + lease["lease_seconds"]
        while not self.stop.is_set():
            try:
                self.client.call("POST", path, body)
            except TransportFailure as failure:
                problem = failure.describe()
            except Refused as refusal:
                if self._terminal(refusal):
                    return
                if refusal.code == LEASE_LOST:
                    log.warning("%s: lease lost, result of work %s dropped",
                                refusal.describe(), lease["work_id"])  # fmt: skip
                    return
                if not refusal.transient:
                    log.error("%s: the control plane refused the completion of work %s",
                              refusal.describe(), lease["work_id"])  # fmt: skip
                    return
                problem = refusal.describe()
            else:
                code = f" ({body['error']['code']})" if body["error"] else ""
                log.info("work %s %s in %.2fs%s", lease["work_id"], body["outcome"], took, code)
                return
            step, delay = backoff.next_step()
            if time.monotonic() + delay > deadline:
                log.error("%s: giving up on work %s; its lease will expire", problem,
                          lease["work_id"])  # fmt: skip
                return
            log.warning("%s (backoff %s): retry in %s", problem, backoff.span, seconds(step))
            self.stop.wait(delay)


def _error_of(value: Any) -> dict[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("code"), str):
        return None
    return {"code": value["code"][:64], "message": str(value.get("message") or "")[:1000]}
