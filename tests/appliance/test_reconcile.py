"""The deployment state machine on its own (deployments/reconcile.py): every event from every
state lands in a state of the contract, and the paths a user relies on — a node that goes
away and comes back, a restart, an unload and a wake, a removal — never end where a person
must step in."""

from __future__ import annotations

import itertools

import pytest

from modelforge_appliance.deployments import reconcile
from modelforge_appliance.deployments.reconcile import Member, step
from modelforge_contract.deployments import (
    GOAL_IDLE,
    GOAL_REMOVE,
    GOAL_RUN,
    LEASE_END_EXPIRED,
    LEASE_END_RESTARTED,
    SERVER_REPORTED_STATES,
    SERVER_STATES,
)

EVENTS = (
    reconcile.CLAIM,
    reconcile.REPORT,
    reconcile.EXPIRE,
    reconcile.DECOMMISSION,
    reconcile.RESTART,
    reconcile.UNDEPLOY,
    reconcile.REMOVE,
    reconcile.UNLOAD,
    reconcile.WAKE,
)


@pytest.mark.parametrize("event", EVENTS)
def test_every_event_from_every_state_lands_in_a_contract_state(event):
    goals = (GOAL_RUN, GOAL_IDLE, GOAL_REMOVE)
    reports = SERVER_REPORTED_STATES if event == reconcile.REPORT else (None,)
    for state, goal, leased, undeploying, reported in itertools.product(
        SERVER_STATES, goals, (False, True), (False, True), reports
    ):
        member = Member(state, goal, leased, undeploying)
        outcome = step(member, event, reported)
        assert outcome.state in SERVER_STATES, (member, event, reported)
        assert outcome.goal in goals
        if outcome.end_lease is not None:
            assert leased, (member, event)  # only a lease that exists ends


def test_a_node_that_goes_away_and_comes_back_serves_again_with_no_person():
    running = Member("running", leased=True)
    away = step(running, reconcile.EXPIRE)
    assert (away.state, away.end_lease) == ("waiting", LEASE_END_EXPIRED)
    back = step(Member(away.state), reconcile.CLAIM)
    assert back.state == "starting"
    ready = step(Member(back.state, leased=True), reconcile.REPORT, "running")
    assert ready.state == "running"


def test_an_agent_that_stops_to_go_leaves_its_server_waiting_not_failed():
    outcome = step(Member("running", leased=True), reconcile.REPORT, "stopped")
    assert outcome.state == "waiting" and outcome.end_lease is not None


def test_restart_of_a_running_server_ends_its_lease_restarted_and_starts_it_again():
    outcome = step(Member("running", leased=True), reconcile.RESTART)
    assert (outcome.state, outcome.end_lease) == ("pending", LEASE_END_RESTARTED)
    assert reconcile.desired("pending") == "stop"  # an old lease renewing is told to stop
    assert step(Member("failed"), reconcile.RESTART).state == "pending"
    assert step(Member("idle", GOAL_IDLE), reconcile.RESTART).goal == GOAL_RUN


def test_a_runtime_that_exits_backs_off_and_keeps_its_lease():
    outcome = step(Member("running", leased=True), reconcile.REPORT, "backoff")
    assert (outcome.state, outcome.end_lease) == ("backoff", None)
    assert reconcile.desired("backoff") == "run"  # the agent keeps it, and starts it again


def test_unload_and_wake():
    unloading = step(Member("running", leased=True), reconcile.UNLOAD)
    assert (unloading.state, unloading.goal) == ("stopping", GOAL_IDLE)
    stopped = step(Member("stopping", GOAL_IDLE, leased=True), reconcile.REPORT, "stopped")
    assert stopped.state == "idle" and stopped.end_lease is not None
    assert step(Member("pending"), reconcile.UNLOAD).state == "idle"  # nothing to stop
    assert step(Member("failed"), reconcile.UNLOAD).state == "failed"  # kept for a person
    woken = step(Member("idle", GOAL_IDLE), reconcile.WAKE)
    assert (woken.state, woken.goal) == ("pending", GOAL_RUN)
    # Woken while it still stops: it starts again once stopped, never lands idle.
    rewoken = step(Member("stopping", GOAL_IDLE, leased=True), reconcile.WAKE)
    assert (rewoken.state, rewoken.goal) == ("stopping", GOAL_RUN)
    landed = step(Member("stopping", GOAL_RUN, leased=True), reconcile.REPORT, "stopped")
    assert landed.state == "pending"


def test_removal_deletes_the_row_once_stopped_and_a_restart_does_not_bring_it_back():
    assert step(Member("waiting"), reconcile.REMOVE).delete
    leaving = step(Member("running", leased=True), reconcile.REMOVE)
    assert (leaving.state, leaving.goal, leaving.delete) == ("stopping", GOAL_REMOVE, False)
    member = Member("stopping", GOAL_REMOVE, leased=True)
    assert step(member, reconcile.RESTART).goal == GOAL_REMOVE
    assert step(member, reconcile.REPORT, "stopped").delete
    assert step(member, reconcile.EXPIRE).delete


def test_undeploy_stops_and_only_decommission_fails():
    assert step(Member("running", leased=True), reconcile.UNDEPLOY).state == "stopping"
    assert step(Member("waiting"), reconcile.UNDEPLOY).state == "stopped"
    done = step(Member("stopping", leased=True, undeploying=True), reconcile.REPORT, "stopped")
    assert done.state == "stopped" and not done.delete
    assert step(Member("running", leased=True), reconcile.DECOMMISSION).state == "failed"


@pytest.mark.parametrize(
    ("states", "undeploying", "shown"),
    [
        (["running", "running"], False, "running"),
        (["running", "waiting"], False, "degraded"),
        (["running", "backoff"], False, "degraded"),
        (["pending", "starting"], False, "starting"),
        (["waiting", "backoff"], False, "down"),
        (["failed"], False, "down"),
        (["idle", "idle"], False, "idle"),
        (["idle", "stopping"], False, "idle"),
        (["running", "stopped"], False, "running"),  # a removed member on its way out
        (["stopping", "stopped"], True, "stopping"),
        (["stopped"], True, "stopped"),
    ],
)
def test_the_deployment_state_says_how_many_members_serve(states, undeploying, shown):
    assert reconcile.deployment_state(states, undeploying) == shown
