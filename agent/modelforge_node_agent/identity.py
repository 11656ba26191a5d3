"""The node's persisted identity: identity id and secret, node id and credential.

Invariant 6: the identity is generated on first start and written
to the state volume *before* enrolling, so a re-enrollment with a fresh token
lands on the same node. The file is replaced atomically (temp file, fsync,
rename) with mode 0600. A file that cannot be read or parsed stops the agent:
silently minting a new identity would create a duplicate node.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from modelforge_contract import KIND_CREDENTIAL, KIND_IDENTITY, split_secret
from modelforge_contract.files import write_atomically

from .client import checked_node_id

log = logging.getLogger(__name__)

STATE_FILE_NAME = "identity.json"
STATE_FORMAT = 1


class StateError(Exception):
    """The state volume or the identity file is unusable; the CLI exits 2."""


@dataclass(frozen=True)
class NodeState:
    identity_id: str
    identity_secret: str
    node_id: str | None = None
    credential: str | None = None
    # The error code the control plane refused the credential with (CREDENTIAL_REVOKED…);
    # kept so a restart without a fresh token stops at once instead of calling again.
    credential_refused: str | None = None
    # The lookup id (not secret) of the enrollment token this node last enrolled with, so a
    # spent token left in the settings is told apart from a fresh one held in reserve.
    enrollment_id: str | None = None

    def __repr__(self) -> str:
        return f"NodeState(identity_id={self.identity_id!r}, node_id={self.node_id!r})"

    @property
    def enrolled(self) -> bool:
        return bool(self.node_id and self.credential and not self.credential_refused)

    def identity(self) -> dict[str, str]:
        return {"identity_id": self.identity_id, "identity_secret": self.identity_secret}

    def with_enrollment(
        self, node_id: str, credential: str, enrollment_id: str | None = None
    ) -> NodeState:
        return replace(
            self,
            node_id=node_id,
            credential=credential,
            credential_refused=None,
            enrollment_id=enrollment_id,
        )

    def with_refusal(self, code: str) -> NodeState:
        return replace(self, credential_refused=code)


def new_identity() -> NodeState:
    identity_id = secrets.token_hex(8)
    return NodeState(identity_id, f"{KIND_IDENTITY}_{identity_id}_{secrets.token_urlsafe(32)}")


def state_path(state_volume: Path) -> Path:
    return state_volume / STATE_FILE_NAME


def _corrupt(path: Path, why: str) -> StateError:
    return StateError(
        f"{path} is unreadable ({why}). The agent will not invent a new identity: restore "
        "the file from the state volume's backup, or delete it to enroll this host as a NEW "
        "node with a fresh enrollment token"
    )


def load_state(state_volume: Path) -> NodeState | None:
    """The stored state, None when there is none yet, or StateError."""
    path = state_path(state_volume)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _corrupt(path, exc.strerror or type(exc).__name__) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _corrupt(path, "not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
        raise _corrupt(path, f"not a format {STATE_FORMAT} identity file")
    fields = {key: data.get(key) for key in NodeState.__dataclass_fields__}
    if any(value is not None and not isinstance(value, str) for value in fields.values()):
        raise _corrupt(path, "a field is not a string")
    identity_id, identity_secret = fields["identity_id"], fields["identity_secret"]
    parsed = split_secret(identity_secret or "", KIND_IDENTITY)
    if not identity_id or parsed is None or parsed[0] != identity_id:
        raise _corrupt(path, "the identity secret does not match the identity id")
    if fields["credential"] and split_secret(fields["credential"], KIND_CREDENTIAL) is None:
        raise _corrupt(path, "the stored credential is malformed")
    if bool(fields["node_id"]) != bool(fields["credential"]):
        raise _corrupt(path, "it has a node id without a credential or the reverse")
    if fields["node_id"] and checked_node_id(fields["node_id"]) is None:
        raise _corrupt(path, "the stored node id is malformed")
    return NodeState(**fields)


def save_state(state_volume: Path, state: NodeState) -> None:
    """Replace the identity file atomically: a crash leaves the old file or the new one."""
    path = state_path(state_volume)
    document = json.dumps({"format": STATE_FORMAT, **asdict(state)}, indent=2)
    try:
        state_volume.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(path, document, mode=0o600)
    except OSError as exc:
        raise StateError(
            f"cannot write {path} ({exc.strerror}); MODELFORGE_AGENT_STATE_VOLUME must be a "
            "writable, durable directory"
        ) from None
