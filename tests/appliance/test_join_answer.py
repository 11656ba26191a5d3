"""The mint answer for the one-command join: env file and join commands per install type,
the accelerator mode asked for, and refusals that name both origins."""

from __future__ import annotations

import shlex

import pytest

from modelforge_contract import PATH_ADMIN_ENROLLMENTS
from modelforge_contract.envfile import parse_env_file
from tests.harness.control_plane import error_code, new_identity


def test_mint_answer_carries_join_commands_and_an_env_file_without_a_hostname(
    sqlite_control_plane,
):
    cp = sqlite_control_plane
    answer = cp.admin(
        "POST",
        PATH_ADMIN_ENROLLMENTS,
        json={"display_name": "GPU Node", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
    )
    assert answer.status_code == 201, answer.text
    body = answer.json()
    settings = parse_env_file(body["env_file"])
    assert settings["MODELFORGE_AGENT_ACCELERATOR_MODE"] == "cpu"
    assert settings["MODELFORGE_AGENT_CONTROL_PLANE_URL"] == cp.url
    assert "MODELFORGE_AGENT_HOSTNAME" not in settings  # two "GPU Node"s must not collide
    assert body["accelerator_mode"] == "cpu"
    assert set(body["join_commands"]) == {"systemd", "checkout", "container"}
    for kind, command in body["join_commands"].items():
        assert body["token"] not in command
        (joining,) = [part for part in command.split(" && ") if " join " in part]
        words = shlex.split(joining)
        join_at = words.index("join")
        assert words[join_at + 1] == cp.url, kind
        assert words[words.index("--accelerator") + 1] == "cpu", kind
        assert words[words.index("--token-file") + 1] == "-", kind
    assert "--gpus" not in body["join_commands"]["container"]  # cpu mode
    # A checkout cannot use /run/modelforge: its worker socket sits beside its state.
    checkout = body["join_commands"]["checkout"]
    assert "--worker-socket var/node-agent/worker.sock" in checkout
    assert body["start_command"].startswith("bash -c ")  # kept for the console's wizard

    default = cp.mint()
    assert "--accelerator nvidia" in default["join_commands"]["systemd"]
    assert "--gpus all" in default["join_commands"]["container"]
    refused = cp.admin(
        "POST",
        PATH_ADMIN_ENROLLMENTS,
        json={"display_name": "x", "expires_in_seconds": 900, "accelerator_mode": "tpu"},
    )
    assert refused.status_code == 400 and error_code(refused) == "FIELD_CHOICE"


def test_mint_answer_carries_the_worker_commands_and_human_titles(sqlite_control_plane):
    """The wizard shows what the CLI's enroll prints: the Runtime Worker beside the agent,
    each command under a title a person reads, not a raw key."""
    from modelforge_appliance.identity.enrollment import WORKER_SOCKET
    from modelforge_appliance.identity.join_commands import INSTALL_TYPES, checkout_worker_command

    cp = sqlite_control_plane
    body = cp.admin(
        "POST",
        PATH_ADMIN_ENROLLMENTS,
        json={"display_name": "CPU box", "expires_in_seconds": 900, "accelerator_mode": "cpu"},
    ).json()
    assert parse_env_file(body["env_file"])["MODELFORGE_AGENT_WORKER_SOCKET"] == WORKER_SOCKET
    worker = body["worker_command"]
    # The env file's socket, else the same default (test_start_command.py runs it).
    assert 'MODELFORGE_WORKER_SOCKET="${sock:-' + WORKER_SOCKET + '}" ' in worker
    assert "MODELFORGE_WORKER_ACCELERATOR_MODE=cpu " in worker
    assert body["join_worker_commands"] == {"checkout": checkout_worker_command("cpu")}
    titles = body["command_titles"]
    assert set(titles["join_commands"]) == set(body["join_commands"]) == set(INSTALL_TYPES)
    for kind, title in titles["join_commands"].items():
        assert INSTALL_TYPES[kind] in title and "_" not in title.split("(")[0], title
    assert set(titles["join_worker_commands"]) == set(body["join_worker_commands"])
    assert titles["worker_command"] == "Runtime Worker for the start command"
    assert body["token"] not in str(titles) + worker


def test_an_origin_mismatch_names_both_origins(sqlite_control_plane):
    cp = sqlite_control_plane
    token = cp.mint()["token"]
    refused = cp.enroll(token, identity=new_identity(), headers={"Host": "cp.lan:8000"})
    assert refused.status_code == 403
    body = refused.json()
    assert body["error"]["code"] == "ENROLLMENT_ORIGIN_MISMATCH"
    assert (body["api_origin"], body["request_origin"]) == (cp.url, "http://cp.lan:8000")
    assert f"MODELFORGE_AGENT_CONTROL_PLANE_URL={cp.url}" in body["error"]["next_step"]


def test_the_heartbeat_answer_asks_for_what_the_control_plane_lacks(sqlite_control_plane):
    cp = sqlite_control_plane
    enrolled = cp.enroll(cp.mint()["token"], identity=new_identity()).json()
    node_id, credential = enrolled["node_id"], enrolled["credential"]
    assert cp.heartbeat(credential, node_id).json()["republish"] == ["inventory"]
    inventory = {"node_id": node_id, "agent_version": "0.1.0", "accelerators": []}
    assert cp.agent("PUT", "/api/v1/agent/inventory", credential, json=inventory).ok
    assert cp.heartbeat(credential, node_id).json()["republish"] == []


def test_the_container_join_prepares_the_state_directory_for_the_image_user():
    """The images run as SERVICE_UID: the host directory the container writes must be its, and
    the agent reads its own env file (mode 0600, that user's) inside the container. The
    runtime worker starts first, on the socket volume the agent mounts too (without it the
    node is online but never ready); the agent joins its network namespace (a runtime the
    worker starts listens on 127.0.0.1 there, where the agent polls it), so the host's name is
    set on the worker; the artifact root, apart from the identity, is read-only in the
    worker at the same path."""
    from modelforge_appliance.identity.join_commands import (
        AGENT_IMAGE_UID,
        CONTAINER_ARTIFACT_ROOT,
        CONTAINER_WORKER_SOCKET,
        WORKER_SOCKET_VOLUME,
        join_commands,
    )
    from modelforge_release.images import SERVICE_UID

    assert AGENT_IMAGE_UID == SERVICE_UID
    prepare, prepare_models, worker, joining, running = join_commands(
        "http://cp.lan:8000", "nvidia"
    )["container"].split(" && ")
    assert prepare == (
        f"sudo install -d -m 0700 -o {SERVICE_UID} -g {SERVICE_UID} /var/lib/modelforge-node-agent"
    )
    assert prepare_models == (
        f"sudo install -d -m 0750 -o {SERVICE_UID} -g {SERVICE_UID} {CONTAINER_ARTIFACT_ROOT}"
    )
    models = f"{CONTAINER_ARTIFACT_ROOT}:{CONTAINER_ARTIFACT_ROOT}"
    words = shlex.split(worker)
    assert {"--read-only", "--gpus"} <= set(words) and "--network" not in words
    assert words[words.index("--hostname") + 1] == "$(hostname)"  # the shell fills it in
    assert f"{models}:ro" in words
    assert f"MODELFORGE_WORKER_SOCKET={CONTAINER_WORKER_SOCKET}" in words
    assert "MODELFORGE_WORKER_ACCELERATOR_MODE=nvidia" in words
    assert words[-1].startswith("modelforge-runtime-worker:")
    assert "--rm -it --gpus all" in joining and " join http://cp.lan:8000 " in joining
    # The join enrolls under the host's name, not the throw-away container's random id.
    joining_words = shlex.split(joining)
    assert joining_words[joining_words.index("--hostname") + 1] == "$(hostname)"
    assert f"--worker-socket {CONTAINER_WORKER_SOCKET}" in joining  # into the env file
    words = shlex.split(running)
    assert "--env-file" not in words[: words.index("python3")]  # not read on the host
    assert words[-2:] == ["--env-file", "/var/lib/modelforge-node-agent/modelforge-node-agent.env"]
    assert {"--read-only", "--gpus"} <= set(words) and "--hostname" not in words
    assert words[words.index("--network") + 1] == "container:modelforge-runtime-worker"
    assert f"MODELFORGE_AGENT_ARTIFACT_ROOT={CONTAINER_ARTIFACT_ROOT}" in words
    assert models in words
    for command in (worker, running):
        assert f"{WORKER_SOCKET_VOLUME}:/run/modelforge-worker" in shlex.split(command)
    cpu_worker = join_commands("http://cp.lan:8000", "cpu")["container"].split(" && ")[2]
    assert shlex.split(cpu_worker)[-1].startswith("modelforge-runtime-worker-cpu:")
    assert "--gpus" not in cpu_worker


@pytest.mark.parametrize(
    ("origin", "warned"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8000", True),
        ("http://[::1]:8000", True),
        ("http://192.168.1.20:8000", False),
        ("https://cp.lan", False),
    ],
)
def test_a_token_locked_to_a_loopback_origin_comes_with_a_warning(origin, warned):
    from modelforge_appliance.identity.join_commands import origin_warnings

    warnings = origin_warnings(origin)
    assert bool(warnings) is warned
    if warned:
        assert "loopback" in warnings[0] and "MODELFORGE_PUBLIC_API_ORIGIN" in warnings[0]


def test_minting_through_an_unusable_host_header_is_a_400(sqlite_control_plane):
    """Minting through a Host header that names no usable origin (one too long, one with a
    space) did not get a clean refusal: the token's origin comes from that header, so the
    answer is 400 HOST_INVALID."""
    cp = sqlite_control_plane
    for host in ("a" * 400 + ":1", "bad host"):
        response = cp.admin(
            "POST",
            "/api/v1/admin/node-enrollments",
            json={"display_name": "n", "expires_in_seconds": 900},
            headers={"Host": host},
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "HOST_INVALID"
