"""`modelforge-node-agent join` and `status` as real processes against a real control plane;
re-enrolling at once with an unused token; refusals that name both origins; messages that fit
how the agent runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from modelforge_contract import (
    EXIT_CHECK_FAILED,
    EXIT_CREDENTIAL_REFUSED,
    EXIT_ENROLLMENT_REFUSED,
    EXIT_NVIDIA_PREFLIGHT,
    EXIT_OK,
    EXIT_USAGE,
    HEADER_ADMIN_TOKEN,
    ONLINE,
    PATH_ADMIN_ENROLLMENTS,
)
from modelforge_node_agent import join as join_module
from modelforge_node_agent import refusals, runtime
from tests.harness.agent_process import AGENT_COMMAND, AgentProcess, agent_env, nvml_env, wait_until
from tests.harness.control_plane import free_port
from tests.harness.nvml import h100_80g_x8, without_devices
from tests.harness.work_node import short_dir
from tests.harness.worker_process import WorkerProcess, worker_env


def join(
    cp_url: str,
    token: str,
    where: Path,
    *extra: str,
    mode: str = "cpu",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """The checkout's join command, the token on stdin as a pipe sends it."""
    return subprocess.run(
        [
            *AGENT_COMMAND,
            "join",
            cp_url,
            "--accelerator",
            mode,
            "--token-file",
            "-",
            "--state-dir",
            str(where),
            "--env-file",
            str(where / "agent.env"),
            *extra,
        ],
        input=token + "\n",
        env=env or agent_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def status(where: Path) -> tuple[int, dict]:
    result = subprocess.run(
        [*AGENT_COMMAND, "status", "--env-file", str(where / "agent.env"), "--json"],
        env=agent_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode, json.loads(result.stdout)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        path.name: (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(directory.iterdir())
    }


def test_join_writes_settings_and_state_then_a_second_join_changes_nothing(
    restartable_control_plane, tmp_path
):
    cp = restartable_control_plane
    token = cp.plane.mint("GPU Node")["token"]
    where = tmp_path / "agent"
    joined = join(cp.url, token, where)
    assert joined.returncode == EXIT_OK, joined.stderr
    node_id = json.loads((where / "identity.json").read_text())["node_id"]
    assert f"as node {node_id}" in joined.stdout
    assert f"--env-file {where / 'agent.env'}" in joined.stdout  # how to start it here
    env_file = where / "agent.env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert (where / "identity.json").stat().st_mode & 0o777 == 0o600
    settings = env_file.read_text()
    assert f"MODELFORGE_AGENT_CONTROL_PLANE_URL={cp.url}\n" in settings
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE=cpu\n" in settings
    assert f"MODELFORGE_AGENT_STATE_VOLUME={where}\n" in settings
    assert "HOSTNAME" not in settings  # left to the machine
    assert token not in settings and token not in joined.stdout + joined.stderr
    assert [n["node_id"] for n in cp.nodes()] == [node_id]

    before = snapshot(where)
    again = join(cp.url, cp.plane.mint("GPU Node")["token"], where)
    assert again.returncode == EXIT_USAGE
    assert f"already joined as node {node_id}" in again.stderr
    assert "nothing was changed" in again.stderr and "Traceback" not in again.stderr
    assert snapshot(where) == before
    assert len(cp.nodes()) == 1

    # A join cut short after enrolling left no env file: joining again only writes it.
    (where / "agent.env").unlink()
    spare = cp.plane.mint("GPU Node")
    resumed = join(cp.url, spare["token"], where)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert f"as node {node_id}" in resumed.stdout and (where / "agent.env").read_text() == settings
    assert [n["node_id"] for n in cp.nodes()] == [node_id]
    enrollments = cp.plane.admin("GET", PATH_ADMIN_ENROLLMENTS).json()["enrollments"]
    assert {e["enrollment_id"]: e["state"] for e in enrollments}[
        spare["enrollment_id"]
    ] == "pending"


def test_join_leaves_a_state_directory_of_its_own_choosing_to_the_user_who_ran_it(
    restartable_control_plane, tmp_path
):
    """A checkout's join as root (--state-dir var/node-agent) gave the directory to the
    systemd unit's user whenever that user existed on the host, and the checkout's CLI then
    refused its own state directory: only the unit's StateDirectory= is the service's."""
    import os
    import pwd

    if os.geteuid() != 0:
        pytest.skip("joins as root")
    try:
        pwd.getpwnam(join_module.SERVICE_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                join_module.SERVICE_USER,
            ],
            check=True,
        )
    cp = restartable_control_plane
    where = tmp_path / "agent"
    assert join(cp.url, cp.plane.mint("GPU Node")["token"], where).returncode == EXIT_OK
    assert {path.stat().st_uid for path in (where, *where.iterdir())} == {0}


def test_join_refusals_change_nothing_and_name_both_origins(restartable_control_plane, tmp_path):
    cp = restartable_control_plane
    nowhere = join(f"http://127.0.0.1:{free_port()}", "mfe_0123456789abcdef_" + "A" * 43, tmp_path)
    assert nowhere.returncode == EXIT_USAGE
    assert "cannot reach the control plane" in nowhere.stderr
    assert not (tmp_path / "agent.env").exists()

    # A token minted through another name of this host is locked to that origin.
    other = f"http://localhost:{cp.port}"
    minted = cp.plane.admin(
        "POST",
        PATH_ADMIN_ENROLLMENTS,
        json={"display_name": "gpu", "expires_in_seconds": 900},
        headers={HEADER_ADMIN_TOKEN: cp.admin_token, "Host": f"localhost:{cp.port}"},
    )
    assert minted.json()["api_origin"] == other
    where = tmp_path / "mismatch"
    refused = join(cp.url, minted.json()["token"], where)
    assert refused.returncode == EXIT_ENROLLMENT_REFUSED
    line = refused.stderr.strip().splitlines()[-1]
    assert f"locked to {other}, but this join called {cp.url}; join {other}" in line
    # The operator typed a join command and set no variable: the advice is join's own.
    assert "MODELFORGE_AGENT_" not in line
    assert not (where / "agent.env").exists()
    enrollment = cp.plane.admin("GET", PATH_ADMIN_ENROLLMENTS).json()["enrollments"][0]
    assert enrollment["state"] == "pending"  # the refusal did not spend the token

    # A used token: mint a fresh one and run join again, in join's words.
    used = cp.plane.mint("GPU Node")["token"]
    assert join(cp.url, used, tmp_path / "first").returncode == EXIT_OK
    spent = join(cp.url, used, tmp_path / "second")
    assert spent.returncode == EXIT_ENROLLMENT_REFUSED
    line = spent.stderr.strip().splitlines()[-1]
    assert "already used" in line and "join URL --token-file -` again" in line
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" not in line


def test_join_in_nvidia_mode_runs_the_preflight_first(
    restartable_control_plane, fake_nvml_dir, tmp_path
):
    cp = restartable_control_plane
    token = cp.plane.mint()["token"]
    no_gpu = agent_env(**nvml_env(fake_nvml_dir, without_devices(h100_80g_x8()), tmp_path / "n0"))
    failed = join(cp.url, token, tmp_path / "none", mode="nvidia", env=no_gpu)
    assert failed.returncode == EXIT_NVIDIA_PREFLIGHT
    assert "NVIDIA_DEVICE_NOT_FOUND" in failed.stderr
    assert "docker run --gpus" not in failed.stderr  # a plain process: the host's driver
    assert not (tmp_path / "none").exists()  # nothing written, the token unspent

    gpus = agent_env(**nvml_env(fake_nvml_dir, h100_80g_x8(), tmp_path / "n8"))
    joined = join(cp.url, token, tmp_path / "gpu", mode="nvidia", env=gpus)
    assert joined.returncode == EXIT_OK, joined.stderr
    assert "8 GPU(s)" in joined.stderr and "nvidia mode" in joined.stdout
    assert "MODELFORGE_AGENT_ACCELERATOR_MODE=nvidia\n" in (tmp_path / "gpu/agent.env").read_text()
    assert cp.nodes()[0]["accelerator_mode"] == "nvidia"


def test_status_follows_the_running_agent(restartable_control_plane, tmp_path):
    cp = restartable_control_plane
    where = tmp_path / "agent"
    with short_dir() as sockets:
        socket_path = sockets / "worker.sock"
        joined = join(cp.url, cp.plane.mint()["token"], where, "--worker-socket", str(socket_path))
        assert joined.returncode == EXIT_OK, joined.stderr
        code, answer = status(where)
        assert code == EXIT_CHECK_FAILED and answer["running"] is False
        run = agent_env()
        command = [*AGENT_COMMAND, "--env-file", str(where / "agent.env")]
        with AgentProcess(run, tmp_path / "a.log", command) as agent:
            # Heartbeating without its worker, the node is not ready: status says so (it said
            # healthy), and turns healthy once the worker answers.
            wait_until(lambda: (status(where)[1]["worker"] or {}).get("usable") is False,
                       what="the worker found missing")  # fmt: skip
            code, answer = status(where)
            assert code == EXIT_CHECK_FAILED and answer["running"] is True
            assert answer["problem"].startswith("the node is NOT READY")
            assert str(socket_path) in answer["problem"]
            with WorkerProcess(worker_env(socket_path), tmp_path / "w.log"):
                wait_until(lambda: status(where)[0] == EXIT_OK, what="a healthy status")
                code, answer = status(where)
                assert answer["node_id"] == cp.nodes()[0]["node_id"]
                assert answer["control_plane_url"] == cp.url and answer["pid"] == agent.process.pid
                assert answer["last_heartbeat_age_seconds"] is not None
                assert answer["problem"] is None and answer["worker"]["usable"] is True
                cp.stop()
                wait_until(lambda: status(where)[1]["last_failure"], what="a failed heartbeat")
                code, answer = status(where)
                assert code == EXIT_CHECK_FAILED
                assert answer["last_failure"].startswith(
                    "ConnectError on POST /api/v1/agent/heartbeat"
                )
                assert "nothing listens" in answer["next_step"]
                cp.start()
                assert agent.terminate()[0] == EXIT_OK
    code, answer = status(where)
    assert code == EXIT_CHECK_FAILED and answer["running"] is False
    assert answer["stopped"]["exit_status"] == EXIT_OK
    assert (where / "status.json").stat().st_mode & 0o777 == 0o600


def test_a_refused_credential_reenrolls_at_once_with_an_unused_token(
    restartable_control_plane, tmp_path
):
    cp = restartable_control_plane
    where = tmp_path / "agent"
    assert join(cp.url, cp.plane.mint()["token"], where).returncode == EXIT_OK
    node_id = json.loads((where / "identity.json").read_text())["node_id"]
    spare = cp.plane.mint()["token"]
    env = agent_env(enrollment_token=spare)
    command = [*AGENT_COMMAND, "--env-file", str(where / "agent.env")]
    with AgentProcess(env, tmp_path / "agent.log", command) as agent:
        agent.wait_for_log(r"kept in reserve")
        wait_until(lambda: cp.nodes()[0]["liveness"] == ONLINE, what="online")
        revoked = cp.plane.admin("DELETE", f"/api/v1/admin/hardware/nodes/{node_id}/credential")
        assert revoked.status_code == 200
        agent.wait_for_log(r"re-enrolling at once")
        agent.wait_for_log(rf"re-enrolled .* as node {node_id}")
        beat = cp.nodes()[0]["last_heartbeat_at"]
        wait_until(lambda: cp.nodes()[0]["last_heartbeat_at"] != beat, what="a heartbeat")
        assert agent.process.poll() is None  # no exit 6, no restart needed
        credentials = cp.plane.admin(
            "GET", f"/api/v1/admin/hardware/nodes/{node_id}/credentials"
        ).json()
        assert (credentials["active"], credentials["revoked"]) == (1, 1)

        # The token is spent now: a second refusal ends in exit 6, not in a loop.
        cp.plane.admin("DELETE", f"/api/v1/admin/hardware/nodes/{node_id}/credential")
        assert agent.wait(timeout=30) == EXIT_CREDENTIAL_REFUSED
    log = agent.log()
    assert log.count("re-enrolling at once") == 1
    assert "recreate the container" not in log  # this agent is a plain process
    assert "start the agent again" in log
    assert [n["node_id"] for n in cp.nodes()] == [node_id]


# Run in a fresh interpreter: load_settings() reads and changes this process's environment.
_TOKEN_IN_RESERVE = """
import json, os, sys
from pathlib import Path
from modelforge_node_agent.identity import NodeState
from modelforge_node_agent.main import _can_reenroll
from modelforge_node_agent.settings import load_settings

settings = load_settings(env_file=Path(sys.argv[1]) if sys.argv[1] else None)
spare_id = settings.enrollment_token.split("_")[1]
refused = NodeState("i", "s", "n", "c", "CREDENTIAL_REVOKED", enrollment_id="0123456789abcdef")
spent = NodeState("i", "s", "n", "c", "CREDENTIAL_REVOKED", enrollment_id=spare_id)
print(json.dumps({
    "in_environment": "MODELFORGE_AGENT_ENROLLMENT_TOKEN" in os.environ,
    "kept": bool(settings.enrollment_token),
    "reenrolls_with_an_unused_token": _can_reenroll(settings, refused),
    "not_with_the_spent_one": not _can_reenroll(settings, spent),
}))
"""


def test_the_token_leaves_the_environment_at_start_and_stays_in_reserve(tmp_path):
    """Issue 14 takes the token out of the agent's environment at start (nothing it starts
    inherits it); issue 15 re-enrolls at once with an unused one. Both hold in one process,
    with the token from the environment beside an env file written by join."""
    import sys

    env_file = tmp_path / "agent.env"
    env_file.write_text(f"MODELFORGE_AGENT_STATE_VOLUME={tmp_path / 'state'}\n")
    spare = "mfe_fedcba9876543210_" + "x" * 43
    for settings_file in ("", str(env_file)):
        env = agent_env(control_plane_url="http://127.0.0.1:9", enrollment_token=spare)
        result = subprocess.run(
            [sys.executable, "-c", _TOKEN_IN_RESERVE, settings_file],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {
            "in_environment": False,
            "kept": True,
            "reenrolls_with_an_unused_token": True,
            "not_with_the_spent_one": True,
        }
        assert spare not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("how", "must", "must_not"),
    [
        (runtime.SYSTEMD, ["join URL --token-file -", "systemctl restart"], ["container"]),
        (runtime.CONTAINER, ["recreate the container"], ["systemctl"]),
        (runtime.PROCESS, ["start the agent again"], ["container", "systemctl"]),
    ],
)
def test_messages_fit_how_the_agent_runs(how, must, must_not):
    text = runtime.fresh_token_step(how) + " " + runtime.remove_token_step(how)
    for phrase in must:
        assert phrase in text, (how, text)
    for phrase in must_not:
        assert phrase not in runtime.fresh_token_step(how), (how, text)


def test_how_the_agent_runs_is_seen_from_the_process(tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/system.slice/modelforge-node-agent.service\n")
    assert runtime.detect(cgroup, tmp_path, pid=4242, ppid=1) == runtime.SYSTEMD
    cgroup.write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    assert runtime.detect(cgroup, tmp_path, pid=4242, ppid=4000) == runtime.PROCESS
    (tmp_path / ".dockerenv").touch()
    assert runtime.detect(cgroup, tmp_path, pid=1, ppid=0) == runtime.CONTAINER
    assert runtime.detect(cgroup, tmp_path, pid=17, ppid=0) == runtime.CONTAINER  # docker exec
    # A shell's child in a development container is a plain process.
    assert runtime.detect(cgroup, tmp_path, pid=17, ppid=16) == runtime.PROCESS


def test_every_section_the_agent_names_exists():
    text = (Path(__file__).resolve().parents[2] / refusals.DOC).read_text()
    headings = {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}
    missing = [section for section in refusals.SECTIONS if section not in headings]
    assert missing == []


def test_status_file_has_one_entry_per_kind_of_call_and_writes_routine_successes_once_a_second(
    tmp_path,
):
    """A node running hundreds of work items a second: status.json keeps one entry per kind
    of call (a work item's path under its template), and only news is written at once."""
    from modelforge_contract import (
        PATH_AGENT_HEARTBEAT,
        PATH_AGENT_WORK_CLAIM,
        PATH_AGENT_WORK_COMPLETE,
        PATH_AGENT_WORK_RENEW,
        work_path,
    )
    from modelforge_node_agent.client import TransportFailure
    from modelforge_node_agent.status import StatusRecorder, read_status

    now = [1000.0]
    recorder = StatusRecorder(tmp_path, "http://cp.lan:8000", "cpu", clock=lambda: now[0])

    def ok_at(path: str) -> float:
        return read_status(tmp_path)["calls"][f"POST {path}"]["ok_at"]

    for i in range(200):
        now[0] += 0.001
        recorder.succeeded("POST", PATH_AGENT_WORK_CLAIM)
        recorder.succeeded("POST", work_path(PATH_AGENT_WORK_RENEW, f"w{i}"))
        recorder.succeeded("POST", work_path(PATH_AGENT_WORK_COMPLETE, f"w{i}"))
    recorder.stopped(0, None)
    calls = read_status(tmp_path)["calls"]
    assert set(calls) == {
        f"POST {PATH_AGENT_WORK_CLAIM}",
        f"POST {PATH_AGENT_WORK_RENEW}",
        f"POST {PATH_AGENT_WORK_COMPLETE}",
    }
    assert calls[f"POST {PATH_AGENT_WORK_COMPLETE}"]["ok_at"] == pytest.approx(1000.2)

    now[0] = 2000.0
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)  # the first success: written at once
    assert ok_at(PATH_AGENT_HEARTBEAT) == 2000.0
    now[0] = 2000.5
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)  # routine, within the second: not yet
    assert ok_at(PATH_AGENT_HEARTBEAT) == 2000.0
    now[0] = 2001.0
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)  # a second on: written
    assert ok_at(PATH_AGENT_HEARTBEAT) == 2001.0
    now[0] = 2001.1
    recorder.failed(
        "POST", PATH_AGENT_HEARTBEAT, TransportFailure("ConnectError", "POST", "/x")
    )  # a failure: at once
    assert read_status(tmp_path)["calls"][f"POST {PATH_AGENT_HEARTBEAT}"]["failed_at"] == 2001.1
    now[0] = 2001.2
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)  # recovered: at once
    assert ok_at(PATH_AGENT_HEARTBEAT) == 2001.2
    now[0] = 2001.3
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)
    recorder.stopped(0, None)  # stopping writes what was held back
    assert ok_at(PATH_AGENT_HEARTBEAT) == 2001.3


def _recorded_running(**extra) -> dict:
    import os

    from modelforge_node_agent.status import process_started

    return {
        "pid": os.getpid(),
        "process_started": process_started(os.getpid()),
        "heartbeat_interval_seconds": 10,
        **extra,
    }


def test_status_is_unhealthy_when_the_last_good_heartbeat_is_too_old():
    """A wedged agent was healthy to every monitor: status said so whatever the age of its
    last successful heartbeat."""
    import time

    from modelforge_contract import PATH_AGENT_HEARTBEAT
    from modelforge_node_agent.identity import new_identity
    from modelforge_node_agent.status import report

    state = new_identity().with_enrollment("node-1", "mfc_0123456789abcdef_" + "x" * 43)
    beat = f"POST {PATH_AGENT_HEARTBEAT}"
    fresh = _recorded_running(calls={beat: {"ok_at": time.time() - 1}})
    assert report(state, fresh, None)["healthy"]
    old = _recorded_running(calls={beat: {"ok_at": time.time() - 31}})
    answer = report(state, old, None)
    assert not answer["healthy"] and answer["running"]
    assert "more than 3 intervals of 10s" in answer["problem"]
    # The interval is the control plane's: with 30 s heartbeats, 31 s is fine.
    slow = _recorded_running(
        calls={beat: {"ok_at": time.time() - 31}}, heartbeat_interval_seconds=30
    )
    assert report(state, slow, None)["healthy"]


def test_a_pid_reused_by_another_process_is_not_the_agent():
    import time

    from modelforge_contract import PATH_AGENT_HEARTBEAT
    from modelforge_node_agent.identity import new_identity
    from modelforge_node_agent.status import report

    state = new_identity().with_enrollment("node-1", "mfc_0123456789abcdef_" + "x" * 43)
    calls = {f"POST {PATH_AGENT_HEARTBEAT}": {"ok_at": time.time() - 1}}
    recorded = _recorded_running(calls=calls)
    assert report(state, recorded, None)["running"]
    # This test's pid is alive, but it is not the process that wrote the file.
    reused = {**recorded, "process_started": recorded["process_started"] + 1}
    answer = report(state, reused, None)
    assert not answer["running"] and not answer["healthy"]
    assert answer["problem"].startswith("the agent is not running")


def test_a_second_agent_on_one_state_volume_exits_2_naming_the_first(
    sqlite_control_plane, tmp_path
):
    """Two agents on one state volume ran side by side with one identity for as long as
    they were let."""
    cp = sqlite_control_plane
    volume = tmp_path / "state"
    env = agent_env(
        control_plane_url=cp.url,
        enrollment_token=cp.mint()["token"],
        accelerator_mode="cpu",
        state_volume=volume,
    )
    with AgentProcess(env, tmp_path / "first.log") as first:
        first.wait_for_log(r"enrolled as node ([0-9a-f-]{36})")
        second = subprocess.run(AGENT_COMMAND, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == EXIT_USAGE, second.stderr
        assert f"another node agent (pid {first.process.pid}) already runs" in second.stderr
        # status.json is still the running agent's.
        assert json.loads((volume / "status.json").read_text())["pid"] == first.process.pid
        assert first.process.poll() is None


def test_failing_since_counts_from_the_first_failure_of_the_outage(tmp_path):
    """A 28 s outage read 'failing since 7s': the time of the latest failed try."""
    from modelforge_contract import PATH_AGENT_HEARTBEAT
    from modelforge_node_agent.client import TransportFailure
    from modelforge_node_agent.status import StatusRecorder, read_status

    now = [1000.0]
    recorder = StatusRecorder(tmp_path, "http://cp.lan:8000", "cpu", clock=lambda: now[0])
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)
    failure = TransportFailure("ConnectError", "POST", PATH_AGENT_HEARTBEAT)
    for at in (1010.0, 1017.0, 1038.0):  # the outage begins at 1010; tries back off
        now[0] = at
        recorder.failed("POST", PATH_AGENT_HEARTBEAT, failure)
    call = read_status(tmp_path)["calls"][f"POST {PATH_AGENT_HEARTBEAT}"]
    assert (call["failing_since"], call["failed_at"]) == (1010.0, 1038.0)
    now[0] = 1040.0
    recorder.succeeded("POST", PATH_AGENT_HEARTBEAT)
    now[0] = 1050.0
    recorder.failed("POST", PATH_AGENT_HEARTBEAT, failure)  # a new outage, a new start
    assert read_status(tmp_path)["calls"][f"POST {PATH_AGENT_HEARTBEAT}"]["failing_since"] == 1050.0
