"""Work secrets are sealed (docs/work.md, "Secrets"): an item's env values are in clear only
in the lease answer to the node that claims it.

The attack: a submitted ``HF_TOKEN`` sat in clear in the store, its WAL and every backup,
came back from every admin answer and CLI view, and could be moved between items by anyone
who could write the store. Each test here failed on the code before sealing.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from modelforge_appliance.core import sealing
from modelforge_contract import WORK_SECRET_UNREADABLE
from tests.harness.control_plane import (
    ControlPlane,
    clean_env,
    make_settings,
    run_cli,
    serve,
    serving,
    store_env,
)
from tests.harness.scripted_node import WORK, WorkNode, item, submit, work_events

IMAGE = {"image": "trainer:1.4", "image_id": "sha256:" + "4f" * 32}


def hf_token() -> str:
    """A value shaped like a Hugging Face token, fresh for each test."""
    return f"hf_secret_0{secrets.token_hex(16)}"


def container(env: dict[str, str]) -> dict:
    return {"input": {**IMAGE, "env": env}}


def found_in(places: dict[str, bytes], values: list[str]) -> dict[str, int]:
    """Place -> how many times any of the values occurs in it (the figure the issue counts)."""
    counts = {}
    for name, data in places.items():
        hits = sum(data.count(value.encode()) for value in values)
        if hits:
            counts[name] = hits
    return counts


def state_files(state: Path) -> dict[str, bytes]:
    return {f"state/{p.name}": p.read_bytes() for p in sorted(state.iterdir()) if p.is_file()}


def test_a_work_secret_is_in_no_store_wal_backup_answer_or_log_only_in_the_lease(tmp_path):
    state = tmp_path / "state"
    env = clean_env(MODELFORGE_STATE_DIR=str(state), MODELFORGE_LOG_LEVEL="DEBUG")
    admin_token = json.loads(run_cli("init", "--json", env=env, check=True).stdout)["admin_token"]
    by_api, by_cli, refused = hf_token(), hf_token(), hf_token()
    values = [by_api, by_cli, refused]
    answers: dict[str, bytes] = {}
    log_path = tmp_path / "serve.log"
    with serving(env, log_path) as (url, _process):
        cp = ControlPlane(url, make_settings(state), None, admin_token)
        node = WorkNode(cp, "gpu-secrets").ready()

        body = {"capability": "container", **container({"HF_TOKEN": by_api, "MODE": "fast"})}
        first = cp.admin("POST", WORK, json={**body, "idempotency_key": "nightly-1"})
        again = cp.admin("POST", WORK, json={**body, "idempotency_key": "nightly-1"})
        assert (first.status_code, again.status_code) == (201, 200), first.text
        answers |= {"submit answer": first.content, "idempotent submit answer": again.content}
        assert first.json()["input"]["env"] == {"HF_TOKEN": "<sealed>", "MODE": "<sealed>"}

        job = tmp_path / "job.json"
        job.write_text(json.dumps({**IMAGE, "env": {"HF_TOKEN": by_cli}}))
        cli_env = env
        cli = run_cli("work", "submit", "container", "--input", f"@{job}", "--json", env=cli_env)
        assert cli.returncode == 0, cli.stderr
        answers["CLI submit"] = (cli.stdout + cli.stderr).encode()
        work_ids = [first.json()["work_id"], json.loads(cli.stdout)["work_id"]]

        # A refusal names the field, never the value.
        bad = cp.admin(
            "POST", WORK, json={"capability": "container", **container({"T": refused + "\0"})}
        )
        assert bad.status_code == 400 and "input.env.T" in bad.json()["error"]["message"]
        answers["refused submit answer"] = bad.content

        for name, path in [
            ("list", WORK),
            ("list queued", f"{WORK}?state=queued"),
            *[(f"show {w}", f"{WORK}/{w}") for w in work_ids],
            ("audit", "/api/v1/admin/audit-events?limit=500"),
        ]:
            response = cp.admin("GET", path)
            assert response.status_code == 200, response.text
            answers[name] = response.content
        for argv in (["work", "list", "--json"], ["work", "show", work_ids[0]]):
            shown = run_cli(*argv, env=cli_env)
            assert shown.returncode == 0, shown.stderr
            answers[f"CLI {' '.join(argv[:2])}"] = (shown.stdout + shown.stderr).encode()

        for name, extra in [("plain", []), ("with-key", ["--include-work-key"])]:
            made = run_cli("backup", str(tmp_path / f"{name}.sqlite3"), *extra, env=cli_env)
            assert made.returncode == 0, made.stderr
            answers[f"CLI backup {name}"] = (made.stdout + made.stderr).encode()
        assert "sealed env values" in answers["CLI backup plain"].decode()
        backups = {
            p.name: p.read_bytes() for p in sorted(tmp_path.iterdir()) if ".sqlite3" in p.name
        }
        assert set(backups) == {"plain.sqlite3", "with-key.sqlite3", "with-key.sqlite3.work-key"}
        running = state_files(state)
        assert "state/modelforge.sqlite3-wal" in running, sorted(running)

        # The one place the values are in clear: the answer to the node that won the item.
        claims = [node.claim(work_slots=2) for _ in range(2)]
        assert [claim.status_code for claim in claims] == [200, 200]
        leases = [claim.json()["lease"] for claim in claims]
        assert [lease["input"]["env"] for lease in leases] == [
            {"HF_TOKEN": by_api, "MODE": "fast"},
            {"HF_TOKEN": by_cli},
        ]
        for lease in leases:
            done = node.complete(lease)
            assert done.status_code == 200, done.text
        answers["show after completion"] = cp.admin("GET", f"{WORK}/{work_ids[0]}").content
        answers["audit after completion"] = cp.admin("GET", "/api/v1/admin/audit-events").content

    places = {
        **{f"while serving {name}": data for name, data in running.items()},
        **state_files(state),
        **{f"backup {name}": data for name, data in backups.items()},
        **{f"answer: {name}": data for name, data in answers.items()},
        "serve log (DEBUG)": log_path.read_bytes(),
    }
    assert found_in(places, values) == {}
    key = (state / sealing.WORK_KEY_FILE).stat()
    assert stat.S_IMODE(key.st_mode) == 0o600


@pytest.fixture
def node(control_plane) -> WorkNode:
    return WorkNode(control_plane, "gpu-claimer").ready()


def _sql(cp, sql: str, params: tuple):
    """A statement on the test's store, with the store's placeholder for ``?``."""
    return cp.store.db.execute_sql(sql.replace("?", cp.store.db.param), params)


def _input_of(cp, work_id: str) -> str:
    return _sql(cp, "SELECT input FROM work_item WHERE work_id = ?", (work_id,)).fetchone()[0]


def _set_input(cp, work_id: str, stored: str) -> None:
    """What someone who can write the store does."""
    _sql(cp, "UPDATE work_item SET input = ? WHERE work_id = ?", (stored, work_id))


def test_a_sealed_value_moved_to_another_item_or_name_fails_closed(control_plane, node):
    cp = control_plane
    a, b, c, x, y = (hf_token() for _ in range(5))
    first = submit(cp, "container", **container({"HF_TOKEN": a}))["work_id"]
    second = submit(cp, "container", **container({"HF_TOKEN": b}))["work_id"]
    renamed = submit(cp, "container", **container({"READ": x, "WRITE": y}))["work_id"]
    intact = submit(cp, "container", **container({"HF_TOKEN": c}))["work_id"]
    with cp.store.write():
        # One item's sealed input into the other's row, and back.
        one, other = _input_of(cp, first), _input_of(cp, second)
        _set_input(cp, first, other)
        _set_input(cp, second, one)
        # Within one item: READ's sealed value under WRITE and WRITE's under READ.
        stored = json.loads(_input_of(cp, renamed))
        env = stored["env"]
        stored["env"] = {"READ": env["WRITE"], "WRITE": env["READ"]}
        _set_input(cp, renamed, json.dumps(stored))

    # One claim: the three tampered items fail on the way, the intact one is leased.
    claim = node.claim()
    assert claim.status_code == 200, (claim.status_code, claim.headers)
    lease = claim.json()["lease"]
    assert lease["work_id"] == intact and lease["input"]["env"] == {"HF_TOKEN": c}
    for value in (a, b, x, y):
        assert value not in claim.text
    for work_id, field in ((first, "HF_TOKEN"), (second, "HF_TOKEN"), (renamed, "READ")):
        failed = item(cp, work_id)
        assert failed["state"] == "failed" and failed["node_id"] is None, failed
        assert failed["attempts"] == 0
        assert failed["error"]["code"] == WORK_SECRET_UNREADABLE
        message = failed["error"]["message"]
        assert f"input.env.{field} does not open" in message
        assert "sealed for another item or field" in message
        assert "not handed to any node" in message
    events = work_events(cp)
    unreadable = [e for e in events if e["action"] == "work.secret_unreadable"]
    assert sorted(e["detail"]["work_id"] for e in unreadable) == sorted([first, second, renamed])
    leased = [e["detail"]["work_id"] for e in events if e["action"] == "work.leased"]
    assert leased == [intact]
    assert node.claim().status_code == 204  # nothing left that it may have


def _key_writer(path: Path, go: Path, out: Path) -> subprocess.Popen:
    code = (
        "import sys, time, pathlib\n"
        "from modelforge_appliance.core.sealing import WorkKeys\n"
        "go = pathlib.Path(sys.argv[2])\n"
        "while not go.exists(): time.sleep(0.001)\n"
        "sealed = WorkKeys(pathlib.Path(sys.argv[1])).seal('value-' + sys.argv[3], 'race')\n"
        "pathlib.Path(sys.argv[3]).write_text(sealed)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(path), str(go), str(out)],
        env=clean_env(),
        preexec_fn=lambda: os.umask(0),  # the umask must not matter
    )


def test_the_work_key_file_is_made_once_0600_and_whole_by_racing_processes(tmp_path):
    path = tmp_path / sealing.WORK_KEY_FILE
    go = tmp_path / "go"
    outs = [tmp_path / f"sealed-{i}" for i in range(8)]
    writers = [_key_writer(path, go, out) for out in outs]
    seen: list[str] = []
    stop = threading.Event()

    def read_while_racing() -> None:
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            seen.append(text)
            sealing.parse_keys(text, path)  # never a part of a file

    reader = threading.Thread(target=read_while_racing)
    reader.start()
    try:
        time.sleep(0.2)  # every writer is waiting for go
        go.touch()
        for writer in writers:
            assert writer.wait(timeout=60) == 0
    finally:
        stop.set()
        reader.join()
    keys = sealing.read_key_file(path)
    assert len(keys) == 1 and len(set(seen)) <= 1
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    opener = sealing.WorkKeys(path)
    for out in outs:
        sealed = out.read_text()
        assert sealing.key_ids_in(sealed) == {keys[0].key_id}
        assert opener.open(sealed, "race") == "value-" + str(out)
        with pytest.raises(sealing.SealedValueUnreadable, match="sealed for another item"):
            opener.open(sealed, "elsewhere")


def test_restore_without_the_work_key_fails_each_item_clearly_when_leased(tmp_path):
    token = hf_token()
    source = make_settings(tmp_path / "a")
    run_cli("init", env=store_env(source), check=True)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**IMAGE, "env": {"HF_TOKEN": token}}))
    submitted = run_cli(
        "work", "submit", "container", "--input", f"@{job}", "--json", env=store_env(source)
    )
    assert submitted.returncode == 0, submitted.stderr
    work_id = json.loads(submitted.stdout)["work_id"]
    (key_id,) = sealing.WorkKeys.of(source.state_dir).key_ids()
    for name, extra in (("plain", []), ("with-key", ["--include-work-key"])):
        run_cli(
            "backup", str(tmp_path / f"{name}.sqlite3"), *extra, env=store_env(source), check=True
        )

    # Another host, without the key: the restore says what will happen, the lease does it.
    bare = make_settings(tmp_path / "b")
    run_cli("init", env=store_env(bare), check=True)
    restored = run_cli(
        "restore", "--yes", str(tmp_path / "plain.sqlite3"), env=store_env(bare), check=True
    )
    assert (
        f"1 of 1 queued or leased item holds env values sealed with work key {key_id}"
        in restored.stdout
    )
    assert WORK_SECRET_UNREADABLE in restored.stdout
    with serve(bare) as cp:
        node = WorkNode(cp, "gpu-elsewhere").ready()
        claim = node.claim()
        assert claim.status_code == 204 and token not in claim.text
        failed = item(cp, work_id)
        assert failed["state"] == "failed" and failed["error"]["code"] == WORK_SECRET_UNREADABLE
        assert f"sealed with work key {key_id}" in failed["error"]["message"]
        assert "holds: none" in failed["error"]["message"]
    shown = run_cli("work", "show", work_id, env=store_env(bare), check=True)
    assert f"error:    {WORK_SECRET_UNREADABLE}" in shown.stdout

    # With the key beside the backup, the restored item reaches its node whole.
    keyed = make_settings(tmp_path / "c")
    run_cli("init", env=store_env(keyed), check=True)
    restored = run_cli(
        "restore", "--yes", str(tmp_path / "with-key.sqlite3"), env=store_env(keyed), check=True
    )
    assert f"({key_id})" in restored.stdout and "opens them all" in restored.stdout
    with serve(keyed) as cp:
        lease = WorkNode(cp, "gpu-restored").ready().lease()
        assert lease["work_id"] == work_id and lease["input"]["env"] == {"HF_TOKEN": token}


def test_values_an_earlier_release_stored_in_clear_are_sealed_when_serve_starts(tmp_path):
    """A store upgraded from a release before sealing: its items' env values in clear are
    sealed (and the file rewritten) before anything is served; their lease is unchanged."""
    token = hf_token()
    settings = make_settings(tmp_path / "state")
    env = store_env(settings)
    run_cli("init", env=env, check=True)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**IMAGE, "env": {"HF_TOKEN": "placeholder", "MODE": "fast"}}))
    submitted = run_cli("work", "submit", "container", "--input", f"@{job}", "--json", env=env)
    work_id = json.loads(submitted.stdout)["work_id"]
    database = settings.state_dir / "modelforge.sqlite3"
    with sqlite3.connect(database) as conn:  # what the earlier release wrote
        (text,) = conn.execute("SELECT input FROM work_item WHERE work_id = ?", (work_id,))
        stored = json.loads(text[0])
        stored["env"] = {"HF_TOKEN": token, "MODE": stored["env"]["MODE"]}
        conn.execute(
            "UPDATE work_item SET input = ? WHERE work_id = ?", (json.dumps(stored), work_id)
        )
    assert token.encode() in database.read_bytes() + _wal(database)

    log_path = tmp_path / "serve.log"
    with serving(env, log_path) as (_url, _process):
        assert found_in(state_files(settings.state_dir), [token]) == {}
    assert "sealed the env values of 1 work item(s)" in log_path.read_text()
    assert found_in(state_files(settings.state_dir), [token]) == {}
    with serve(settings) as cp:
        lease = WorkNode(cp, "gpu-upgraded").ready().lease()
    assert lease["work_id"] == work_id
    assert lease["input"]["env"] == {"HF_TOKEN": token, "MODE": "fast"}


def _wal(database: Path) -> bytes:
    wal = database.with_name(database.name + "-wal")
    return wal.read_bytes() if wal.exists() else b""
