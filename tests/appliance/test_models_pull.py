"""Models from a hub (issue 39, docs/architecture.md §10): the real huggingface_hub client
against a stand-in of the hub's file routes on 127.0.0.1 (tests/harness/hub_stand_in.py),
through the real control plane (waitress, SQLite) and the real ``modelforge`` CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import AuditEvent, Model
from modelforge_contract.hub import PATH_ADMIN_HUB_TOKEN, PATH_ADMIN_MODEL_PULLS
from modelforge_contract.models import PATH_ADMIN_MODELS, PATH_AGENT_MODELS
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import (
    APPLIANCE_CLI,
    error_code,
    free_port,
    invoke_cli,
    make_settings,
    run_cli,
    serve,
    store_env,
)
from tests.harness.hub_stand_in import HubStandIn, safetensors_bytes
from tests.harness.scripted_node import WorkNode

GGUF_REPO = "tiny-org/tiny-GGUF"
ST_REPO = "tiny-org/tiny-safetensors"
GATED_REPO = "tiny-org/gated-tiny"
BIG_REPO = "tiny-org/big"
TOKEN = "hf_pulltoken_" + "Zq7" * 12
CHUNK = hub_constants.DOWNLOAD_CHUNK_SIZE  # what the client writes at once
BIG = 4 * CHUNK


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hub(tiny_gguf):
    gguf = Path(tiny_gguf).read_bytes()
    with HubStandIn() as stand_in:
        stand_in.add_repo(
            GGUF_REPO,
            {
                "README.md": b"# tiny\nquantisations of a tiny llama\n",
                "tiny-Q4_K_M.gguf": gguf,
                "tiny-Q8_0.gguf": gguf + b"\x00" * 4096,
                "tiny-F16.gguf": gguf + b"\x01" * 8192,
            },
        )
        stand_in.repos[GGUF_REPO].refs["v1.0"] = stand_in.repos[GGUF_REPO].commit  # a tag
        stand_in.add_repo(
            ST_REPO,
            {
                "config.json": b'{"hidden_size": 8}',
                "tokenizer.json": b'{"model": {"vocab": {"a": 0}}}',
                "model.safetensors": safetensors_bytes(60_000),
            },
        )
        stand_in.add_repo(GATED_REPO, {"tiny.gguf": gguf}, gated=True, tokens=(TOKEN,))
        yield stand_in


@pytest.fixture
def cp(tmp_path, hub):
    with serve(make_settings(tmp_path / "state", hub_endpoint=hub.url)) as plane:
        yield plane


def pull(cp, name: str, repo: str, **source):
    body = {"name": name, "source": {"hub": "huggingface", "repo": repo, **source}}
    return cp.admin("POST", PATH_ADMIN_MODELS, json=body)


def finished(cp, answer) -> dict:
    """The pull an accepted POST started, once it has finished."""
    assert answer.status_code == 202, answer.text
    pull_id = answer.json()["pull"]["pull_id"]
    assert answer.headers["Location"] == f"{PATH_ADMIN_MODEL_PULLS}/{pull_id}"
    cp.server.app.model_pulls.wait(pull_id, timeout=120)
    shown = cp.admin("GET", answer.headers["Location"])
    assert shown.status_code == 200, shown.text
    return shown.json()["pull"]


def cache_files(cp) -> set[str]:
    blobs = cp.settings.state_dir / "models" / "blobs" / "sha256"
    return {p.name for p in blobs.iterdir()} if blobs.exists() else set()


def cli_env(cp, **extra):
    return store_env(cp.settings, HF_ENDPOINT=cp.settings.hub_endpoint, **extra)


# -- choosing files, resolving the revision ------------------------------------------------


def test_one_quantisation_of_a_multi_file_repo_by_include(cp, hub, tiny_gguf):
    repo = hub.repos[GGUF_REPO]
    answer = pull(cp, "tiny-q4", f"hf://{GGUF_REPO}@v1.0", include=["*Q4_K_M.gguf"])
    started = answer.json()["pull"] if answer.status_code == 202 else answer.json()
    assert started["commit"] == repo.commit and started["state"] in ("downloading", "done")
    assert [f["path"] for f in started["files"]] == ["tiny-Q4_K_M.gguf"]
    done = finished(cp, answer)
    assert done["state"] == "done", done
    assert done["bytes_done"] == done["bytes_total"] == repo.files["tiny-Q4_K_M.gguf"].size
    model = done["model"]
    # The revision is the commit it resolved to, recorded with the source.
    assert (model["revision"], model["source"]) == (repo.commit, f"hf://{GGUF_REPO}@{repo.commit}")
    gguf = Path(tiny_gguf).read_bytes()
    assert model["files"] == [{"path": "tiny-Q4_K_M.gguf", "size": len(gguf), "sha256": sha(gguf)}]
    # Only that file was fetched, and it sits in the seed cache like an imported one.
    assert dict(hub.served) == {"tiny-Q4_K_M.gguf": len(gguf)}
    assert cache_files(cp) == {sha(gguf)}
    blob = cp.settings.state_dir / "models/blobs/sha256" / sha(gguf)
    assert blob.read_bytes() == gguf
    assert not list((cp.settings.state_dir / "models/hub/verified").iterdir())
    shown = cp.admin("GET", f"{PATH_ADMIN_MODELS}/tiny-q4").json()
    assert shown["digest"] == model["digest"]
    verify = run_cli("models", "verify", "tiny-q4", env=cli_env(cp))
    assert verify.returncode == 0, verify.stderr

    # Again: the same revision, nothing downloaded again.
    again = finished(cp, pull(cp, "tiny-q4", f"hf://{GGUF_REPO}@v1.0", include=["*Q4_K_M.gguf"]))
    assert (again["state"], again["created"], again["model"]["digest"]) == (
        "done",
        False,
        model["digest"],
    )
    assert dict(hub.served) == {"tiny-Q4_K_M.gguf": len(gguf)}
    with cp.store.connection():
        events = [
            json.loads(e.detail)
            for e in AuditEvent.select().where(AuditEvent.action == "model.pulled")
        ]
    assert events == [
        {
            "name": "tiny-q4",
            "revision": repo.commit,
            "digest": model["digest"],
            "size_bytes": len(gguf),
            "file_count": 1,
            "source": f"hf://{GGUF_REPO}@{repo.commit}",
        }
    ]


def test_the_cli_pulls_what_exclude_leaves_and_lists_it(cp, hub):
    repo = hub.repos[ST_REPO]
    result = run_cli(
        "models", "pull", "tiny-st", f"hf://{ST_REPO}", "--exclude", "*.json", "--json",
        env=cli_env(cp), check=True,
    )  # fmt: skip
    view = json.loads(result.stdout)
    weights = repo.files["model.safetensors"]
    assert view["files"] == [
        {"path": "model.safetensors", "size": weights.size, "sha256": weights.sha256}
    ]
    assert view["revision"] == repo.commit
    assert set(hub.served) == {"model.safetensors"}
    listed = run_cli("models", "list", "--json", env=cli_env(cp), check=True)
    assert [m["name"] for m in json.loads(listed.stdout)["models"]] == ["tiny-st"]
    # Files kept in git are verified by their blob id: the whole repository, under another
    # recorded revision, adds the two small files and not the weights again.
    whole = run_cli(
        "models", "pull", "tiny-st-all", f"hf://{ST_REPO}@main", "--revision", "v1", "--json",
        env=cli_env(cp), check=True,
    )  # fmt: skip
    assert [f["path"] for f in json.loads(whole.stdout)["files"]] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert json.loads(whole.stdout)["revision"] == "v1"
    assert hub.served["model.safetensors"] == weights.size


@pytest.mark.parametrize(
    ("source", "status", "code", "next_step"),
    [
        ({"repo": "tiny-org/nope"}, 400, "HUB_REPO_NOT_FOUND", "modelforge hub-token set"),
        ({"repo": f"hf://{GGUF_REPO}@v9"}, 400, "HUB_REVISION_NOT_FOUND", "branch, tag or commit"),
        ({"repo": GGUF_REPO, "include": ["*Q2_K.gguf"]}, 400, "HUB_NO_MATCHING_FILES", "--include"),
        ({"repo": "tiny-org/../etc"}, 400, "HUB_SOURCE_INVALID", "ORG/REPO"),
        ({"repo": "hf://tiny-org/x@main", "revision": "v1"}, 400, "HUB_SOURCE_INVALID", "ORG/REPO"),
    ],
)
def test_a_source_the_hub_does_not_have_is_refused_before_a_byte(
    cp, hub, source, status, code, next_step
):
    answer = pull(cp, "tiny", **source)
    assert (answer.status_code, error_code(answer)) == (status, code), answer.text
    assert next_step in answer.json()["error"]["next_step"]
    assert hub.served == {} and cache_files(cp) == set()
    assert cp.admin("GET", PATH_ADMIN_MODEL_PULLS).json() == {"pulls": []}


def test_no_matching_file_lists_the_files_there_are(cp):
    answer = pull(cp, "tiny", GGUF_REPO, include=["*Q2_K.gguf"])
    message = answer.json()["error"]["message"]
    assert "tiny-Q4_K_M.gguf" in message and "tiny-F16.gguf" in message


def test_the_hub_out_of_reach_says_so_and_points_at_import(tmp_path):
    settings = make_settings(tmp_path / "state", hub_endpoint=f"http://127.0.0.1:{free_port()}")
    with serve(settings) as plane:
        answer = pull(plane, "tiny", GGUF_REPO)
        assert (answer.status_code, error_code(answer)) == (503, "HUB_UNREACHABLE")
        assert "modelforge models import NAME PATH" in answer.json()["error"]["next_step"]
        result = invoke_cli(
            "models", "pull", "tiny", f"hf://{GGUF_REPO}",
            env=store_env(settings, HF_ENDPOINT=settings.hub_endpoint),
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert "HUB_UNREACHABLE" in result.stderr and "models import" in result.stderr


def test_a_rate_limited_hub_says_when_to_come_back(cp, hub):
    hub.rate_limited = True
    answer = pull(cp, "tiny", GGUF_REPO)
    assert (answer.status_code, error_code(answer)) == (503, "HUB_RATE_LIMITED")
    assert answer.headers["Retry-After"] == "30"
    assert "Wait 30 s" in answer.json()["error"]["next_step"]


def test_too_little_space_is_refused_before_the_first_byte(tmp_path, hub):
    hub.add_repo(
        "tiny-org/huge", {"huge.safetensors": b"x" * 1024}, listed_sizes={"huge.safetensors": 2**60}
    )
    with serve(make_settings(tmp_path / "state", hub_endpoint=hub.url)) as plane:
        answer = pull(plane, "huge", "tiny-org/huge")
        assert (answer.status_code, error_code(answer)) == (507, "INSUFFICIENT_SPACE")
        assert "Free space" in answer.json()["error"]["next_step"]
        assert hub.served == {}
        partial = plane.settings.state_dir / "models/hub/partial"
        assert not partial.exists() or not list(partial.iterdir())
        result = invoke_cli(
            "models", "pull", "huge", "hf://tiny-org/huge",
            env=store_env(plane.settings, HF_ENDPOINT=hub.url),
        )  # fmt: skip
        assert result.returncode == 9 and "INSUFFICIENT_SPACE" in result.stderr


# -- resuming ---------------------------------------------------------------------------


def big_repo(hub) -> bytes:
    data = hashlib.shake_256(b"big").digest(BIG)
    hub.add_repo(BIG_REPO, {"big.safetensors": data})
    return data


def test_a_pull_killed_half_way_resumes_without_fetching_the_first_half_again(tmp_path, hub):
    data = big_repo(hub)
    settings = make_settings(tmp_path / "state", hub_endpoint=hub.url)
    settings.state_dir.mkdir(parents=True)
    made = Store(settings.database_url, Clock())
    made.migrate()
    made.close()
    # The client's read timeout cannot end the paused download: only the kill does.
    env = store_env(settings, HF_ENDPOINT=hub.url, HF_HUB_DOWNLOAD_TIMEOUT="600")
    # Paused a chunk past half: the client has written at least the first half to disk.
    release = hub.pause("big.safetensors", BIG // 2 + CHUNK)
    partial = settings.state_dir / "models/hub/partial" / f"sha256-{sha(data)}"
    log = (tmp_path / "first.log").open("w")
    process = subprocess.Popen(
        [*APPLIANCE_CLI, "models", "pull", "big", f"hf://{BIG_REPO}", "--json"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(
            lambda: partial.exists() and partial.stat().st_size >= BIG // 2,
            timeout=120,
            what="the first half on disk",
        )
    finally:
        process.kill()
        process.wait(timeout=30)
        release.set()
    kept = partial.stat().st_size
    assert BIG // 2 <= kept < BIG
    store = Store(settings.database_url, Clock())
    try:
        with store.connection():
            assert Model.select().count() == 0
    finally:
        store.close()
    first_bodies = len(hub.bodies)

    result = run_cli("models", "pull", "big", f"hf://{BIG_REPO}", "--json", env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    # The second pull asked for the rest only, and got it.
    [resumed] = hub.bodies[first_bodies:]
    assert (resumed.start, resumed.sent) == (kept, BIG - kept)
    view = json.loads(result.stdout)
    assert view["files"] == [{"path": "big.safetensors", "size": BIG, "sha256": sha(data)}]
    blob = settings.state_dir / "models/blobs/sha256" / sha(data)
    assert blob.read_bytes() == data
    assert not partial.exists()


def test_a_connection_cut_half_way_resumes_within_the_pull(cp, hub):
    data = big_repo(hub)
    hub.cut("big.safetensors", BIG // 2 + CHUNK)
    done = finished(cp, pull(cp, "big", BIG_REPO))
    assert done["state"] == "done", done
    first, second = hub.bodies
    assert first.start == 0 and BIG // 2 <= second.start == BIG - second.sent
    assert done["model"]["files"][0]["sha256"] == sha(data)


def test_progress_shows_while_it_downloads_and_a_second_pull_of_the_file_waits_its_turn(cp, hub):
    big_repo(hub)
    release = hub.pause("big.safetensors", BIG // 2 + CHUNK)
    first = pull(cp, "big", BIG_REPO)
    assert first.status_code == 202, first.text
    pull_id = first.json()["pull"]["pull_id"]

    def moving():
        [shown] = [p for p in cp.admin("GET", PATH_ADMIN_MODEL_PULLS).json()["pulls"]
                   if p["pull_id"] == pull_id]  # fmt: skip
        return shown if shown["bytes_done"] >= BIG // 2 else None

    try:
        shown = wait_until(moving, timeout=120, what="progress past half")
        assert shown["state"] == "downloading" and shown["bytes_total"] == BIG
        assert shown["files"][0]["state"] == "downloading"
        second = finished(cp, pull(cp, "big-again", BIG_REPO))
        assert (second["state"], second["error"]["code"]) == ("failed", "PULL_IN_PROGRESS")
    finally:
        release.set()
    done = cp.server.app.model_pulls.wait(pull_id, timeout=120)
    assert done["state"] == "done", done
    assert cp.admin("GET", f"{PATH_ADMIN_MODEL_PULLS}/pull_0000").status_code == 404


# -- verification ------------------------------------------------------------------------


def test_a_corrupted_file_is_quarantined_and_nothing_is_half_imported(cp, hub):
    repo = hub.repos[ST_REPO]
    hub.corrupt("model.safetensors")
    failed = finished(cp, pull(cp, "tiny-st", ST_REPO))
    assert (failed["state"], failed["error"]["code"]) == ("failed", "DIGEST_MISMATCH"), failed
    assert "Pull again" in failed["error"]["next_step"]
    assert failed["model"] is None
    missing = cp.admin("GET", f"{PATH_ADMIN_MODELS}/tiny-st")
    assert (missing.status_code, error_code(missing)) == (404, "MODEL_NOT_FOUND")
    assert cache_files(cp) == set()  # not even the files that did verify
    [quarantined] = (cp.settings.state_dir / "models/quarantine").iterdir()
    weights = repo.files["model.safetensors"]
    assert quarantined.name.startswith(f"sha256-{weights.sha256}.")
    assert quarantined.read_bytes() != weights.data and quarantined.stat().st_size == weights.size

    hub.repair("model.safetensors")
    again = finished(cp, pull(cp, "tiny-st", ST_REPO))
    assert again["state"] == "done", again
    assert hub.served["model.safetensors"] == 2 * weights.size  # downloaded anew
    assert cache_files(cp) == {f.sha256 for f in repo.files.values()}


# -- tokens ------------------------------------------------------------------------------


def test_a_gated_repo_needs_the_token_which_goes_to_the_hub_and_nowhere_else(
    cp, hub, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    answers: list[str] = []
    refused = pull(cp, "gated", GATED_REPO)
    assert (refused.status_code, error_code(refused)) == (400, "HUB_TOKEN_REQUIRED"), refused.text
    assert "gated" in refused.json()["error"]["message"]
    assert "401" in refused.json()["error"]["message"]
    assert "modelforge hub-token set" in refused.json()["error"]["next_step"]
    cli = run_cli("models", "pull", "gated", f"hf://{GATED_REPO}", env=cli_env(cp))
    assert cli.returncode == 1 and "HUB_TOKEN_REQUIRED" in cli.stderr
    assert "next step:" in cli.stderr and "hub-token set" in cli.stderr

    # A token of an account without access: 403, said as such.
    wrong = cp.admin("PUT", PATH_ADMIN_HUB_TOKEN, json={"token": "hf_other_" + "x" * 30})
    assert wrong.status_code == 200 and wrong.json()["set"] is True
    denied = pull(cp, "gated", GATED_REPO)
    assert (denied.status_code, error_code(denied)) == (400, "HUB_ACCESS_DENIED")
    assert "403" in denied.json()["error"]["message"]

    # The token, set on the CLI from stdin, is answered back by nothing.
    set_cli = run_cli("hub-token", "set", "--json", env=cli_env(cp), stdin=TOKEN + "\n")
    assert set_cli.returncode == 0, set_cli.stderr
    answers += [set_cli.stdout, set_cli.stderr]
    done = finished(cp, pull(cp, "gated", GATED_REPO))
    assert done["state"] == "done", done
    assert f"Bearer {TOKEN}" in hub.authorizations["hub"]
    assert hub.authorizations["cdn"] and not any(hub.authorizations["cdn"])  # the CDN: never

    shown = run_cli("hub-token", "show", "--json", env=cli_env(cp), check=True)
    assert json.loads(shown.stdout)["set"] is True
    answers += [shown.stdout, json.dumps(done)]
    for path in (
        PATH_ADMIN_HUB_TOKEN,
        PATH_ADMIN_MODEL_PULLS,
        f"{PATH_ADMIN_MODELS}/gated",
        "/api/v1/admin/audit-events?limit=500",
    ):
        answers.append(cp.admin("GET", path).text)
    # The node that holds the model never sees it either.
    node = WorkNode(cp, "cpu-a", gpus=[], mode="cpu").ready()
    made = cp.admin(
        "POST", f"{PATH_ADMIN_MODELS}/gated/replicas", json={"node_ids": [node.node_id]}
    )
    assert made.status_code == 202, made.text
    answers.append(made.text)
    beat = {"node_id": node.node_id, "agent_version": "0.1.0",
            "health": {"status": "ok", "gpu_probe": "not_applicable"}}  # fmt: skip
    answers.append(cp.agent("POST", "/api/v1/agent/heartbeat", node.credential, json=beat).text)
    desired = cp.agent("GET", PATH_AGENT_MODELS, node.credential)
    assert desired.json()["models"][0]["digest"] == done["model"]["digest"]
    answers.append(desired.text)
    backup = tmp_path / "store.backup"
    run_cli("backup", str(backup), env=cli_env(cp), check=True)

    places = {
        "answers": "\n".join(answers).encode(),
        "log": caplog.text.encode(),
        "backup": backup.read_bytes(),
    }
    places |= {p.name: p.read_bytes() for p in cp.settings.state_dir.iterdir() if p.is_file()}
    assert "modelforge.sqlite3" in places
    for name, content in places.items():
        assert TOKEN.encode() not in content, f"the hub token leaked into {name}"
        assert TOKEN.split("_", 2)[2].encode() not in content, f"part of it is in {name}"

    cleared = cp.admin("DELETE", PATH_ADMIN_HUB_TOKEN)
    assert (cleared.status_code, cleared.json()["cleared"], cleared.json()["set"]) == (
        200, True, False,
    )  # fmt: skip
    assert run_cli("hub-token", "clear", env=cli_env(cp), check=True).stdout.startswith("No")


def test_a_private_repo_without_a_token_is_not_found_and_says_a_token_may_help(cp, hub):
    hub.add_repo("tiny-org/private-tiny", {"a.gguf": b"GGUF"}, private=True, tokens=(TOKEN,))
    answer = pull(cp, "private", "tiny-org/private-tiny")
    assert (answer.status_code, error_code(answer)) == (400, "HUB_REPO_NOT_FOUND")
    assert "401" in answer.json()["error"]["message"]
    assert "modelforge hub-token set" in answer.json()["error"]["next_step"]
    assert cp.admin("PUT", PATH_ADMIN_HUB_TOKEN, json={"token": TOKEN}).status_code == 200
    assert finished(cp, pull(cp, "private", "tiny-org/private-tiny"))["state"] == "done"


def test_a_token_that_does_not_fit_is_refused_without_echoing_it(cp):
    answer = cp.admin("PUT", PATH_ADMIN_HUB_TOKEN, json={"token": "hf_a b"})
    assert (answer.status_code, error_code(answer)) == (400, "FIELD_FORMAT")
    assert "hf_a b" not in answer.text
    assert cp.admin("GET", PATH_ADMIN_HUB_TOKEN).json()["set"] is False
    empty = run_cli("hub-token", "set", env=cli_env(cp), stdin="\n")
    assert empty.returncode == 2 and "no token on stdin" in empty.stderr
