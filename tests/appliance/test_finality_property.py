"""Property (hypothesis stateful): whatever sequence of enrollments, revocations, admin token
changes, decommissions, backups and restores of any earlier backup an operator runs, no
secret that was ever revoked or spent authenticates again, after every single step.

It drives the service functions and backup.backup/backup.restore in-process over real
SQLite files; restores run with the store closed, as the runbook has the server stopped.
Derandomized with a fixed example count, so CI runs the same sequences every time.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from modelforge_appliance import lifecycle
from modelforge_appliance.core.clock import ManualClock
from modelforge_appliance.core.errors import ApiError
from modelforge_appliance.fleet import nodes
from modelforge_appliance.identity import admin_tokens, credentials, enrollment
from modelforge_appliance.store import audit, backup
from modelforge_appliance.store.database import Store
from modelforge_appliance.store.tables import Credential
from tests.harness.control_plane import make_settings, new_identity

ORIGIN = "http://127.0.0.1:8000"
PICK = st.integers(min_value=0, max_value=1_000)


class Operator(RuleBasedStateMachine):
    """One control plane, and everything that was ever revoked or spent on it."""

    base: Path  # set by the test: a directory for this run's stores and backups

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(dir=self.base))
        self.settings = make_settings(self.root / "state")
        self.clock = ManualClock()
        self.store = Store(self.settings.database_url, self.clock)
        self.store.migrate()
        self.numbers = itertools.count()
        # What the operator holds: node id -> identity; credential id -> (secret, node id).
        self.identities: dict[str, dict] = {}
        self.credentials: dict[str, tuple[str, str]] = {}
        self.admin: dict[str, str] = {}  # token id -> secret
        self.pending: list[str] = []  # enrollment tokens minted and not yet used
        self.backups: list[Path] = []
        # Ever revoked or spent.
        self.spent_credentials: set[str] = set()
        self.spent_admin: set[str] = set()
        self.spent_enrollments: set[str] = set()
        self.retired_identities: list[dict] = []
        self.used_confirmations: list[tuple[str, str]] = []

    def teardown(self) -> None:
        self.store.close()

    # -- helpers -------------------------------------------------------------------------

    def _claim(self, token: str, identity: dict) -> enrollment.Enrolled:
        return enrollment.claim_token(
            self.store,
            enrollment.EnrollRequest(
                token=token,
                hostname=f"gpu-{next(self.numbers)}",
                agent_version="0.1.0",
                accelerator_mode="cpu",
                protocol_version=1,
                request_origin=ORIGIN,
                identity_id=identity["identity_id"],
                identity_secret=identity["identity_secret"],
            ),
        )

    def _mint(self) -> str:
        minted = enrollment.mint_enrollment_token(
            self.store,
            display_name="gpu",
            expires_in_seconds=3600,
            api_origin=ORIGIN,
            actor=audit.CLI_ACTOR,
        )
        return minted.token

    def _active_credential_ids(self, node_id: str) -> set[str]:
        with self.store.connection():
            return {
                row.credential_id
                for row in Credential.select().where(
                    (Credential.node == node_id) & Credential.revoked_at.is_null()
                )
            }

    def _enrolled(self, done: enrollment.Enrolled, identity: dict, token: str) -> None:
        node_id = done.node.node_id
        self.identities[node_id] = identity
        credential_id = done.credential.split("_")[1]
        self.credentials[credential_id] = (done.credential, node_id)
        self.spent_enrollments.add(token)

    def _node(self, pick: int) -> str:
        return list(self.identities)[pick % len(self.identities)]  # in enrollment order

    # -- rules ---------------------------------------------------------------------------

    @rule()
    def mint_enrollment_token(self) -> None:
        self.pending.append(self._mint())

    @precondition(lambda self: self.pending)
    @rule(pick=PICK)
    def enroll_new_node(self, pick: int) -> None:
        token = self.pending.pop(pick % len(self.pending))
        identity = new_identity()
        try:
            done = self._claim(token, identity)
        except ApiError:
            return  # revoked by a restore's record, or never in this store: refused is fine
        self._enrolled(done, identity, token)

    @precondition(lambda self: self.identities)
    @rule(pick=PICK)
    def reenroll_node(self, pick: int) -> None:
        node_id = self._node(pick)
        identity = self.identities[node_id]
        before = self._active_credential_ids(node_id)
        token = self._mint()
        try:
            done = self._claim(token, identity)
        except ApiError:
            return  # a decommissioned identity
        if done.node.node_id == node_id:
            self.spent_credentials |= before  # the re-enrollment revoked them
        self._enrolled(done, identity, token)

    @precondition(lambda self: self.pending)
    @rule(pick=PICK)
    def revoke_enrollment_token(self, pick: int) -> None:
        token = self.pending.pop(pick % len(self.pending))
        try:
            enrollment.revoke_enrollment(self.store, token.split("_")[1], audit.CLI_ACTOR)
        except ApiError:
            return  # not in this store (restored away) or already used
        self.spent_enrollments.add(token)

    @precondition(lambda self: self.identities)
    @rule(pick=PICK)
    def revoke_node_credential(self, pick: int) -> None:
        node_id = self._node(pick)
        try:
            node = nodes.get_node(self.store, node_id)
        except ApiError:
            return
        self.spent_credentials |= set(
            lifecycle.revoke_node_credential(self.store, node, audit.CLI_ACTOR)["revoked"]
        )

    @rule()
    def create_admin_token(self) -> None:
        row, secret = admin_tokens.create_admin_token(self.store, "t", audit.CLI_ACTOR)
        self.admin[row.token_id] = secret

    @precondition(lambda self: self.admin)
    @rule(pick=PICK)
    def revoke_admin_token(self, pick: int) -> None:
        token_id = list(self.admin)[pick % len(self.admin)]
        try:
            admin_tokens.revoke_admin_token(self.store, token_id, audit.CLI_ACTOR)
        except ApiError:
            return  # restored away
        self.spent_admin.add(token_id)

    @precondition(lambda self: self.identities)
    @rule(pick=PICK)
    def decommission_node(self, pick: int) -> None:
        node_id = self._node(pick)
        try:
            plan = lifecycle.preview_decommission(self.store, node_id, audit.CLI_ACTOR)
            done = lifecycle.execute_decommission(self.store, node_id, plan["confirmation"], "cli")
        except ApiError:
            return  # not in this store, or already decommissioned
        self.spent_credentials |= set(done["effects"]["credentials_revoked"])
        self.retired_identities.append(self.identities[node_id])
        self.used_confirmations.append((node_id, plan["confirmation"]))

    @rule()
    def take_backup(self) -> None:
        path = self.root / f"backup-{len(self.backups)}.sqlite3"
        backup.backup(self.settings, path)
        self.backups.append(path)

    @precondition(lambda self: self.backups)
    @rule(pick=PICK)
    def restore_an_earlier_backup(self, pick: int) -> None:
        self.store.close()
        backup.restore(self.settings, self.backups[pick % len(self.backups)], self.clock)
        self.store = Store(self.settings.database_url, self.clock)
        self.store.migrate()

    @precondition(lambda self: len(self.backups) >= 2)
    @rule(first=PICK, then=PICK)
    def restore_two_backups_in_a_row(self, first: int, then: int) -> None:
        """An operator trying one backup, then another, without starting in between."""
        self.store.close()
        for pick in (first, then):
            backup.restore(self.settings, self.backups[pick % len(self.backups)], self.clock)
        self.store = Store(self.settings.database_url, self.clock)
        self.store.migrate()

    # -- the property --------------------------------------------------------------------

    @invariant()
    def nothing_revoked_or_spent_authenticates(self) -> None:
        for credential_id in self.spent_credentials:
            secret, node_id = self.credentials[credential_id]
            with pytest.raises(ApiError):
                credentials.authenticate_node(self.store, f"Bearer {secret}", node_id)
        for token_id in self.spent_admin:
            with pytest.raises(ApiError):
                admin_tokens.authenticate_admin(self.store, self.admin[token_id])
        for token in self.spent_enrollments:
            with pytest.raises(ApiError):
                self._claim(token, new_identity())
        for node_id, confirmation in self.used_confirmations:
            with pytest.raises(ApiError):
                lifecycle.execute_decommission(self.store, node_id, confirmation, audit.CLI_ACTOR)
        if self.retired_identities:
            token = self._mint()
            for identity in self.retired_identities:
                with pytest.raises(ApiError):
                    self._claim(token, identity)
            self.pending.append(token)  # still unused: every claim above was refused


def test_no_revoked_or_spent_secret_ever_authenticates_again(tmp_path):
    Operator.base = tmp_path
    run = Operator.TestCase
    run.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run().runTest()
