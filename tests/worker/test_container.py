"""The ``container`` capability against the real dockerd, with a tiny image built locally."""

from __future__ import annotations

import secrets

import pytest

from modelforge_contract import (
    CONTAINER_FAILED,
    IMAGE_ID_MISMATCH,
    IMAGE_NOT_FOUND,
    WORK_INPUT_INVALID,
    WORK_TIMED_OUT,
)
from modelforge_worker.capabilities import RunContext, run_capability
from modelforge_worker.capabilities.container import LABEL_WORK_ID
from tests.harness.worker_process import WorkerProcess, worker_env

pytestmark = pytest.mark.docker


def work_id() -> str:
    return f"test-{secrets.token_hex(6)}"


def leftovers(docker_client, work: str) -> list:
    return docker_client.containers.list(all=True, filters={"label": f"{LABEL_WORK_ID}={work}"})


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
