"""Model revisions: import into the seed cache, list, show, delete (docs/architecture.md §10).

The revision rules: an explicit revision (or a Hugging Face snapshot's commit) that exists
with the same files is answered again (200), with other files refused 409
MODEL_REVISION_EXISTS; without one, the same files as an existing revision of that name
answer that revision, and new files make the next free ``rN``: never an overwrite.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peewee as pw

from modelforge_contract import FIELD_FORMAT
from modelforge_contract.models import (
    MODEL_IN_USE,
    MODEL_NOT_FOUND,
    MODEL_REPLICATED,
    MODEL_REVISION_EXISTS,
    NAME_RE,
    REVISION_RE,
    manifest_digest,
)

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound
from ..store import audit
from ..store.database import Store
from ..store.tables import Deployment, Model, ModelReplica, Node
from . import cache


@dataclass(frozen=True)
class Imported:
    model: Model
    created: bool


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise Invalid(
            f"name {name!r} is not a model name (letters, digits, '.', '_', '-'; 1-120)",
            code=FIELD_FORMAT,
        )
    return name


def check_revision(revision: str) -> str:
    if not REVISION_RE.fullmatch(revision):
        raise Invalid(
            f"revision {revision!r} is not a revision (letters, digits, '.', '_', '-'; 1-64)",
            code=FIELD_FORMAT,
        )
    return revision


def model_view(model: Model) -> dict[str, Any]:
    manifest = json.loads(model.manifest)
    return {
        "name": model.name,
        "revision": model.revision,
        "digest": model.digest,
        "size_bytes": model.size_bytes,
        "file_count": model.file_count,
        "files": manifest["files"],
        "source": model.source,
        "created_by": model.created_by,
        "created_at": isoformat(model.created_at),
    }


def _next_revision(taken: set[str]) -> str:
    number = 1
    while f"r{number}" in taken:
        number += 1
    return f"r{number}"


def import_model(
    store: Store,
    state_dir: Path,
    name: str,
    source: str,
    actor: str,
    revision: str | None = None,
    progress: cache.Progress | None = None,
) -> Imported:
    """Hash source into the seed cache and record the revision (see the module's rules)."""
    check_name(name)
    if revision is not None:
        check_revision(revision)
    path = Path(os.path.abspath(os.path.expanduser(source)))
    found = cache.scan_source(path)  # every refusal before a byte is written
    snapshot = cache.hf_snapshot(path)
    explicit = revision or (snapshot[1] if snapshot else None)
    if explicit is not None:
        check_revision(explicit)
    added: list[str] = []
    files = []
    try:
        for entry in found:
            hexdigest, new = cache.store_file(state_dir, entry.real, progress)
            if new:
                added.append(hexdigest)
            files.append({"path": entry.path, "size": entry.size, "sha256": hexdigest})
        return _record(store, name, explicit, files, str(path), actor)
    except BaseException:
        _forget_unreferenced(store, state_dir, added)
        raise


def import_staged(
    store: Store,
    state_dir: Path,
    name: str,
    revision: str,
    files: list[dict[str, Any]],
    staged: dict[str, Path],
    source: str,
    actor: str,
) -> Imported:
    """Record a revision whose files were verified elsewhere (a pull from a hub): each staged
    file (by its sha256 hex) is renamed into the seed cache, then the revision is recorded
    under the same rules as an import, with ``revision`` explicit."""
    check_name(name)
    check_revision(revision)
    added: list[str] = []
    try:
        for hexdigest, path in staged.items():
            if cache.adopt_blob(state_dir, path, hexdigest):
                added.append(hexdigest)
        ordered = sorted(files, key=lambda f: f["path"])
        return _record(store, name, revision, ordered, source, actor, "model.pulled")
    except BaseException:
        _forget_unreferenced(store, state_dir, added)
        raise


def _record(
    store: Store,
    name: str,
    explicit: str | None,
    files: list,
    source: str,
    actor: str,
    action: str = "model.imported",
) -> Imported:
    canonical_files = _canonical(files)
    now = store.clock.now()
    with store.write():
        existing = list(Model.select().where(Model.name == name))
        same = [
            m for m in existing if _canonical(json.loads(m.manifest)["files"]) == canonical_files
        ]
        if explicit is not None:
            named = next((m for m in existing if m.revision == explicit), None)
            if named is not None:
                if _canonical(json.loads(named.manifest)["files"]) == canonical_files:
                    return Imported(named, False)
                raise Conflict(
                    f"model {name} revision {explicit} exists with other files",
                    code=MODEL_REVISION_EXISTS,
                    next_step="Import under another --revision, or leave it out for the next "
                    "free one.",
                )
            revision = explicit
        else:
            if same:
                return Imported(max(same, key=lambda m: m.created_at), False)
            revision = _next_revision({m.revision for m in existing})
        manifest = {"name": name, "revision": revision, "files": files}
        model = Model.create(
            model_id=f"mdl_{secrets.token_hex(8)}",
            name=name,
            revision=revision,
            digest=manifest_digest(manifest),
            manifest=_canonical(manifest),
            size_bytes=sum(f["size"] for f in files),
            file_count=len(files),
            source=source,
            created_by=actor,
            created_at=now,
        )
        audit.record(
            store,
            actor,
            action,
            name=name,
            revision=revision,
            digest=model.digest,
            size_bytes=model.size_bytes,
            file_count=model.file_count,
            # A pull's source (hf://ORG/REPO@COMMIT) says where it came from; an import's
            # path is shown by `models show`.
            **({"source": source} if action == "model.pulled" else {}),
        )
    return Imported(model, True)


def referenced_blobs(store: Store) -> set[str]:
    """Every blob some model revision lists."""
    with store.connection():
        manifests = [row[0] for row in Model.select(Model.manifest).tuples()]
    return {f["sha256"] for text in manifests for f in json.loads(text)["files"]}


def _forget_unreferenced(store: Store, state_dir: Path, hexes: list[str]) -> None:
    if hexes:
        kept = referenced_blobs(store)
        cache.remove_blobs(state_dir, [h for h in hexes if h not in kept])


def revisions_of(store: Store, name: str) -> list[Model]:
    """A name's revisions, oldest first; MODEL_NOT_FOUND when it has none."""
    with store.connection():
        found = list(Model.select().where(Model.name == name).order_by(Model.created_at))
    if not found:
        raise NotFound(
            f"no model {name}",
            code=MODEL_NOT_FOUND,
            next_step="List the models with `modelforge models list`.",
        )
    return found


def get_revision(store: Store, name: str, revision: str | None = None) -> Model:
    """The named revision, or the latest one."""
    found = revisions_of(store, name)
    if revision is None:
        return found[-1]
    for model in found:
        if model.revision == revision:
            return model
    raise NotFound(
        f"model {name} has no revision {revision}",
        code=MODEL_NOT_FOUND,
        next_step=f"See its revisions with `modelforge models show {name}`.",
    )


def list_models(store: Store) -> list[dict[str, Any]]:
    """The latest revision of each name, with how many revisions it has."""
    with store.connection():
        rows = list(Model.select().order_by(Model.name, Model.created_at))
    latest: dict[str, Model] = {}
    counts: dict[str, int] = {}
    for model in rows:
        latest[model.name] = model
        counts[model.name] = counts.get(model.name, 0) + 1
    views = []
    for name, model in latest.items():
        view = model_view(model)
        view.pop("files")
        view["revision_count"] = counts[name]
        views.append(view)
    return views


def revision_summary(model: Model) -> dict[str, Any]:
    return {
        "revision": model.revision,
        "digest": model.digest,
        "size_bytes": model.size_bytes,
        "file_count": model.file_count,
        "created_at": isoformat(model.created_at),
    }


# How many commands a next step spells out before it says how many more there are.
NEXT_STEP_COMMANDS = 5


def _each(commands: list[str]) -> str:
    """'a; b; c.' for a next step, the first NEXT_STEP_COMMANDS of them and a count of the rest."""
    shown = "; ".join(commands[:NEXT_STEP_COMMANDS])
    more = len(commands) - NEXT_STEP_COMMANDS
    return f"{shown}; and {more} more like it." if more > 0 else f"{shown}."


def refuse_in_use(name: str, deployments: Any) -> None:
    """409 MODEL_IN_USE while a deployment (even one still stopping) runs the model."""
    using = sorted(d.name for d in deployments)
    if using:
        raise Conflict(
            f"model {name} is used by deployment(s) {', '.join(using)}",
            code=MODEL_IN_USE,
            next_step="Undeploy them first: "
            + _each([f"modelforge undeploy {d} --wait" for d in using]),
            extra={"deployments": using},
        )


def delete_model(
    store: Store, state_dir: Path, name: str, actor: str, revision: str | None = None
) -> list[dict[str, Any]]:
    """Delete one revision (or every revision of name) and the cache blobs nothing else
    references; 409 MODEL_REPLICATED while a replica of it exists."""
    targets = [get_revision(store, name, revision)] if revision else revisions_of(store, name)
    ids = [m.model_id for m in targets]
    with store.write():
        refuse_in_use(name, Deployment.select().where(Deployment.model.in_(ids)))
        replicated = list(
            ModelReplica.select(ModelReplica, Node)
            .join(Node)
            .where(ModelReplica.model.in_(ids))
            .order_by(Node.display_name)
        )
        if replicated:
            shown = ", ".join(sorted({r.node.display_name for r in replicated}))
            node_ids = sorted({r.node.node_id for r in replicated})
            raise Conflict(
                f"model {name} has replicas on {shown}",
                code=MODEL_REPLICATED,
                next_step="Remove them first: "
                + _each([f"modelforge models remove {name} --node {n}" for n in node_ids]),
                extra={"node_ids": node_ids},
            )
        try:
            Model.delete().where(Model.model_id.in_(ids)).execute()
        except pw.IntegrityError:  # a replica made in between (PostgreSQL's RESTRICT)
            raise Conflict(
                f"model {name} was replicated meanwhile",
                code=MODEL_REPLICATED,
                next_step=f"Remove its replicas first: modelforge models remove {name} --node "
                "NODE.",
            ) from None
        for model in targets:
            audit.record(
                store,
                actor,
                "model.deleted",
                name=name,
                revision=model.revision,
                digest=model.digest,
            )
    blobs = {f["sha256"] for m in targets for f in json.loads(m.manifest)["files"]}
    kept = referenced_blobs(store)
    cache.remove_blobs(state_dir, sorted(blobs - kept))
    return [revision_summary(m) for m in targets]


def verify_model(
    store: Store,
    state_dir: Path,
    name: str,
    revision: str | None = None,
    progress: cache.Progress | None = None,
) -> list[str]:
    """The problems with a revision's cache blobs (missing, or not hashing), [] when none."""
    model = get_revision(store, name, revision)
    problems = []
    for entry in json.loads(model.manifest)["files"]:
        blob = cache.blob_file(state_dir, entry["sha256"])
        try:
            actual = cache.hash_file(blob, progress)
        except FileNotFoundError:
            problems.append(f"{entry['path']}: cache blob {blob} is missing")
            continue
        if actual != entry["sha256"]:
            problems.append(f"{entry['path']}: cache blob {blob} hashes to sha256:{actual}")
    return problems
