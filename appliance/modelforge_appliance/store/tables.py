"""The peewee models of the control plane; every concept's service module uses them.

Timestamps are float seconds since the epoch from the control plane's clock.
Secrets never appear here: only SHA-256 digests and non-secret lookup ids.
"""

from __future__ import annotations

import peewee as pw

database = pw.DatabaseProxy()


class BaseModel(pw.Model):
    class Meta:
        database = database
        legacy_table_names = False


class SchemaVersion(BaseModel):
    version = pw.IntegerField(primary_key=True)
    name = pw.CharField(max_length=120)
    applied_at = pw.DoubleField()


class AdminToken(BaseModel):
    token_id = pw.CharField(primary_key=True, max_length=32)
    name = pw.CharField(max_length=120)
    digest = pw.CharField(max_length=64)
    created_at = pw.DoubleField()
    last_used_at = pw.DoubleField(null=True)
    revoked_at = pw.DoubleField(null=True)
    user_name = pw.CharField(max_length=64, default="admin")  # whose role it carries (17)


class User(BaseModel):
    """Someone who signs in to the console or holds admin tokens, with a role (migration
    17, identity/users.py). The password is a bcrypt hash; NULL: none set yet."""

    name = pw.CharField(primary_key=True, max_length=64)
    role = pw.CharField(max_length=16)
    password_hash = pw.CharField(max_length=100, null=True)
    created_at = pw.DoubleField()
    created_by = pw.CharField(max_length=120)
    disabled_at = pw.DoubleField(null=True)

    class Meta:
        table_name = "app_user"  # "user" is a reserved word in PostgreSQL


class Node(BaseModel):
    node_id = pw.CharField(primary_key=True, max_length=40)
    display_name = pw.CharField(max_length=120)
    hostname = pw.CharField(max_length=253, index=True)
    identity_id = pw.CharField(max_length=32, null=True, unique=True)
    identity_digest = pw.CharField(max_length=64, null=True)
    accelerator_mode = pw.CharField(max_length=16)
    agent_version = pw.CharField(max_length=64)
    protocol_version = pw.IntegerField()
    production_eligible = pw.BooleanField(default=False)
    cordoned = pw.BooleanField(default=False)
    created_at = pw.DoubleField()
    enrolled_at = pw.DoubleField()
    last_heartbeat_at = pw.DoubleField(null=True)
    health = pw.TextField(null=True)  # JSON of the last heartbeat's health
    inventory = pw.TextField(null=True)  # JSON of the last inventory
    inventory_at = pw.DoubleField(null=True)
    telemetry = pw.TextField(null=True)  # JSON of the last telemetry publication
    telemetry_at = pw.DoubleField(null=True)
    decommissioned_at = pw.DoubleField(null=True)
    source_address = pw.CharField(max_length=64, null=True)  # the agent's last caller address
    # The most items it may hold leased at once; None: MODELFORGE_WORK_SLOTS_PER_NODE.
    work_slots_max = pw.IntegerField(null=True)
    # Trust on first use (fleet/hardware.py): ``inventory`` holds the accepted accelerators;
    # accelerators published unlike them wait here for an administrator, since that time.
    pending_accelerators = pw.TextField(null=True)  # JSON list
    hardware_changed_at = pw.DoubleField(null=True)
    # Bumped with every replica asked for or away on this node (models/replicas.py); the
    # heartbeat answer carries it, and an agent that sees it change fetches its models.
    models_generation = pw.IntegerField(default=0)
    servers_generation = pw.IntegerField(default=0)  # migration 11, deployments/


class EnrollmentToken(BaseModel):
    enrollment_id = pw.CharField(primary_key=True, max_length=32)
    display_name = pw.CharField(max_length=120)
    digest = pw.CharField(max_length=64)
    api_origin = pw.CharField(max_length=300)
    created_by = pw.CharField(max_length=80)
    created_at = pw.DoubleField()
    expires_at = pw.DoubleField()
    consumed_at = pw.DoubleField(null=True)
    revoked_at = pw.DoubleField(null=True)
    node = pw.ForeignKeyField(Node, null=True, backref="enrollments", on_delete="RESTRICT")


class Credential(BaseModel):
    credential_id = pw.CharField(primary_key=True, max_length=32)
    node = pw.ForeignKeyField(Node, backref="credentials", on_delete="RESTRICT")
    digest = pw.CharField(max_length=64)
    created_at = pw.DoubleField()
    last_used_at = pw.DoubleField(null=True)
    revoked_at = pw.DoubleField(null=True)
    revoked_reason = pw.CharField(max_length=120, null=True)


class AuditEvent(BaseModel):
    id = pw.AutoField()
    at = pw.DoubleField()
    actor = pw.CharField(max_length=120)
    action = pw.CharField(max_length=80, index=True)
    node_id = pw.CharField(max_length=40, null=True, index=True)
    detail = pw.TextField()  # JSON; never a secret


class DecommissionConfirmation(BaseModel):
    """A single-use confirmation that binds an execute to exactly what preview showed."""

    confirmation_id = pw.CharField(primary_key=True, max_length=32)
    node = pw.ForeignKeyField(Node, backref="decommission_confirmations", on_delete="RESTRICT")
    digest = pw.CharField(max_length=64)
    fingerprint = pw.CharField(max_length=64)  # of the node state the preview described
    created_by = pw.CharField(max_length=120)
    created_at = pw.DoubleField()
    expires_at = pw.DoubleField()
    used_at = pw.DoubleField(null=True)


class Finality(BaseModel):
    """One secret id that was revoked or spent: the record a restore carries (finality.py).

    Written by the store's own triggers (migration 3), never changed or deleted.
    """

    kind = pw.CharField(max_length=32)
    subject_id = pw.CharField(max_length=64)
    final_at = pw.DoubleField()
    reason = pw.CharField(max_length=120, null=True)

    class Meta:
        table_name = "finality"
        primary_key = pw.CompositeKey("kind", "subject_id")


# -- the console and telemetry history (migration 4) ----------------------------------


class AdminPassword(BaseModel):
    """The one admin password of the console, as a bcrypt hash (row id 1)."""

    id = pw.IntegerField(primary_key=True)
    password_hash = pw.CharField(max_length=100)
    set_at = pw.DoubleField()


class ConsoleSession(BaseModel):
    """A signed-in browser: only the digest of its cookie is kept."""

    session_id = pw.CharField(primary_key=True, max_length=32)
    digest = pw.CharField(max_length=64)
    created_at = pw.DoubleField()
    last_seen_at = pw.DoubleField()
    expires_at = pw.DoubleField()  # absolute expiry; idle expiry counts from last_seen_at
    ended_at = pw.DoubleField(null=True)
    user_name = pw.CharField(max_length=64, default="admin")  # who signed in (17)


class SignInThrottle(BaseModel):
    """Failed sign-ins of one client address, and until when it must wait."""

    address = pw.CharField(primary_key=True, max_length=64)
    failures = pw.IntegerField()
    last_failure_at = pw.DoubleField()
    blocked_until = pw.DoubleField()


class GpuSample(BaseModel):
    """One telemetry sample of one GPU, kept for MODELFORGE_TELEMETRY_RETENTION_SECONDS."""

    id = pw.BigAutoField()
    node_id = pw.CharField(max_length=40)
    gpu_uuid = pw.CharField(max_length=96)
    gpu_index = pw.IntegerField()
    at = pw.DoubleField(index=True)
    utilization_gpu_percent = pw.IntegerField(null=True)
    memory_used_bytes = pw.BigIntegerField()
    memory_total_bytes = pw.BigIntegerField(null=True)
    temperature_c = pw.IntegerField(null=True)
    power_w = pw.DoubleField(null=True)

    class Meta:
        indexes = ((("node_id", "at"), False),)


class TelemetryFlood(BaseModel):
    """What a node's telemetry past MODELFORGE_TELEMETRY_MIN_INTERVAL_SECONDS cost it: the
    publications and samples dropped, when the present flood began and its latest drop."""

    node_id = pw.CharField(primary_key=True, max_length=40)
    dropped_publications = pw.BigIntegerField()
    dropped_samples = pw.BigIntegerField()
    since = pw.DoubleField()
    last_dropped_at = pw.DoubleField()


class WorkItem(BaseModel):
    """One unit of work: queued until a node claims it, then leased, then finished.

    The placement constraints are kept twice: as submitted (``constraints``, JSON) and as
    columns the claim query can filter on before the exact check in Python.
    """

    work_id = pw.CharField(primary_key=True, max_length=40)
    capability = pw.CharField(max_length=64)
    input = pw.TextField()  # JSON object
    constraints = pw.TextField()  # JSON object, as submitted (normalised)
    gpu_count = pw.IntegerField()
    min_gpu_memory_bytes = pw.BigIntegerField(null=True)
    gpu_name = pw.CharField(max_length=120, null=True)
    node_ids = pw.TextField(null=True)  # JSON array of node ids
    timeout_seconds = pw.IntegerField()
    max_attempts = pw.IntegerField()
    idempotency_key = pw.CharField(max_length=200, null=True, unique=True)
    state = pw.CharField(max_length=16)
    attempts = pw.IntegerField()
    node = pw.ForeignKeyField(Node, null=True, backref="work_items", on_delete="RESTRICT")
    lease_id = pw.CharField(max_length=40, null=True)
    lease_expires_at = pw.DoubleField(null=True)
    # Attribution (never a secret): the credential the holding node leased the item with,
    # and the node and credential that reported its outcome, which is their claim alone.
    lease_credential_id = pw.CharField(max_length=32, null=True)
    completed_by_node_id = pw.CharField(max_length=40, null=True)
    completed_by_credential_id = pw.CharField(max_length=32, null=True)
    # The UUIDs of the GPUs its lease holds (JSON array), picked at the claim; kept with the
    # finished item, cleared when it goes back to the queue.
    gpu_uuids = pw.TextField(null=True)
    created_by = pw.CharField(max_length=120)
    created_at = pw.DoubleField()
    started_at = pw.DoubleField(null=True)
    finished_at = pw.DoubleField(null=True)
    result = pw.TextField(null=True)  # JSON
    error = pw.TextField(null=True)  # JSON {code, message}
    log_tail = pw.TextField(null=True)

    class Meta:
        indexes = (
            (("state", "created_at"), False),
            (("state", "lease_expires_at"), False),
            (("node", "state"), False),  # a node's leases, counted at every claim
        )


class WorkLease(BaseModel):
    """Every lease ever granted: who held which item, until when, and how it ended."""

    lease_id = pw.CharField(primary_key=True, max_length=40)
    work = pw.ForeignKeyField(WorkItem, backref="leases", on_delete="RESTRICT")
    node = pw.ForeignKeyField(Node, backref="work_leases", on_delete="RESTRICT")
    credential_id = pw.CharField(max_length=32, null=True)  # the credential that claimed it
    attempt = pw.IntegerField()
    granted_at = pw.DoubleField()
    expires_at = pw.DoubleField()
    ended_at = pw.DoubleField(null=True)
    end_reason = pw.CharField(max_length=32, null=True)


# -- models (migration 10, models/) ----------------------------------------------------


class Model(BaseModel):
    """One imported model revision: its manifest and where its files came from.

    The blobs it names are in the seed cache, ``STATE_DIR/models/blobs/sha256/<hex>``.
    """

    model_id = pw.CharField(primary_key=True, max_length=40)
    name = pw.CharField(max_length=120)
    revision = pw.CharField(max_length=64)
    digest = pw.CharField(max_length=71)  # sha256:<hex> of the canonical manifest
    manifest = pw.TextField()  # canonical JSON of {name, revision, files}
    size_bytes = pw.BigIntegerField()
    file_count = pw.IntegerField()
    source = pw.TextField()  # the imported path on the control-plane host
    created_by = pw.CharField(max_length=120)
    created_at = pw.DoubleField()

    class Meta:
        indexes = (
            (("name", "revision"), True),
            (("name", "digest"), True),
        )


class ModelReplica(BaseModel):
    """One model revision asked for on one node, and what the node last reported of it."""

    id = pw.AutoField()
    model = pw.ForeignKeyField(Model, backref="replicas", on_delete="RESTRICT")
    node = pw.ForeignKeyField(Node, backref="replicas", on_delete="RESTRICT")
    state = pw.CharField(max_length=16)
    bytes_done = pw.BigIntegerField()
    bytes_total = pw.BigIntegerField()
    error = pw.TextField(null=True)  # JSON {code, message}
    requested_by = pw.CharField(max_length=120)
    requested_at = pw.DoubleField()
    updated_at = pw.DoubleField()
    # The node's last verified report of this digest; nulled by a restore (measure again).
    reported_at = pw.DoubleField(null=True)

    class Meta:
        indexes = ((("model", "node"), True),)


# -- deployments (migration 11, deployments/) ------------------------------------------


class Deployment(BaseModel):
    """One model revision served by one runtime on the nodes an administrator chose.

    ``stopping`` once an administrator asked it away; the row (and its servers) goes once
    every server has stopped, so the name can be deployed again.
    """

    deployment_id = pw.CharField(primary_key=True, max_length=40)
    name = pw.CharField(max_length=64, unique=True)
    model = pw.ForeignKeyField(Model, backref="deployments", on_delete="RESTRICT")
    runtime = pw.CharField(max_length=32)
    gpu_count = pw.IntegerField(null=True)  # per server; null: 1 on a GPU node, 0 without
    share_gpus = pw.BooleanField(default=False)
    settings = pw.TextField()  # JSON {context_length, args, image_id, model_file}
    stopping = pw.BooleanField(default=False)
    created_by = pw.CharField(max_length=120)
    created_at = pw.DoubleField()


class DeploymentServer(BaseModel):
    """One member of a deployment: the server its node's agent runs under a serve lease."""

    server_id = pw.CharField(primary_key=True, max_length=40)
    deployment = pw.ForeignKeyField(Deployment, backref="servers", on_delete="RESTRICT")
    node = pw.ForeignKeyField(Node, backref="servers", on_delete="RESTRICT")
    state = pw.CharField(max_length=16)
    state_since = pw.DoubleField()
    error = pw.TextField(null=True)  # JSON {code, message}
    gpus = pw.TextField()  # JSON array of GPU UUIDs, chosen at placement
    restarts = pw.IntegerField(default=0)  # crash restarts the agent reported
    lease_id = pw.CharField(max_length=40, null=True)
    lease_expires_at = pw.DoubleField(null=True)
    lease_credential_id = pw.CharField(max_length=32, null=True)
    # The lease before this one and how it ended, so a renewal under it is told (409
    # LEASE_LOST's lease_end: restarted, replaced, stopped, expired, failed).
    previous_lease_id = pw.CharField(max_length=40, null=True)
    previous_lease_end = pw.CharField(max_length=16, null=True)
    started_at = pw.DoubleField(null=True)  # first seen running under the current lease
    # What the member is for (migration 14): run, unload to idle, or leave the deployment;
    # and, backing off, when its agent starts the runtime again.
    goal = pw.CharField(max_length=8, default="run")
    next_attempt_at = pw.DoubleField(null=True)
    # A model split across nodes (migration 18): main or helper; None for a whole server.
    role = pw.CharField(max_length=8, null=True)

    class Meta:
        indexes = (
            (("node", "state"), False),
            (("state", "lease_expires_at"), False),
        )


# -- client API keys (migration 13, identity/api_keys.py) --------------------------------


class ApiKey(BaseModel):
    """A client's key for the OpenAI-compatible API (``mfk_…``): only its digest is kept.

    Revoking one is final: migration 13's trigger puts it in the finality record.
    """

    key_id = pw.CharField(primary_key=True, max_length=32)
    name = pw.CharField(max_length=120)
    digest = pw.CharField(max_length=64)
    created_by = pw.CharField(max_length=120)
    created_at = pw.DoubleField()
    last_used_at = pw.DoubleField(null=True)  # to the minute (LAST_USED_RESOLUTION_SECONDS)
    revoked_at = pw.DoubleField(null=True)
    revoked_by = pw.CharField(max_length=120, null=True)
    # Its limits (migration 16, relay/limits.py); NULL: none.
    deployments = pw.TextField(null=True)  # a JSON list of the deployments it may call
    expires_at = pw.DoubleField(null=True)
    rpm = pw.IntegerField(null=True)  # requests per minute
    tokens_per_day = pw.BigIntegerField(null=True)  # prompt + completion tokens, UTC days
    owner = pw.CharField(max_length=64, default="admin")  # the user it belongs to (17)


class UsageDay(BaseModel):
    """What one key used of one deployment on one UTC day (migration 16): written in
    batches by relay/limits.py, never once per request."""

    day = pw.CharField(max_length=10)  # YYYY-MM-DD
    key_id = pw.CharField(max_length=32)
    deployment = pw.CharField(max_length=120)
    requests = pw.BigIntegerField(default=0)
    prompt_tokens = pw.BigIntegerField(default=0)
    completion_tokens = pw.BigIntegerField(default=0)
    errors = pw.BigIntegerField(default=0)

    class Meta:
        table_name = "usage_day"
        primary_key = pw.CompositeKey("day", "key_id", "deployment")


# -- the hub token (migration 15, models/hub_token.py) -----------------------------------


class HubToken(BaseModel):
    """The token the control plane pulls from a hub with (``modelforge hub-token set``).

    It must be sent to the hub, so it cannot be kept as a digest: ``sealed`` is it sealed
    with the state directory's work key (core/sealing.py), as work secrets are.
    """

    hub = pw.CharField(primary_key=True, max_length=32)
    sealed = pw.TextField()
    set_by = pw.CharField(max_length=120)
    set_at = pw.DoubleField()
