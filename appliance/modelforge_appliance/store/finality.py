"""The finality record: every secret id that was ever revoked or spent, kept for good.

Invariant 5 says a revoked credential is refused forever, also after a restore. A backup
cannot know what happened after it was taken, so the store keeps a record that only grows:
the triggers of migration 3 add a row whenever a credential or admin token is revoked, an
enrollment token is used or revoked, a node is decommissioned (its identity retired with it)
or a decommission confirmation is used (and migration 13's when a client API key is revoked),
in the same transaction and whichever code or SQL
did it, and refuse to change or delete a row.

A restore reads the record of the store it replaces and carries it into the restored one
(``carry_into``): every entry the backup lacks is added, and every row the restored store
has that an entry names is made final again. The restored store's record is then the union
of both, so finality survives any sequence of restores, also when the backup has no row for
a revoked secret at all. For PostgreSQL the record travels as a file (``save``/``load``)
between ``modelforge save-finality`` and ``modelforge restore-finality``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import peewee as pw

from modelforge_contract.files import write_atomically

from .database import Store
from .tables import Finality

CREDENTIAL = "credential"
ADMIN_TOKEN = "admin_token"
ENROLLMENT_TOKEN = "enrollment_token"
NODE = "node"  # a decommissioned node
IDENTITY = "identity"  # the agent identity of a decommissioned node: it never enrolls again
CONFIRMATION = "decommission_confirmation"
API_KEY = "api_key"  # a client API key (migration 13)
KINDS = (CREDENTIAL, ADMIN_TOKEN, ENROLLMENT_TOKEN, NODE, IDENTITY, CONFIRMATION, API_KEY)

FILE_FORMAT = "modelforge-finality-record"
FILE_VERSION = 1


@dataclass(frozen=True)
class Entry:
    kind: str
    subject_id: str
    final_at: float
    reason: str | None = None


# What a store made final, read from its rows: for stores older than the record (schema
# version 2 and earlier), and as a second source beside the record for newer ones.
# Each query needs the table it names.
_FROM_ROWS = {
    "credential": "SELECT 'credential', credential_id, revoked_at, revoked_reason "
    "FROM credential WHERE revoked_at IS NOT NULL",
    "admin_token": "SELECT 'admin_token', token_id, revoked_at, NULL "
    "FROM admin_token WHERE revoked_at IS NOT NULL",
    "enrollment_token": "SELECT 'enrollment_token', enrollment_id, "
    "COALESCE(consumed_at, revoked_at), "
    "CASE WHEN consumed_at IS NOT NULL THEN 'used' ELSE 'revoked' END "
    "FROM enrollment_token WHERE consumed_at IS NOT NULL OR revoked_at IS NOT NULL",
    "node": "SELECT 'node', node_id, decommissioned_at, 'decommissioned' "
    "FROM node WHERE decommissioned_at IS NOT NULL "
    "UNION ALL SELECT 'identity', identity_id, decommissioned_at, 'decommissioned' "
    "FROM node WHERE decommissioned_at IS NOT NULL AND identity_id IS NOT NULL",
    "decommission_confirmation": "SELECT 'decommission_confirmation', confirmation_id, "
    "used_at, 'used' FROM decommission_confirmation WHERE used_at IS NOT NULL",
    "api_key": "SELECT 'api_key', key_id, revoked_at, revoked_by "
    "FROM api_key WHERE revoked_at IS NOT NULL",
    "finality": "SELECT kind, subject_id, final_at, reason FROM finality",
}


def read(query: Callable[[str], Iterable[tuple]], tables: Iterable[str]) -> list[Entry]:
    """Every entry a store holds, in its record or its rows; query runs one SELECT."""
    present = set(tables)
    entries: dict[tuple[str, str], Entry] = {}
    for table, select in _FROM_ROWS.items():
        if table not in present:
            continue
        for kind, subject_id, final_at, reason in query(select):
            if kind in KINDS and subject_id is not None and final_at is not None:
                entries.setdefault(
                    (kind, str(subject_id)), Entry(kind, str(subject_id), float(final_at), reason)
                )
    return sorted(entries.values(), key=lambda e: (e.kind, e.subject_id))


def read_store(store: Store) -> list[Entry]:
    with store.connection():
        return read(lambda sql: store.db.execute_sql(sql).fetchall(), store.db.get_tables())


# Make final again every row an entry of the record names (each set-based, one statement).
_MAKE_FINAL = {
    "credentials": (
        "UPDATE credential SET revoked_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'credential' AND f.subject_id = credential.credential_id), "
        "revoked_reason = COALESCE((SELECT f.reason FROM finality f WHERE f.kind = "
        "'credential' AND f.subject_id = credential.credential_id), 'revoked before restore') "
        "WHERE revoked_at IS NULL AND credential_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'credential')",
    ),
    "admin_tokens": (
        "UPDATE admin_token SET revoked_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'admin_token' AND f.subject_id = admin_token.token_id) "
        "WHERE revoked_at IS NULL AND token_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'admin_token')",
    ),
    # A token used or revoked elsewhere in history can never be claimed again.
    "enrollment_tokens": (
        "UPDATE enrollment_token SET revoked_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'enrollment_token' AND f.subject_id = enrollment_token.enrollment_id) "
        "WHERE consumed_at IS NULL AND revoked_at IS NULL AND enrollment_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'enrollment_token')",
    ),
    "decommissioned_nodes": (
        "UPDATE node SET decommissioned_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'node' AND f.subject_id = node.node_id), cordoned = TRUE "
        "WHERE decommissioned_at IS NULL AND node_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'node')",
        "UPDATE node SET decommissioned_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'identity' AND f.subject_id = node.identity_id), cordoned = TRUE "
        "WHERE decommissioned_at IS NULL AND identity_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'identity')",
    ),
    "decommission_confirmations": (
        "UPDATE decommission_confirmation SET used_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'decommission_confirmation' "
        "AND f.subject_id = decommission_confirmation.confirmation_id) "
        "WHERE used_at IS NULL AND confirmation_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'decommission_confirmation')",
    ),
    "api_keys": (
        "UPDATE api_key SET revoked_at = (SELECT f.final_at FROM finality f "
        "WHERE f.kind = 'api_key' AND f.subject_id = api_key.key_id), "
        "revoked_by = COALESCE((SELECT f.reason FROM finality f WHERE f.kind = 'api_key' "
        "AND f.subject_id = api_key.key_id), 'revoked before restore') "
        "WHERE revoked_at IS NULL AND key_id IN "
        "(SELECT subject_id FROM finality WHERE kind = 'api_key')",
    ),
}


@dataclass(frozen=True)
class Carried:
    """What carry_into did: rows made final again per kind, and the record's growth."""

    made_final: dict[str, int]
    record_entries: int
    carried: int


def carry_into(store: Store, entries: Iterable[Entry]) -> Carried:
    """Add entries to store's record, then make final every row its record names.

    Call inside the caller's write transaction on a store migrated to this release.
    """
    before = Finality.select().count()
    rows = [asdict(entry) for entry in entries]
    for batch in pw.chunked(rows, 200):
        Finality.insert_many(batch).on_conflict_ignore().execute()
    after = Finality.select().count()
    made_final = {
        name: sum(store.db.execute_sql(sql).rowcount for sql in statements)
        for name, statements in _MAKE_FINAL.items()
    }
    return Carried(made_final=made_final, record_entries=after, carried=after - before)


def identity_retired(identity_id: str) -> bool:
    """Whether this agent identity belonged to a node that was decommissioned."""
    return (
        Finality.select()
        .where((Finality.kind == IDENTITY) & (Finality.subject_id == identity_id))
        .exists()
    )


def save(entries: list[Entry], path: Path, saved_at: float, source: str) -> None:
    """Write the record to path atomically, mode 0600 (ids and times only, never a secret)."""
    document = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "saved_at": saved_at,
        "source": source,
        "entries": [asdict(entry) for entry in entries],
    }
    write_atomically(path, json.dumps(document, indent=1))


class RecordFileError(Exception):
    """The file is not a finality record this program can read."""


def load(path: Path) -> list[Entry]:
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordFileError(f"{path} cannot be read as a finality record ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise RecordFileError(f"{path} is not a file written by `modelforge save-finality`")
    if document.get("version") != FILE_VERSION:
        raise RecordFileError(
            f"{path} is a finality record of version {document.get('version')!r}; this "
            f"program reads version {FILE_VERSION}: use the release that wrote it"
        )
    entries = []
    for item in document.get("entries", []):
        try:
            entry = Entry(
                kind=str(item["kind"]),
                subject_id=str(item["subject_id"]),
                final_at=float(item["final_at"]),
                reason=None if item.get("reason") is None else str(item["reason"])[:120],
            )
        except (KeyError, TypeError, ValueError):
            raise RecordFileError(f"{path} has a malformed entry: {item!r}") from None
        if entry.kind not in KINDS or not 1 <= len(entry.subject_id) <= 64:
            raise RecordFileError(f"{path} has an entry of unknown kind or id: {item!r}")
        entries.append(entry)
    return entries
