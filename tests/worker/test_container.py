"""The ``container`` capability against the real dockerd, with a tiny image built locally."""

from __future__ import annotations

import contextlib
import secrets
import threading
from pathlib import Path

import pytest

from modelforge_contract import (
    CONTAINER_FAILED,
    GPUS_ON_CPU_NODE,
    IMAGE_ID_MISMATCH,
    IMAGE_NOT_FOUND,
    RUN_CANCELLED,
    WORK_INPUT_INVALID,
    WORK_TIMED_OUT,
)
from modelforge_contract import containers as fence
from modelforge_contract.deployments import GPUS_UNAVAILABLE
from modelforge_node_agent.work import WorkerUnavailable
from modelforge_worker.capabilities import RunContext, run_capability
from modelforge_worker.capabilities.container import LABEL_WORK_ID
from tests.harness.agent_process import wait_until
from tests.harness.worker_process import WorkerProcess, worker_env

pytestmark = pytest.mark.docker


def work_id() -> str:
    return f"test-{secrets.token_hex(6)}"


def leftovers(docker_client, work: str) -> list:
    return docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"{LABEL_WORK_ID}={work}"}
    )


def run(test_image, command, *, timeout=60, work=None, **extra):
    given = {"image": test_image.tag, "image_id": test_image.id, "command": command, **extra}
    return run_capability("container", given, RunContext(work or work_id(), timeout, "cpu")).view()


def test_runs_the_pinned_image_captures_logs_and_removes_the_container(docker_client, test_image):
    work = work_id()
    answer = run(
        test_image,
        ["echo", "hello from the probe", "err", "to stderr", "env", "GREETING", "net"],
        work=work,
        env={"GREETING": "hi"},
    )
    assert (answer["outcome"], answer["error"]) == ("succeeded", None)
    assert answer["result"]["exit_code"] == 0
    assert answer["result"]["image_id"] == test_image.id
    log = answer["log_tail"]
    assert "hello from the probe" in log and "to stderr" in log and "GREETING=hi" in log
    # No network unless asked: only the loopback interface exists.
    assert [line for line in log.splitlines() if line.startswith("interface")] == ["interface lo"]
    assert leftovers(docker_client, work) == []


def test_network_only_when_the_item_asks(docker_client, test_image):
    answer = run(test_image, ["net"], network=True)
    interfaces = [line for line in answer["log_tail"].splitlines() if line.startswith("interface")]
    assert "interface lo" in interfaces and len(interfaces) >= 2


def test_timeout_is_enforced_and_nothing_is_left_behind(docker_client, test_image):
    work = work_id()
    answer = run(test_image, ["echo", "started", "sleep", "600"], timeout=2, work=work)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", WORK_TIMED_OUT)
    assert answer["result"]["timed_out"] is True
    assert "started" in answer["log_tail"]
    assert leftovers(docker_client, work) == []


def test_a_failing_program_fails_the_item_with_its_exit_code_and_logs(docker_client, test_image):
    work = work_id()
    answer = run(test_image, ["echo", "about to fail", "exit", "3"], work=work)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", CONTAINER_FAILED)
    assert answer["result"]["exit_code"] == 3
    assert "about to fail" in answer["log_tail"]
    assert leftovers(docker_client, work) == []


# Where the container sees its own memory limit: cgroup v1, then v2.
MEMORY_LIMIT_FILES = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")


def test_memory_limit_is_applied(test_image):
    # The container reads its own cgroup limit: no watcher racing the run.
    answer = run(
        test_image,
        [arg for path in MEMORY_LIMIT_FILES for arg in ("cat", path)],
        memory_bytes=64 * 2**20,
    )
    assert answer["outcome"] == "succeeded"
    seen = dict(line.split("=", 1) for line in answer["log_tail"].splitlines() if "=" in line)
    limits = {seen[path] for path in MEMORY_LIMIT_FILES if seen.get(path, "(absent)") != "(absent)"}
    assert limits == {str(64 * 2**20)}


def test_a_wrong_image_id_is_refused_and_nothing_runs(docker_client, test_image):
    work = work_id()
    wrong = "sha256:" + "0" * 64
    answer = run(test_image, ["echo", "must not run"], work=work, image_id=wrong)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", IMAGE_ID_MISMATCH)
    assert test_image.id in answer["error"]["message"]
    assert leftovers(docker_client, work) == []


def test_a_missing_image_is_never_pulled(docker_client, test_image):
    missing = f"modelforge-test-absent-{secrets.token_hex(4)}:1"
    given = {"image": missing, "image_id": test_image.id}
    answer = run_capability("container", given, RunContext(work_id(), 30, "cpu")).view()
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", IMAGE_NOT_FOUND)
    assert "never pulls" in answer["error"]["message"]
    assert docker_client.images.list(name=missing.split(":")[0]) == []


def test_bad_input_fails_before_docker_is_asked(test_image):
    answer = run(test_image, "not a list")
    assert answer["error"]["code"] == WORK_INPUT_INVALID


def test_through_the_worker_process(docker_client, test_image, socket_dir, tmp_path):
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        assert "container" in worker.client.info()["capabilities"]
        work = work_id()
        answer = worker.client.run(
            {
                "capability": "container",
                "input": {
                    "image": test_image.tag,
                    "image_id": test_image.id,
                    "command": ["echo", "ok"],
                },
                "timeout_seconds": 60,
                "work_id": work,
            }
        )
    assert answer["outcome"] == "succeeded" and "ok" in answer["log_tail"]
    assert leftovers(docker_client, work) == []


# -- the fence (issue 21) -------------------------------------------------------------------------


def lines_of(log: str, prefix: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(prefix)]


class RunInBackground:
    """A run through the real worker process on a thread, so the test can look at the running
    container (docker inspect) and then stop it with the worker's cancel."""

    def __init__(self, worker: WorkerProcess, given: dict, work: str, timeout: float = 300):
        self.answer: dict | None = None
        self.thread = threading.Thread(
            target=self._run,
            args=(
                worker,
                {
                    "capability": "container",
                    "input": given,
                    "timeout_seconds": timeout,
                    "work_id": work,
                },
            ),
        )
        self.thread.start()

    def _run(self, worker: WorkerProcess, body: dict) -> None:
        self.answer = worker.client.run(body)

    def join(self, timeout: float = 120) -> dict:
        self.thread.join(timeout)
        assert self.answer is not None, "the worker never answered the run"
        return self.answer


def running_container(docker_client, work: str, says: str) -> dict:
    """The inspected container of ``work`` once its log shows ``says`` (it then sleeps)."""

    def ready():
        found = leftovers(docker_client, work)
        if not found:
            return None
        if says not in found[0].logs().decode(errors="replace"):
            return None
        return docker_client.api.inspect_container(found[0].id)

    return wait_until(ready, timeout=120, what=f"container of {work} saying {says!r}")


def test_a_container_is_fenced_by_default_and_cancel_stops_it(
    docker_client, test_image, socket_dir, tmp_path
):
    """Before: no pids, CPU, disk or log limit, root with docker's default capabilities (the
    reviewer's item ran 3,002 processes and wrote 1 GiB into its root); a cancelled item ran on
    until its timeout."""
    host_cpus = docker_client.info()["NCPU"]
    work = work_id()
    command = [
        "id",
        "status",
        "CapEff:",
        "status",
        "NoNewPrivs:",
        "write",
        "/written-into-the-root",
        "1048576",
        "write",
        "/tmp/big",
        str(256 * 2**20),
        "fork",
        "3000",
        "echo",
        "fenced",
        "sleep",
        "600",
    ]
    given = {"image": test_image.tag, "image_id": test_image.id, "command": command}
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        run_ = RunInBackground(worker, given, work)
        inspected = running_container(docker_client, work, "fenced")
        # Then the worker's cancel (what the agent sends once its renewal says cancelled).
        assert worker.client.cancel(work) == 1
        answer = run_.join()
        assert worker.client.cancel(work) == 0  # nothing left of it
    host = inspected["HostConfig"]
    assert host["PidsLimit"] == fence.PIDS_DEFAULT
    assert host["NanoCpus"] == int(min(fence.CPUS_DEFAULT, host_cpus) * 1e9)
    assert host["Memory"] == host["MemorySwap"] == fence.MEMORY_DEFAULT_BYTES
    assert host["ReadonlyRootfs"] is True
    assert host["Tmpfs"] == {"/tmp": f"rw,nosuid,nodev,size={fence.TMP_DEFAULT_BYTES},mode=1777"}
    assert host["LogConfig"] == {
        "Type": "json-file",
        "Config": {"max-file": "2", "max-size": str(fence.LOG_DEFAULT_BYTES // 2)},
    }
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges:true"]
    assert host["Privileged"] is False and host["NetworkMode"] == "none"
    assert host["IpcMode"] == "private" and host["PidMode"] == ""
    assert inspected["Config"]["User"] == fence.NON_ROOT_USER
    # From inside: what the container itself could do.
    log = answer["log_tail"]
    assert "uid=65534 gid=65534" in log
    assert lines_of(log, "CapEff:")[0].split() == ["CapEff:", "0000000000000000"]
    assert lines_of(log, "NoNewPrivs:")[0].split() == ["NoNewPrivs:", "1"]
    assert lines_of(log, "write /written-into-the-root=") == [
        "write /written-into-the-root=0 Read-only file system"
    ]
    big = lines_of(log, "write /tmp/big=")[0]
    assert big.endswith("No space left on device")
    assert int(big.split("=")[1].split()[0]) <= fence.TMP_DEFAULT_BYTES
    forked = lines_of(log, "forked=")[0]
    assert forked.endswith("Resource temporarily unavailable")
    assert int(forked.split("=")[1].split()[0]) < fence.PIDS_DEFAULT  # the probe is one too
    # The cancel: the run ends as cancelled, long before its 300 s timeout, and nothing stays.
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", RUN_CANCELLED)
    assert answer["result"]["cancelled"] is True and answer["result"]["timed_out"] is False
    assert leftovers(docker_client, work) == []
    assert "POST /v1/cancel -> 200: 1 run(s) stopped" in (tmp_path / "w.log").read_text()


def test_an_item_gets_the_limits_it_names(docker_client, test_image, socket_dir, tmp_path):
    work = work_id()
    given = {
        "image": test_image.tag,
        "image_id": test_image.id,
        # 6 MiB of output first, so the host log has rotated by the time the container sleeps.
        "command": ["spam", "6000", "id", "status", "CapEff:", "fork", "100", "echo", "named"]
        + ["sleep", "600"],
        "pids_limit": 16,
        "cpus": 1000,  # more than any test host: dockerd refuses that, the worker gives all
        "memory_bytes": 64 * 2**20,
        "swap_bytes": 32 * 2**20,
        "tmp_bytes": 2 * 2**20,
        "log_bytes": 2 * 2**20,
        "run_as_root": True,
        "capabilities": ["CHOWN", "KILL"],
    }
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        run_ = RunInBackground(worker, given, work)
        inspected = running_container(docker_client, work, "named")
        log_files = Path(inspected["LogPath"]).parent.glob(Path(inspected["LogPath"]).name + "*")
        host_log_bytes = sum(path.stat().st_size for path in log_files)
        assert worker.client.cancel(work) == 1
        answer = run_.join()
    host = inspected["HostConfig"]
    assert host["PidsLimit"] == 16
    assert host["NanoCpus"] == docker_client.info()["NCPU"] * 10**9
    assert (host["Memory"], host["MemorySwap"]) == (64 * 2**20, 96 * 2**20)
    assert host["Tmpfs"]["/tmp"].endswith(f"size={2 * 2**20},mode=1777")
    assert host["LogConfig"]["Config"] == {"max-file": "2", "max-size": str(2**20)}
    assert sorted(c.removeprefix("CAP_") for c in host["CapAdd"]) == ["CHOWN", "KILL"]
    assert host["CapDrop"] == ["ALL"]
    assert inspected["Config"]["User"] == "0:0"
    # The host keeps at most the two 1 MiB files of the 6 MiB (docker checks after each
    # write, so a file may pass its size by one line).
    assert host_log_bytes <= 2 * (2**20 + 4096), host_log_bytes
    log = answer["log_tail"]
    assert "uid=0 gid=0" in log
    # CHOWN is bit 0 and KILL bit 5 of the effective set; nothing else.
    assert int(lines_of(log, "CapEff:")[0].split()[1], 16) == (1 << 0) | (1 << 5)
    assert int(lines_of(log, "forked=")[0].split("=")[1].split()[0]) < 16
    assert answer["result"]["cpus"] == docker_client.info()["NCPU"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"env": {"TOKEN": "a\x00b"}}, "env"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"memory_bytes": 4 * 2**20}, "memory_bytes"),
        ({"image": "Not/A Valid:Ref"}, "image"),
        ({"pids_limit": 0}, "pids_limit"),
        ({"cpus": 0}, "cpus"),
        ({"capabilities": ["ALL"]}, "capabilities"),
        ({"run_as_root": "yes"}, "run_as_root"),
        ({"command": ["a\x00b"]}, "command"),
    ],
    ids=["env-nul", "env-equals", "memory-4MiB", "image-ref", "pids", "cpus", "cap", "root", "cmd"],
)
def test_what_docker_would_refuse_is_refused_before_it_is_asked(
    docker_client, test_image, extra, named
):
    """Before: env with NUL and memory_bytes of 4 MiB failed on the node with docker's own
    error; now the worker names the field and docker is never asked."""
    work = work_id()
    answer = run(test_image, **{"command": ["echo", "must not run"], "work": work, **extra})
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", WORK_INPUT_INVALID)
    assert answer["error"]["message"].startswith(named), answer["error"]["message"]
    assert leftovers(docker_client, work) == []


def test_a_stopping_worker_leaves_no_container_running(
    docker_client, test_image, socket_dir, tmp_path
):
    """SIGTERM mid-run: nothing would enforce the item's timeout or remove its container once
    the worker is gone, so the worker stops it on the way out."""
    work = work_id()
    given = {
        "image": test_image.tag,
        "image_id": test_image.id,
        "command": ["echo", "up", "sleep", "600"],
    }
    worker = WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log")
    try:
        caller = threading.Thread(target=lambda: _ignore_unavailable(worker, given, work))
        caller.start()
        running_container(docker_client, work, "up")
        assert worker.terminate(timeout=60) == 0
        caller.join(60)
    finally:
        worker.close()
    assert leftovers(docker_client, work) == []
    assert "stopped 1 run(s) on the way out" in worker.log()


def _ignore_unavailable(worker: WorkerProcess, given: dict, work: str) -> None:
    body = {"capability": "container", "input": given, "timeout_seconds": 300, "work_id": work}
    with contextlib.suppress(WorkerUnavailable):
        worker.client.run(body)


# -- GPUs by UUID (issue 25) ------------------------------------------------------------------
# Before: on an NVIDIA node every container without "gpus" got DeviceRequest(count=-1), every
# GPU of the node whatever else ran there, and on a CPU node "gpus": 2 was dropped and the
# item succeeded without them.

LEASED = ("GPU-00000003-0000-0000-0000-000000000080", "GPU-00000005-0000-0000-0000-000000000080")


@pytest.fixture
def docker_watch(docker_client, monkeypatch):
    """The worker's dockerd, through a watch that inspects each container it starts."""
    from tests.harness.docker_watch import DockerStartWatch

    watch = DockerStartWatch(docker_client)
    monkeypatch.setenv("DOCKER_HOST", watch.url)
    yield watch
    watch.close()


def run_leased(test_image, command, mode, leased, *, work=None, **extra):
    given = {"image": test_image.tag, "image_id": test_image.id, "command": command, **extra}
    context = RunContext(work or work_id(), 60, mode, tuple(leased))
    return run_capability("container", given, context).view()


@pytest.mark.parametrize(
    ("extra", "leased"), [({"gpus": 2}, ()), ({}, LEASED), ({"gpus": 1}, LEASED)],
    ids=["count", "lease", "both"],
)  # fmt: skip
def test_an_item_asking_gpus_on_a_cpu_worker_is_refused_not_dropped(
    docker_client, test_image, docker_watch, extra, leased
):
    work = work_id()
    answer = run_leased(test_image, ["echo", "must not run"], "cpu", leased, work=work, **extra)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", GPUS_ON_CPU_NODE)
    assert "cpu mode" in answer["error"]["message"]
    assert docker_watch.started == {} and leftovers(docker_client, work) == []


def test_a_count_without_uuids_fails_closed_on_an_nvidia_worker(
    docker_client, test_image, docker_watch
):
    """An older control plane sends input.gpus and no UUIDs: never "all GPUs" instead."""
    work = work_id()
    answer = run_leased(test_image, ["echo", "must not run"], "nvidia", (), work=work, gpus=2)
    assert (answer["outcome"], answer["error"]["code"]) == ("failed", GPUS_UNAVAILABLE)
    assert "names 0 by UUID" in answer["error"]["message"]
    assert docker_watch.started == {} and leftovers(docker_client, work) == []


def test_the_container_gets_exactly_the_leased_uuids(docker_client, test_image, docker_watch):
    """dockerd holds exactly the lease's UUIDs for the container when it is asked to start it
    (read from dockerd, between create and start). This host has no NVIDIA container runtime,
    so dockerd then refuses to start it: the item fails CONTAINER_FAILED with dockerd's
    reason, and nothing is left."""
    work = work_id()
    answer = run_leased(test_image, ["echo", "on the GPUs"], "nvidia", LEASED, work=work)
    assert docker_watch.device_requests() == [
        [{"Driver": "", "Count": 0, "DeviceIDs": list(LEASED), "Capabilities": [["gpu"]],
          "Options": {}}]
    ]  # fmt: skip
    assert answer["result"]["gpus"] == list(LEASED) and answer["result"]["gpus_requested"]
    if "nvidia" not in docker_client.info().get("Runtimes", {}):
        assert (answer["outcome"], answer["error"]["code"]) == ("failed", CONTAINER_FAILED)
        assert answer["error"]["message"].startswith("dockerd could not start the container: ")
        assert "device driver" in answer["error"]["message"]
    assert leftovers(docker_client, work) == []
    # A count takes the first of the leased UUIDs, and 0 none at all.
    run_leased(test_image, ["echo", "one"], "nvidia", LEASED, gpus=1)
    assert docker_watch.device_requests()[-1][0]["DeviceIDs"] == [LEASED[0]]


@pytest.mark.parametrize("extra", [{}, {"gpus": 0}], ids=["no-lease-gpus", "zero"])
def test_a_container_without_leased_gpus_gets_no_device_on_an_nvidia_worker(
    docker_client, test_image, docker_watch, extra
):
    leased = LEASED if extra else ()
    answer = run_leased(test_image, ["echo", "no GPU"], "nvidia", leased, **extra)
    assert (answer["outcome"], answer["error"]) == ("succeeded", None)
    assert docker_watch.device_requests() == [[]]  # not count=-1: nothing at all
    assert (answer["result"]["gpus"], answer["result"]["gpus_requested"]) == ([], False)


def test_the_worker_takes_the_runs_gpus_and_refuses_malformed_ones(
    test_image, socket_dir, tmp_path
):
    given = {"image": test_image.tag, "image_id": test_image.id, "command": ["echo", "x"]}
    body = {"capability": "container", "input": given, "timeout_seconds": 60, "gpus": [LEASED[0]]}
    with WorkerProcess(worker_env(socket_dir / "w.sock"), tmp_path / "w.log") as worker:
        answer = worker.client.run({**body, "work_id": work_id()})
        assert answer["error"]["code"] == GPUS_ON_CPU_NODE  # the cpu worker saw the UUID
        for bad in ("GPU-1", ["GPU-1", "GPU-1"], ["GPU-1,GPU-2"], [7], ["x" * 200]):
            status, refused = worker.client._request("POST", "/v1/run", {**body, "gpus": bad}, 30)
            assert (status, refused["error"]["code"]) == (400, WORK_INPUT_INVALID), bad
