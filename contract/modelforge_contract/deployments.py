"""The deployments wire contract (docs/architecture.md §11, docs/deployments.md).

A deployment runs one model revision with one runtime on the nodes an administrator
names: one *server* row per member node, sharing model, runtime and settings, each started
by its own node's agent (the control plane never dials a node).

How a server travels:

1. ``POST /admin/deployments`` checks, against freshly measured state, that every member
   is eligible, offers the runtime and reports the model ``present``; it picks each
   server's GPUs by UUID, makes the rows ``pending`` and bumps each member's
   ``servers_generation``.
2. Every heartbeat answer carries ``servers_generation`` (additive). An agent that sees a
   value other than the one it last fetched calls ``GET /agent/servers``: the servers its
   node should run. A server the agent's worker runs that is not in that answer is stopped.
3. For each server it should run, the agent claims a serve lease
   (``POST /agent/servers/{server_id}/claim``), asks its runtime worker to launch the
   runtime on the replicated files with exactly the lease's GPUs, polls the runtime's
   readiness on the node, and renews the lease while the server runs
   (``POST /agent/servers/{server_id}/renew``), each renewal carrying the state it sees.
4. A lease that runs out puts the server ``waiting`` (its node is away) and it is listed
   again, so the node's agent claims it again the moment it is back; a renewal of a lease
   that is no longer held answers ``409 LEASE_LOST`` with ``lease_end`` saying how it ended
   (``restarted``: stop the runtime and claim again; ``expired`` or ``replaced``: claim it
   again if still listed, adopting a runtime that still runs; anything else: stop it).
   A 409 LEASE_LOST ends that lease: it is never a transient error to retry.
"""

from __future__ import annotations

import re

from . import API_PREFIX

# -- paths ---------------------------------------------------------------------

PATH_ADMIN_DEPLOYMENTS = f"{API_PREFIX}/admin/deployments"
PATH_ADMIN_DEPLOYMENT = f"{PATH_ADMIN_DEPLOYMENTS}/<name>"
PATH_ADMIN_DEPLOYMENT_RESTART = f"{PATH_ADMIN_DEPLOYMENT}/restart"
PATH_ADMIN_DEPLOYMENT_SERVERS = f"{PATH_ADMIN_DEPLOYMENT}/servers"
PATH_ADMIN_DEPLOYMENT_SERVER = f"{PATH_ADMIN_DEPLOYMENT_SERVERS}/<node>"
# One node's servers and replicas, for its console page.
PATH_ADMIN_NODE_SERVING = f"{API_PREFIX}/admin/hardware/nodes/<node_id>/serving"
PATH_AGENT_SERVERS = f"{API_PREFIX}/agent/servers"
PATH_AGENT_SERVER_CLAIM = f"{PATH_AGENT_SERVERS}/<server_id>/claim"
PATH_AGENT_SERVER_RENEW = f"{PATH_AGENT_SERVERS}/<server_id>/renew"


def server_path(template: str, server_id: str) -> str:
    return template.replace("<server_id>", server_id)


# -- runtimes -------------------------------------------------------------------

RUNTIME_LLAMA_CPP = "llama.cpp"
RUNTIME_VLLM = "vllm"
RUNTIMES = (RUNTIME_LLAMA_CPP, RUNTIME_VLLM)
# What a worker also offers when it can be a helper of a llama.cpp model split across nodes
# (it finds ggml-rpc-server): not a runtime a deployment names, a role a member takes.
RUNTIME_LLAMA_CPP_RPC = "llama.cpp-rpc"
# A split deployment's members (docs/deployments.md, "Splitting a model across nodes"): the
# main node runs llama-server over the helpers, each helper a ggml-rpc-server.
ROLE_MAIN = "main"
ROLE_HELPER = "helper"
ROLES = (ROLE_MAIN, ROLE_HELPER)
SPLIT_MAX = 8  # members of one split: the main node and up to 7 helpers
SPLIT_FIXED = "SPLIT_FIXED"  # 409: a split deployment's members are fixed at deploy time
# Arguments the worker sets itself on a split deployment's main server.
SPLIT_RESERVED_ARGS = frozenset(
    {"-ts", "--tensor-split", "-ot", "--override-tensor", "-cram", "--cache-ram", "-sm",
     "--split-mode", "-mg", "--main-gpu", "-dev", "--device", "-ngl", "--n-gpu-layers",
     "--gpu-layers"}
)  # fmt: skip
# The output layer stays on the main node (anchored: unanchored it also takes every
# attn_output.weight, and costs round trips on each token).
SPLIT_OUTPUT_ON_MAIN = r"^output\.weight$=CPU"
CAPABILITY_SERVE = "serve"  # what a worker with at least one runtime offers

# -- server states (docs/deployments.md, "What each state means") ----------------------
# A deployment is a desired state the control plane reconciles (docs/deployments.md): ``pending``:
# to start, not yet claimed by its node's agent; ``starting``: claimed, the runtime is
# launching or not ready yet; ``running``: the agent saw it ready; ``waiting``: its node is
# away (offline, agent restarting, lease ran out), it starts again when the node is back;
# ``backoff``: the runtime exited or never became ready, the agent starts it again at
# ``next_attempt_at``; ``failed`` with ``{code, message}``: only what needs a person;
# ``idle``: unloaded after ``idle_unload_seconds`` without a request, the next request
# starts it; ``stopping``: asked to stop (undeploy, removal, unload), the agent has not
# said it stopped; ``stopped``.

SERVER_PENDING = "pending"
SERVER_STARTING = "starting"
SERVER_RUNNING = "running"
SERVER_WAITING = "waiting"
SERVER_BACKOFF = "backoff"
SERVER_IDLE = "idle"
SERVER_STOPPING = "stopping"
SERVER_STOPPED = "stopped"
SERVER_FAILED = "failed"
SERVER_STATES = (
    SERVER_PENDING,
    SERVER_STARTING,
    SERVER_RUNNING,
    SERVER_WAITING,
    SERVER_BACKOFF,
    SERVER_IDLE,
    SERVER_STOPPING,
    SERVER_STOPPED,
    SERVER_FAILED,
)
# States whose server holds its GPUs (a waiting one keeps them for its node's return; an
# idle, failed or stopped one does not, and picks them again when it starts).
SERVER_ACTIVE_STATES = (
    SERVER_PENDING,
    SERVER_STARTING,
    SERVER_RUNNING,
    SERVER_WAITING,
    SERVER_BACKOFF,
    SERVER_STOPPING,
)
# What an agent may report in a renewal.
SERVER_REPORTED_STATES = (
    SERVER_STARTING,
    SERVER_RUNNING,
    SERVER_BACKOFF,
    SERVER_STOPPED,
    SERVER_FAILED,
)
# Deployment states, from its servers' (plus ``stopping`` and ``stopped`` once undeployed).
DEPLOYMENT_RUNNING = "running"  # every member runs
DEPLOYMENT_DEGRADED = "degraded"  # some do
DEPLOYMENT_STARTING = "starting"  # none yet, and none is away, backing off or failed
DEPLOYMENT_DOWN = "down"  # none does
DEPLOYMENT_IDLE = "idle"  # unloaded; the next request starts it
# What a member is for (a server's ``goal``): run; unload to idle; leave the deployment.
GOAL_RUN = "run"
GOAL_IDLE = "idle"
GOAL_REMOVE = "remove"
# The agent's restart backoff for a runtime that exits or never becomes ready.
BACKOFF_FIRST_SECONDS = 5.0
BACKOFF_MAX_SECONDS = 300.0


def backoff_seconds(restarts: int) -> float:
    """The wait before restart number ``restarts`` (1, 2, …): 5, 10, 20 … at most 300 s."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** max(0, min(restarts - 1, 16)))


# How a serve lease ended, as a 409 LEASE_LOST's ``lease_end`` says.
LEASE_END_RESTARTED = "restarted"  # the admin restarted the deployment: claim again
LEASE_END_REPLACED = "replaced"  # this node claimed the server again (an agent restart)
LEASE_END_STOPPED = "stopped"
LEASE_END_EXPIRED = "expired"  # it ran out (the node was away): claim again if listed
LEASE_END_IDLE = "idle"  # unloaded: stop the runtime

# -- error codes (docs/deployments.md says what each means and what to do) -------------

DEPLOYMENT_NOT_FOUND = "DEPLOYMENT_NOT_FOUND"
DEPLOYMENT_EXISTS = "DEPLOYMENT_EXISTS"
DEPLOYMENT_STOPPING = "DEPLOYMENT_STOPPING"  # 409: restart refused while it is undeployed
MODEL_MISSING = "MODEL_MISSING"  # a member has not reported the model present
RUNTIME_UNSUPPORTED = "RUNTIME_UNSUPPORTED"  # a member's worker does not offer the runtime
MODEL_FORMAT_UNSUPPORTED = "MODEL_FORMAT_UNSUPPORTED"  # e.g. llama.cpp and no .gguf file
GPUS_UNAVAILABLE = "GPUS_UNAVAILABLE"  # a member has fewer free GPUs than asked
SERVER_NOT_CLAIMABLE = "SERVER_NOT_CLAIMABLE"  # 409 on claim: not this node's, or ended
# What a server's error can say (set by the control plane or reported by the agent).
SERVER_LEASE_LOST = "SERVER_LEASE_LOST"  # the agent stopped renewing (node or agent down)
NODE_OFFLINE = "NODE_OFFLINE"
NODE_DECOMMISSIONED = "NODE_DECOMMISSIONED"
RUNTIME_EXITED = "RUNTIME_EXITED"  # the runtime exited on its own (backoff says when again)
RUNTIME_NOT_READY = "RUNTIME_NOT_READY"  # never answered its readiness check in time
NODE_STOPPING = "NODE_STOPPING"  # waiting: the node's agent stopped its servers to go
LAST_MEMBER = "LAST_MEMBER"  # 409: removing the last member; undeploy instead
NOT_A_MEMBER = "NOT_A_MEMBER"  # 404: the node is not a member of the deployment
ALREADY_A_MEMBER = "ALREADY_A_MEMBER"  # 409: the node is already a member
RUNTIME_LAUNCH_FAILED = "RUNTIME_LAUNCH_FAILED"  # the worker could not start it
MODEL_NOT_ON_NODE = "MODEL_NOT_ON_NODE"  # the agent does not hold the model's files

# -- names and limits ---------------------------------------------------------------

DEPLOYMENT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
ARGS_MAX = 64  # extra runtime arguments per deployment
ARG_MAX_CHARS = 512
CONTEXT_LENGTH_MAX = 1 << 22
IDLE_UNLOAD_MAX = 30 * 86400  # settings.idle_unload_seconds: at most 30 days
SERVE_LEASE_SECONDS = 30  # the default MODELFORGE_SERVE_LEASE_SECONDS
# Arguments the worker sets itself: an extra argument may not move the address, the port,
# the served name or the model (a runtime on 0.0.0.0 would bypass the control plane), nor
# make the runtime fetch anything or dial out (a hub, a URL, a registry, an RPC helper).
RESERVED_ARGS = frozenset(
    {
        "--host", "--port", "--alias", "-a", "-m", "--model", "-mu", "--model-url", "-hf",
        "--hf-repo", "-hfr", "--hf-file", "-hff", "--path", "--api-key", "--api-key-file",
        "--ssl-key-file", "--ssl-cert-file", "--served-model-name", "--download-dir", "--uds",
        "--ssl-keyfile", "--ssl-certfile",
        # llama.cpp's other fetching and dialling options: the draft, vocoder and projector
        # models from a hub or a URL, a hub token, a Docker Hub repository, RPC helpers
        "-hfd", "-hfrd", "--hf-repo-draft", "-hfv", "-hfrv", "--hf-repo-v", "-hffv",
        "--hf-file-v", "-hft", "--hf-token", "-mmu", "--mmproj-url", "-dr", "--docker-repo",
        "--rpc",
    }
)  # fmt: skip


def arg_name(arg: str) -> str:
    """The option an argument names, as the reserved sets spell it: ``--api_key=x`` is
    ``--api-key`` (vLLM and llama.cpp read both spellings of a long option)."""
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def reserved_arg(
    args: list[str] | tuple[str, ...], reserved: frozenset[str] = RESERVED_ARGS
) -> str | None:
    """The first argument the worker sets itself (``--port``, ``--host=…``, ``--api_key``) as
    it was given, or None."""
    for arg in args:
        if arg_name(arg) in reserved:
            return arg.split("=", 1)[0]
    return None


# -- agent <-> runtime worker ----------------------------------------------------------
# The worker owns the runtime processes (and containers), so an agent restart finds them
# again: ``GET /v1/servers`` lists them, ``POST /v1/servers`` launches one (the same
# server_id again answers the one running), ``POST /v1/servers/stop`` stops one.

WORKER_PATH_SERVERS = "/v1/servers"
WORKER_PATH_SERVER_STOP = "/v1/servers/stop"
