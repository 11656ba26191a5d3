"""The Enroll node wizard's image step: which node-agent image a node may run, and how.

Default mode, the local release bundle: the operator loads the images tarball on the node
and pastes the ``images.modelforge-node-agent`` entry of the release manifest. The entry is
checked with ``modelforge_contract.manifest`` (no second checker here):

- with ``MODELFORGE_RELEASE_MANIFEST`` set, it must equal that release's entry in every
  compared field (tag, architecture, os, RootFS layers, every label, every runtime field
  of ``config``) — a changed layer is named by its index;
- without it, it must be well formed and tagged exactly
  ``modelforge-node-agent:<this control plane's version>``.

The image id is ignored (``docker load`` may rewrite it). The generated script checks the
loaded image against the same values (its user, entrypoint, command, environment and the
other runtime fields included), records the local image id before Compose starts, and
checks that the created container runs that id as that user with that command. Alternate mode: a registry image
pinned by ``@sha256:`` digest, which Docker itself verifies on pull.

Beside the agent the files run the release's Runtime Worker (``modelforge-runtime-worker``
for ``nvidia``, ``modelforge-runtime-worker-cpu`` otherwise), loaded from the same bundle,
sharing the worker's socket through a volume: without it a node is online but never ready.
The agent joins the worker's network namespace (a model runtime the worker starts listens on
127.0.0.1 there, where the agent polls its readiness), so the host name is set on the worker,
and the worker mounts the agent's artifact root read-only at the same path, to open the
model directories the agent names.
GPUs are reserved only for the ``nvidia`` accelerator mode the enrollment was minted with.
The script runs whichever Compose the host has: ``docker compose`` (v2) or
``docker-compose`` (v1, Debian 12's).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from modelforge_contract import (
    ACCELERATOR_MODES,
    IMAGE_ENTRY_REJECTED,
    RELEASE_MANIFEST_UNREADABLE,
    __version__,
)
from modelforge_contract.manifest import (
    LABEL_TITLE,
    LABEL_VERSION,
    NODE_AGENT_IMAGE,
    RUNTIME_FIELDS,
    RUNTIME_WORKER_CPU_IMAGE,
    RUNTIME_WORKER_IMAGE,
    ManifestError,
    Problem,
    entry_differences,
    entry_problems,
    parse_manifest,
    runtime_config,
)

from ..core.errors import ApiError, Invalid
from ..core.settings import Settings
from ..identity.enrollment import DEFAULT_ACCELERATOR_MODE

COMPOSE_FILE = "docker-compose.modelforge-node-agent.yml"
START_SCRIPT = "modelforge-node-agent-start.sh"
ENV_FILE = "modelforge-node.env"
SERVICE = "node-agent"
STATE_VOLUME = "modelforge-node-agent-state"
TOKEN_PATTERN = r"^mfe_[0-9a-f]{8,32}_[A-Za-z0-9_-]{20,}$"
# Label names go inside a Go template string in the generated script: keep them plain.
_LABEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REGISTRY_IMAGE = re.compile(
    r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"@sha256:[0-9a-f]{64}"
)

WORKER_SERVICE = "runtime-worker"
WORKER_SOCKET_VOLUME = "modelforge-worker-socket"
# The worker image makes this directory its user's (release/modelforge_release/layers.py):
# Docker copies that ownership into the empty volume when the worker's container is created
# (the agent's container is created after it), and both images run as that user.
WORKER_SOCKET_DIR = "/run/modelforge-worker"
WORKER_SOCKET = f"{WORKER_SOCKET_DIR}/worker.sock"
# The agent's replicated models, apart from its identity: the worker mounts them read-only at
# the same path. The agent image makes the directory its user's (layers.py), which Docker
# copies into the empty volume, as for the socket's.
ARTIFACTS_VOLUME = "modelforge-node-agent-artifacts"
ARTIFACT_ROOT = "/var/lib/modelforge-artifacts"
# The host's name, which the start script sets from `hostname`: a container's own name is
# its id, new at every recreate, so without it every recreate would report a new hostname.
HOSTNAME_VARIABLE = "MODELFORGE_NODE_AGENT_HOSTNAME"
TOKEN_FILE_VARIABLE = "MODELFORGE_NODE_AGENT_TOKEN_FILE"

# After the token was used: recreate both containers without it, keeping the named state
# volume with the identity. The script finds the host's Compose and sets the host name.
RECREATE_COMMAND = f"bash {START_SCRIPT} --recreate"
CLEANUP_COMMAND = f"bash {START_SCRIPT} --down   # keeps the state and model volumes"


def release_version(settings: Settings) -> str:
    """The version whose node-agent image nodes must run."""
    manifest = _release_manifest(settings)
    return manifest["version"] if manifest else __version__


def bundle_steps(settings: Settings) -> list[dict[str, str]]:
    """What to run on the node before pasting the entry (no secrets)."""
    version = release_version(settings)
    return [  # as docs/node-agent.md runs them (a test holds them to it)
        {
            "name": "verify_signature",
            "title": "In the release bundle's directory, check who wrote SHA256SUMS, against "
            "the allowed_signers file you keep outside it with the release key's public line",
            "text": "ssh-keygen -Y verify -f ~/.config/modelforge/allowed_signers "
            "-I releases@modelforge \\\n    -n modelforge-release -s SHA256SUMS.sig < SHA256SUMS",
        },
        {
            "name": "verify_sums",
            "title": "Then the files",
            "text": "sha256sum -c --strict SHA256SUMS",
        },
        {
            "name": "load_images",
            "title": "Load the images into the node's Docker",
            "text": f"docker image load -i modelforge-{version}-images.tar",
        },
    ]


def _release_manifest(settings: Settings) -> dict[str, Any] | None:
    path: Path | None = settings.release_manifest
    if path is None:
        return None
    try:
        return parse_manifest(path.read_text(encoding="utf-8"))
    except (OSError, ManifestError) as exc:
        raise ApiError(
            f"the release manifest {path} cannot be used: {exc}",
            code=RELEASE_MANIFEST_UNREADABLE,
            status=503,
            next_step="Fix MODELFORGE_RELEASE_MANIFEST (the release's -manifest.json) and "
            "restart the control plane.",
        ) from None


def _unwrap(entry: dict[str, Any]) -> Any:
    """Accept the entry itself, ``{"modelforge-node-agent": entry}`` or a whole manifest."""
    if isinstance(entry.get("images"), dict):
        entry = entry["images"]
    if set(entry) == {NODE_AGENT_IMAGE}:
        return entry[NODE_AGENT_IMAGE]
    return entry


def entry_check_problems(settings: Settings, pasted: Any) -> list[Problem]:
    """Everything wrong with a pasted entry, each naming its field; [] when accepted."""
    manifest = _release_manifest(settings)
    version = manifest["version"] if manifest else __version__
    problems = entry_problems(NODE_AGENT_IMAGE, pasted, version)
    if manifest is not None and isinstance(pasted, dict):
        expected = manifest["images"].get(NODE_AGENT_IMAGE)
        if expected is None:
            problems.append(Problem(NODE_AGENT_IMAGE, "the release manifest has no such image"))
        else:
            named = {problem.field for problem in problems}
            problems += [p for p in entry_differences(expected, pasted) if p.field not in named]
    if isinstance(pasted, dict) and isinstance(pasted.get("labels"), dict):
        for name, value in pasted["labels"].items():
            if not _LABEL_NAME.fullmatch(str(name)):
                problems.append(Problem(f"labels.{name}", "is not a plain label name"))
            elif isinstance(value, str) and _CONTROL.search(value):
                problems.append(Problem(f"labels.{name}", "contains control characters"))
    return problems


def worker_image(version: str, accelerator_mode: str) -> str:
    """The Runtime Worker image of the release: the CUDA one only for ``nvidia``."""
    name = RUNTIME_WORKER_IMAGE if accelerator_mode == "nvidia" else RUNTIME_WORKER_CPU_IMAGE
    return f"{name}:{version}"


def check(settings: Settings, fields: dict[str, Any]) -> dict[str, Any]:
    """Check the wizard's image choice; answer the commands for it, or 400 naming each field.

    ``accelerator_mode`` is the mode the enrollment was minted with (``nvidia`` when not
    sent, as for minting): it decides the worker image and whether GPUs are reserved."""
    mode = fields.get("accelerator_mode") or DEFAULT_ACCELERATOR_MODE
    if mode not in ACCELERATOR_MODES:  # the API's field check says so first
        raise _rejected([Problem("accelerator_mode", f"must be one of {ACCELERATOR_MODES}")])
    worker = worker_image(release_version(settings), mode)
    registry_image = fields.get("registry_image")
    if registry_image is not None:
        if "entry" in fields:
            raise Invalid(
                "send either entry or registry_image, not both",
                code=IMAGE_ENTRY_REJECTED,
                extra={"problems": []},
            )
        if not _REGISTRY_IMAGE.fullmatch(registry_image):
            problem = Problem(
                "registry_image", "must be REPOSITORY@sha256:<64 hex>, pinned by digest"
            )
            raise _rejected([problem])
        return _answer(registry_image, None, "registry image pinned by digest", worker, mode)
    if "entry" not in fields:
        raise Invalid(
            "send the pasted manifest entry as entry (or registry_image)",
            code=IMAGE_ENTRY_REJECTED,
            extra={"problems": []},
        )
    pasted = _unwrap(fields["entry"])
    problems = entry_check_problems(settings, pasted)
    if problems:
        raise _rejected(problems)
    against = (
        f"release manifest {settings.release_manifest.name}"
        if settings.release_manifest
        else f"control plane version {__version__}"
    )
    return _answer(pasted["tag"], pasted, against, worker, mode)


def _rejected(problems: list[Problem]) -> Invalid:
    return Invalid(
        "the image entry was rejected: " + "; ".join(str(p) for p in problems),
        code=IMAGE_ENTRY_REJECTED,
        next_step="Paste images.modelforge-node-agent from the manifest of the release whose "
        "images you loaded.",
        extra={"problems": [{"field": p.field, "message": p.message} for p in problems]},
    )


def _answer(
    image: str, entry: dict[str, Any] | None, against: str, worker: str, mode: str
) -> dict[str, Any]:
    return {
        "image": image,
        "worker_image": worker,
        "accelerator_mode": mode,
        "mode": "registry" if entry is None else "release-bundle",
        "checked_against": against,
        "ignored": ["image_id"] if entry is not None else [],
        "commands": [
            {
                "name": "compose_file",
                "title": f"Save beside {ENV_FILE} as {COMPOSE_FILE}",
                "file": COMPOSE_FILE,
                "text": compose_file(image, worker, mode),
            },
            {
                "name": "start_script",
                "title": f"Save as {START_SCRIPT}, then run: bash {START_SCRIPT}",
                "file": START_SCRIPT,
                "text": start_script(image, entry, worker),
            },
            {
                "name": "cleanup",
                "title": "To stop and remove the containers (the state and model volumes stay)",
                "text": CLEANUP_COMMAND,
            },
        ],
    }


_GPUS = (
    "    deploy:\n"
    "      resources:\n"
    "        reservations:\n"
    "          devices:\n"
    "            - {driver: nvidia, count: all, capabilities: [gpu]}\n"
)
_HARDENED = (
    "    read_only: true\n"
    "    tmpfs:\n"
    "      - /tmp\n"
    "    cap_drop: [ALL]\n"
    '    security_opt: ["no-new-privileges:true"]\n'
)


def compose_file(image: str, worker: str, accelerator_mode: str) -> str:
    """The Compose file naming the exact images; the token only ever comes from a temp file.

    Compose v1 and v2 both read it. The second ``env_file`` entry is the token file for the
    first start, and otherwise the env file again as ``./`` + its name (v1 refuses
    ``/dev/null``, which is no file, and an entry listed twice)."""
    gpus = _GPUS if accelerator_mode == "nvidia" else ""
    hardware = (
        "# The NVIDIA GPUs are reserved for both services (accelerator mode nvidia).\n"
        if gpus
        else f"# No GPUs are reserved (accelerator mode {accelerator_mode}); a GPU node is "
        "minted with nvidia.\n"
    )
    return (
        "# Generated by the ModelForge console: the node agent from\n"
        f"#   {image}\n"
        "# and its Runtime Worker from\n"
        f"#   {worker}.\n"
        "# No secrets here: the enrollment token is read by the start script into a\n"
        "# temporary file for the first start only. Run Compose through that script\n"
        f"# (bash {START_SCRIPT} --recreate, --down): it sets\n"
        f"# {HOSTNAME_VARIABLE} to this host's name and finds docker compose or\n"
        "# docker-compose.\n" + hardware + "services:\n"
        f"  {WORKER_SERVICE}:\n"
        f"    image: {worker}\n"
        "    pull_policy: never\n"
        "    restart: unless-stopped\n"
        "    # The node's network namespace, the agent's too: its host name is the one the\n"
        "    # node reports (a container in another's namespace takes that one's).\n"
        f"    hostname: ${{{HOSTNAME_VARIABLE}:?set {HOSTNAME_VARIABLE} to this host's name "
        f"(bash {START_SCRIPT} does)}}\n"
        "    environment:\n"
        f"      MODELFORGE_WORKER_SOCKET: {WORKER_SOCKET}\n"
        f"      MODELFORGE_WORKER_ACCELERATOR_MODE: {accelerator_mode}\n"
        "    volumes:\n"
        f"      - {WORKER_SOCKET_VOLUME}:{WORKER_SOCKET_DIR}\n"
        f"      - {ARTIFACTS_VOLUME}:{ARTIFACT_ROOT}:ro\n" + _HARDENED + gpus + f"  {SERVICE}:\n"
        f"    image: {image}\n"
        "    pull_policy: never\n"
        "    restart: unless-stopped\n"
        f"    depends_on: [{WORKER_SERVICE}]\n"
        "    # The worker's namespace: the runtimes it starts listen on 127.0.0.1 there.\n"
        f'    network_mode: "service:{WORKER_SERVICE}"\n'
        "    env_file:\n"
        f"      - {ENV_FILE}\n"
        f'      - "${{{TOKEN_FILE_VARIABLE}:-./{ENV_FILE}}}"\n'
        "    environment:\n"
        f"      MODELFORGE_AGENT_WORKER_SOCKET: {WORKER_SOCKET}\n"
        f"      MODELFORGE_AGENT_ARTIFACT_ROOT: {ARTIFACT_ROOT}\n"
        "    volumes:\n"
        f"      - {STATE_VOLUME}:/var/lib/modelforge-node-agent\n"
        f"      - {WORKER_SOCKET_VOLUME}:{WORKER_SOCKET_DIR}\n"
        f"      - {ARTIFACTS_VOLUME}:{ARTIFACT_ROOT}\n" + _HARDENED + gpus + "volumes:\n"
        f"  {STATE_VOLUME}: {{}}\n"
        f"  {WORKER_SOCKET_VOLUME}: {{}}\n"
        f"  {ARTIFACTS_VOLUME}: {{}}\n"
    )


# How ``docker inspect --format '{{json .Config.X}}'`` prints an unset field.
_UNSET_STRING_FIELDS = ("User", "WorkingDir", "StopSignal")
# The fields a container created by the generated Compose file keeps from its image.
CONTAINER_FIELDS = ("User", "Entrypoint", "Cmd", "WorkingDir")
_HEALTHCHECK_ORDER = ("Test", "Interval", "Timeout", "StartPeriod", "StartInterval", "Retries")


def go_json(name: str, value: Any) -> str:
    """``value`` as docker's Go template ``{{json .Config.<name>}}`` prints it (a test
    compares with a real ``docker image inspect``)."""
    if value is None:
        return '""' if name in _UNSET_STRING_FIELDS else "null"
    if name == "Healthcheck" and isinstance(value, dict):  # a Go struct: its field order
        value = {key: value[key] for key in _HEALTHCHECK_ORDER if value.get(key)}
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    else:
        text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    # docker's template json does not escape <, > and & (SetEscapeHTML(false)); Go still
    # escapes the two line separators.
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _verify_lines(image: str, entry: dict[str, Any]) -> list[str]:
    q = shlex.quote
    labels = entry["labels"]
    lines = [
        f"expect architecture {q(entry['architecture'])} \"$(inspect '{{{{.Architecture}}}}')\"",
        f"expect os {q(entry['os'])} \"$(inspect '{{{{.Os}}}}')\"",
        f"expect rootfs_layers {q(' '.join(entry['rootfs_layers']))} "
        "\"$(inspect '{{range $i, $l := .RootFS.Layers}}{{if $i}} {{end}}{{$l}}{{end}}')\"",
        f"expect 'label names' {q(''.join(f'{name} ' for name in sorted(labels)))} "
        "\"$(inspect '{{range $k, $v := .Config.Labels}}{{$k}} {{end}}')\"",
    ]
    for name in sorted(labels):
        template = f'{{{{index .Config.Labels "{name}"}}}}'
        lines.append(f'expect {q("labels." + name)} {q(labels[name])} "$(inspect {q(template)})"')
    config = runtime_config(entry.get("config"))
    for name in RUNTIME_FIELDS:
        template = f"{{{{json .Config.{name}}}}}"
        lines.append(
            f"expect {q('config.' + name)} {q(go_json(name, config[name]))} "
            f'"$(inspect {q(template)})"'
        )
    return lines


def _container_lines(entry: dict[str, Any]) -> list[str]:
    """After the start: the container runs the image's user, entrypoint and command."""
    q = shlex.quote
    config = runtime_config(entry.get("config"))
    lines = []
    for name in CONTAINER_FIELDS:
        template = f"{{{{json .Config.{name}}}}}"
        lines.append(
            f"expect_running {q('config.' + name)} {q(go_json(name, config[name]))} "
            f'"$(docker inspect --format {q(template)} "$container")"'
        )
    return lines


def _worker_lines(worker: str) -> list[str]:
    """The worker image is loaded and is the release's (its title and version labels)."""
    q = shlex.quote
    name, _, version = worker.rpartition(":")
    lines = [
        'docker image inspect "$worker_image" >/dev/null 2>&1 || fail "$worker_image is not '
        "loaded: run docker image load -i the release's -images.tar first\"",
    ]
    for label, value in ((LABEL_TITLE, name), (LABEL_VERSION, version)):
        template = f'{{{{index .Config.Labels "{label}"}}}}'
        lines.append(
            f'expect {q("worker labels." + label)} {q(value)} "$(inspect_worker {q(template)})"'
        )
    return lines


def start_script(image: str, entry: dict[str, Any] | None, worker: str) -> str:
    """Bash: verify the images, note their ids, start with the token from a temp file (or
    recreate without it, or stop), check the ids the containers run."""
    q = shlex.quote
    if entry is not None:
        obtain = [
            'docker image inspect "$image" >/dev/null 2>&1 || fail "$image is not loaded: run '
            "docker image load -i the release's -images.tar first\"",
            *_verify_lines(image, entry),
        ]
    else:
        obtain = ['docker pull "$image" >/dev/null || fail "cannot pull $image"']
    compose_up = '"${compose[@]}" up -d --no-build ${no_pull[@]+"${no_pull[@]}"}'
    body = [
        "#!/usr/bin/env bash",
        f"# Generated by the ModelForge console: start the node agent from {image}",
        f"# and its Runtime Worker from {worker}.",
        "# No secret is in this file: the enrollment token is asked for without echo.",
        "#   bash THIS_FILE                first start: asks for the enrollment token",
        "#   bash THIS_FILE --verify-only  checks the images and prints their ids, starting nothing",
        "#   bash THIS_FILE --recreate     (re)creates both containers without the token: after",
        "#                                 the token was used, after --down, after an upgrade",
        "#   bash THIS_FILE --down         stops and removes both containers; the state volume",
        "#                                 (the node's identity and credential) and the models",
        "#                                 volume stay",
        "# Compose v2 (docker compose) when the host has it, else v1 (docker-compose).",
        "set +x",
        "set -euo pipefail",
        "umask 077",
        f"image={q(image)}",
        f"worker_image={q(worker)}",
        'action="${1:-start}"',
        'fail() { echo "modelforge: $*" >&2; exit 1; }',
        'case "$action" in',
        "    start | --verify-only | --recreate | --down) ;;",
        '    *) fail "unknown option $action: use --verify-only, --recreate or --down" ;;',
        "esac",
        f"unset {TOKEN_FILE_VARIABLE}  # only the first start passes a token file",
        "find_compose() {",
        f"    [ -f {ENV_FILE} ] || fail 'run this beside {ENV_FILE} and {COMPOSE_FILE}'",
        "    if docker compose version >/dev/null 2>&1; then",
        f"        compose=(docker compose -f {COMPOSE_FILE})",
        "        no_pull=(--pull never)",
        "        echo 'using docker compose (Compose v2)'",
        "    elif command -v docker-compose >/dev/null 2>&1; then",
        "        # Compose v1 has no --pull option; the file's pull_policy: never holds.",
        f"        compose=(docker-compose -f {COMPOSE_FILE})",
        "        no_pull=()",
        "        echo 'using docker-compose (Compose v1)'",
        "    else",
        '        fail "neither docker compose (Compose v2) nor docker-compose (v1) runs here: '
        'install one (Debian: apt-get install docker-compose)"',
        "    fi",
        f'    {HOSTNAME_VARIABLE}="${{{HOSTNAME_VARIABLE}:-$(hostname)}}"',
        f"    export {HOSTNAME_VARIABLE}",
        "}",
        'if [ "$action" = --down ]; then',
        "    find_compose",
        '    "${compose[@]}" down',
        "    echo 'stopped the node agent and its worker; the state and model volumes stay'",
        "    exit 0",
        "fi",
        'expect() { [ "$3" = "$2" ] || fail "the image does not match: $1 is \'$3\', expected \'$2\'"; }',
        'inspect() { docker image inspect --format "$1" "$image"; }',
        'inspect_worker() { docker image inspect --format "$1" "$worker_image"; }',
        'expect_running() { [ "$3" = "$2" ] || { "${compose[@]}" down; fail "the container does '
        "not run as its image says: $1 is '$3', expected '$2'; stopped it\"; }; }",
        *obtain,
        *_worker_lines(worker),
        "image_id=$(inspect '{{.Id}}')",
        "worker_image_id=$(inspect_worker '{{.Id}}')",
        'echo "verified $image (local image id $image_id)"',
        'echo "verified $worker_image (local image id $worker_image_id)"',
        'if [ "$action" = --verify-only ]; then exit 0; fi',
        "find_compose",
        'if [ "$action" = start ]; then',
        "    tok_file=$(mktemp)",
        "    trap 'rm -f \"$tok_file\"' EXIT",
        "    trap 'rm -f \"$tok_file\"; exit 130' INT",
        "    trap 'rm -f \"$tok_file\"; exit 143' TERM",
        "    trap 'rm -f \"$tok_file\"; exit 129' HUP",
        "    IFS= read -rsp 'Enrollment token: ' tok; echo >&2",
        f"    [[ $tok =~ {TOKEN_PATTERN} ]] || fail 'that is not an enrollment token (mfe_...)'",
        '    printf \'MODELFORGE_AGENT_ENROLLMENT_TOKEN=%s\\n\' "$tok" > "$tok_file"; unset tok',
        f'    {TOKEN_FILE_VARIABLE}="$tok_file" {compose_up} {WORKER_SERVICE} {SERVICE}',
        '    rm -f "$tok_file"',
        "else",
        f"    {compose_up} --force-recreate {WORKER_SERVICE} {SERVICE}",
        "fi",
        f'container=$("${{compose[@]}}" ps -q {SERVICE})',
        f'worker_container=$("${{compose[@]}}" ps -q {WORKER_SERVICE})',
        "running=$(docker inspect --format '{{.Image}}' \"$container\")",
        'if [ "$running" != "$image_id" ]; then',
        '    "${compose[@]}" down',
        '    fail "the container ran $running, not the verified $image_id: stopped it"',
        "fi",
        "running=$(docker inspect --format '{{.Image}}' \"$worker_container\")",
        'if [ "$running" != "$worker_image_id" ]; then',
        '    "${compose[@]}" down',
        '    fail "the worker container ran $running, not the verified $worker_image_id: stopped it"',
        "fi",
        *(_container_lines(entry) if entry is not None else []),
        'if [ "$action" = --recreate ]; then',
        "    carried=$(docker inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "
        '"$container" | grep -c "^MODELFORGE_AGENT_ENROLLMENT_TOKEN=" || true)',
        '    [ "$carried" = 0 ] || fail "the recreated container still carries the enrollment '
        f'token: is {TOKEN_FILE_VARIABLE} set in a .env file here?"',
        "    echo 'the container no longer carries the enrollment token'",
        "fi",
        'echo "node agent started from $image ($image_id), worker from $worker_image '
        '($worker_image_id)"',
    ]
    return "\n".join(body) + "\n"
