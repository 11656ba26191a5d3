"""A store as an earlier release left it: exactly the schema of its migrations, rows kept.

Tests of "a backup (or dump) from before migration N" must not keep what later migrations
added: a real one has none of it, and what survives (the console's tables, a later column)
hides bugs such as a restore that migrates onto leftovers. ``downgrade`` compares the store
with a reference migrated to the older version only, and drops every table, column, index,
trigger and function that the reference does not have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import peewee as pw

from modelforge_appliance.store import tables
from modelforge_appliance.store.migrations import MIGRATIONS

from .control_plane import fresh_postgres_database


@dataclass(frozen=True)
class Schema:
    columns: dict[str, frozenset[str]]  # table: columns
    indexes: frozenset[str]
    routines: frozenset[str]  # SQLite triggers; PostgreSQL functions (their triggers go too)


def schema_of(db: pw.Database) -> Schema:
    tables = db.get_tables()
    columns = {table: frozenset(c.name for c in db.get_columns(table)) for table in tables}
    indexes = frozenset(i.name for table in tables for i in db.get_indexes(table))
    if isinstance(db, pw.SqliteDatabase):
        sql = "SELECT name FROM sqlite_master WHERE type = 'trigger'"
    else:
        sql = (
            "SELECT p.proname FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = "
            "p.pronamespace WHERE n.nspname = 'public'"
        )
    routines = frozenset(name for (name,) in db.execute_sql(sql).fetchall())
    return Schema(columns, indexes, routines)


def migrate_to(db: pw.Database, version: int) -> None:
    """Apply the migrations up to ``version`` to an empty database, as that release did."""
    with db.bind_ctx([tables.SchemaVersion]), db.atomic():
        db.create_tables([tables.SchemaVersion])
        for migration in MIGRATIONS[:version]:
            migration.apply(db)
            tables.SchemaVersion.create(
                version=migration.version, name=migration.name, applied_at=0
            )


@contextlib.contextmanager
def _reference(kind_of: pw.Database) -> Iterator[pw.Database]:
    if isinstance(kind_of, pw.SqliteDatabase):
        db = pw.SqliteDatabase(":memory:")
        try:
            yield db
        finally:
            db.close()
        return
    with fresh_postgres_database() as url:
        from modelforge_appliance.store.database import open_database

        db = open_database(url)
        try:
            yield db
        finally:
            db.close()


def schema_at(kind_of: pw.Database, version: int) -> Schema:
    """The schema a store of ``kind_of``'s kind had at ``version``."""
    with _reference(kind_of) as reference:
        migrate_to(reference, version)
        return schema_of(reference)


def downgrade(db: pw.Database, version: int) -> None:
    """Turn the store in ``db`` into what the release at ``version`` left, keeping its rows."""
    old = schema_at(db, version)
    now = schema_of(db)
    sqlite = isinstance(db, pw.SqliteDatabase)
    with db.bind_ctx([tables.SchemaVersion]), db.atomic():
        for routine in sorted(now.routines - old.routines):
            if sqlite:
                db.execute_sql(f'DROP TRIGGER "{routine}"')
            else:
                db.execute_sql(f'DROP FUNCTION "{routine}"() CASCADE')
        for table in sorted(set(now.columns) - set(old.columns)):
            db.execute_sql(f'DROP TABLE "{table}"' + ("" if sqlite else " CASCADE"))
        for index in sorted(schema_of(db).indexes - old.indexes):
            db.execute_sql(f'DROP INDEX "{index}"')
        for table, columns in old.columns.items():
            for column in sorted(now.columns[table] - columns):
                db.execute_sql(f'ALTER TABLE "{table}" DROP COLUMN "{column}"')
        tables.SchemaVersion.delete().where(tables.SchemaVersion.version > version).execute()
    assert schema_of(db) == old, "the downgrade left something of a later release"
