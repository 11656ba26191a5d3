"""A pull from a hub, start to end (docs/architecture.md §10): the source resolved and the
free space reserved before the first byte, the files fetched and verified (hub_files.py),
then the revision recorded in the seed cache as an import is, under the commit as its
revision unless another is asked for.

``modelforge models pull`` runs it in its own process (pull_model). The API and the
console start it in the control plane (PullRunner): what can be refused before a byte moves
is answered at once (an unknown repository or revision, no matching file, a missing token,
the hub out of reach, too little space); the download then runs on a thread of its own and
its progress and outcome are read with ``GET /admin/model-pulls``. A pull belongs to the
process that runs it: a control plane restarted meanwhile forgets it, and pulling again
continues from the bytes on disk.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from modelforge_contract import FIELD_REQUIRED
from modelforge_contract.hub import (
    HUB_SOURCE_INVALID,
    PULL_DONE,
    PULL_DOWNLOADING,
    PULL_FAILED,
    PULL_NOT_FOUND,
    HubSource,
    HubSourceError,
    hub_source,
    parse_hub_url,
)

from ..core.clock import isoformat
from ..core.errors import ApiError, Invalid, NotFound
from ..core.sealing import WorkKeys
from ..core.settings import Settings
from ..store.database import Store
from . import catalog, hub, hub_files, hub_token
from .hub import HubFile, PullPlan
from .hub_files import RESERVATIONS, Progress

log = logging.getLogger(__name__)

KEEP_FINISHED = 50  # finished pulls a control plane still lists, newest first


_HUB_FIELDS = ("hub", "repo", "revision", "include", "exclude")


def source_of(given: dict[str, Any]) -> str | HubSource:
    """An import's or a pull's source from a request's ``source`` object: the path, or the
    hub repository (``repo`` as ORG/REPO, or hf://ORG/REPO[@REVISION])."""
    hub_fields = [name for name in _HUB_FIELDS if name in given]
    if "path" in given:
        if hub_fields:
            raise _source_invalid(
                f"source has a path and {', '.join(hub_fields)}: a path, or a hub repository"
            )
        return given["path"]
    if not hub_fields:
        raise Invalid(
            "source.path: is required (or source.hub and source.repo)",
            code=FIELD_REQUIRED,
            next_step="Give source.path, a path on the control-plane host, or source.hub "
            "(huggingface) and source.repo (ORG/REPO).",
        )
    if "hub" not in given or "repo" not in given:
        raise _source_invalid("a hub source needs both source.hub and source.repo")
    repo, revision = given["repo"], given.get("revision")
    try:
        if repo.startswith("hf://"):
            repo, at_revision = parse_hub_url(repo)
            if "@" in given["repo"] and revision is not None:
                raise HubSourceError("a revision both in source.repo and in source.revision")
            revision = revision or at_revision
        return hub_source(
            repo, revision, given.get("include") or (), given.get("exclude") or (), given["hub"]
        )
    except HubSourceError as exc:
        raise _source_invalid(str(exc)) from None


def _source_invalid(message: str) -> Invalid:
    return Invalid(
        message,
        code=HUB_SOURCE_INVALID,
        next_step="Name the repository as ORG/REPO (or hf://ORG/REPO[@REVISION]) with a "
        "branch, tag or commit, and glob patterns of at most 200 characters.",
    )


@dataclass(frozen=True)
class Prepared:
    """A pull that may start: its plan, the token it sends, the space it holds."""

    name: str
    revision: str
    plan: PullPlan
    token: str | None
    ticket: int


def prepare(
    store: Store, settings: Settings, name: str, source: HubSource, revision: str | None
) -> Prepared:
    """Everything that can refuse a pull before its first byte; reserves its space."""
    catalog.check_name(name)
    if revision is not None:
        catalog.check_revision(revision)
    token = hub_token.open_token(store, WorkKeys.of(settings.state_dir), source.hub)
    plan = hub.plan_pull(settings.hub_endpoint, source, token)
    ticket = RESERVATIONS.reserve(settings.state_dir, plan)
    return Prepared(name, revision or plan.commit, plan, token, ticket)


def complete(
    store: Store, settings: Settings, prepared: Prepared, actor: str, progress: Progress
) -> catalog.Imported:
    """Fetch and verify every file, then record the revision; releases the space held."""
    plan = prepared.plan
    try:
        progress.started(plan, hub_files.bytes_here(settings.state_dir, plan))
        staged = hub_files.fetch(
            settings.state_dir, plan, prepared.token, progress, store.clock.now
        )
        files = [{"path": s.path, "size": s.size, "sha256": s.sha256} for s in staged]
        waiting = {s.sha256: s.staged for s in staged if s.staged is not None}
        imported = catalog.import_staged(
            store, settings.state_dir, prepared.name, prepared.revision, files, waiting,
            plan.url, actor,
        )  # fmt: skip
    finally:
        RESERVATIONS.release(prepared.ticket)
    log.info(
        "pulled %s as model %s revision %s (%s)",
        plan.url,
        prepared.name,
        prepared.revision,
        "new" if imported.created else "already imported",
    )
    return imported


def pull_model(
    store: Store,
    settings: Settings,
    name: str,
    source: HubSource,
    actor: str,
    revision: str | None = None,
    progress: Progress | None = None,
) -> tuple[PullPlan, catalog.Imported]:
    """The whole pull in this thread (the CLI's)."""
    prepared = prepare(store, settings, name, source, revision)
    return prepared.plan, complete(store, settings, prepared, actor, progress or Progress())


# -- pulls run by the control plane --------------------------------------------------------


@dataclass
class Pull:
    """One pull the control plane runs, as its answers show it (guarded by the runner)."""

    pull_id: str
    name: str
    revision: str
    plan: PullPlan
    requested_by: str
    started_at: float
    state: str = PULL_DOWNLOADING
    bytes_done: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    created: bool | None = None
    finished_at: float | None = None

    def view(self) -> dict[str, Any]:
        source = self.plan.source
        return {
            "pull_id": self.pull_id,
            "name": self.name,
            "revision": self.revision,
            "source": self.plan.url,
            "hub": source.hub,
            "repo": source.repo,
            "hub_revision": source.revision,
            "commit": self.plan.commit,
            "include": list(source.include),
            "exclude": list(source.exclude),
            "state": self.state,
            "bytes_done": self.bytes_done,
            "bytes_total": self.plan.bytes_total,
            "files": [dict(f) for f in self.files],
            "error": self.error,
            "model": self.model,
            "created": self.created,
            "requested_by": self.requested_by,
            "started_at": isoformat(self.started_at),
            "finished_at": isoformat(self.finished_at) if self.finished_at else None,
        }


class _Tracked(Progress):
    """A running pull's progress, written into its Pull under the runner's lock."""

    def __init__(self, lock: threading.Lock, pull: Pull) -> None:
        self.lock = lock
        self.pull = pull
        self.current: dict[str, Any] | None = None

    def _entry(self, file: HubFile) -> dict[str, Any]:
        return next(f for f in self.pull.files if f["path"] == file.path)

    def started(self, plan: PullPlan, here: dict[str, int]) -> None:
        with self.lock:
            for entry in self.pull.files:
                entry["bytes_done"] = here.get(entry["path"], 0)
            self.pull.bytes_done = sum(here.values())

    def file_started(self, file: HubFile, done: int) -> None:
        with self.lock:
            self.current = self._entry(file)
            self.current.update(state="downloading", bytes_done=done)

    def advanced(self, count: int) -> None:
        with self.lock:
            self.pull.bytes_done += count
            if self.current is not None:
                self.current["bytes_done"] += count

    def file_finished(self, file: HubFile) -> None:
        with self.lock:
            entry = self._entry(file)
            entry.update(state="verified", bytes_done=file.size)
            self.pull.bytes_done = sum(f["bytes_done"] for f in self.pull.files)
            self.current = None


class PullRunner:
    """The pulls this control-plane process runs, each on a thread of its own."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self._lock = threading.Lock()
        self._pulls: dict[str, Pull] = {}
        self._threads: dict[str, threading.Thread] = {}

    def start(
        self, name: str, source: HubSource, revision: str | None, actor: str
    ) -> dict[str, Any]:
        """Refuse now what can be refused before a byte moves; else start, its view."""
        prepared = prepare(self.store, self.settings, name, source, revision)
        pull = Pull(
            pull_id=f"pull_{secrets.token_hex(8)}",
            name=name,
            revision=prepared.revision,
            plan=prepared.plan,
            requested_by=actor,
            started_at=self.store.clock.now(),
            files=[
                {"path": f.path, "size": f.size, "bytes_done": 0, "state": "waiting"}
                for f in prepared.plan.files
            ],
        )
        thread = threading.Thread(
            target=self._run, args=(pull, prepared), name=f"model-{pull.pull_id}", daemon=True
        )
        with self._lock:
            self._pulls[pull.pull_id] = pull
            self._threads[pull.pull_id] = thread
            self._forget_old()
            view = pull.view()
        thread.start()
        return view

    def _run(self, pull: Pull, prepared: Prepared) -> None:
        try:
            imported = complete(
                self.store, self.settings, prepared, pull.requested_by, _Tracked(self._lock, pull)
            )
        except ApiError as exc:
            log.warning("pull %s of %s failed: %s %s", pull.pull_id, pull.plan.url, exc.code,
                        exc.message)  # fmt: skip
            self._finish(pull, PULL_FAILED, error=exc.body()["error"])
        except Exception as exc:  # a bug, or the store gone: the pull says so, not the thread
            log.exception("pull %s of %s failed", pull.pull_id, pull.plan.url)
            error = {
                "code": "INTERNAL_ERROR",
                "message": f"the pull failed: {type(exc).__name__}",
                "next_step": "Read the control plane's log, then pull again (it resumes).",
            }
            self._finish(pull, PULL_FAILED, error=error)
        else:
            self._finish(
                pull, PULL_DONE, model=catalog.model_view(imported.model), created=imported.created
            )

    def _finish(self, pull: Pull, state: str, **fields: Any) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(pull, name, value)
            pull.state = state
            pull.finished_at = self.store.clock.now()
            self._threads.pop(pull.pull_id, None)

    def _forget_old(self) -> None:
        finished = sorted(
            (p for p in self._pulls.values() if p.state != PULL_DOWNLOADING),
            key=lambda p: p.started_at,
        )
        for pull in finished[: max(len(finished) - KEEP_FINISHED, 0)]:
            del self._pulls[pull.pull_id]

    def views(self) -> list[dict[str, Any]]:
        """Every pull still listed, newest first."""
        with self._lock:
            pulls = sorted(self._pulls.values(), key=lambda p: p.started_at, reverse=True)
            return [p.view() for p in pulls]

    def view(self, pull_id: str) -> dict[str, Any]:
        with self._lock:
            pull = self._pulls.get(pull_id)
            if pull is not None:
                return pull.view()
        raise NotFound(
            f"no pull {pull_id} in this control plane",
            code=PULL_NOT_FOUND,
            next_step="List the pulls (GET /api/v1/admin/model-pulls); one that ran before a "
            "restart is gone: pull again, it resumes from the bytes on disk.",
        )

    def wait(self, pull_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Until that pull has finished (or the timeout): its view. For tests and tools."""
        with self._lock:
            thread = self._threads.get(pull_id)
        if thread is not None:
            thread.join(timeout)
        return self.view(pull_id)
