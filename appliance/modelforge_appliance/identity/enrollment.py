"""Single-use enrollment tokens: minting, listing, revoking and the atomic claim."""

from __future__ import annotations

import hmac
import uuid
from dataclasses import dataclass
from typing import Any

import peewee as pw

from modelforge_contract import (
    AGENT_PYZ_PATH,
    ENROLLMENT_NOT_REVOCABLE,
    ENROLLMENT_ORIGIN_MISMATCH,
    ENROLLMENT_TOKEN_CONSUMED,
    ENROLLMENT_TOKEN_EXPIRED,
    ENROLLMENT_TOKEN_INVALID,
    ENROLLMENT_TOKEN_REVOKED,
    FIELD_FORMAT,
    IDENTITY_CONFLICT,
    IDENTITY_SECRET_MISMATCH,
    KIND_ENROLLMENT,
    KIND_IDENTITY,
    NODE_DECOMMISSIONED,
)

from ..core import tokens
from ..core.clock import isoformat
from ..core.errors import ApiError, Conflict, Forbidden, Gone, Invalid, NotFound, Unauthorized
from ..store import audit, finality
from ..store.database import Store
from ..store.tables import EnrollmentToken, Node
from . import credentials
from .join_commands import (
    AGENT_PYZ_INTERPRETER,
    checkout_worker_command,
    command_titles,
    join_commands,
    origin_warnings,
)

# What the env file and join commands say when the minting side does not choose: fail
# closed on a GPU fleet (invariant 9); `--accelerator cpu|auto` changes it.
DEFAULT_ACCELERATOR_MODE = "nvidia"

_MINT_AGAIN = (
    "Mint a fresh enrollment token (`modelforge enroll --name NAME --expires 15m`, or "
    "POST /api/v1/admin/node-enrollments)."
)


def enrollment_state(row: EnrollmentToken, now: float) -> str:
    if row.consumed_at is not None:
        return "consumed"
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at <= now:
        return "expired"
    return "pending"


def enrollment_view(row: EnrollmentToken, now: float) -> dict[str, Any]:
    return {
        "enrollment_id": row.enrollment_id,
        "display_name": row.display_name,
        "state": enrollment_state(row, now),
        "api_origin": row.api_origin,
        "created_by": row.created_by,
        "created_at": isoformat(row.created_at),
        "expires_at": isoformat(row.expires_at),
        "consumed_at": isoformat(row.consumed_at),
        "revoked_at": isoformat(row.revoked_at),
        "node_id": row.node_id,
        "production_eligible": False,
    }


# Where the agent started by START_COMMAND finds its Runtime Worker, and where
# WORKER_COMMAND puts it: the default of both (a test keeps the three equal).
WORKER_SOCKET = "/run/modelforge/worker.sock"


def agent_env_file(api_origin: str, accelerator_mode: str = DEFAULT_ACCELERATOR_MODE) -> str:
    """The non-secret agent settings; the token is entered separately, never written here.

    The host name is left to the machine: two nodes minted with one display name must not
    claim one hostname. The generated Compose file sets its own worker socket over this one.
    """
    return (
        "# ModelForge Node Agent settings (no secrets: the enrollment token is read at start)\n"
        f"MODELFORGE_AGENT_CONTROL_PLANE_URL={api_origin}\n"
        f"MODELFORGE_AGENT_ACCELERATOR_MODE={accelerator_mode}\n"
        "MODELFORGE_AGENT_TLS_VERIFY=true\n"
        "MODELFORGE_AGENT_IDENTITY_MODE=persisted\n"
        "MODELFORGE_AGENT_STATE_VOLUME=/var/lib/modelforge-node-agent\n"
        f"MODELFORGE_AGENT_WORKER_SOCKET={WORKER_SOCKET}\n"
        "# MODELFORGE_AGENT_HOSTNAME=  (unset: the machine's own host name)\n"
    )


# The start command for Bash (agent pyz under systemd's user, or a checkout). Tracing is
# turned off first; the agent is found the way each documented install has it (a
# checkout's .venv, the command on PATH, the agent pyz) before anything is asked; the token
# is read without echo, checked for its shape (so nothing else is ever sourced), written to
# a mode-0600 temporary env file that is removed before the agent starts, and on any exit,
# error or signal; it never reaches argv or shell history.
# tests/appliance/test_start_command.py runs it with real bash.
_CHECKOUT_AGENT = ".venv/bin/modelforge-node-agent"
_AGENT_PYZ = f"{AGENT_PYZ_INTERPRETER} {AGENT_PYZ_PATH}"
_FIND_AGENT = (
    f"if [ -x {_CHECKOUT_AGENT} ]; then agent=({_CHECKOUT_AGENT}); "
    "elif command -v modelforge-node-agent >/dev/null 2>&1; then agent=(modelforge-node-agent); "
    f"elif [ -f {AGENT_PYZ_PATH} ] && [ -x {AGENT_PYZ_INTERPRETER} ]; then agent=({_AGENT_PYZ}); "
    f'else echo "modelforge: no node agent found: looked for {_CHECKOUT_AGENT} (run from the '
    f"root of a checkout), modelforge-node-agent on PATH and {AGENT_PYZ_PATH} (the agent pyz, "
    f'run by {AGENT_PYZ_INTERPRETER}); install one (docs/node-agent.md)" >&2; exit 127; fi'
)
# A node that has enrolled keeps its identity in the env file's state volume: run again (a
# restart, a reboot), the command starts its agent as it is, asking no token it no longer has.
_ENROLLED_ALREADY = (
    'state=$(set -a; . ./modelforge-node.env; printf %s "${MODELFORGE_AGENT_STATE_VOLUME:-}")',
    'if [ -n "$state" ] && [ -f "$state/identity.json" ]; then echo "modelforge: this node '
    'is enrolled already ($state/identity.json): starting its agent, no token needed" >&2; '
    'set -a; . ./modelforge-node.env; set +a; unset state; exec "${agent[@]}"; fi',
    "unset state",
)
_START_STEPS = (
    "set +x",
    "umask 077",
    '[ -f ./modelforge-node.env ] || { echo "modelforge: run this in the directory that '
    'holds modelforge-node.env" >&2; exit 2; }',
    _FIND_AGENT,
    *_ENROLLED_ALREADY,
    "tok_file=$(mktemp) || exit 1",
    'trap "rm -f \\"$tok_file\\"" EXIT',
    'trap "rm -f \\"$tok_file\\"; exit 130" INT',
    'trap "rm -f \\"$tok_file\\"; exit 143" TERM',
    'trap "rm -f \\"$tok_file\\"; exit 129" HUP',
    'IFS= read -rsp "Enrollment token: " tok',
    "echo >&2",
    "[[ $tok =~ ^mfe_[0-9a-f]{8,32}_[A-Za-z0-9_-]{20,}$ ]] || { unset tok; echo "
    '"modelforge: that is not an enrollment token (mfe_...)" >&2; exit 2; }',
    'printf "MODELFORGE_AGENT_ENROLLMENT_TOKEN=%s\\n" "$tok" > "$tok_file"',
    "unset tok",
    "set -a",
    ". ./modelforge-node.env",
    '. "$tok_file"',
    "set +a",
    'rm -f "$tok_file"',
    'exec "${agent[@]}"',
)
START_COMMAND = "bash -c '" + "; ".join(_START_STEPS) + "'"

_CHECKOUT_WORKER = ".venv/bin/modelforge-runtime-worker"


def worker_command(accelerator_mode: str) -> str:
    """The Runtime Worker for START_COMMAND's agent, for Bash, run in the same directory:
    found like the agent (a checkout's .venv, or on PATH), on the socket the env file names
    for the agent (MODELFORGE_AGENT_WORKER_SOCKET, edited or not), else the default."""
    steps = (
        f"if [ -x {_CHECKOUT_WORKER} ]; then worker={_CHECKOUT_WORKER}; "
        "elif command -v modelforge-runtime-worker >/dev/null 2>&1; then "
        "worker=modelforge-runtime-worker; "
        f'else echo "modelforge: no runtime worker found: looked for {_CHECKOUT_WORKER} (run '
        "from the root of a checkout) and modelforge-runtime-worker on PATH; install one "
        '(docs/work.md)" >&2; exit 127; fi',
        "sock=; [ -f ./modelforge-node.env ] && sock=$(set -a; . ./modelforge-node.env; "
        'printf %s "${MODELFORGE_AGENT_WORKER_SOCKET:-}")',
        f'MODELFORGE_WORKER_SOCKET="${{sock:-{WORKER_SOCKET}}}" '
        f'MODELFORGE_WORKER_ACCELERATOR_MODE={accelerator_mode} exec "$worker"',
    )
    return "bash -c '" + "; ".join(steps) + "'"


@dataclass(frozen=True)
class MintedEnrollment:
    row: EnrollmentToken
    token: str
    accelerator_mode: str = DEFAULT_ACCELERATOR_MODE

    def response(self, now: float) -> dict[str, Any]:
        """The one and only answer that carries the token."""
        return {
            **enrollment_view(self.row, now),
            "token": self.token,
            "accelerator_mode": self.accelerator_mode,
            "env_file": agent_env_file(self.row.api_origin, self.accelerator_mode),
            "env_file_name": "modelforge-node.env",
            "start_command": START_COMMAND,
            "worker_command": worker_command(self.accelerator_mode),
            "join_commands": join_commands(self.row.api_origin, self.accelerator_mode),
            "join_worker_commands": {"checkout": checkout_worker_command(self.accelerator_mode)},
            "command_titles": command_titles(),
            "warnings": origin_warnings(self.row.api_origin),
        }


def mint_enrollment_token(
    store: Store,
    *,
    display_name: str,
    expires_in_seconds: int,
    api_origin: str,
    actor: str,
    accelerator_mode: str = DEFAULT_ACCELERATOR_MODE,
) -> MintedEnrollment:
    enrollment_id, token = tokens.mint_secret(KIND_ENROLLMENT)
    now = store.clock.now()
    with store.write():
        row = EnrollmentToken.create(
            enrollment_id=enrollment_id,
            display_name=display_name,
            digest=tokens.digest(token),
            api_origin=api_origin,
            created_by=actor,
            created_at=now,
            expires_at=now + expires_in_seconds,
        )
        audit.record(
            store,
            actor,
            "enrollment.minted",
            enrollment_id=enrollment_id,
            display_name=display_name,
            api_origin=api_origin,
            expires_in_seconds=expires_in_seconds,
        )
    return MintedEnrollment(row, token, accelerator_mode)


def list_enrollments(store: Store) -> list[dict[str, Any]]:
    with store.connection():
        rows = list(EnrollmentToken.select().order_by(EnrollmentToken.created_at.desc()))
    now = store.clock.now()
    return [enrollment_view(row, now) for row in rows]


def revoke_enrollment(store: Store, enrollment_id: str, actor: str) -> dict[str, Any]:
    """Revoke an unused token; a consumed one is history and stays as it is."""
    now = store.clock.now()
    with store.write():
        # Conditional, like the claim: whichever commits first decides.
        revoked = (
            EnrollmentToken.update(revoked_at=now)
            .where(
                (EnrollmentToken.enrollment_id == enrollment_id)
                & EnrollmentToken.consumed_at.is_null()
                & EnrollmentToken.revoked_at.is_null()
            )
            .execute()
        )
        row = EnrollmentToken.get_or_none(EnrollmentToken.enrollment_id == enrollment_id)
        if row is None:
            raise NotFound(f"no enrollment {enrollment_id}")
        if row.consumed_at is not None:
            raise Conflict(
                "this enrollment token was already used; revoke the node's credential instead",
                code=ENROLLMENT_NOT_REVOCABLE,
                next_step="DELETE /api/v1/admin/hardware/nodes/{node_id}/credential",
            )
        if revoked:
            audit.record(store, actor, "enrollment.revoked", enrollment_id=enrollment_id)
    return enrollment_view(row, now)


@dataclass(frozen=True)
class EnrollRequest:
    token: str
    hostname: str
    agent_version: str
    accelerator_mode: str
    protocol_version: int
    request_origin: str
    identity_id: str | None = None
    identity_secret: str | None = None
    source_address: str | None = None


@dataclass(frozen=True)
class Enrolled:
    node: Node
    credential: str
    reenrolled: bool


def _refusal_for(row: EnrollmentToken, now: float) -> ApiError:
    state = enrollment_state(row, now)
    if state == "consumed":
        return Gone("this enrollment token was already used", code=ENROLLMENT_TOKEN_CONSUMED)
    if state == "revoked":
        return Gone("this enrollment token was revoked", code=ENROLLMENT_TOKEN_REVOKED)
    return Gone("this enrollment token has expired", code=ENROLLMENT_TOKEN_EXPIRED)


def claim_token(
    store: Store, request: EnrollRequest, refusals: audit.RefusalLog | None = None
) -> Enrolled:
    """Claim a token for a node; refusals are audited and leave nothing else behind.

    With ``refusals``, repeats of one refusal (a consumed token replayed) are counted and
    written once per window instead of one row each.
    """
    parsed = tokens.parse(request.token, KIND_ENROLLMENT)
    enrollment_id = parsed[0] if parsed else None
    try:
        return _claim(store, request, parsed)
    except ApiError as refusal:
        if refusal.code == ENROLLMENT_TOKEN_INVALID:
            # Anyone can send garbage: logged and counted, but not written to the store.
            raise
        what = {"enrollment_id": enrollment_id, "code": refusal.code}
        actor = f"enrollment:{enrollment_id}"
        if refusals is None:
            audit.record_alone(
                store, actor, "enrollment.refused", **what, hostname=request.hostname
            )
        else:
            key = (str(enrollment_id), refusal.code)
            refusals.record(key, actor, "enrollment.refused", **what, hostname=request.hostname)
        raise


def _claim(store: Store, request: EnrollRequest, parsed: tuple[str, str] | None) -> Enrolled:
    invalid = Unauthorized(
        "the enrollment token is unknown or malformed",
        code=ENROLLMENT_TOKEN_INVALID,
        next_step=_MINT_AGAIN,
    )
    if parsed is None:
        raise invalid
    enrollment_id, token = parsed
    with store.connection():
        row = EnrollmentToken.get_or_none(EnrollmentToken.enrollment_id == enrollment_id)
    if row is None or not tokens.digest_matches(token, row.digest):
        raise invalid
    if row.api_origin != request.request_origin:
        # Both origins, also as fields: only a holder of the valid token gets this far.
        raise Forbidden(
            f"this token is locked to {row.api_origin}; the request arrived for "
            f"{request.request_origin}",
            code=ENROLLMENT_ORIGIN_MISMATCH,
            next_step=f"Set MODELFORGE_AGENT_CONTROL_PLANE_URL={row.api_origin} (the origin the "
            "token is locked to), or mint a token for the address this agent uses.",
            extra={"api_origin": row.api_origin, "request_origin": request.request_origin},
        )
    identity_digest = _identity_digest(request)
    actor = f"enrollment:{enrollment_id}"
    try:
        with store.write():
            node = _known_node(store, request, identity_digest)
            now = store.clock.now()
            # Invariant 2: the row count of this conditional update decides the winner.
            claimed = (
                EnrollmentToken.update(consumed_at=now)
                .where(
                    (EnrollmentToken.enrollment_id == enrollment_id)
                    & EnrollmentToken.consumed_at.is_null()
                    & EnrollmentToken.revoked_at.is_null()
                    & (EnrollmentToken.expires_at > now)
                )
                .execute()
            )
            if claimed != 1:
                raise _refusal_for(EnrollmentToken.get_by_id(enrollment_id), now)
            reenrolled = node is not None
            if node is None:
                node = Node.create(
                    node_id=str(uuid.uuid4()),
                    display_name=row.display_name,
                    hostname=request.hostname,
                    identity_id=request.identity_id,
                    identity_digest=identity_digest,
                    accelerator_mode=request.accelerator_mode,
                    agent_version=request.agent_version,
                    protocol_version=request.protocol_version,
                    created_at=now,
                    enrolled_at=now,
                    source_address=(request.source_address or "")[:64] or None,
                )
            else:
                credentials.revoke_active_credentials(store, node, actor, "re-enrolled")
                node.hostname = request.hostname
                node.accelerator_mode = request.accelerator_mode
                node.agent_version = request.agent_version
                node.protocol_version = request.protocol_version
                node.enrolled_at = now
                node.source_address = (request.source_address or "")[:64] or node.source_address
                node.save()
            EnrollmentToken.update(node=node).where(
                EnrollmentToken.enrollment_id == enrollment_id
            ).execute()
            audit.record(
                store,
                actor,
                "enrollment.reenrolled" if reenrolled else "enrollment.claimed",
                node_id=node.node_id,
                enrollment_id=enrollment_id,
                hostname=request.hostname,
            )
            secret = credentials.issue_credential(store, node, actor)
    except pw.IntegrityError:
        raise Conflict(
            "another enrollment for this identity is in progress",
            code=IDENTITY_CONFLICT,
            next_step="Retry the enrollment with a fresh token.",
        ) from None
    return Enrolled(node=node, credential=secret, reenrolled=reenrolled)


def _identity_digest(request: EnrollRequest) -> str | None:
    if request.identity_id is None:
        return None
    parsed = tokens.parse(request.identity_secret, KIND_IDENTITY)
    # Exactly as sent: the digest stored at the first enrollment is compared with the one of
    # every later one, so a secret that only matches after trimming would enroll once and
    # never again.
    if parsed is None or parsed[0] != request.identity_id or parsed[1] != request.identity_secret:
        raise Invalid(
            "identity.identity_secret is not a well-formed secret for identity.identity_id "
            "(exactly, without surrounding spaces)",
            code=FIELD_FORMAT,
            next_step="Let the node agent generate its identity; do not edit the state file.",
        )
    return tokens.digest(parsed[1])


def _known_node(store: Store, request: EnrollRequest, identity_digest: str | None) -> Node | None:
    """The node this identity already owns (locked for update where the store can)."""
    if request.identity_id is None:
        return None
    query = Node.select().where(Node.identity_id == request.identity_id)
    if not store.is_sqlite:
        query = query.for_update()
    node = query.first()
    if node is None:
        # A restore can bring back a store without this node; its retirement stays final.
        if finality.identity_retired(request.identity_id):
            raise _identity_decommissioned()
        return None
    if not hmac.compare_digest(identity_digest or "", node.identity_digest or ""):
        raise Forbidden(
            "this identity id is enrolled with a different identity secret",
            code=IDENTITY_SECRET_MISMATCH,
            next_step="Restore the agent's state volume, or delete its identity file to enroll "
            "as a new node (then decommission the old one).",
        )
    if node.decommissioned_at is not None:
        raise _identity_decommissioned()
    return node


def _identity_decommissioned() -> Forbidden:
    return Forbidden(
        "this identity belongs to a decommissioned node",
        code=NODE_DECOMMISSIONED,
        next_step="Delete the agent's identity file to enroll the hardware as a new node.",
    )
