"""The serve loop (issue 25): run the deployment servers the control plane places here.

It fetches ``GET /agent/servers`` at start, whenever a heartbeat answer's
``servers_generation`` moves, and at least every SERVERS_REFETCH_SECONDS. For each server
listed it claims a serve lease, asks the local runtime worker to launch the runtime on the
replicated model directory with exactly the lease's GPUs, polls the runtime's readiness on
127.0.0.1 itself (the control plane never dials a node), and renews the lease while the
server runs, each renewal carrying what it sees. A runtime that exits, or never becomes
ready, is started again after a backoff (5 s, 10 s, 20 s … at most 5 min), reported
``backoff`` meanwhile, for as long as the control plane lists the server: only what needs a
person (the model's files gone, a runtime this node cannot run) is reported ``failed``.

A renewal refused ``409 LEASE_LOST`` ends that lease, never a transient error: ``restarted``
stops the runtime and claims the server again afresh; ``expired`` (the node was away) and
``replaced`` claim it again if it is still listed, adopting the runtime that still runs.

The worker owns the runtimes, so an agent restart finds them again: a server the worker
still runs is claimed again (adopted), never launched twice; one the control plane no
longer lists is stopped. Log lines name servers and states, never a body (invariant 10).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import LEASE_LOST
from modelforge_contract.deployments import (
    LEASE_END_EXPIRED,
    LEASE_END_REPLACED,
    LEASE_END_RESTARTED,
    MODEL_NOT_ON_NODE,
    PATH_AGENT_SERVER_CLAIM,
    PATH_AGENT_SERVER_RENEW,
    PATH_AGENT_SERVERS,
    ROLE_HELPER,
    ROLE_MAIN,
    RUNTIME_EXITED,
    RUNTIME_LAUNCH_FAILED,
    RUNTIME_LLAMA_CPP,
    RUNTIME_NOT_READY,
    RUNTIME_UNSUPPORTED,
    SERVER_BACKOFF,
    SERVER_FAILED,
    SERVER_PENDING,
    SERVER_RUNNING,
    SERVER_STARTING,
    SERVER_STOPPED,
    WORKER_PATH_SERVER_STOP,
    WORKER_PATH_SERVERS,
    backoff_seconds,
    server_path,
)

from .backoff import BACKOFF_STEPS, seconds
from .blobs import BlobStore
from .client import ControlPlaneClient, Refused, TransportFailure, checked_node_id, printable
from .generation import Generation
from .links import Listener
from .settings import AgentSettings
from .work import WorkerClient, WorkerUnavailable, WorkerWatch

log = logging.getLogger(__name__)

SERVERS_REFETCH_SECONDS = 30.0
TICK_SECONDS = 0.25  # while a server starts or restarts
IDLE_TICK_SECONDS = 1.0
RENEW_MAX_SECONDS = 5.0
READY_PROBE_TIMEOUT = 2.0
LAUNCH_TIMEOUT = 60.0
# The worker's launch refusals that no retry can mend: a person must change the node or the
# deployment (every other refusal is tried again after a backoff: an image loaded meanwhile,
# a port or a process limit that freed up).
NEEDS_A_PERSON = frozenset(
    {
        MODEL_NOT_ON_NODE,
        RUNTIME_UNSUPPORTED,
        "GPUS_ON_CPU_NODE",
        "IMAGE_ID_MISMATCH",
        "WORK_INPUT_INVALID",
    }
)


class ServeWorker(WorkerClient):
    """The worker's ``/v1/servers`` routes."""

    def servers(self) -> dict[str, dict[str, Any]]:
        status, answer = self._request("GET", WORKER_PATH_SERVERS, None, 10.0)
        listed = answer.get("servers")
        if status != 200 or not isinstance(listed, list):
            raise WorkerUnavailable(f"HTTP {status} on GET {WORKER_PATH_SERVERS}")
        return {s["server_id"]: s for s in listed if isinstance(s, dict) and "server_id" in s}

    def launch(self, body: dict[str, Any]) -> dict[str, Any]:
        """The launched server, or a (code, message) refusal as ServeRefused."""
        status, answer = self._request("POST", WORKER_PATH_SERVERS, body, LAUNCH_TIMEOUT)
        if status == 200 and isinstance(answer.get("server"), dict):
            return answer["server"]
        error = answer.get("error") if isinstance(answer.get("error"), dict) else {}
        if status in (400, 409) and error:
            raise ServeRefused(
                str(error.get("code") or RUNTIME_LAUNCH_FAILED)[:64],
                str(error.get("message") or "")[:500],
            )
        raise WorkerUnavailable(f"HTTP {status} on POST {WORKER_PATH_SERVERS}")

    def stop_server(self, server_id: str) -> bool:
        status, answer = self._request(
            "POST", WORKER_PATH_SERVER_STOP, {"server_id": server_id}, 60.0
        )
        if status != 200:
            raise WorkerUnavailable(f"HTTP {status} on POST {WORKER_PATH_SERVER_STOP}")
        return bool(answer.get("stopped"))


class ServeRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def ready(runtime: str, port: int, served_name: str, role: str | None = None) -> bool:
    """The runtime's own readiness answer on 127.0.0.1 (llama.cpp /health; vLLM /v1/models
    naming the served model; a split's helper, ggml-rpc-server, accepting a connection)."""
    if role == ROLE_HELPER:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=READY_PROBE_TIMEOUT).close()
        except OSError:
            return False
        return True
    path = "/health" if runtime == RUNTIME_LLAMA_CPP else "/v1/models"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_PROBE_TIMEOUT)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read(1 << 20)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
    if response.status != 200:
        return False
    if runtime == RUNTIME_LLAMA_CPP:
        return True
    try:
        listed = json.loads(body).get("data") or []
    except (ValueError, AttributeError):
        return False
    return any(isinstance(m, dict) and m.get("id") == served_name for m in listed)


@dataclass
class Held:
    """A server this agent holds a serve lease on."""

    server_id: str
    entry: dict[str, Any]  # as GET /agent/servers listed it
    lease_id: str
    lease_seconds: float
    state: str = SERVER_STARTING
    port: int | None = None
    launched_at: float | None = None  # monotonic, of the current launch
    relaunch_at: float | None = None  # monotonic: the runtime exited, start again then
    restarts: int = 0
    error: dict[str, str] | None = None
    renewed_at: float = field(default_factory=time.monotonic)
    dirty: bool = True  # a state change to report at once
    stopped: threading.Event | None = None  # set once the worker stopped it (asked to stop)


class ServeLoop:
    """One thread that keeps this node's servers as the control plane asks."""

    def __init__(
        self,
        settings: AgentSettings,
        node_id: str,
        client: ControlPlaneClient,
        watch: WorkerWatch,
        stop: threading.Event,
        refuse: Callable[[Refused], None],
        *,
        steps: tuple[float, ...] = BACKOFF_STEPS,
    ) -> None:
        self.settings, self.node_id, self.client = settings, node_id, client
        self.watch, self.stop, self.refuse, self.steps = watch, stop, refuse, steps
        self.worker = ServeWorker(settings.worker_socket)
        self.models = BlobStore(settings.artifacts_dir, settings.quarantine_dir)
        self.held: dict[str, Held] = {}
        self.generation = Generation()  # the heartbeat answer's servers_generation
        self._fetch = self.generation.wanted
        self._stops: dict[str, threading.Event] = {}  # stops in flight, by server
        # A split's main server: a loopback listener per helper (links.py), by server id;
        # each connection there rides the tunnel (set once the tunnel exists).
        self.open_link: Callable[[str, str, socket.socket], None] | None = None
        self._listeners: dict[str, list[Listener]] = {}

    def server_of(self, server_id: str) -> tuple[int, str, str | None] | None:
        """The loopback port, served name and model directory of a server this agent runs
        and saw ready (the tunnel reaches no other); None otherwise. Safe from any thread."""
        held = self.held.get(server_id)
        if held is None or held.state != SERVER_RUNNING or not held.port:
            return None
        digest = str((held.entry.get("model") or {}).get("digest") or "")
        hexdigest = digest.removeprefix("sha256:")
        model_dir = str(self.models.model_dir(hexdigest)) if len(hexdigest) == 64 else None
        return int(held.port), str(held.entry.get("deployment")), model_dir

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="serve-loop", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        self._fetch.set()
        last_fetch = float("-inf")
        while not self.stop.is_set():
            try:
                due = (
                    self._fetch.is_set() or time.monotonic() - last_fetch > SERVERS_REFETCH_SECONDS
                )
                if due and self.watch.current().usable:
                    self._fetch.clear()
                    self.sync()
                    last_fetch = time.monotonic()
                self.tick()
            except _Terminal:
                return
            except Exception as exc:  # logged by type only: its text may quote an answer
                log.error("serve loop: %s; again in %s", type(exc).__name__,
                          seconds(self.steps[-1]))  # fmt: skip
                if self.stop.wait(self.steps[-1]):
                    return
                self._fetch.set()
                continue
            busy = any(h.state == SERVER_STARTING for h in self.held.values())
            tick = TICK_SECONDS if busy else IDLE_TICK_SECONDS
            if self.watch.current().usable:
                self._fetch.wait(tick)
            else:
                # A fetch waits for the worker, so the event stays set until it answers:
                # waiting on it would return at once and spin a core. Wait the tick instead.
                self.stop.wait(tick)

    def stop_runtime(self, server_id: str) -> threading.Event:
        """Have the worker stop the server's runtime in the background: a runtime slow to
        stop (SIGTERM, up to 20 s, then SIGKILL) must not hold up the other servers'
        renewals. The event is set once it has stopped (or the worker could not say)."""
        done = threading.Event()
        self._stops[server_id] = done
        self._close_listeners(server_id)

        def stop() -> None:
            try:
                self.worker.stop_server(server_id)
            except WorkerUnavailable as unavailable:
                log.warning("server %s: the runtime worker could not stop it (%s)", server_id,
                            unavailable)  # fmt: skip
            finally:
                done.set()
                self._fetch.set()  # wakes the loop to report it

        threading.Thread(target=stop, name=f"stop-{server_id}", daemon=True).start()
        return done

    # -- control-plane calls -----------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The answer; None on a transport failure or a transient refusal (tried again at
        the next turn); a terminal refusal stops the loop; other refusals are raised."""
        try:
            return self.client.call(method, path, body)
        except TransportFailure as failure:
            log.warning("%s: the serve loop tries again", failure.describe())
            return None
        except Refused as refusal:
            if refusal.credential_refused or refusal.protocol_incompatible:
                self.refuse(refusal)
                raise _Terminal() from None
            if refusal.transient:
                log.warning("%s: the serve loop tries again", refusal.describe())
                return None
            raise

    def sync(self) -> None:
        """Fetch what should run here and make it so."""
        generation = self.generation.asking()
        answer = self._call("GET", PATH_AGENT_SERVERS, {})
        if answer is None:
            self._fetch.set()
            self.stop.wait(self.steps[0])
            return
        self.generation.fetched(answer.get("servers_generation", generation))
        wanted = {}
        for entry in answer.get("servers") or []:
            server_id = checked_node_id(entry.get("server_id")) if isinstance(entry, dict) else None
            if server_id is not None:
                wanted[server_id] = entry
        running = self.worker.servers()
        # Not listed and not held: left from before (stopped, failed or removed meanwhile).
        for server_id in sorted(set(running) - set(wanted) - set(self.held)):
            log.info("server %s is not asked of this node any more; stopping it", server_id)
            self.stop_runtime(server_id)
        # Held but no longer listed: the next renewal says how it ended.
        for held in self.held.values():
            if held.server_id not in wanted:
                held.dirty = True
        for server_id, entry in sorted(wanted.items()):
            if server_id not in self.held:
                self.take(server_id, entry, running.get(server_id))

    def take(self, server_id: str, entry: dict[str, Any], running: dict | None) -> None:
        """Claim the server; adopt the runtime the worker still runs, or launch it."""
        stopping = self._stops.pop(server_id, None)
        if stopping is not None and not stopping.wait(120):  # a stop of it still in flight
            self._fetch.set()
            return
        if stopping is not None:
            running = self.worker.servers().get(server_id)
        fresh = entry.get("state") == SERVER_PENDING
        if (fresh or _role(entry) == ROLE_MAIN) and running is not None:
            # Restarted by an administrator (or placed here again): a fresh start. So too
            # a split's main server, whose helpers' listeners were this agent's before.
            self.worker.stop_server(server_id)
            running = None
        path = server_path(PATH_AGENT_SERVER_CLAIM, server_id)
        try:
            answer = self._call("POST", path, {"node_id": self.node_id})
        except Refused as refusal:
            log.warning("%s: server %s not claimed", refusal.describe(), server_id)
            if running is not None:
                self.stop_runtime(server_id)
            return
        lease = (answer or {}).get("lease")
        if not isinstance(lease, dict) or checked_node_id(lease.get("lease_id")) is None:
            self._fetch.set()
            return
        lease_seconds = lease.get("lease_seconds")
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int | float):
            lease_seconds = 30.0
        held = Held(server_id, entry, lease["lease_id"], max(1.0, float(lease_seconds)))
        restarts = entry.get("restarts")
        if isinstance(restarts, int) and not isinstance(restarts, bool) and restarts > 0:
            held.restarts = min(restarts, 10**6)  # counted across agent restarts
        self.held[server_id] = held
        if running is not None and running.get("exit") is None:
            held.port = running.get("port")
            held.launched_at = time.monotonic()
            if held.port and ready(
                str(entry.get("runtime")), held.port, str(entry.get("deployment")), _role(entry)
            ):
                held.state = SERVER_RUNNING  # reported as it is, never "starting" again
            log.info("server %s (%s) adopted: its runtime still runs on 127.0.0.1:%s",
                     server_id, printable(entry.get("deployment")), held.port)  # fmt: skip
            return
        self.launch(held)

    def _link_to(self, server_id: str, peer_server_id: str, sock: socket.socket) -> None:
        if self.open_link is None:
            sock.close()
            return
        self.open_link(server_id, peer_server_id, sock)

    def _close_listeners(self, server_id: str) -> None:
        for listener in self._listeners.pop(server_id, []):
            listener.close()

    def _split_body(self, held: Held, member: dict[str, Any]) -> dict[str, Any] | None:
        """A split member's part of the launch: a helper's cache, or the main server's
        listeners (one per helper, new at each launch) and shares. None: refused."""
        role = member.get("role")
        if role == ROLE_HELPER:
            # The helper's tensor cache, for the worker (this agent's group under systemd) to
            # write; a worker that cannot (a read-only mount) runs without one.
            cache = self.settings.artifacts_dir / "rpc-cache"
            with contextlib.suppress(OSError):
                cache.mkdir(exist_ok=True)
                cache.chmod(0o770)
            return {"role": ROLE_HELPER, "cache_dir": str(cache) if cache.is_dir() else None}
        helpers = member.get("helpers")
        if role != ROLE_MAIN or not isinstance(helpers, list) or not helpers:
            self.fail(held, RUNTIME_UNSUPPORTED, "a split member of a role this agent lacks")
            return None
        self._close_listeners(held.server_id)
        listeners = [
            Listener(held.server_id, str(peer), self._link_to)
            for peer in helpers
            if checked_node_id(peer) is not None
        ]
        self._listeners[held.server_id] = listeners
        shares = member.get("shares") if isinstance(member.get("shares"), list) else []
        return {
            "role": ROLE_MAIN,
            "rpc": [listener.endpoint for listener in listeners],
            "tensor_split": shares,
        }

    def launch(self, held: Held) -> None:
        entry = held.entry
        member = entry.get("split") if isinstance(entry.get("split"), dict) else None
        digest = str((entry.get("model") or {}).get("digest") or "")
        digest_hex = digest[len("sha256:") :] if digest.startswith("sha256:") else ""
        model_dir = self.models.model_dir(digest_hex) if len(digest_hex) == 64 else None
        helper = _role(entry) == ROLE_HELPER
        if not helper and (model_dir is None or not model_dir.is_dir()):
            self.fail(held, MODEL_NOT_ON_NODE, f"the model {digest[:19]}… is not on this node")
            return
        settings = entry.get("settings") if isinstance(entry.get("settings"), dict) else {}
        body = {
            "server_id": held.server_id,
            "runtime": entry.get("runtime"),
            "served_name": entry.get("deployment"),
            "model_dir": None if helper else str(model_dir),
            "model_file": None if helper else settings.get("model_file"),
            "gpus": entry.get("gpus") or [],
            "context_length": settings.get("context_length"),
            "args": [] if helper else settings.get("args") or [],
            "image_id": settings.get("image_id"),
        }
        if member is not None:
            extra = self._split_body(held, member)
            if extra is None:
                return
            body.update(extra)
        try:
            launched = self.worker.launch(body)
        except ServeRefused as refused:
            if refused.code in NEEDS_A_PERSON:
                self.fail(held, refused.code, refused.message)
            else:
                self.exited(held, f"could not be launched ({refused.message})", code=refused.code)
            return
        except WorkerUnavailable as unavailable:
            self.exited(held, f"the runtime worker did not launch it ({unavailable})")
            return
        held.port = launched.get("port")
        held.launched_at = time.monotonic()
        held.relaunch_at = None
        held.state = SERVER_STARTING
        held.dirty = True
        log.info("server %s (%s) launched on 127.0.0.1:%s", held.server_id,
                 printable(entry.get("deployment")), held.port)  # fmt: skip

    # -- each turn ------------------------------------------------------------------------

    def tick(self) -> None:
        if not self.held:
            return
        problem = ""
        try:
            running: dict[str, dict[str, Any]] | None = self.worker.servers()
        except WorkerUnavailable as unavailable:
            running = None
            problem = f"the runtime worker does not answer ({unavailable})"
        now = time.monotonic()
        for held in list(self.held.values()):
            if held.stopped is not None:
                if held.stopped.is_set():  # the worker stopped it: say so, and let it go
                    held.state = SERVER_STOPPED
                    self.renew(held)
                    self.held.pop(held.server_id, None)
                else:
                    self.renew_if_due(held, now)  # the lease stays held while it stops
                continue
            if held.relaunch_at is not None:
                if now >= held.relaunch_at and running is not None:
                    self.launch(held)
            elif held.launched_at is not None:
                seen = running.get(held.server_id) if running is not None else None
                exit_reason = (
                    problem
                    if running is None
                    else ("it is no longer running" if seen is None else seen.get("exit"))
                )
                if exit_reason is not None:
                    self.exited(held, str(exit_reason), (seen or {}).get("log_tail"))
                elif held.state == SERVER_STARTING:
                    self.check_ready(held, now)
            if held.server_id in self.held:
                self.renew_if_due(held, now)

    def check_ready(self, held: Held, now: float) -> None:
        entry = held.entry
        if held.port and ready(
            str(entry.get("runtime")), held.port, str(entry.get("deployment")), _role(entry)
        ):
            held.state = SERVER_RUNNING
            held.dirty = True
            log.info("server %s (%s) is ready", held.server_id, printable(entry.get("deployment")))
            return
        assert held.launched_at is not None
        if now - held.launched_at > self.settings.serve_ready_seconds:
            self.stop_runtime(held.server_id)
            self.exited(
                held,
                f"did not answer its readiness check within "
                f"{self.settings.serve_ready_seconds:g} s",
                code=RUNTIME_NOT_READY,
            )

    def exited(
        self, held: Held, reason: str, tail: object = None, code: str = RUNTIME_EXITED
    ) -> None:
        """The runtime ended on its own (or never became ready): start it again after a
        backoff that doubles each time, reported as ``backoff`` meanwhile."""
        last = ""
        if isinstance(tail, str) and tail.strip():
            last = ": " + tail.strip().splitlines()[-1][:300]
        held.restarts += 1
        delay = backoff_seconds(held.restarts)
        held.error = {
            "code": code,
            "message": f"the runtime {reason}{last}; restart {held.restarts} in {delay:g} s",
        }
        held.launched_at = None
        held.relaunch_at = time.monotonic() + delay
        held.state = SERVER_BACKOFF
        held.dirty = True
        log.warning("server %s: the runtime %s; starting it again in %s (restart %d)",
                    held.server_id, reason, seconds(delay), held.restarts)  # fmt: skip

    def fail(self, held: Held, code: str, message: str) -> None:
        held.state = SERVER_FAILED
        held.error = {"code": code, "message": message[:1000]}
        held.dirty = True
        log.warning("server %s failed (%s): %s", held.server_id, code, message)
        self.renew(held)
        self.held.pop(held.server_id, None)

    def renew_if_due(self, held: Held, now: float) -> None:
        every = max(0.2, min(RENEW_MAX_SECONDS, held.lease_seconds / 3))
        if held.dirty or now - held.renewed_at >= every:
            self.renew(held)

    def renew(self, held: Held) -> None:
        body: dict[str, Any] = {
            "node_id": self.node_id,
            "lease_id": held.lease_id,
            "state": held.state,
            "restarts": held.restarts,
            "error": held.error if held.state != SERVER_RUNNING else None,
        }
        if held.state == SERVER_BACKOFF and held.relaunch_at is not None:
            body["next_attempt_in"] = round(max(0.0, held.relaunch_at - time.monotonic()), 3)
        path = server_path(PATH_AGENT_SERVER_RENEW, held.server_id)
        try:
            answer = self._call("POST", path, body)
        except Refused as refusal:
            self.lost(held, refusal)
            return
        if answer is None:
            return  # tried again at the next turn; the lease outlasts a few misses
        held.renewed_at = time.monotonic()
        held.dirty = False
        if held.state in (SERVER_FAILED, SERVER_STOPPED):
            return
        if answer.get("desired") == "stop" and held.stopped is None:
            log.info("server %s: the control plane asks it stopped", held.server_id)
            held.stopped = self.stop_runtime(held.server_id)

    def lost(self, held: Held, refusal: Refused) -> None:
        """The lease is not ours any more: say how it ended, and fetch again."""
        self.held.pop(held.server_id, None)
        self._fetch.set()
        if refusal.code != LEASE_LOST or held.state in (SERVER_FAILED, SERVER_STOPPED):
            if held.state not in (SERVER_FAILED, SERVER_STOPPED):
                log.warning("%s: server %s dropped", refusal.describe(), held.server_id)
                self.stop_runtime(held.server_id)
            return
        ended = refusal.details.get("lease_end")
        if ended in (None, LEASE_END_EXPIRED, LEASE_END_REPLACED):
            # The node was away (or a restored store does not know this lease): the runtime
            # keeps running and the server is claimed again, adopting it, if the control
            # plane still lists it; the next fetch stops it otherwise.
            log.warning("%s: server %s will be claimed again (lease %s)", refusal.describe(),
                        held.server_id, printable(ended or "unknown"))  # fmt: skip
            return
        how = "restarted" if ended == LEASE_END_RESTARTED else printable(ended)
        log.info("server %s: its lease ended (%s); stopping its runtime", held.server_id, how)
        self.stop_runtime(held.server_id)


def _role(entry: dict[str, Any]) -> str | None:
    member = entry.get("split")
    return str(member.get("role")) if isinstance(member, dict) else None


class _Terminal(Exception):
    """The control plane refused this node's credential or protocol: the run stops."""
