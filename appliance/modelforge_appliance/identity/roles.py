"""What each role may do: every admin route declares the action it performs (``action=``
beside ``auth=``), and the auth plugin (web/auth.py) lets a caller through only when its
role is at least the action's. A ``viewer`` reads everything but secrets; an ``operator``
also enrolls, cordons, replicates, deploys, runs work and mints API keys for itself; an
``admin`` also manages users, other users' keys, the hub token, credentials and
decommissions. ``docs/console.md`` has the table; ``tests/appliance/test_roles.py`` walks
every route with every role.
"""

from __future__ import annotations

from modelforge_contract import ROLE_FORBIDDEN

from ..core.errors import Forbidden
from .users import ADMIN, OPERATOR, VIEWER, Principal

MIN_ROLE: dict[str, str] = {
    "nodes.read": VIEWER,
    "nodes.enroll": OPERATOR,
    "nodes.change": OPERATOR,
    "nodes.decommission": ADMIN,
    "work.read": VIEWER,
    "work.write": OPERATOR,
    "models.read": VIEWER,
    "models.write": OPERATOR,
    "hub_token.read": VIEWER,
    "hub_token.write": ADMIN,
    "deployments.read": VIEWER,
    "deployments.write": OPERATOR,
    "keys.read": VIEWER,
    "keys.write": OPERATOR,
    "usage.read": VIEWER,
    "audit.read": VIEWER,
    "users.read": VIEWER,
    "users.write": ADMIN,
    "metrics.read": VIEWER,
}


def check(principal: Principal, action: str) -> None:
    """403 ROLE_FORBIDDEN unless the principal's role may perform ``action``."""
    needed = MIN_ROLE[action]
    if not principal.at_least(needed):
        raise Forbidden(
            f"{action} needs the role {needed}; {principal.user} is {principal.role}",
            code=ROLE_FORBIDDEN,
            next_step=f"Ask an admin to make you {needed} (`modelforge users set-role "
            f"{principal.user} {needed}`), or use an account that is.",
            extra={"action": action, "role_needed": needed, "role": principal.role},
        )
