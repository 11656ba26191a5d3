"""The numbered schema migrations, frozen as SQL: append-only, never edited once released.

They are written out rather than derived from the models, so a later model change can
never alter what an old migration creates. ``tests/appliance/test_schema.py`` checks that
the migrated schema and the models agree, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass

import peewee as pw

# Column types that differ between the two stores.
_TYPES = {
    "sqlite": {"double": "REAL", "bool": "INTEGER", "serial": "INTEGER", "bigint": "INTEGER"},
    "postgresql": {
        "double": "DOUBLE PRECISION",
        "bool": "BOOLEAN",
        "serial": "SERIAL",
        "bigint": "BIGINT",
    },
}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]

    def apply(self, db: pw.Database) -> None:
        types = _TYPES["sqlite" if isinstance(db, pw.SqliteDatabase) else "postgresql"]
        for statement in self.statements:
            db.execute_sql(statement.format(**types))


_INITIAL = (
    'CREATE TABLE "admin_token" ("token_id" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"name" VARCHAR(120) NOT NULL, "digest" VARCHAR(64) NOT NULL, '
    '"created_at" {double} NOT NULL, "last_used_at" {double}, "revoked_at" {double})',
    'CREATE TABLE "node" ("node_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"display_name" VARCHAR(120) NOT NULL, "hostname" VARCHAR(253) NOT NULL, '
    '"identity_id" VARCHAR(32), "identity_digest" VARCHAR(64), '
    '"accelerator_mode" VARCHAR(16) NOT NULL, "agent_version" VARCHAR(64) NOT NULL, '
    '"protocol_version" INTEGER NOT NULL, "production_eligible" {bool} NOT NULL, '
    '"cordoned" {bool} NOT NULL, "created_at" {double} NOT NULL, '
    '"enrolled_at" {double} NOT NULL, "last_heartbeat_at" {double}, "health" TEXT, '
    '"inventory" TEXT, "inventory_at" {double}, "telemetry" TEXT, "telemetry_at" {double}, '
    '"decommissioned_at" {double})',
    'CREATE INDEX "node_hostname" ON "node" ("hostname")',
    'CREATE UNIQUE INDEX "node_identity_id" ON "node" ("identity_id")',
    'CREATE TABLE "enrollment_token" ("enrollment_id" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"display_name" VARCHAR(120) NOT NULL, "digest" VARCHAR(64) NOT NULL, '
    '"api_origin" VARCHAR(300) NOT NULL, "created_by" VARCHAR(80) NOT NULL, '
    '"created_at" {double} NOT NULL, "expires_at" {double} NOT NULL, "consumed_at" {double}, '
    '"revoked_at" {double}, "node_id" VARCHAR(40), '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "enrollment_token_node_id" ON "enrollment_token" ("node_id")',
    'CREATE TABLE "credential" ("credential_id" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"node_id" VARCHAR(40) NOT NULL, "digest" VARCHAR(64) NOT NULL, '
    '"created_at" {double} NOT NULL, "last_used_at" {double}, "revoked_at" {double}, '
    '"revoked_reason" VARCHAR(120), '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "credential_node_id" ON "credential" ("node_id")',
    'CREATE TABLE "audit_event" ("id" {serial} NOT NULL PRIMARY KEY, "at" {double} NOT NULL, '
    '"actor" VARCHAR(120) NOT NULL, "action" VARCHAR(80) NOT NULL, "node_id" VARCHAR(40), '
    '"detail" TEXT NOT NULL)',
    'CREATE INDEX "audit_event_action" ON "audit_event" ("action")',
    'CREATE INDEX "audit_event_node_id" ON "audit_event" ("node_id")',
)

_DECOMMISSION_CONFIRMATIONS = (
    'CREATE TABLE "decommission_confirmation" ('
    '"confirmation_id" VARCHAR(32) NOT NULL PRIMARY KEY, "node_id" VARCHAR(40) NOT NULL, '
    '"digest" VARCHAR(64) NOT NULL, "fingerprint" VARCHAR(64) NOT NULL, '
    '"created_by" VARCHAR(120) NOT NULL, "created_at" {double} NOT NULL, '
    '"expires_at" {double} NOT NULL, "used_at" {double}, '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "decommission_confirmation_node_id" ON "decommission_confirmation" ("node_id")',
)

# The work plane (issue 13): queued work, and every lease granted on it.
_WORK = (
    'CREATE TABLE "work_item" ("work_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"capability" VARCHAR(64) NOT NULL, "input" TEXT NOT NULL, "constraints" TEXT NOT NULL, '
    '"gpu_count" INTEGER NOT NULL, "min_gpu_memory_bytes" {bigint}, '
    '"gpu_name" VARCHAR(120), "node_ids" TEXT, "timeout_seconds" INTEGER NOT NULL, '
    '"max_attempts" INTEGER NOT NULL, "idempotency_key" VARCHAR(200), '
    '"state" VARCHAR(16) NOT NULL, "attempts" INTEGER NOT NULL, "node_id" VARCHAR(40), '
    '"lease_id" VARCHAR(40), "lease_expires_at" {double}, "created_by" VARCHAR(120) NOT NULL, '
    '"created_at" {double} NOT NULL, "started_at" {double}, "finished_at" {double}, '
    '"result" TEXT, "error" TEXT, "log_tail" TEXT, '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE UNIQUE INDEX "work_item_idempotency_key" ON "work_item" ("idempotency_key")',
    'CREATE INDEX "work_item_node_id" ON "work_item" ("node_id")',
    'CREATE INDEX "work_item_state_created_at" ON "work_item" ("state", "created_at")',
    'CREATE INDEX "work_item_state_lease_expires_at" ON "work_item" ("state", "lease_expires_at")',
    'CREATE TABLE "work_lease" ("lease_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"work_id" VARCHAR(40) NOT NULL, "node_id" VARCHAR(40) NOT NULL, '
    '"attempt" INTEGER NOT NULL, "granted_at" {double} NOT NULL, '
    '"expires_at" {double} NOT NULL, "ended_at" {double}, "end_reason" VARCHAR(32), '
    'FOREIGN KEY ("work_id") REFERENCES "work_item" ("work_id") ON DELETE RESTRICT, '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "work_lease_work_id" ON "work_lease" ("work_id")',
    'CREATE INDEX "work_lease_node_id" ON "work_lease" ("node_id")',
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial", _INITIAL),
    Migration(2, "decommission confirmations", _DECOMMISSION_CONFIRMATIONS),
    # Provisional number (issue 13): the integrator renumbers on merge.
    Migration(4, "work items and leases", _WORK),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
