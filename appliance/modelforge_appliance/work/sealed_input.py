"""The secret fields of a work item's input: sealed at submit, masked in every answer, opened
only for the lease that hands the item to a node (docs/work.md, "Secrets").

Every value of a ``container`` item's ``env`` is a secret (that is where an ``HF_TOKEN``
goes); its names are not. Each value is sealed on its own (core/sealing.py), bound to the
item's id, the field and the name, so the stored input keeps its shape and shows which
names it has, and a value moved to another item or name fails to open.
"""

from __future__ import annotations

import json
from typing import Any

from ..core.sealing import SealedValueUnreadable, WorkKeys, is_sealed
from ..store.database import Store
from ..store.tables import WorkItem

# Per capability: the input fields that map names to secret values.
SECRET_FIELDS: dict[str, tuple[str, ...]] = {"container": ("env",)}
# What an answer shows in place of a secret value, whatever it is.
MASK = "<sealed>"


class SealedInputUnreadable(Exception):
    """An item's sealed input does not open: ``field`` names the value (input.env.NAME)."""

    def __init__(self, field: str, reason: SealedValueUnreadable) -> None:
        super().__init__(f"{field} does not open: {reason}")
        self.field = field
        self.key_id = reason.key_id


def _context(work_id: str, field: str, name: str) -> str:
    return f"work-item:{work_id}:input.{field}.{name}"


def _secret_maps(capability: str, given: dict[str, Any]):
    for field in SECRET_FIELDS.get(capability, ()):
        values = given.get(field)
        if isinstance(values, dict) and values:
            yield field, values


def seal_input(
    capability: str, given: dict[str, Any], work_id: str, keys: WorkKeys
) -> dict[str, Any]:
    """The input as it is stored: every secret value sealed for this item, field and name."""
    sealed = dict(given)
    for field, values in _secret_maps(capability, given):
        sealed[field] = {
            name: keys.seal(value, _context(work_id, field, name)) for name, value in values.items()
        }
    return sealed


def has_secrets(capability: str, given: dict[str, Any]) -> bool:
    return any(True for _ in _secret_maps(capability, given))


def masked_input(capability: str, stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """The input as answers show it: the names of secret fields, never a value."""
    if not stored:
        return stored
    shown = dict(stored)
    for field, values in _secret_maps(capability, stored):
        shown[field] = dict.fromkeys(values, MASK)
    return shown


def open_input(
    capability: str, stored: dict[str, Any], work_id: str, keys: WorkKeys
) -> dict[str, Any]:
    """The input as the leasing node gets it, every secret in clear; SealedInputUnreadable
    when one does not open for this item. A value stored by a release before sealing (not
    sealed) goes as it is."""
    opened = dict(stored)
    for field, values in _secret_maps(capability, stored):
        clear = {}
        for name, value in values.items():
            if not is_sealed(value):
                clear[name] = value
                continue
            try:
                clear[name] = keys.open(value, _context(work_id, field, name))
            except SealedValueUnreadable as exc:
                raise SealedInputUnreadable(f"input.{field}.{name}", exc) from None
        opened[field] = clear
    return opened


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def seal_stored_in_clear(store: Store, keys: WorkKeys) -> int:
    """Seal the secret values a release before sealing stored in clear; how many items.

    Run when ``serve`` starts. Each row is changed only while it still holds what was read,
    so a concurrent change is never overwritten. On SQLite the file is then rewritten
    (VACUUM) and the WAL emptied, so the clear values' old pages do not linger in them;
    copies made before (backups, a PostgreSQL server's dead rows until it vacuums) still
    hold them.
    """
    query = WorkItem.select(WorkItem.work_id, WorkItem.capability, WorkItem.input).where(
        WorkItem.capability.in_(sorted(SECRET_FIELDS))
    )
    with store.connection():
        rows = list(query.tuples())
    changes = []
    for work_id, capability, text in rows:
        stored = json.loads(text) if text else {}
        clear = {
            field: {name: value for name, value in values.items() if not is_sealed(value)}
            for field, values in _secret_maps(capability, stored)
        }
        if not any(clear.values()):
            continue
        sealed = dict(stored)
        for field, values in clear.items():
            sealed[field] = {
                **stored[field],
                **{n: keys.seal(v, _context(work_id, field, n)) for n, v in values.items()},
            }
        changes.append((_dump(sealed), work_id, text))
    if not changes:
        return 0
    update = "UPDATE work_item SET input = ? WHERE work_id = ? AND input = ?"
    changed = 0
    with store.write():
        for change in changes:
            changed += store.db.execute_sql(update.replace("?", store.db.param), change).rowcount
    if store.is_sqlite:
        with store.connection():
            store.db.execute_sql("VACUUM")
            store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    return changed
