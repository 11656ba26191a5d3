"""``modelforge users add|list|set-role|disable|enable|reset-password``: who may sign in to
the console or hold admin tokens, and with which role (docs/console.md, "Users and roles").
Passwords are asked twice without echo on a terminal, or read as one line from stdin with
``--password-stdin``; never from the command line."""

from __future__ import annotations

import click

from modelforge_contract import ROLES

from ..core.errors import ApiError
from ..identity import users
from ..store import audit
from .admin_password import read_new_password
from .errors import refused
from .support import JSON_OPTION, Context, emit

_STDIN = click.option(
    "--password-stdin", is_flag=True, help="Read the password as one line from stdin."
)


@click.group("users")
def users_group() -> None:
    """Add, list and change the users who sign in to the console, and their roles."""


def _line(user: dict) -> str:
    state = "disabled" if user["state"] == "disabled" else "enabled"
    password = "" if user["password_set"] else ", no password"
    return f"{user['name']} ({user['role']}, {state}{password})"


@users_group.command("add")
@click.argument("name")
@click.option("--role", type=click.Choice(ROLES), required=True, help="What the user may do.")
@_STDIN
@click.option(
    "--no-password",
    is_flag=True,
    help="No password: the user cannot sign in, but may hold admin tokens (a script's user).",
)
@JSON_OPTION
@click.pass_obj
def users_add(
    obj: Context, name: str, role: str, password_stdin: bool, no_password: bool, as_json: bool
) -> None:
    """Add a user with a role (viewer, operator or admin)."""
    store = obj.store()
    password = None
    if not no_password:
        password = read_new_password(as_json, f"modelforge users add {name} --role {role} "
                                     "--password-stdin", name, "no user was added",
                                     password_stdin)  # fmt: skip
    try:
        made = users.add_user(store, name, role, password, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, made, f"Added {_line(made)}.")


@users_group.command("list")
@JSON_OPTION
@click.pass_obj
def users_list(obj: Context, as_json: bool) -> None:
    """List the users with their roles (never a password)."""
    rows = users.list_users(obj.store())
    lines = [f"{'NAME':24} {'ROLE':9} {'STATE':9} PASSWORD"]
    for row in rows:
        lines.append(
            f"{row['name'][:24]:24} {row['role']:9} {row['state']:9} "
            f"{'set' if row['password_set'] else 'none'}"
        )
    emit(as_json, {"users": rows}, "\n".join(lines))


@users_group.command("set-role")
@click.argument("name")
@click.argument("role", type=click.Choice(ROLES))
@JSON_OPTION
@click.pass_obj
def users_set_role(obj: Context, name: str, role: str, as_json: bool) -> None:
    """Give a user another role (the last enabled admin keeps its own: exit 1, LAST_ADMIN)."""
    try:
        changed = users.set_role(obj.store(), name, role, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, changed, f"{_line(changed)}.")


def _set_disabled(obj: Context, name: str, disabled: bool, as_json: bool) -> None:
    try:
        changed = users.set_disabled(obj.store(), name, disabled, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, changed, f"{_line(changed)}.")


@users_group.command("disable")
@click.argument("name")
@JSON_OPTION
@click.pass_obj
def users_disable(obj: Context, name: str, as_json: bool) -> None:
    """Disable a user: its console sessions end and its admin tokens stop at once."""
    _set_disabled(obj, name, True, as_json)


@users_group.command("enable")
@click.argument("name")
@JSON_OPTION
@click.pass_obj
def users_enable(obj: Context, name: str, as_json: bool) -> None:
    """Enable a disabled user again (its tokens work again; it signs in anew)."""
    _set_disabled(obj, name, False, as_json)


@users_group.command("reset-password")
@click.argument("name")
@_STDIN
@JSON_OPTION
@click.pass_obj
def users_reset_password(obj: Context, name: str, password_stdin: bool, as_json: bool) -> None:
    """Set a new password for a user; its console sessions end."""
    store = obj.store()
    try:
        users.get_user(store, name)
    except ApiError as exc:
        raise refused(exc) from None
    password = read_new_password(as_json, f"modelforge users reset-password {name} "
                                 "--password-stdin", name, "the password is unchanged",
                                 password_stdin)  # fmt: skip
    try:
        ended = users.set_password(store, name, password, audit.CLI_ACTOR)
    except ApiError as exc:
        raise refused(exc) from None
    emit(as_json, {"name": name, "password_set": True, "sessions_signed_out": ended},
         f"Password of {name} set; {ended} console session(s) signed out.")  # fmt: skip
