"""``modelforge admin-password set``: the password that signs in to the console.

Never from argv (it would sit in shell history and ``ps``): prompted twice on a terminal,
otherwise one line read from stdin (``modelforge admin-password set < file``).
"""

from __future__ import annotations

import sys

import click

from .. import audit
from ..console.sessions import PasswordRefused, check_new_password, set_admin_password
from .support import Context, fail


def _read_password() -> str:
    if sys.stdin.isatty():
        try:
            first = click.prompt("New admin password", hide_input=True, err=True)
            second = click.prompt("Repeat it", hide_input=True, err=True)
        except click.Abort:
            fail("cancelled; the password is unchanged")
        if first != second:
            fail("the two entries differ; the password is unchanged")
        return first
    line = sys.stdin.readline()
    if not line:
        fail("no password on stdin (send one line, or run this on a terminal)")
    return line.rstrip("\r\n")


@click.group("admin-password")
def admin_password() -> None:
    """Set the admin password that signs in to the web console."""


@admin_password.command("set")
@click.pass_obj
def admin_password_set(obj: Context) -> None:
    """Set or replace the console's admin password (bcrypt); signs out every console session.

    On a terminal it asks twice without echo; otherwise it reads one line from stdin.
    At least 12 characters. It is never taken from the command line.
    """
    password = _read_password()
    try:
        check_new_password(password)
    except PasswordRefused as exc:
        fail(f"{exc}; the password is unchanged")
    ended = set_admin_password(obj.store(), password, audit.CLI_ACTOR)
    suffix = f"; {ended} console session(s) signed out" if ended else ""
    click.echo(f"Admin password set{suffix}. Sign in at /console/ on the control plane.")
