"""The rules of models on the control plane (issue 24): what an import accepts and refuses,
the revision rules, who may take a replica, two replicate calls at once, presence after a
restore, the CLI, and a blob larger than any buffer served in full."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from modelforge_appliance.core.errors import ApiError
from modelforge_appliance.store.tables import Model, ModelReplica, Node
from modelforge_contract import HEADER_AGENT_PROTOCOL, PROTOCOL_VERSION
from modelforge_contract.models import PATH_ADMIN_MODELS, blob_path
from tests.harness.control_plane import (
    APPLIANCE_CLI,
    clean_env,
    error_code,
    invoke_cli,
    make_settings,
    run_cli,
    serve,
    store_env,
)
from tests.harness.scripted_node import WorkNode

from .test_models import import_model, make_model_dir, node, replicas_of, report

MODELS = PATH_ADMIN_MODELS


def blobs(cp) -> list[str]:
    root = cp.settings.state_dir / "models" / "blobs" / "sha256"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def model_rows(cp) -> int:
    with cp.store.connection():
        return Model.select().count()


def test_a_file_a_directory_and_a_hugging_face_snapshot(control_plane, tmp_path):
    cp = control_plane
    single = tmp_path / "weights.gguf"
    single.write_bytes(b"gguf" * 1000)
    answer = import_model(cp, "one-file", single)
    assert answer.status_code == 201, answer.text
    assert [f["path"] for f in answer.json()["files"]] == ["weights.gguf"]

    # A Hugging Face cache: the snapshot's files are links into ../../blobs.
    repo = tmp_path / "hub" / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    contents = {"config.json": b"{}", "model.safetensors": b"w" * 5000, "sub/vocab.txt": b"a\nb"}
    for relative, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    stray = tmp_path / "hub" / "stray.bin"
    stray.write_bytes(b"outside the repo folder")
    (repo / "snapshots" / commit / "stray.bin").symlink_to(stray)
    escaped = import_model(cp, "tiny", repo / "snapshots" / commit)
    assert (escaped.status_code, error_code(escaped)) == (400, "MODEL_SYMLINK_ESCAPES")
    (repo / "snapshots" / commit / "stray.bin").unlink()
    answer = import_model(cp, "tiny", repo / "snapshots" / commit)
    assert answer.status_code == 201, answer.text
    model = answer.json()
    assert model["revision"] == commit
    assert {f["path"]: f["size"] for f in model["files"]} == {
        k: len(v) for k, v in contents.items()
    }
    # Identical blobs are stored once: the same content under another name adds none.
    before = blobs(cp)
    plain = make_model_dir(tmp_path / "copy", contents)
    assert import_model(cp, "tiny-copy", plain).status_code == 201
    assert blobs(cp) == before
    listed = cp.admin("GET", MODELS).json()["models"]
    assert [(m["name"], m["revision_count"]) for m in listed] == [
        ("one-file", 1),
        ("tiny", 1),
        ("tiny-copy", 1),
    ]


def test_bad_sources_are_refused_and_nothing_is_kept(control_plane, tmp_path):
    cp = control_plane
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    escaping = make_model_dir(tmp_path / "escaping", {"a.bin": b"a" * 100})
    (escaping / "link.txt").symlink_to(outside)
    dir_link = make_model_dir(tmp_path / "dir-link", {"a.bin": b"b" * 100})
    (dir_link / "etc").symlink_to(tmp_path / "escaping")
    fifo_dir = make_model_dir(tmp_path / "fifo", {"a.bin": b"c" * 100})
    os.mkfifo(fifo_dir / "pipe")
    empty = tmp_path / "empty"
    (empty / "nested").mkdir(parents=True)
    sock_dir = make_model_dir(tmp_path / "sock", {"a.bin": b"d"})
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_dir / "s.sock"))
    unreadable = make_model_dir(tmp_path / "unreadable", {"a.bin": b"e", "b.bin": b"f"})
    (unreadable / "b.bin").chmod(0)
    cases = [
        (escaping, "MODEL_SYMLINK_ESCAPES", "link.txt"),
        (dir_link, "MODEL_SYMLINK_ESCAPES", "etc"),
        (fifo_dir, "MODEL_SOURCE_INVALID", "pipe"),
        (sock_dir, "MODEL_SOURCE_INVALID", "s.sock"),
        (empty, "MODEL_SOURCE_INVALID", "empty"),
        (tmp_path / "missing", "MODEL_SOURCE_INVALID", "missing"),
    ]
    if os.geteuid() != 0:  # as root: through setpriv, below
        cases.append((unreadable, "MODEL_SOURCE_INVALID", "b.bin"))
    try:
        for path, code, named in cases:
            answer = import_model(cp, "bad", path)
            assert (answer.status_code, error_code(answer)) == (400, code), path
            assert named in answer.json()["error"]["message"]
    finally:
        server.close()
    if os.geteuid() == 0:
        # Root reads a file whatever its mode; without CAP_DAC_OVERRIDE and
        # CAP_DAC_READ_SEARCH (setpriv) the CLI meets the mode as any other user would.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        env["MODELFORGE_STATE_DIR"] = str(tmp_path / "cli-state")
        cli = [sys.executable, "-m", "modelforge_appliance.cli"]
        subprocess.run([*cli, "init", "--json"], env=env, check=True, capture_output=True)
        refused = subprocess.run(
            ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
             *cli, "models", "import", "bad", str(unreadable)],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "b.bin: not readable (MODEL_SOURCE_INVALID)" in refused.stderr
        assert not (tmp_path / "cli-state" / "models" / "blobs").exists()
    bad_name = import_model(cp, "../up", escaping)
    assert (bad_name.status_code, error_code(bad_name)) == (400, "FIELD_FORMAT")
    assert (model_rows(cp), blobs(cp)) == (0, [])
    tmp = cp.settings.state_dir / "models" / "tmp"
    assert not tmp.exists() or list(tmp.iterdir()) == []


def test_revision_rules(control_plane, tmp_path):
    cp = control_plane
    first = make_model_dir(tmp_path / "v1", {"w.bin": b"one"})
    second = make_model_dir(tmp_path / "v2", {"w.bin": b"two"})
    assert import_model(cp, "m", first).json()["revision"] == "r1"
    again = import_model(cp, "m", first)
    assert (again.status_code, again.json()["revision"]) == (200, "r1")
    new = import_model(cp, "m", second)
    assert (new.status_code, new.json()["revision"]) == (201, "r2")
    taken = import_model(cp, "m", first, revision="r2")
    assert (taken.status_code, error_code(taken)) == (409, "MODEL_REVISION_EXISTS")
    same = import_model(cp, "m", second, revision="r2")
    assert (same.status_code, same.json()["revision"]) == (200, "r2")
    named = import_model(cp, "m", first, revision="v1.0")
    assert (named.status_code, named.json()["revision"]) == (201, "v1.0")
    shown = cp.admin("GET", f"{MODELS}/m").json()
    assert shown["revision"] == "v1.0"
    assert [r["revision"] for r in shown["revisions"]] == ["r1", "r2", "v1.0"]
    assert cp.admin("GET", f"{MODELS}/m?revision=r1").json()["files"][0]["size"] == 3
    # Deleting one revision keeps the blobs another still lists.
    assert cp.admin("DELETE", f"{MODELS}/m?revision=r1").status_code == 200
    assert hashlib.sha256(b"one").hexdigest() in blobs(cp)  # v1.0 has it
    assert cp.admin("DELETE", f"{MODELS}/m").status_code == 200
    assert blobs(cp) == []


def test_only_online_nodes_take_replicas_all_or_nothing(clocked_control_plane, tmp_path):
    cp, clock = clocked_control_plane, clocked_control_plane.store.clock
    assert import_model(cp, "m", make_model_dir(tmp_path / "m", {"w": b"x"})).status_code == 201
    online, quiet = node(cp, "cpu-on"), node(cp, "cpu-quiet")
    unseen = WorkNode(cp, "cpu-unseen", gpus=[], mode="cpu")  # enrolled, never heartbeated
    clock.advance(cp.settings.stale_after_seconds + 1)
    online.heartbeat()
    cp.heartbeats.flush()
    path = f"{MODELS}/m/replicas"
    for node_id, code, liveness in [
        (quiet.node_id, "NODE_NOT_ELIGIBLE", "stale"),
        (unseen.node_id, "NODE_NOT_ELIGIBLE", "pending"),
        ("node_unknown", "NOT_FOUND", None),
    ]:
        answer = cp.admin("POST", path, json={"node_ids": [online.node_id, node_id]})
        assert error_code(answer) == code, answer.text
        if liveness:
            assert answer.status_code == 409 and liveness in answer.json()["error"]["message"]
    assert replicas_of(cp, "m") == []
    with cp.store.connection():
        assert Node.get_by_id(online.node_id).models_generation == 0
    missing = cp.admin("POST", f"{MODELS}/nope/replicas", json={"node_ids": [online.node_id]})
    assert (missing.status_code, error_code(missing)) == (404, "MODEL_NOT_FOUND")
    assert cp.admin("POST", path, json={"node_ids": [online.node_id]}).status_code == 202


def test_two_replicate_calls_at_once_make_one_row(control_plane, tmp_path):
    cp = control_plane
    assert import_model(cp, "m", make_model_dir(tmp_path / "m", {"w": b"x"})).status_code == 201
    member = node(cp)
    barrier = threading.Barrier(8)
    answers: list = [None] * 8

    def send(index: int) -> None:
        barrier.wait()
        answers[index] = cp.admin(
            "POST", f"{MODELS}/m/replicas", json={"node_ids": [member.node_id]}
        )

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [202] * 8, [a.text for a in answers]
    with cp.store.connection():
        assert ModelReplica.select().count() == 1
    # A failed replica asked for again is a retry: pending, its error gone.
    digest = answers[0].json()["replicas"][0]["digest"]
    error = {"code": "DISK_FULL", "message": "no space left on /artifacts"}
    failed = {"digest": digest, "state": "failed", "bytes_done": 0, "bytes_total": 1}
    report(cp, member, [{**failed, "error": error}])
    [shown] = replicas_of(cp, "m")
    assert (shown["state"], shown["error"]) == ("failed", error)
    retried = cp.admin("POST", f"{MODELS}/m/replicas", json={"node_ids": [member.node_id]})
    assert [(r["state"], r["error"]) for r in retried.json()["replicas"]] == [("pending", None)]


def test_a_restore_makes_presence_be_measured_again(tmp_path):
    settings = make_settings(tmp_path / "state")
    backup = tmp_path / "backup.sqlite3"
    with serve(settings) as cp:
        assert import_model(cp, "m", make_model_dir(tmp_path / "m", {"w": b"x"})).status_code == 201
        member = node(cp)
        made = cp.admin("POST", f"{MODELS}/m/replicas", json={"node_ids": [member.node_id]})
        digest = made.json()["replicas"][0]["digest"]
        present = {"digest": digest, "state": "present", "bytes_done": 1, "bytes_total": 1}
        report(cp, member, [present])
        assert replicas_of(cp, "m")[0]["state"] == "present"
        run_cli("backup", str(backup), env=store_env(settings), check=True)
    run_cli("restore", str(backup), "--yes", env=store_env(settings), check=True)
    with serve(settings) as cp:
        [shown] = replicas_of(cp, "m")
        assert (shown["state"], shown["reported_at"]) == ("pending", None)
        report(cp, member, [present])
        assert replicas_of(cp, "m")[0]["state"] == "present"


def test_the_cli_imports_replicates_and_verifies(sqlite_control_plane, tmp_path):
    cp = sqlite_control_plane
    env = store_env(cp.settings)
    source = make_model_dir(tmp_path / "m", {"a.bin": b"a" * 1000, "b/c.bin": b"c" * 10})
    imported = run_cli("models", "import", "m", str(source), "--json", env=env, check=True)
    view = json.loads(imported.stdout)
    assert (view["revision"], view["file_count"]) == ("r1", 2)
    listed = json.loads(run_cli("models", "list", "--json", env=env, check=True).stdout)
    assert [m["name"] for m in listed["models"]] == ["m"]
    member = node(cp, "cpu-cli")
    cp.heartbeats.flush()  # the CLI reads the store, not the server's heartbeat buffer
    made = run_cli("models", "replicate", "m", "cpu-cli", "--json", env=env, check=True)
    assert [r["node_id"] for r in json.loads(made.stdout)["replicas"]] == [member.node_id]
    shown = json.loads(run_cli("models", "show", "m", "--json", env=env, check=True).stdout)
    assert [r["state"] for r in shown["replicas"]] == ["pending"]
    ok = run_cli("models", "verify", "m", env=env)
    assert ok.returncode == 0, ok.stderr

    # --wait without a terminal: a line per state change; exit 1 with the failure's code
    # and next step, 0 once present.
    error = {"code": "INSUFFICIENT_SPACE", "message": "needs 1010 B, 0 B free"}
    entry = {"digest": view["digest"], "bytes_done": 0, "bytes_total": 1010}
    for outcome, code in [({"state": "failed", "error": error}, 1), ({"state": "present"}, 0)]:
        waiting = subprocess.Popen(
            [*APPLIANCE_CLI, "models", "replicate", "m", member.node_id, "--wait"],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiting.stdout.readline().endswith(": pending\n")
        report(cp, member, [{**entry, **outcome}])
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == code, err
        assert out.endswith(f": {outcome['state']}\n")
        if code:
            assert "INSUFFICIENT_SPACE" in err and "next step" in err

    refused = run_cli("models", "remove", "m", env=env)
    assert refused.returncode == 1 and "MODEL_REPLICATED" in refused.stderr
    removed = run_cli("models", "remove", "m", "--node", "cpu-cli", env=env, check=True)
    assert "remove" in removed.stdout
    blob = cp.settings.state_dir / "models/blobs/sha256" / view["files"][0]["sha256"]
    blob.chmod(0o644)
    blob.write_bytes(b"tampered")
    bad = run_cli("models", "verify", "m", env=env)
    assert bad.returncode == 1
    assert "MODEL_CACHE_INVALID" in bad.stderr and "a.bin" in bad.stderr
    blob.unlink()
    gone = run_cli("models", "verify", "m", env=env)
    assert gone.returncode == 1 and "missing" in gone.stderr
    assert run_cli("models", "show", "nope", env=env).returncode == 7


def test_a_blob_larger_than_any_buffer_streams_whole_and_in_ranges(sqlite_control_plane, tmp_path):
    cp = sqlite_control_plane
    big = tmp_path / "big.bin"
    size = 96 * 1024 * 1024 + 12345
    digest = hashlib.sha256()
    with open(big, "wb") as handle:
        block = os.urandom(1024 * 1024)
        written = 0
        while written < size:
            piece = block[: min(len(block), size - written)]
            handle.write(piece)
            digest.update(piece)
            written += len(piece)
    model = import_model(cp, "big", big).json()
    member = node(cp)
    cp.admin("POST", f"{MODELS}/big/replicas", json={"node_ids": [member.node_id]})
    headers = {
        HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
        "Authorization": f"Bearer {member.credential}",
    }
    url = cp.url + blob_path(model["files"][0]["sha256"])

    def fetch(extra: dict) -> tuple[int, str, int]:
        got, count = hashlib.sha256(), 0
        with requests.get(url, headers={**headers, **extra}, stream=True, timeout=60) as answer:
            for chunk in answer.iter_content(1024 * 1024):
                got.update(chunk)
                count += len(chunk)
            return answer.status_code, got.hexdigest(), count

    assert fetch({}) == (200, digest.hexdigest(), size)
    start = 50 * 1024 * 1024 + 3
    status, _, count = fetch({"Range": f"bytes={start}-"})
    assert (status, count) == (206, size - start)
    status, _, count = fetch({"Range": "bytes=1000-1999"})
    assert (status, count) == (206, 1000)
    # Counted when the server closes each blob, once its last byte has left (a moment after
    # the client has it): what left, not what was asked for.
    expected, deadline = size + size - start + 1000, time.monotonic() + 30
    while True:
        metrics = cp.admin("GET", "/metrics").text
        [served] = [
            line
            for line in metrics.splitlines()
            if line.startswith("modelforge_blob_bytes_served_total")
        ]
        if float(served.split()[1]) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert float(served.split()[1]) == expected
    assert 'modelforge_model_replicas{state="pending"} 1.0' in metrics
    # The cache lost the blob: a 500 that says to import again, not a 403 or a hang.
    (cp.settings.state_dir / "models/blobs/sha256" / model["files"][0]["sha256"]).unlink()
    lost = requests.get(url, headers=headers, timeout=30)
    assert (lost.status_code, error_code(lost)) == (500, "MODEL_CACHE_INVALID")
    assert "import" in lost.json()["error"]["next_step"]


def test_a_download_slower_than_the_request_timeout_is_not_cut(tmp_path):
    """The request deadline covers receiving a request, never sending its answer: a blob a
    slow agent reads for longer than MODELFORGE_REQUEST_TIMEOUT_SECONDS arrives whole."""
    settings = make_settings(tmp_path / "state", request_timeout_seconds=1)
    data = os.urandom(16 * 1024 * 1024)  # more than the socket buffers hold
    (tmp_path / "w.bin").write_bytes(data)
    with serve(settings) as cp:
        model = import_model(cp, "slow", tmp_path / "w.bin").json()
        member = node(cp)
        cp.admin("POST", f"{MODELS}/slow/replicas", json={"node_ids": [member.node_id]})
        headers = {
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "Authorization": f"Bearer {member.credential}",
        }
        url = cp.url + blob_path(model["files"][0]["sha256"])
        got = hashlib.sha256()
        began = time.monotonic()
        with requests.get(url, headers=headers, stream=True, timeout=30) as answer:
            for chunk in answer.iter_content(512 * 1024):
                got.update(chunk)
                time.sleep(0.1)  # 32 chunks: over 3 s, past the 1 s request deadline
        assert time.monotonic() - began > 2 * settings.request_timeout_seconds
        assert got.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_range_of_any_length_is_read_without_a_500():
    """A Range with more digits than CPython turns into an int (4,300) answered 500 with a
    traceback: a start past any file is 416, an end or a suffix past it is the whole file."""
    from modelforge_appliance.api.agent_models import byte_range

    huge = "9" * 5000
    with pytest.raises(ApiError) as refused:
        byte_range(f"bytes={huge}-", 1000)
    assert refused.value.status == 416
    assert byte_range(f"bytes=10-{huge}", 1000) == (10, 999)
    assert byte_range(f"bytes=-{huge}", 1000) == (0, 999)
    assert byte_range(f"bytes={'0' * 5000}7-9", 1000) == (7, 9)
    assert byte_range("bytes=5-3", 1000) is None


def test_a_range_header_of_thousands_of_digits_is_416_in_the_error_shape(
    sqlite_control_plane, tmp_path
):
    cp = sqlite_control_plane
    source = make_model_dir(tmp_path / "m", {"a.bin": b"a" * 1000})
    model = import_model(cp, "m", source).json()
    member = node(cp)
    cp.admin("POST", f"{MODELS}/m/replicas", json={"node_ids": [member.node_id]})
    answer = requests.get(
        cp.url + blob_path(model["files"][0]["sha256"]),
        headers={
            HEADER_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
            "Authorization": f"Bearer {member.credential}",
            "Range": f"bytes={'9' * 5000}-",
        },
        timeout=30,
    )
    assert (answer.status_code, error_code(answer)) == (416, "RANGE_NOT_SATISFIABLE")
    assert answer.headers["Content-Range"] == "bytes */1000"


def test_the_cli_counts_one_file_as_one_file(tmp_path):
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"))
    assert invoke_cli("init", env=env).returncode == 0
    source = make_model_dir(tmp_path / "one", {"a.bin": b"a" * 10})
    imported = invoke_cli("models", "import", "one", str(source), env=env, check=True)
    assert ": 1 file, " in imported.stdout, imported.stdout
    shown = invoke_cli("models", "show", "one", env=env, check=True)
    assert " in 1 file\n" in shown.stdout, shown.stdout


def test_an_import_from_the_cache_s_file_system_says_it_is_a_copy(tmp_path):
    """The seed cache never hard-links a source (an edit in place would change cached bytes
    under their digest): an import from its own file system says the bytes are now twice
    there; one from elsewhere (tmpfs) or one already imported says nothing of it."""
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"))
    assert invoke_cli("init", env=env).returncode == 0
    source = make_model_dir(tmp_path / "same", {"w.bin": b"w" * 4096})
    imported = invoke_cli("models", "import", "same", str(source), env=env, check=True)
    assert "keeps its own copy on the same file system as" in imported.stdout, imported.stdout
    [blob] = (tmp_path / "state" / "models" / "blobs" / "sha256").iterdir()
    assert blob.stat().st_nlink == 1  # a copy, not a link to w.bin
    again = invoke_cli("models", "import", "same", str(source), env=env, check=True)
    assert "Already imported" in again.stdout and "own copy" not in again.stdout
    with tempfile.TemporaryDirectory(dir="/dev/shm") as elsewhere:
        other = make_model_dir(Path(elsewhere) / "other", {"o.bin": b"o" * 4096})
        assert os.stat(other).st_dev != os.stat(tmp_path).st_dev
        apart = invoke_cli("models", "import", "other", str(other), env=env, check=True)
        assert "own copy" not in apart.stdout, apart.stdout


def test_an_imported_file_name_with_a_bidi_override_is_refused(tmp_path):
    """`models show` printed such names raw: U+202E shows 'model‮fdp.exe' as 'modelexe.pdf'."""
    env = clean_env(MODELFORGE_STATE_DIR=str(tmp_path / "state"))
    assert invoke_cli("init", env=env).returncode == 0
    source = make_model_dir(tmp_path / "m", {"ok.bin": b"a", "model\u202efdp.exe": b"b"})
    refused = invoke_cli("models", "import", "m", str(source), env=env)
    assert refused.returncode != 0
    assert "MODEL_SOURCE_INVALID" in refused.stderr and "U+202E" in refused.stderr
    listed = invoke_cli("models", "list", "--json", env=env, check=True)
    assert json.loads(listed.stdout)["models"] == []


def test_a_next_step_names_every_command_up_to_five():
    from modelforge_appliance.models.catalog import _each

    assert _each(["a"]) == "a."
    assert _each(["a", "b"]) == "a; b."
    assert _each([str(i) for i in range(7)]) == "0; 1; 2; 3; 4; and 2 more like it."
