"""Models on the control plane (issue 24): import into the seed cache, replicas, the agent's
models and blob routes, and presence recorded from the node's inventory."""

from __future__ import annotations

import hashlib
import os

from modelforge_appliance.store.tables import AuditEvent
from modelforge_contract.models import (
    PATH_ADMIN_MODELS,
    PATH_AGENT_MODELS,
    blob_path,
    check_manifest,
    manifest_digest,
)
from tests.harness.control_plane import error_code
from tests.harness.scripted_node import WorkNode

MODELS = PATH_ADMIN_MODELS


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def make_model_dir(root, files: dict[str, bytes]):
    for name, data in files.items():
        write(root / name, data)
    return root


def import_model(cp, name, path, **extra):
    return cp.admin("POST", MODELS, json={"name": name, "source": {"path": str(path)}, **extra})


def node(cp, hostname="cpu-a") -> WorkNode:
    return WorkNode(cp, hostname, gpus=[], mode="cpu").ready()


def report(cp, member: WorkNode, models: list[dict] | None):
    body = {"node_id": member.node_id, "agent_version": "0.1.0", "accelerators": []}
    if models is not None:
        body["models"] = models
    response = cp.agent("PUT", "/api/v1/agent/inventory", member.credential, json=body)
    assert response.status_code == 200, response.text
    return response


def replicas_of(cp, name):
    response = cp.admin("GET", f"{MODELS}/{name}/replicas")
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


FILES = {
    "config.json": b'{"hidden_size": 8}',
    "weights/model.safetensors": os.urandom(3 * 1024 * 1024 + 17),
    "tokenizer.json": b'{"v": 1}',
}


def test_import_replicate_pull_and_report_present(control_plane, tmp_path):
    cp = control_plane
    source = make_model_dir(tmp_path / "tiny", FILES)
    answer = import_model(cp, "tiny", source)
    assert answer.status_code == 201, answer.text
    model = answer.json()
    assert model["revision"] == "r1"
    assert [f["path"] for f in model["files"]] == sorted(FILES)
    manifest = {"name": "tiny", "revision": "r1", "files": model["files"]}
    check_manifest(manifest)
    assert model["digest"] == manifest_digest(manifest)
    assert model["size_bytes"] == sum(len(d) for d in FILES.values())
    for entry in model["files"]:
        blob = cp.settings.state_dir / "models/blobs/sha256" / entry["sha256"]
        assert blob.read_bytes() == FILES[entry["path"]]
    # The same files again: that revision answered again, not a new one.
    again = import_model(cp, "tiny", source)
    assert (again.status_code, again.json()["digest"]) == (200, model["digest"])

    member, other = node(cp, "cpu-a"), node(cp, "cpu-b")
    heartbeat = cp.heartbeat(member.credential, member.node_id).json()
    assert heartbeat["models_generation"] == 0
    made = cp.admin("POST", f"{MODELS}/tiny/replicas", json={"node_ids": [member.node_id]})
    assert made.status_code == 202, made.text
    [replica] = made.json()["replicas"]
    assert (replica["node_id"], replica["state"], replica["bytes_total"]) == (
        member.node_id,
        "pending",
        model["size_bytes"],
    )
    assert cp.heartbeat(member.credential, member.node_id).json()["models_generation"] == 1

    desired = cp.agent("GET", PATH_AGENT_MODELS, member.credential)
    assert desired.status_code == 200, desired.text
    body = desired.json()
    assert body["models"] == [{"digest": model["digest"], "manifest": manifest}]
    assert (body["remove"], body["models_generation"]) == ([], 1)
    assert cp.agent("GET", PATH_AGENT_MODELS, other.credential).json()["models"] == []

    weights = next(f for f in model["files"] if f["path"] == "weights/model.safetensors")
    data = FILES["weights/model.safetensors"]
    path = blob_path(weights["sha256"])
    whole = cp.agent("GET", path, member.credential)
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["Content-Length"] == str(len(data))
    assert whole.headers["Accept-Ranges"] == "bytes"
    assert whole.headers["ETag"] == f'"sha256:{weights["sha256"]}"'
    assert whole.headers["Cache-Control"] == "no-store"
    for header, start, end in [
        ("bytes=10-99", 10, 99),
        ("bytes=1048576-", 1048576, len(data) - 1),
        ("bytes=-5", len(data) - 5, len(data) - 1),
        (f"bytes=5-{len(data) + 100}", 5, len(data) - 1),
    ]:
        part = cp.agent("GET", path, member.credential, headers={"Range": header})
        assert part.status_code == 206, header
        assert part.content == data[start : end + 1], header
        assert part.headers["Content-Range"] == f"bytes {start}-{end}/{len(data)}"
    for header in ["bytes=0-1,5-9", "bytes=abc", "items=0-5", "bytes=9-3"]:
        ignored = cp.agent("GET", path, member.credential, headers={"Range": header})
        assert (ignored.status_code, ignored.content == data) == (200, True), header
    for header in [f"bytes={len(data)}-", "bytes=-0"]:
        out = cp.agent("GET", path, member.credential, headers={"Range": header})
        assert (out.status_code, error_code(out)) == (416, "RANGE_NOT_SATISFIABLE"), header
        assert out.headers["Content-Range"] == f"bytes */{len(data)}"

    # Another node, a blob no model lists, a blob nobody has: the same 403.
    refusals = [
        cp.agent("GET", path, other.credential),
        cp.agent("GET", blob_path(sha(b"nothing")), member.credential),
    ]
    for refusal in refusals:
        assert (refusal.status_code, error_code(refusal)) == (403, "BLOB_NOT_ASSIGNED")
    assert refusals[0].json()["error"]["message"].replace(weights["sha256"], "X") == refusals[
        1
    ].json()["error"]["message"].replace(sha(b"nothing"), "X")
    assert cp.agent("GET", path).status_code == 401

    # Progress, then present.
    total = model["size_bytes"]
    entry = {"digest": model["digest"], "bytes_total": total, "error": None}
    report(cp, member, [{**entry, "state": "downloading", "bytes_done": 1024}])
    [shown] = replicas_of(cp, "tiny")
    assert (shown["state"], shown["bytes_done"], shown["reported_at"]) == (
        "downloading",
        1024,
        None,
    )
    report(cp, member, [{**entry, "state": "present", "bytes_done": total}])
    [shown] = replicas_of(cp, "tiny")
    assert (shown["state"], shown["bytes_done"]) == ("present", total)
    assert shown["reported_at"] is not None
    # An inventory without the field (an older agent) changes nothing.
    report(cp, member, None)
    assert replicas_of(cp, "tiny")[0]["state"] == "present"
    # A digest with no replica row is ignored.
    report(cp, other, [{**entry, "state": "present", "bytes_done": total}])
    assert len(replicas_of(cp, "tiny")) == 1
    # The files went away: back to pending.
    report(cp, member, [])
    assert replicas_of(cp, "tiny")[0]["state"] == "pending"
    report(cp, member, [{**entry, "state": "present", "bytes_done": total}])

    # Removal: removing until the node no longer reports it, then the row goes.
    shown = cp.admin("GET", f"{MODELS}/tiny").json()
    assert [r["state"] for r in shown["replicas"]] == ["present"]
    refused = cp.admin("DELETE", f"{MODELS}/tiny")
    assert (refused.status_code, error_code(refused)) == (409, "MODEL_REPLICATED")
    assert refused.json()["node_ids"] == [member.node_id]
    assert refused.json()["error"]["next_step"] == (
        f"Remove them first: modelforge models remove tiny --node {member.node_id}."
    )
    removed = cp.admin("DELETE", f"{MODELS}/tiny/replicas/{member.node_id}")
    assert removed.status_code == 202, removed.text
    assert [r["state"] for r in removed.json()["replicas"]] == ["removing"]
    assert cp.heartbeat(member.credential, member.node_id).json()["models_generation"] == 2
    desired = cp.agent("GET", PATH_AGENT_MODELS, member.credential).json()
    assert (desired["models"], desired["remove"]) == ([], [model["digest"]])
    gone = cp.agent("GET", path, member.credential)
    assert (gone.status_code, error_code(gone)) == (403, "BLOB_NOT_ASSIGNED")
    report(cp, member, [{**entry, "state": "present", "bytes_done": total}])
    assert replicas_of(cp, "tiny")[0]["state"] == "removing"
    report(cp, member, [])
    assert replicas_of(cp, "tiny") == []
    again = cp.admin("DELETE", f"{MODELS}/tiny/replicas/{member.node_id}")
    assert (again.status_code, error_code(again)) == (404, "REPLICA_NOT_FOUND")

    deleted = cp.admin("DELETE", f"{MODELS}/tiny")
    assert deleted.status_code == 200, deleted.text
    assert list((cp.settings.state_dir / "models/blobs/sha256").iterdir()) == []
    missing = cp.admin("GET", f"{MODELS}/tiny")
    assert (missing.status_code, error_code(missing)) == (404, "MODEL_NOT_FOUND")
    with cp.store.connection():
        actions = [e.action for e in AuditEvent.select().where(AuditEvent.action ** "model.%")]
    assert actions == [
        "model.imported",
        "model.replicated",
        "model.replica_removed",
        "model.replica_gone",
        "model.deleted",
    ]
