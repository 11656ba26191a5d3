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
    "sqlite": {"double": "REAL", "bool": "INTEGER", "serial": "INTEGER", "bigserial": "INTEGER"},
    "postgresql": {
        "double": "DOUBLE PRECISION",
        "bool": "BOOLEAN",
        "serial": "SERIAL",
        "bigserial": "BIGSERIAL",
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

_CONSOLE_AND_TELEMETRY = (
    'CREATE TABLE "admin_password" ("id" INTEGER NOT NULL PRIMARY KEY, '
    '"password_hash" VARCHAR(100) NOT NULL, "set_at" {double} NOT NULL)',
    'CREATE TABLE "console_session" ("session_id" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"digest" VARCHAR(64) NOT NULL, "created_at" {double} NOT NULL, '
    '"last_seen_at" {double} NOT NULL, "expires_at" {double} NOT NULL, "ended_at" {double})',
    'CREATE TABLE "sign_in_throttle" ("address" VARCHAR(64) NOT NULL PRIMARY KEY, '
    '"failures" INTEGER NOT NULL, "last_failure_at" {double} NOT NULL, '
    '"blocked_until" {double} NOT NULL)',
    'CREATE TABLE "gpu_sample" ("id" {bigserial} NOT NULL PRIMARY KEY, '
    '"node_id" VARCHAR(40) NOT NULL, "gpu_uuid" VARCHAR(96) NOT NULL, '
    '"gpu_index" INTEGER NOT NULL, "at" {double} NOT NULL, "utilization_gpu_percent" INTEGER, '
    '"memory_used_bytes" BIGINT NOT NULL, "memory_total_bytes" BIGINT, "temperature_c" INTEGER, '
    '"power_w" {double})',
    'CREATE INDEX "gpu_sample_at" ON "gpu_sample" ("at")',
    'CREATE INDEX "gpu_sample_node_id_at" ON "gpu_sample" ("node_id", "at")',
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial", _INITIAL),
    Migration(2, "decommission confirmations", _DECOMMISSION_CONFIRMATIONS),
    # Provisional number 5 (issue 11); the integrator renumbers on merge.
    Migration(5, "console sessions, admin password, telemetry history", _CONSOLE_AND_TELEMETRY),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
