"""The one-command join shown with every minted token: one ready command per install type.

Each runs ``modelforge-node-agent join ORIGIN --token-file -``, which asks for the token
without echo (or reads it from stdin), checks the origin, writes the agent's env file (mode
0600) where that install reads it, persists the identity, enrolls, and then starts the agent
the way that install runs it. The token is never part of a command line.
"""

from __future__ import annotations

import ipaddress
import shlex
from urllib.parse import urlsplit

from modelforge_contract import (
    AGENT_ENV_FILE,
    AGENT_PYZ_PATH,
    AGENT_SERVICE,
    AGENT_STATE_DIR,
    WORKER_SERVICE,
    __version__,
)
from modelforge_contract.manifest import RUNTIME_WORKER_CPU_IMAGE, RUNTIME_WORKER_IMAGE

# The interpreter systemd/modelforge-node-agent.service runs the agent pyz with (a test
# keeps the two equal).
AGENT_PYZ_INTERPRETER = "/usr/bin/python3"
AGENT_IMAGE = f"modelforge-node-agent:{__version__}"
# The user the release images run as (release/modelforge_release/images.py SERVICE_UID; a
# test keeps the two equal): the host's state directory must be its.
AGENT_IMAGE_UID = 65532
# A checkout keeps the agent's state beside the control plane's (./var), out of git.
CHECKOUT_STATE_DIR = "var/node-agent"
CHECKOUT_ENV_FILE = f"{CHECKOUT_STATE_DIR}/modelforge-node-agent.env"
# The runtime worker's socket in a checkout: /run/modelforge is not the operator's to write.
CHECKOUT_WORKER_SOCKET = f"{CHECKOUT_STATE_DIR}/worker.sock"
# The container install: the worker's socket in a named volume both containers mount (the
# worker image owns the directory, and Docker gives an empty volume its ownership).
WORKER_SOCKET_VOLUME = "modelforge-worker-socket"
CONTAINER_WORKER_SOCKET = "/run/modelforge-worker/worker.sock"
# The agent's replicated models, a host directory of the image user's apart from the
# identity: the worker mounts it read-only at the same path, to open what the agent names.
CONTAINER_ARTIFACT_ROOT = "/var/lib/modelforge-artifacts"

INSTALL_TYPES = {
    "systemd": "the agent pyz under systemd (docs/install-systemd.md)",
    "checkout": "the agent from a ModelForge checkout with its .venv (scripts/run)",
    "container": "the modelforge-node-agent image under Docker",
}


def join_commands(api_origin: str, accelerator_mode: str) -> dict[str, str]:
    """{install type: a command for Bash} for a token locked to api_origin."""
    join = f"join {shlex.quote(api_origin)} --accelerator {accelerator_mode} --token-file -"
    volume = f"{AGENT_STATE_DIR}:{AGENT_STATE_DIR}"
    container_env = f"{AGENT_STATE_DIR}/modelforge-node-agent.env"
    socket_volume = f"{WORKER_SOCKET_VOLUME}:{CONTAINER_WORKER_SOCKET.rsplit('/', 1)[0]}"
    artifacts = f"{CONTAINER_ARTIFACT_ROOT}:{CONTAINER_ARTIFACT_ROOT}"
    gpus = " --gpus all" if accelerator_mode == "nvidia" else ""
    return {
        "systemd": (
            f"sudo {AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH} {join} && "
            f"sudo systemctl enable --now {WORKER_SERVICE} {AGENT_SERVICE}"
        ),
        "checkout": (
            f".venv/bin/modelforge-node-agent {join} --state-dir {CHECKOUT_STATE_DIR} "
            f"--env-file {CHECKOUT_ENV_FILE} --worker-socket {CHECKOUT_WORKER_SOCKET} && "
            f".venv/bin/modelforge-node-agent --env-file {CHECKOUT_ENV_FILE}"
        ),
        # The worker first, on its own socket volume, with the host's name; then the join, in
        # a throw-away agent container with the host's name too (the node is recorded under
        # the name it enrolls with, not the container's random id); then the agent, in the worker's network namespace (a
        # runtime the worker starts listens on 127.0.0.1 there, where the agent polls it;
        # such a container takes the worker's host name and may not set one). The state and
        # artifact directories are the image user's; the worker mounts the artifact root
        # read-only at the same path. The agent reads its env file itself (mode 0600, that
        # user's), so nothing on the host needs to read it.
        "container": (
            f"sudo install -d -m 0700 -o {AGENT_IMAGE_UID} -g {AGENT_IMAGE_UID} "
            f"{AGENT_STATE_DIR} && "
            f"sudo install -d -m 0750 -o {AGENT_IMAGE_UID} -g {AGENT_IMAGE_UID} "
            f"{CONTAINER_ARTIFACT_ROOT} && "
            f"docker run -d --name {WORKER_SERVICE} --restart unless-stopped "
            f'--hostname "$(hostname)"'
            f"{gpus} --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges "
            f"-e MODELFORGE_WORKER_SOCKET={CONTAINER_WORKER_SOCKET} "
            f"-e MODELFORGE_WORKER_ACCELERATOR_MODE={accelerator_mode} -v {socket_volume} "
            f"-v {artifacts}:ro {worker_image(accelerator_mode)} && "
            f'docker run --rm -it{gpus} --hostname "$(hostname)" -v {volume} {AGENT_IMAGE} '
            f"python3 -m modelforge_node_agent.main {join} --env-file {container_env} "
            f"--worker-socket {CONTAINER_WORKER_SOCKET} && "
            f"docker run -d --name {AGENT_SERVICE} --restart unless-stopped "
            f"--network container:{WORKER_SERVICE}"
            f"{gpus} --read-only --tmpfs /tmp --cap-drop ALL --security-opt no-new-privileges "
            f"-e MODELFORGE_AGENT_ARTIFACT_ROOT={CONTAINER_ARTIFACT_ROOT} "
            f"-v {volume} -v {socket_volume} -v {artifacts} "
            f"{AGENT_IMAGE} python3 -m modelforge_node_agent.main --env-file {container_env}"
        ),
    }


def worker_image(accelerator_mode: str) -> str:
    """The runtime worker image for a node of this mode: CUDA for nvidia, else the -cpu one."""
    name = RUNTIME_WORKER_IMAGE if accelerator_mode == "nvidia" else RUNTIME_WORKER_CPU_IMAGE
    return f"{name}:{__version__}"


def origin_warnings(api_origin: str) -> list[str]:
    """What the operator should know about a token's origin before using its join commands."""
    host = (urlsplit(api_origin).hostname or "").lower()
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.endswith(".localhost")
    if not loopback:
        return []
    return [
        f"the token is locked to {api_origin}, a loopback address: only a node on this machine "
        "can join with it, and not its container commands (a container's loopback is its "
        "own). For other nodes, mint it for the address they reach: set "
        "MODELFORGE_PUBLIC_API_ORIGIN (or pass --origin) to it."
    ]


def checkout_worker_command(accelerator_mode: str) -> str:
    """The runtime worker for the checkout's join command: its socket (the worker takes an
    absolute path only), the agent's mode."""
    return (
        f'MODELFORGE_WORKER_SOCKET="$PWD/{CHECKOUT_WORKER_SOCKET}" '
        f"MODELFORGE_WORKER_ACCELERATOR_MODE={accelerator_mode} .venv/bin/modelforge-runtime-worker"
    )


def command_titles() -> dict[str, object]:
    """Human titles for the command fields of a mint answer, as the console shows them:
    ``{field: title}`` for a single command, ``{field: {key: title}}`` for a mapping."""
    return {
        "start_command": "Start command for Bash",
        "worker_command": "Runtime Worker for the start command",
        "join_commands": {kind: f"Join command: {text}" for kind, text in INSTALL_TYPES.items()},
        "join_worker_commands": {
            "checkout": "Runtime Worker for the checkout's join command (start it first)"
        },
    }


def describe(commands: dict[str, str]) -> str:
    """The commands as the CLI prints them."""
    blocks = [f"  {INSTALL_TYPES[kind]}:\n\n    {command}\n" for kind, command in commands.items()]
    return "\n".join(blocks)


__all__ = [
    "AGENT_ENV_FILE",
    "INSTALL_TYPES",
    "checkout_worker_command",
    "origin_warnings",
    "worker_image",
    "command_titles",
    "describe",
    "join_commands",
]
