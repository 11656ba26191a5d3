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
    "sqlite": {
        "double": "REAL",
        "bool": "INTEGER",
        "serial": "INTEGER",
        "bigserial": "INTEGER",
        "bigint": "INTEGER",
    },
    "postgresql": {
        "double": "DOUBLE PRECISION",
        "bool": "BOOLEAN",
        "serial": "SERIAL",
        "bigserial": "BIGSERIAL",
        "bigint": "BIGINT",
    },
}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]
    # Statements only one kind of store understands (triggers), run after the shared ones.
    sqlite: tuple[str, ...] = ()
    postgresql: tuple[str, ...] = ()

    def apply(self, db: pw.Database) -> None:
        kind = "sqlite" if isinstance(db, pw.SqliteDatabase) else "postgresql"
        types = _TYPES[kind]
        for statement in (*self.statements, *getattr(self, kind)):
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

# 3: the finality record (finality.py): every secret id ever revoked or spent. The store
# keeps it itself: triggers add a row in the same transaction as the revocation, whichever
# code or hand-written SQL made it, and refuse to change or delete one. Re-runnable (IF NOT
# EXISTS, OR REPLACE): a pg_restore --clean of a dump from before this migration leaves the
# current record in place, as it is not in the dump, and migrating again must keep it.
_FINALITY_RECORD = (
    'CREATE TABLE IF NOT EXISTS "finality" ("kind" VARCHAR(32) NOT NULL, "subject_id" '
    'VARCHAR(64) NOT NULL, "final_at" {double} NOT NULL, "reason" VARCHAR(120), PRIMARY '
    'KEY ("kind", "subject_id"))',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    '\'credential\', c."credential_id", c."revoked_at", c."revoked_reason" FROM '
    '"credential" AS c WHERE c."revoked_at" IS NOT NULL AND NOT EXISTS (SELECT 1 FROM '
    '"finality" AS f WHERE f."kind" = \'credential\' AND f."subject_id" = '
    'c."credential_id")',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    '\'admin_token\', a."token_id", a."revoked_at", NULL FROM "admin_token" AS a WHERE '
    'a."revoked_at" IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE '
    'f."kind" = \'admin_token\' AND f."subject_id" = a."token_id")',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    '\'enrollment_token\', e."enrollment_id", COALESCE(e."consumed_at", e."revoked_at"), '
    "CASE WHEN e.\"consumed_at\" IS NOT NULL THEN 'used' ELSE 'revoked' END FROM "
    '"enrollment_token" AS e WHERE COALESCE(e."consumed_at", e."revoked_at") IS NOT NULL '
    'AND NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = \'enrollment_token\' '
    'AND f."subject_id" = e."enrollment_id")',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT \'node\', '
    'n."node_id", n."decommissioned_at", \'decommissioned\' FROM "node" AS n WHERE '
    'n."decommissioned_at" IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "finality" AS f '
    'WHERE f."kind" = \'node\' AND f."subject_id" = n."node_id")',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    '\'identity\', n."identity_id", n."decommissioned_at", \'decommissioned\' FROM "node" AS '
    'n WHERE n."decommissioned_at" IS NOT NULL AND n."identity_id" IS NOT NULL AND NOT '
    'EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = \'identity\' AND f."subject_id" '
    '= n."identity_id")',
    'INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    "'decommission_confirmation', d.\"confirmation_id\", d.\"used_at\", 'used' FROM "
    '"decommission_confirmation" AS d WHERE d."used_at" IS NOT NULL AND NOT EXISTS '
    '(SELECT 1 FROM "finality" AS f WHERE f."kind" = \'decommission_confirmation\' AND '
    'f."subject_id" = d."confirmation_id")',
)

# Triggers; the INSERT in each body is the same SQL on both stores.
_FINALITY_SQLITE = (
    'CREATE TRIGGER IF NOT EXISTS "credential_final" AFTER UPDATE OF "revoked_at" ON '
    '"credential" WHEN NEW."revoked_at" IS NOT NULL BEGIN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'credential\', NEW."credential_id", '
    'NEW."revoked_at", NEW."revoked_reason" WHERE NOT EXISTS (SELECT 1 FROM "finality" AS '
    'f WHERE f."kind" = \'credential\' AND f."subject_id" = NEW."credential_id"); END',
    'CREATE TRIGGER IF NOT EXISTS "admin_token_final" AFTER UPDATE OF "revoked_at" ON '
    '"admin_token" WHEN NEW."revoked_at" IS NOT NULL BEGIN INSERT INTO "finality" '
    '("kind", "subject_id", "final_at", "reason") SELECT \'admin_token\', NEW."token_id", '
    'NEW."revoked_at", NULL WHERE NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE '
    'f."kind" = \'admin_token\' AND f."subject_id" = NEW."token_id"); END',
    'CREATE TRIGGER IF NOT EXISTS "enrollment_token_final" AFTER UPDATE OF "consumed_at", '
    '"revoked_at" ON "enrollment_token" WHEN COALESCE(NEW."consumed_at", '
    'NEW."revoked_at") IS NOT NULL BEGIN INSERT INTO "finality" ("kind", "subject_id", '
    '"final_at", "reason") SELECT \'enrollment_token\', NEW."enrollment_id", '
    'COALESCE(NEW."consumed_at", NEW."revoked_at"), CASE WHEN NEW."consumed_at" IS NOT '
    "NULL THEN 'used' ELSE 'revoked' END WHERE NOT EXISTS (SELECT 1 FROM \"finality\" AS f "
    'WHERE f."kind" = \'enrollment_token\' AND f."subject_id" = NEW."enrollment_id"); END',
    'CREATE TRIGGER IF NOT EXISTS "node_final" AFTER UPDATE OF "decommissioned_at" ON '
    '"node" WHEN NEW."decommissioned_at" IS NOT NULL BEGIN INSERT INTO "finality" '
    '("kind", "subject_id", "final_at", "reason") SELECT \'node\', NEW."node_id", '
    'NEW."decommissioned_at", \'decommissioned\' WHERE NOT EXISTS (SELECT 1 FROM "finality" '
    'AS f WHERE f."kind" = \'node\' AND f."subject_id" = NEW."node_id"); INSERT INTO '
    '"finality" ("kind", "subject_id", "final_at", "reason") SELECT \'identity\', '
    'NEW."identity_id", NEW."decommissioned_at", \'decommissioned\' WHERE NEW."identity_id" '
    'IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = '
    '\'identity\' AND f."subject_id" = NEW."identity_id"); END',
    'CREATE TRIGGER IF NOT EXISTS "decommission_confirmation_final" AFTER UPDATE OF '
    '"used_at" ON "decommission_confirmation" WHEN NEW."used_at" IS NOT NULL BEGIN INSERT '
    'INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    "'decommission_confirmation', NEW.\"confirmation_id\", NEW.\"used_at\", 'used' WHERE NOT "
    'EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = \'decommission_confirmation\' '
    'AND f."subject_id" = NEW."confirmation_id"); END',
    'CREATE TRIGGER IF NOT EXISTS "finality_only_grows_update" BEFORE UPDATE ON '
    '"finality" BEGIN SELECT RAISE(ABORT, \'the finality record only grows: its rows are '
    "never changed or deleted'); END",
    'CREATE TRIGGER IF NOT EXISTS "finality_only_grows_delete" BEFORE DELETE ON '
    '"finality" BEGIN SELECT RAISE(ABORT, \'the finality record only grows: its rows are '
    "never changed or deleted'); END",
)

_FINALITY_POSTGRESQL = (
    'CREATE OR REPLACE FUNCTION "credential_final"() RETURNS trigger LANGUAGE plpgsql AS '
    '$$ BEGIN IF NEW."revoked_at" IS NOT NULL THEN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'credential\', NEW."credential_id", '
    'NEW."revoked_at", NEW."revoked_reason" WHERE NOT EXISTS (SELECT 1 FROM "finality" AS '
    'f WHERE f."kind" = \'credential\' AND f."subject_id" = NEW."credential_id"); END IF; '
    "RETURN NULL; END $$",
    'DROP TRIGGER IF EXISTS "credential_final" ON "credential"',
    'CREATE TRIGGER "credential_final" AFTER UPDATE OF "revoked_at" ON "credential" FOR '
    'EACH ROW EXECUTE FUNCTION "credential_final"()',
    'CREATE OR REPLACE FUNCTION "admin_token_final"() RETURNS trigger LANGUAGE plpgsql AS '
    '$$ BEGIN IF NEW."revoked_at" IS NOT NULL THEN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'admin_token\', NEW."token_id", '
    'NEW."revoked_at", NULL WHERE NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE '
    'f."kind" = \'admin_token\' AND f."subject_id" = NEW."token_id"); END IF; RETURN NULL; '
    "END $$",
    'DROP TRIGGER IF EXISTS "admin_token_final" ON "admin_token"',
    'CREATE TRIGGER "admin_token_final" AFTER UPDATE OF "revoked_at" ON "admin_token" FOR '
    'EACH ROW EXECUTE FUNCTION "admin_token_final"()',
    'CREATE OR REPLACE FUNCTION "enrollment_token_final"() RETURNS trigger LANGUAGE '
    'plpgsql AS $$ BEGIN IF COALESCE(NEW."consumed_at", NEW."revoked_at") IS NOT NULL '
    'THEN INSERT INTO "finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    '\'enrollment_token\', NEW."enrollment_id", COALESCE(NEW."consumed_at", '
    'NEW."revoked_at"), CASE WHEN NEW."consumed_at" IS NOT NULL THEN \'used\' ELSE '
    '\'revoked\' END WHERE NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = '
    '\'enrollment_token\' AND f."subject_id" = NEW."enrollment_id"); END IF; RETURN NULL; '
    "END $$",
    'DROP TRIGGER IF EXISTS "enrollment_token_final" ON "enrollment_token"',
    'CREATE TRIGGER "enrollment_token_final" AFTER UPDATE OF "consumed_at", "revoked_at" '
    'ON "enrollment_token" FOR EACH ROW EXECUTE FUNCTION "enrollment_token_final"()',
    'CREATE OR REPLACE FUNCTION "node_final"() RETURNS trigger LANGUAGE plpgsql AS $$ '
    'BEGIN IF NEW."decommissioned_at" IS NOT NULL THEN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'node\', NEW."node_id", '
    'NEW."decommissioned_at", \'decommissioned\' WHERE NOT EXISTS (SELECT 1 FROM "finality" '
    'AS f WHERE f."kind" = \'node\' AND f."subject_id" = NEW."node_id"); INSERT INTO '
    '"finality" ("kind", "subject_id", "final_at", "reason") SELECT \'identity\', '
    'NEW."identity_id", NEW."decommissioned_at", \'decommissioned\' WHERE NEW."identity_id" '
    'IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = '
    '\'identity\' AND f."subject_id" = NEW."identity_id"); END IF; RETURN NULL; END $$',
    'DROP TRIGGER IF EXISTS "node_final" ON "node"',
    'CREATE TRIGGER "node_final" AFTER UPDATE OF "decommissioned_at" ON "node" FOR EACH '
    'ROW EXECUTE FUNCTION "node_final"()',
    'CREATE OR REPLACE FUNCTION "decommission_confirmation_final"() RETURNS trigger '
    'LANGUAGE plpgsql AS $$ BEGIN IF NEW."used_at" IS NOT NULL THEN INSERT INTO '
    '"finality" ("kind", "subject_id", "final_at", "reason") SELECT '
    "'decommission_confirmation', NEW.\"confirmation_id\", NEW.\"used_at\", 'used' WHERE NOT "
    'EXISTS (SELECT 1 FROM "finality" AS f WHERE f."kind" = \'decommission_confirmation\' '
    'AND f."subject_id" = NEW."confirmation_id"); END IF; RETURN NULL; END $$',
    'DROP TRIGGER IF EXISTS "decommission_confirmation_final" ON "decommission_confirmation"',
    'CREATE TRIGGER "decommission_confirmation_final" AFTER UPDATE OF "used_at" ON '
    '"decommission_confirmation" FOR EACH ROW EXECUTE FUNCTION '
    '"decommission_confirmation_final"()',
    'CREATE OR REPLACE FUNCTION "finality_only_grows"() RETURNS trigger LANGUAGE plpgsql '
    "AS $$ BEGIN RAISE EXCEPTION 'the finality record only grows: its rows are never "
    "changed or deleted'; END $$",
    'DROP TRIGGER IF EXISTS "finality_only_grows" ON "finality"',
    'CREATE TRIGGER "finality_only_grows" BEFORE UPDATE OR DELETE OR TRUNCATE ON '
    '"finality" FOR EACH STATEMENT EXECUTE FUNCTION "finality_only_grows"()',
)

# 4: the console (admin password, sessions, sign-in throttling) and telemetry history.
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

# 5: the work plane: queued work, and every lease granted on it.
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

# 6: the address a node's agent last called from (enrollment, inventory, telemetry), shown
# by `modelforge nodes show`. Behind MODELFORGE_TRUSTED_PROXY it is the proxy's client.
_NODE_SOURCE_ADDRESS = ('ALTER TABLE "node" ADD COLUMN "source_address" VARCHAR(64)',)

# 7: leases capped per node (an administrator's maximum for the node, null for the default),
# counted through an index on the node's items by state; and who leased and completed an
# item: the node and the credential (its id, never a secret).
_WORK_SLOTS_AND_ATTRIBUTION = (
    'ALTER TABLE "node" ADD COLUMN "work_slots_max" INTEGER',
    'ALTER TABLE "work_item" ADD COLUMN "lease_credential_id" VARCHAR(32)',
    'ALTER TABLE "work_item" ADD COLUMN "completed_by_node_id" VARCHAR(40)',
    'ALTER TABLE "work_item" ADD COLUMN "completed_by_credential_id" VARCHAR(32)',
    'ALTER TABLE "work_lease" ADD COLUMN "credential_id" VARCHAR(32)',
    'CREATE INDEX "work_item_node_id_state" ON "work_item" ("node_id", "state")',
)

# 8: telemetry floods: per node, what was dropped for coming faster than it is kept.
_TELEMETRY_FLOOD = (
    'CREATE TABLE "telemetry_flood" ("node_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"dropped_publications" {bigint} NOT NULL, "dropped_samples" {bigint} NOT NULL, '
    '"since" {double} NOT NULL, "last_dropped_at" {double} NOT NULL)',
)

# 9: hardware held for an administrator (trust on first use, fleet/hardware.py): a node's
# published accelerators that differ from its accepted ones, and since when. The accepted
# ones stay in "inventory", so every node's inventory at the upgrade is its baseline.
_PENDING_HARDWARE = (
    'ALTER TABLE "node" ADD COLUMN "pending_accelerators" TEXT',
    'ALTER TABLE "node" ADD COLUMN "hardware_changed_at" {double}',
)

# 10: models (models/): imported revisions, their replicas per node, and the generation a
# node's heartbeat answer carries so its agent knows when to fetch what it should hold.
_MODELS = (
    'ALTER TABLE "node" ADD COLUMN "models_generation" INTEGER NOT NULL DEFAULT 0',
    'CREATE TABLE "model" ("model_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"name" VARCHAR(120) NOT NULL, "revision" VARCHAR(64) NOT NULL, '
    '"digest" VARCHAR(71) NOT NULL, "manifest" TEXT NOT NULL, '
    '"size_bytes" {bigint} NOT NULL, "file_count" INTEGER NOT NULL, "source" TEXT NOT NULL, '
    '"created_by" VARCHAR(120) NOT NULL, "created_at" {double} NOT NULL)',
    'CREATE UNIQUE INDEX "model_name_revision" ON "model" ("name", "revision")',
    'CREATE UNIQUE INDEX "model_name_digest" ON "model" ("name", "digest")',
    'CREATE TABLE "model_replica" ("id" {serial} NOT NULL PRIMARY KEY, '
    '"model_id" VARCHAR(40) NOT NULL, "node_id" VARCHAR(40) NOT NULL, '
    '"state" VARCHAR(16) NOT NULL, "bytes_done" {bigint} NOT NULL, '
    '"bytes_total" {bigint} NOT NULL, "error" TEXT, "requested_by" VARCHAR(120) NOT NULL, '
    '"requested_at" {double} NOT NULL, "updated_at" {double} NOT NULL, '
    '"reported_at" {double}, '
    'FOREIGN KEY ("model_id") REFERENCES "model" ("model_id") ON DELETE RESTRICT, '
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "model_replica_model_id" ON "model_replica" ("model_id")',
    'CREATE INDEX "model_replica_node_id" ON "model_replica" ("node_id")',
    'CREATE UNIQUE INDEX "model_replica_model_id_node_id" ON "model_replica" '
    '("model_id", "node_id")',
)

# 11: deployments (deployments/): one server row per member node, each under its node's
# serve lease, and the generation a heartbeat answer carries so the agent fetches its
# servers when they change.
_DEPLOYMENTS = (
    'ALTER TABLE "node" ADD COLUMN "servers_generation" INTEGER NOT NULL DEFAULT 0',
    'CREATE TABLE "deployment" ("deployment_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"name" VARCHAR(64) NOT NULL, "model_id" VARCHAR(40) NOT NULL, '
    '"runtime" VARCHAR(32) NOT NULL, "gpu_count" INTEGER, "share_gpus" {bool} NOT NULL, '
    '"settings" TEXT NOT NULL, "stopping" {bool} NOT NULL, '
    '"created_by" VARCHAR(120) NOT NULL, "created_at" {double} NOT NULL, '
    'FOREIGN KEY ("model_id") REFERENCES "model" ("model_id") ON DELETE RESTRICT)',
    'CREATE UNIQUE INDEX "deployment_name" ON "deployment" ("name")',
    'CREATE INDEX "deployment_model_id" ON "deployment" ("model_id")',
    'CREATE TABLE "deployment_server" ("server_id" VARCHAR(40) NOT NULL PRIMARY KEY, '
    '"deployment_id" VARCHAR(40) NOT NULL, "node_id" VARCHAR(40) NOT NULL, '
    '"state" VARCHAR(16) NOT NULL, "state_since" {double} NOT NULL, "error" TEXT, '
    '"gpus" TEXT NOT NULL, "restarts" INTEGER NOT NULL, "lease_id" VARCHAR(40), '
    '"lease_expires_at" {double}, "lease_credential_id" VARCHAR(32), '
    '"previous_lease_id" VARCHAR(40), "previous_lease_end" VARCHAR(16), "started_at" {double}, '
    'FOREIGN KEY ("deployment_id") REFERENCES "deployment" ("deployment_id") '
    "ON DELETE RESTRICT, "
    'FOREIGN KEY ("node_id") REFERENCES "node" ("node_id") ON DELETE RESTRICT)',
    'CREATE INDEX "deployment_server_deployment_id" ON "deployment_server" ("deployment_id")',
    'CREATE INDEX "deployment_server_node_id" ON "deployment_server" ("node_id")',
    'CREATE INDEX "deployment_server_node_id_state" ON "deployment_server" ("node_id", "state")',
    'CREATE INDEX "deployment_server_state_lease_expires_at" ON "deployment_server" '
    '("state", "lease_expires_at")',
)

# 12: the GPUs a leased work item holds, by UUID (work/placement.py picks them at the claim
# and the lease carries them): a JSON array, null for an item that never held one.
_WORK_GPU_UUIDS = ('ALTER TABLE "work_item" ADD COLUMN "gpu_uuids" TEXT',)

# 13: client API keys (identity/api_keys.py): digests only, like every secret; revoking one
# is final, so the store adds it to the finality record itself, as for admin tokens (3),
# with who revoked it as the reason.
_API_KEYS = (
    'CREATE TABLE "api_key" ("key_id" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"name" VARCHAR(120) NOT NULL, "digest" VARCHAR(64) NOT NULL, '
    '"created_by" VARCHAR(120) NOT NULL, "created_at" {double} NOT NULL, '
    '"last_used_at" {double}, "revoked_at" {double}, "revoked_by" VARCHAR(120))',
)

_API_KEYS_SQLITE = (
    'CREATE TRIGGER IF NOT EXISTS "api_key_final" AFTER UPDATE OF "revoked_at" ON '
    '"api_key" WHEN NEW."revoked_at" IS NOT NULL BEGIN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'api_key\', NEW."key_id", '
    'NEW."revoked_at", NEW."revoked_by" WHERE NOT EXISTS (SELECT 1 FROM "finality" AS f '
    'WHERE f."kind" = \'api_key\' AND f."subject_id" = NEW."key_id"); END',
)

_API_KEYS_POSTGRESQL = (
    'CREATE OR REPLACE FUNCTION "api_key_final"() RETURNS trigger LANGUAGE plpgsql AS $$ '
    'BEGIN IF NEW."revoked_at" IS NOT NULL THEN INSERT INTO "finality" ("kind", '
    '"subject_id", "final_at", "reason") SELECT \'api_key\', NEW."key_id", '
    'NEW."revoked_at", NEW."revoked_by" WHERE NOT EXISTS (SELECT 1 FROM "finality" AS f '
    'WHERE f."kind" = \'api_key\' AND f."subject_id" = NEW."key_id"); END IF; RETURN NULL; '
    "END $$",
    'DROP TRIGGER IF EXISTS "api_key_final" ON "api_key"',
    'CREATE TRIGGER "api_key_final" AFTER UPDATE OF "revoked_at" ON "api_key" FOR EACH ROW '
    'EXECUTE FUNCTION "api_key_final"()',
)

# 14: a deployment is a desired state (deployments/reconcile.py): what each member is for
# (run, unload to idle, leave the deployment) and when a backing-off one starts again.
_SERVER_GOALS = (
    'ALTER TABLE "deployment_server" ADD COLUMN "goal" VARCHAR(8) NOT NULL DEFAULT \'run\'',
    'ALTER TABLE "deployment_server" ADD COLUMN "next_attempt_at" {double}',
)

# 15: the hub token models/hub.py pulls with, sealed with the work key (models/hub_token.py).
_HUB_TOKEN = (
    'CREATE TABLE "hub_token" ("hub" VARCHAR(32) NOT NULL PRIMARY KEY, '
    '"sealed" TEXT NOT NULL, "set_by" VARCHAR(120) NOT NULL, "set_at" {double} NOT NULL)',
)

# 16: API keys with limits, and what each key used of each deployment per day (relay/limits.py).
_KEY_LIMITS_AND_USAGE = (
    'ALTER TABLE "api_key" ADD COLUMN "deployments" TEXT',
    'ALTER TABLE "api_key" ADD COLUMN "expires_at" {double}',
    'ALTER TABLE "api_key" ADD COLUMN "rpm" INTEGER',
    'ALTER TABLE "api_key" ADD COLUMN "tokens_per_day" {bigint}',
    'CREATE TABLE "usage_day" ("day" VARCHAR(10) NOT NULL, "key_id" VARCHAR(32) NOT NULL, '
    '"deployment" VARCHAR(120) NOT NULL, "requests" {bigint} NOT NULL DEFAULT 0, '
    '"prompt_tokens" {bigint} NOT NULL DEFAULT 0, "completion_tokens" {bigint} NOT NULL '
    'DEFAULT 0, "errors" {bigint} NOT NULL DEFAULT 0, '
    'PRIMARY KEY ("day", "key_id", "deployment"))',
)

# 17: users with roles (identity/users.py). The console's one password becomes the user
# admin's; every admin token, session and API key so far belongs to admin.
_USERS = (
    'CREATE TABLE "app_user" ("name" VARCHAR(64) NOT NULL PRIMARY KEY, '
    '"role" VARCHAR(16) NOT NULL, "password_hash" VARCHAR(100), '
    '"created_at" {double} NOT NULL, "created_by" VARCHAR(120) NOT NULL, "disabled_at" {double})',
    'INSERT INTO "app_user" ("name", "role", "password_hash", "created_at", "created_by") '
    'SELECT \'admin\', \'admin\', (SELECT "password_hash" FROM "admin_password" WHERE "id" = 1), '
    'COALESCE((SELECT "set_at" FROM "admin_password" WHERE "id" = 1), 0), \'migration\'',
    'ALTER TABLE "admin_token" ADD COLUMN "user_name" VARCHAR(64) NOT NULL DEFAULT \'admin\'',
    'ALTER TABLE "console_session" ADD COLUMN "user_name" VARCHAR(64) NOT NULL DEFAULT \'admin\'',
    'ALTER TABLE "api_key" ADD COLUMN "owner" VARCHAR(64) NOT NULL DEFAULT \'admin\'',
)

# 18: a model split across nodes (deployments/split.py): each server's role in its group,
# main or helper; null for a whole server.
_SERVER_ROLES = ('ALTER TABLE "deployment_server" ADD COLUMN "role" VARCHAR(8)',)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial", _INITIAL),
    Migration(2, "decommission confirmations", _DECOMMISSION_CONFIRMATIONS),
    Migration(
        3,
        "finality record",
        _FINALITY_RECORD,
        sqlite=_FINALITY_SQLITE,
        postgresql=_FINALITY_POSTGRESQL,
    ),
    Migration(4, "console sessions, admin password, telemetry history", _CONSOLE_AND_TELEMETRY),
    Migration(5, "work items and leases", _WORK),
    Migration(6, "node source address", _NODE_SOURCE_ADDRESS),
    Migration(7, "work slots per node, work attribution", _WORK_SLOTS_AND_ATTRIBUTION),
    Migration(8, "telemetry floods", _TELEMETRY_FLOOD),
    Migration(9, "pending hardware", _PENDING_HARDWARE),
    Migration(10, "models and replicas", _MODELS),
    Migration(11, "deployments and servers", _DEPLOYMENTS),
    Migration(12, "work item GPUs by UUID", _WORK_GPU_UUIDS),
    Migration(
        13, "client API keys", _API_KEYS, sqlite=_API_KEYS_SQLITE, postgresql=_API_KEYS_POSTGRESQL
    ),
    Migration(14, "server goals and backoff", _SERVER_GOALS),
    Migration(15, "hub token", _HUB_TOKEN),
    Migration(16, "API key limits and usage", _KEY_LIMITS_AND_USAGE),
    Migration(17, "users with roles", _USERS),
    Migration(18, "server roles of a split deployment", _SERVER_ROLES),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
