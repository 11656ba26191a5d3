"""A deployment is a desired state (docs/deployments.md): this is its state machine, pure.

``step(member, event)`` says what one server becomes when something happens to it: its
agent claims or renews it, its lease runs out, its node goes away or is decommissioned,
an administrator restarts, undeploys or removes it, the relay unloads or wakes it. The
code that does the I/O (leases.py, servers.py, members.py, idle.py) reads the row, asks
``step`` and writes the answer with a conditional ``UPDATE``; this module touches nothing.

Nothing here ends in a state a person must leave, except ``failed``, which only what needs
a person reaches (the agent reports it for a model gone or a runtime the node cannot run,
and a decommissioned node's servers): a lease that ran out leaves the server ``waiting``,
listed to its node again, so the node's agent claims it the moment it is back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from modelforge_contract.deployments import (
    DEPLOYMENT_DEGRADED,
    DEPLOYMENT_DOWN,
    DEPLOYMENT_IDLE,
    DEPLOYMENT_RUNNING,
    DEPLOYMENT_STARTING,
    GOAL_IDLE,
    GOAL_REMOVE,
    GOAL_RUN,
    LEASE_END_EXPIRED,
    LEASE_END_IDLE,
    LEASE_END_RESTARTED,
    LEASE_END_STOPPED,
    SERVER_BACKOFF,
    SERVER_FAILED,
    SERVER_IDLE,
    SERVER_PENDING,
    SERVER_RUNNING,
    SERVER_STARTING,
    SERVER_STOPPED,
    SERVER_STOPPING,
    SERVER_WAITING,
)

# The events, as the I/O code names them.
CLAIM = "claim"  # its node's agent claims a serve lease on it
REPORT = "report"  # a renewal carries the state the agent sees
EXPIRE = "expire"  # its lease ran out, or its node went offline
DECOMMISSION = "decommission"  # its node was decommissioned
RESTART = "restart"  # an administrator restarted the deployment
UNDEPLOY = "undeploy"
REMOVE = "remove"  # an administrator took its node out of the deployment
UNLOAD = "unload"  # the deployment went idle_unload_seconds without a request
WAKE = "wake"  # a request came for the unloaded deployment

# A lease may be claimed on these (by its own node's agent, when the deployment runs).
CLAIMABLE = (SERVER_PENDING, SERVER_WAITING, SERVER_BACKOFF, SERVER_STARTING, SERVER_RUNNING)
# A renewal answers "run" in these, "stop" in every other.
RUNNING_ON_NODE = (SERVER_STARTING, SERVER_RUNNING, SERVER_BACKOFF)


@dataclass(frozen=True)
class Member:
    """What the state machine sees of one server."""

    state: str
    goal: str = GOAL_RUN
    leased: bool = False
    undeploying: bool = False  # its deployment is being undeployed


@dataclass(frozen=True)
class Outcome:
    """What the server becomes: its state and goal, how its lease ends (None: it is kept,
    or there is none), and whether its row goes (a removed member that stopped)."""

    state: str
    goal: str
    end_lease: str | None = None
    delete: bool = False


def _after_stop(member: Member, end: str) -> Outcome:
    """Where a stopping server lands once its runtime stopped."""
    if member.undeploying:
        return Outcome(SERVER_STOPPED, member.goal, end)
    if member.goal == GOAL_REMOVE:
        return Outcome(SERVER_STOPPED, member.goal, end, delete=True)
    if member.goal == GOAL_IDLE:
        return Outcome(SERVER_IDLE, GOAL_IDLE, end)
    return Outcome(SERVER_PENDING, GOAL_RUN, end)  # woken (or restarted) while it stopped


def _keep(member: Member) -> Outcome:
    return Outcome(member.state, member.goal)


def step(member: Member, event: str, reported: str | None = None) -> Outcome:
    """What ``event`` makes of ``member`` (``reported``: the state a renewal carries)."""
    outcome = _step(member, event, reported)
    if outcome.end_lease is not None and not member.leased:
        return replace(outcome, end_lease=None)  # only a lease that exists ends
    return outcome


def _step(member: Member, event: str, reported: str | None) -> Outcome:
    state, goal = member.state, member.goal
    if event == CLAIM:
        if state in (SERVER_PENDING, SERVER_WAITING, SERVER_BACKOFF):
            return Outcome(SERVER_STARTING, goal)
        return _keep(member)  # starting or running: the agent adopts what still runs
    if event == REPORT:
        if state == SERVER_STOPPING:
            if reported in (SERVER_STOPPED, SERVER_FAILED):
                return _after_stop(member, LEASE_END_STOPPED)
            return _keep(member)  # still stopping: the answer says stop
        if reported == SERVER_FAILED:
            return Outcome(SERVER_FAILED, goal, SERVER_FAILED)
        if reported == SERVER_STOPPED:  # its agent stopped it to go (the node stops)
            return Outcome(SERVER_WAITING, goal, LEASE_END_STOPPED)
        if reported in RUNNING_ON_NODE:
            return Outcome(reported, goal)
        return _keep(member)
    if event == EXPIRE:
        if not member.leased:
            return _keep(member)
        if state == SERVER_STOPPING:
            return _after_stop(member, LEASE_END_EXPIRED)
        return Outcome(SERVER_WAITING, goal, LEASE_END_EXPIRED)
    if event == DECOMMISSION:
        if state == SERVER_STOPPING:
            return _after_stop(member, LEASE_END_STOPPED)
        if state in (SERVER_STOPPED, SERVER_FAILED):
            return _keep(member)
        return Outcome(SERVER_FAILED, goal, SERVER_FAILED if member.leased else None)
    if event == RESTART:
        if state == SERVER_STOPPING and goal == GOAL_REMOVE:
            return _keep(member)  # leaving: a restart does not bring it back
        if state == SERVER_STOPPING:  # unloading: it starts again once it has stopped
            return Outcome(SERVER_STOPPING, GOAL_RUN)
        end = LEASE_END_RESTARTED if member.leased else None
        return Outcome(SERVER_PENDING, GOAL_RUN, end)
    if event == UNDEPLOY:
        if state == SERVER_STOPPED:
            return _keep(member)
        if member.leased and state in (*RUNNING_ON_NODE, SERVER_STOPPING):
            return Outcome(SERVER_STOPPING, goal)
        return Outcome(SERVER_STOPPED, goal, LEASE_END_STOPPED if member.leased else None)
    if event == REMOVE:
        if member.leased and state in (*RUNNING_ON_NODE, SERVER_STOPPING):
            return Outcome(SERVER_STOPPING, GOAL_REMOVE)
        end = LEASE_END_STOPPED if member.leased else None
        return Outcome(SERVER_STOPPED, GOAL_REMOVE, end, delete=True)
    if event == UNLOAD:
        if goal != GOAL_RUN or state in (SERVER_STOPPING, SERVER_STOPPED, SERVER_IDLE):
            return _keep(member)
        if state == SERVER_FAILED:
            return _keep(member)  # a person's to look at; unloading would hide it
        if member.leased and state in RUNNING_ON_NODE:
            return Outcome(SERVER_STOPPING, GOAL_IDLE)
        return Outcome(SERVER_IDLE, GOAL_IDLE, LEASE_END_IDLE if member.leased else None)
    if event == WAKE:
        if state == SERVER_IDLE:
            return Outcome(SERVER_PENDING, GOAL_RUN)
        if state == SERVER_STOPPING and goal == GOAL_IDLE:
            return Outcome(SERVER_STOPPING, GOAL_RUN)
        return _keep(member)
    raise ValueError(f"unknown event {event!r}")


def desired(state: str) -> str:
    """What a renewal answers the agent: keep it running, or stop it."""
    return "run" if state in RUNNING_ON_NODE else "stop"


def deployment_state(states: list[str], undeploying: bool) -> str:
    """One word for a deployment, from its servers' states."""
    if undeploying:
        return SERVER_STOPPED if all(s == SERVER_STOPPED for s in states) else SERVER_STOPPING
    live = [s for s in states if s != SERVER_STOPPED]  # a removed member on its way out
    running = live.count(SERVER_RUNNING)
    if live and running == len(live):
        return DEPLOYMENT_RUNNING
    if running:
        return DEPLOYMENT_DEGRADED
    if live and all(s in (SERVER_IDLE, SERVER_STOPPING) for s in live) and SERVER_IDLE in live:
        return DEPLOYMENT_IDLE
    if live and all(s in (SERVER_PENDING, SERVER_STARTING) for s in live):
        return DEPLOYMENT_STARTING
    return DEPLOYMENT_DOWN
