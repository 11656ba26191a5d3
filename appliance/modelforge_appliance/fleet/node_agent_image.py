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
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from modelforge_contract import (
    IMAGE_ENTRY_REJECTED,
    RELEASE_MANIFEST_UNREADABLE,
    __version__,
)
from modelforge_contract.manifest import (
    NODE_AGENT_IMAGE,
    RUNTIME_FIELDS,
    ManifestError,
    Problem,
    entry_differences,
    entry_problems,
    parse_manifest,
    runtime_config,
)

from ..core.errors import ApiError, Invalid
from ..core.settings import Settings

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

COMPOSE = f"docker compose -f {COMPOSE_FILE}"
# After the token was used: recreate the container without it (the token file variable is
# unset, so Compose reads /dev/null), keeping the named state volume with the identity.
RECREATE_COMMAND = (
    f"{COMPOSE} up -d --no-build --pull never --force-recreate {SERVICE} && "
    f"docker inspect --format '{{{{range .Config.Env}}}}{{{{println .}}}}{{{{end}}}}' "
    f'"$({COMPOSE} ps -q {SERVICE})" | grep -c "^MODELFORGE_AGENT_ENROLLMENT_TOKEN=" '
    "| grep -qx 0 && echo 'the container no longer carries the enrollment token'"
)
CLEANUP_COMMAND = f"{COMPOSE} down   # keeps the state volume; never add -v"


def release_version(settings: Settings) -> str:
    """The version whose node-agent image nodes must run."""
    manifest = _release_manifest(settings)
    return manifest["version"] if manifest else __version__


def bundle_steps(settings: Settings) -> list[dict[str, str]]:
    """What to run on the node before pasting the entry (no secrets)."""
    version = release_version(settings)
    return [
        {
            "name": "verify_sums",
            "title": "In the release bundle's directory, check the checksums",
            "text": "sha256sum -c SHA256SUMS",
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


def check(settings: Settings, fields: dict[str, Any]) -> dict[str, Any]:
    """Check the wizard's image choice; answer the commands for it, or 400 naming each field."""
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
        return _answer(registry_image, None, "registry image pinned by digest")
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
    return _answer(pasted["tag"], pasted, against)


def _rejected(problems: list[Problem]) -> Invalid:
    return Invalid(
        "the image entry was rejected: " + "; ".join(str(p) for p in problems),
        code=IMAGE_ENTRY_REJECTED,
        next_step="Paste images.modelforge-node-agent from the manifest of the release whose "
        "images you loaded.",
        extra={"problems": [{"field": p.field, "message": p.message} for p in problems]},
    )


def _answer(image: str, entry: dict[str, Any] | None, against: str) -> dict[str, Any]:
    return {
        "image": image,
        "mode": "registry" if entry is None else "release-bundle",
        "checked_against": against,
        "ignored": ["image_id"] if entry is not None else [],
        "commands": [
            {
                "name": "compose_file",
                "title": f"Save beside {ENV_FILE} as {COMPOSE_FILE}",
                "file": COMPOSE_FILE,
                "text": compose_file(image),
            },
            {
                "name": "start_script",
                "title": f"Save as {START_SCRIPT}, then run: bash {START_SCRIPT}",
                "file": START_SCRIPT,
                "text": start_script(image, entry),
            },
            {
                "name": "cleanup",
                "title": "To stop and remove the container",
                "text": CLEANUP_COMMAND,
            },
        ],
    }


def compose_file(image: str) -> str:
    """The Compose file naming the exact image; the token only ever comes from a temp file."""
    return (
        f"# Generated by the ModelForge console for {image}. No secrets here: the enrollment\n"
        f"# token is read by {START_SCRIPT} into a temporary file for the first start only.\n"
        "services:\n"
        f"  {SERVICE}:\n"
        f"    image: {image}\n"
        "    pull_policy: never\n"
        "    restart: unless-stopped\n"
        "    env_file:\n"
        f"      - {ENV_FILE}\n"
        '      - "${MODELFORGE_NODE_AGENT_TOKEN_FILE:-/dev/null}"\n'
        "    volumes:\n"
        f"      - {STATE_VOLUME}:/var/lib/modelforge-node-agent\n"
        "    read_only: true\n"
        "    cap_drop: [ALL]\n"
        '    security_opt: ["no-new-privileges:true"]\n'
        "    deploy:\n"
        "      resources:\n"
        "        reservations:\n"
        "          devices:\n"
        "            - {driver: nvidia, count: all, capabilities: [gpu]}\n"
        "volumes:\n"
        f"  {STATE_VOLUME}: {{}}\n"
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


def start_script(image: str, entry: dict[str, Any] | None) -> str:
    """Bash: verify the image, note its id, start with the token from a temp file, check the id."""
    q = shlex.quote
    if entry is not None:
        obtain = [
            'docker image inspect "$image" >/dev/null 2>&1 || fail "$image is not loaded: run '
            "docker image load -i the release's -images.tar first\"",
            *_verify_lines(image, entry),
        ]
    else:
        obtain = ['docker pull "$image" >/dev/null || fail "cannot pull $image"']
    body = [
        "#!/usr/bin/env bash",
        f"# Generated by the ModelForge console: start the node agent from {image}.",
        "# No secret is in this file: the enrollment token is asked for without echo.",
        "# bash THIS_FILE --verify-only checks the image and prints its id, starting nothing.",
        "set +x",
        "set -euo pipefail",
        "umask 077",
        f"image={q(image)}",
        f"compose=(docker compose -f {COMPOSE_FILE})",
        'fail() { echo "modelforge: $*" >&2; exit 1; }',
        'expect() { [ "$3" = "$2" ] || fail "the image does not match: $1 is \'$3\', expected \'$2\'"; }',
        'inspect() { docker image inspect --format "$1" "$image"; }',
        'expect_running() { [ "$3" = "$2" ] || { "${compose[@]}" down; fail "the container does '
        "not run as its image says: $1 is '$3', expected '$2'; stopped it\"; }; }",
        *obtain,
        "image_id=$(inspect '{{.Id}}')",
        'echo "verified $image (local image id $image_id)"',
        'if [ "${1:-}" = --verify-only ]; then exit 0; fi',
        f"[ -f {ENV_FILE} ] || fail 'run this beside {ENV_FILE} and {COMPOSE_FILE}'",
        "tok_file=$(mktemp)",
        "trap 'rm -f \"$tok_file\"' EXIT",
        "trap 'rm -f \"$tok_file\"; exit 130' INT",
        "trap 'rm -f \"$tok_file\"; exit 143' TERM",
        "trap 'rm -f \"$tok_file\"; exit 129' HUP",
        "IFS= read -rsp 'Enrollment token: ' tok; echo >&2",
        f"[[ $tok =~ {TOKEN_PATTERN} ]] || fail 'that is not an enrollment token (mfe_...)'",
        'printf \'MODELFORGE_AGENT_ENROLLMENT_TOKEN=%s\\n\' "$tok" > "$tok_file"; unset tok',
        'MODELFORGE_NODE_AGENT_TOKEN_FILE="$tok_file" "${compose[@]}" up -d --no-build '
        f"--pull never {SERVICE}",
        'rm -f "$tok_file"',
        f'container=$("${{compose[@]}}" ps -q {SERVICE})',
        "running=$(docker inspect --format '{{.Image}}' \"$container\")",
        'if [ "$running" != "$image_id" ]; then',
        '    "${compose[@]}" down',
        '    fail "the container ran $running, not the verified $image_id: stopped it"',
        "fi",
        *(_container_lines(entry) if entry is not None else []),
        'echo "node agent started from $image ($image_id)"',
    ]
    return "\n".join(body) + "\n"
