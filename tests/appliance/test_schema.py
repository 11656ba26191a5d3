"""The frozen migrations and the peewee models describe the same schema, on both stores."""

from __future__ import annotations

import peewee as pw

from modelforge_appliance.core.clock import Clock
from modelforge_appliance.store import tables
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.migrations import MIGRATIONS

MODELS = [
    tables.AdminToken,
    tables.Node,
    tables.EnrollmentToken,
    tables.Credential,
    tables.AuditEvent,
    tables.DecommissionConfirmation,
    tables.Finality,
    tables.AdminPassword,
    tables.ConsoleSession,
    tables.SignInThrottle,
    tables.GpuSample,
    tables.TelemetryFlood,
    tables.WorkItem,
    tables.WorkLease,
    tables.ApiKey,
]


def test_migrated_tables_match_the_models(database_url):
    store = Store(database_url, Clock())
    try:
        assert store.migrate() == [m.version for m in MIGRATIONS]
        db = store.db
        for model in MODELS:
            table = model._meta.table_name
            columns = {c.name: c for c in db.get_columns(table)}
            fields = {f.column_name: f for f in model._meta.sorted_fields}
            assert set(columns) == set(fields), table
            for name, field in fields.items():
                assert columns[name].null == field.null, f"{table}.{name} nullability"
            key = model._meta.primary_key
            key_columns = (
                set(key.field_names) if isinstance(key, pw.CompositeKey) else {key.column_name}
            )
            assert {c.name for c in columns.values() if c.primary_key} == key_columns, table
            for field in fields.values():
                if isinstance(field, pw.ForeignKeyField):
                    keys = {(k.column, k.dest_table) for k in db.get_foreign_keys(table)}
                    assert (field.column_name, field.rel_model._meta.table_name) in keys
            unique = {tuple(i.columns) for i in db.get_indexes(table) if i.unique}
            for field in fields.values():
                if field.unique:
                    assert (field.column_name,) in unique, f"{table}.{field.column_name}"
    finally:
        store.close()


def test_migrations_are_numbered_one_after_another():
    """Merged branches renumber their provisional migrations: no gap, no repeat."""
    assert [m.version for m in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
