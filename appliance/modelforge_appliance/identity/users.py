"""Users with roles (docs/console.md, "Users and roles").

A user signs in to the console with its name and password, and holds admin tokens; each
session and token carries its user's role. Roles rank ``viewer`` < ``operator`` < ``admin``;
what each may do is declared per route as an action (``roles.py``). A disabled user's
sessions and tokens stop at once (they are looked up with their user on every call). The
last enabled admin can be neither demoted nor disabled (409 LAST_ADMIN), so someone can
always manage the control plane. The password is kept as a bcrypt hash (invariant 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import bcrypt

from modelforge_contract import FIELD_CHOICE, FIELD_FORMAT, LAST_ADMIN, ROLES, USER_DISABLED

from ..core.clock import isoformat
from ..core.errors import Conflict, Invalid, NotFound, Unauthorized
from ..store import audit
from ..store.database import Store
from ..store.tables import AdminPassword, AdminToken, ConsoleSession, User

ADMIN = "admin"
OPERATOR = "operator"
VIEWER = "viewer"
RANK = {role: rank for rank, role in enumerate(ROLES)}
BCRYPT_ROUNDS = 12
FIRST_USER = "admin"  # the user migration 17 made of the console's one password
_NAME = re.compile(r"[a-z][a-z0-9._-]{0,63}")
PASSWORD_MIN_LENGTH = 12
# bcrypt reads at most 72 bytes; a longer password would be silently cut.
PASSWORD_MAX_BYTES = 72


class PasswordRefused(ValueError):
    """The new password does not meet the rules; the message says which."""


def check_new_password(password: str) -> None:
    if len(password) < PASSWORD_MIN_LENGTH:
        raise PasswordRefused(f"the password must be at least {PASSWORD_MIN_LENGTH} characters")
    if len(password.encode("utf-8")) > PASSWORD_MAX_BYTES:
        raise PasswordRefused(f"the password must be at most {PASSWORD_MAX_BYTES} bytes")
    if password != password.strip() or any(ord(c) < 32 for c in password):
        raise PasswordRefused(
            "the password must not start or end with spaces or contain control characters"
        )


@dataclass(frozen=True)
class Principal:
    """Who makes an admin call: a user with its role, and through what (``actor``, as the
    audit trail records it: the token or session, and the user)."""

    user: str
    role: str
    actor: str

    def at_least(self, role: str) -> bool:
        return RANK[self.role] >= RANK[role]


# The command line on the control plane's host acts with every right: whoever runs it holds
# the state directory.
CLI_PRINCIPAL = Principal(FIRST_USER, ADMIN, audit.CLI_ACTOR)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise Invalid(
            f"user name {str(name)[:70]!r}: 1–64 characters, lower-case letters, digits, "
            "'.', '_' or '-', beginning with a letter",
            code=FIELD_FORMAT,
            next_step="Choose a name such as alice or lab.bot.",
        )
    return name


def check_role(role: object) -> str:
    if role not in ROLES:
        raise Invalid(
            f"role {str(role)[:30]!r} is not one of {', '.join(ROLES)}",
            code=FIELD_CHOICE,
            next_step=f"Give one of: {', '.join(ROLES)}.",
        )
    return str(role)


def _hash(password: str) -> str:
    try:
        check_new_password(password)
    except PasswordRefused as refused:
        raise Invalid(str(refused), code=FIELD_FORMAT,
                      next_step="Choose a longer password.") from None  # fmt: skip
    return bcrypt.hashpw(password.encode("utf-8"), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()


def view(row: User) -> dict[str, Any]:
    return {
        "name": row.name,
        "role": row.role,
        "state": "disabled" if row.disabled_at is not None else "enabled",
        "password_set": row.password_hash is not None,
        "created_at": isoformat(row.created_at),
        "created_by": row.created_by,
        "disabled_at": isoformat(row.disabled_at),
    }


def _get(name: str) -> User:
    row = User.get_or_none(User.name == name)
    if row is None:
        raise NotFound(
            f"no user {name[:70]!r}",
            next_step="See the users with `modelforge users list` (GET /api/v1/admin/users).",
        )
    return row


def get_user(store: Store, name: str) -> dict[str, Any]:
    with store.connection():
        return view(_get(name))


def list_users(store: Store) -> list[dict[str, Any]]:
    with store.connection():
        return [view(row) for row in User.select().order_by(User.name)]


def add_user(
    store: Store, name: str, role: str, password: str | None, actor: str
) -> dict[str, Any]:
    """A new enabled user (409 when the name is taken). Without a password it cannot sign
    in until one is set; it may still hold admin tokens."""
    name, role = check_name(name), check_role(role)
    hashed = None if password is None else _hash(password)
    with store.write():
        if User.get_or_none(User.name == name) is not None:
            raise Conflict(f"a user {name!r} exists already", code="USER_EXISTS",
                           next_step="Choose another name, or change that user's role.")  # fmt: skip
        row = User.create(name=name, role=role, password_hash=hashed,
                          created_at=store.clock.now(), created_by=actor)  # fmt: skip
        audit.record(store, actor, "user.added", user=name, role=role)
    return view(row)


def _enabled_admins_besides(name: str) -> int:
    return (
        User.select()
        .where((User.role == ADMIN) & User.disabled_at.is_null() & (User.name != name))
        .count()
    )


def _last_admin(name: str) -> Conflict:
    return Conflict(
        f"{name!r} is the last enabled admin",
        code=LAST_ADMIN,
        next_step="Make another user an admin first (`modelforge users set-role NAME admin`).",
    )


def set_role(store: Store, name: str, role: str, actor: str) -> dict[str, Any]:
    role = check_role(role)
    with store.write():
        row = _get(name)
        if row.role == role:
            return view(row)
        if row.role == ADMIN and row.disabled_at is None and not _enabled_admins_besides(name):
            raise _last_admin(name)
        previous, row.role = row.role, role
        row.save()
        audit.record(store, actor, "user.role_set", user=name, role=role, previous=previous)
    return view(row)


def set_disabled(store: Store, name: str, disabled: bool, actor: str) -> dict[str, Any]:
    """Disable (its sessions end; its tokens are refused from the next call on) or enable."""
    now = store.clock.now()
    with store.write():
        row = _get(name)
        if disabled == (row.disabled_at is not None):
            return view(row)
        if disabled and row.role == ADMIN and not _enabled_admins_besides(name):
            raise _last_admin(name)
        row.disabled_at = now if disabled else None
        row.save()
        ended = 0
        if disabled:
            ended = (
                ConsoleSession.update(ended_at=now)
                .where((ConsoleSession.user_name == name) & ConsoleSession.ended_at.is_null())
                .execute()
            )
        audit.record(store, actor, "user.disabled" if disabled else "user.enabled", user=name,
                     sessions_ended=ended)  # fmt: skip
    return view(row)


def set_password(store: Store, name: str, password: str, actor: str) -> int:
    """Set (or replace) a user's password; its open sessions end. How many did."""
    hashed = _hash(password)
    now = store.clock.now()
    with store.write():
        row = User.get_or_none(User.name == name)
        if row is None and name == FIRST_USER:  # a store older than users: admin comes back
            row = User.create(name=name, role=ADMIN, created_at=now, created_by=actor)
        elif row is None:
            _get(name)
        replaced = row.password_hash is not None
        row.password_hash = hashed
        row.save()
        if name == FIRST_USER:
            mirror_admin_password(hashed, now)
        ended = (
            ConsoleSession.update(ended_at=now)
            .where((ConsoleSession.user_name == name) & ConsoleSession.ended_at.is_null())
            .execute()
        )
        audit.record(store, actor, "user.password_replaced" if replaced else "user.password_set",
                     user=name, sessions_ended=ended)  # fmt: skip
    return ended


def mirror_admin_password(hashed: str, now: float) -> None:
    """Inside a write: keep the user admin's password in ``admin_password`` too, with when it
    was set, so a restore keeps a password set since the backup (store/backup.py)."""
    AdminPassword.insert(id=1, password_hash=hashed, set_at=now).on_conflict(
        conflict_target=[AdminPassword.id],
        update={AdminPassword.password_hash: hashed, AdminPassword.set_at: now},
    ).execute()


def role_of(store: Store, name: str) -> str:
    """The role of an enabled user; 401 USER_DISABLED for a disabled or removed one."""
    with store.connection():
        row = User.get_or_none(User.name == name)
    if row is None or row.disabled_at is not None:
        raise Unauthorized(
            f"the user {name!r} is disabled",
            code=USER_DISABLED,
            next_step="Ask an admin to enable the user (`modelforge users enable NAME`).",
        )
    return row.role


def tokens_of(store: Store, name: str) -> int:
    with store.connection():
        return (
            AdminToken.select()
            .where((AdminToken.user_name == name) & AdminToken.revoked_at.is_null())
            .count()
        )
