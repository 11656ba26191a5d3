"""``modelforge admin-password set``: the password that signs in to the console.

Never from argv (it would sit in shell history and ``ps``): prompted twice on a terminal
(on stderr, so stdout stays for the answer), otherwise one line read from stdin
(``modelforge admin-password set < file``). Like every command but ``init`` and ``serve``,
it needs an existing store, opened as its owner, before it asks for anything.
"""

from __future__ import annotations

import sys

import click

from modelforge_contract import EXIT_CHECK_FAILED

from ..core.settings import ConfigError
from ..identity.sessions import PasswordRefused, check_new_password, set_admin_password
from ..runtime import serving
from ..store import audit
from .errors import CliError
from .support import JSON_OPTION, Context, emit

_UNCHANGED = "the password is unchanged"


def read_new_password(
    as_json: bool,
    command: str = "modelforge admin-password set",
    whose: str = "admin",
    unchanged: str = _UNCHANGED,
    from_stdin: bool = False,
) -> str:
    """A new password: asked twice without echo on a terminal (on stderr), else (or with
    ``from_stdin``) one line read from stdin; never from the command line."""
    if sys.stdin.isatty() and not from_stdin:
        if as_json:
            raise CliError(
                f"--json does not ask questions; {unchanged}",
                f"send the password as one line on stdin: {command} --json < FILE",
            )
        try:
            first = click.prompt(f"New {whose} password", hide_input=True, err=True)
            second = click.prompt("Repeat it", hide_input=True, err=True)
        except click.Abort:
            raise CliError(f"cancelled; {unchanged}", None, EXIT_CHECK_FAILED) from None
        if first != second:
            raise CliError(f"the two entries differ; {unchanged}", "run it again")
        return first
    line = sys.stdin.readline()
    if not line:
        raise CliError(
            f"no password on stdin; {unchanged}",
            f"send one line ({command} < FILE), or run this on a terminal",
        )
    return line.rstrip("\r\n")


@click.group("admin-password")
def admin_password() -> None:
    """Set the admin password that signs in to the web console."""


@admin_password.command("set")
@JSON_OPTION
@click.pass_obj
def admin_password_set(obj: Context, as_json: bool) -> None:
    """Set or replace the console's admin password (bcrypt); signs out every console session.

    On a terminal it asks twice without echo; otherwise (and always with --json) it reads
    one line from stdin. At least 12 characters. It is never taken from the command line.
    """
    store = obj.store()  # a missing store or the wrong user is refused before the prompt
    password = read_new_password(as_json)
    try:
        check_new_password(password)
    except PasswordRefused as exc:
        raise CliError(f"{exc}; {_UNCHANGED}", "choose another password") from None
    ended = set_admin_password(store, password, audit.CLI_ACTOR)
    suffix = f"; {ended} console session(s) signed out" if ended else ""
    console = _console_url(obj)
    emit(
        as_json,
        {"password_set": True, "sessions_signed_out": ended, "console_url": console},
        f"Admin password set{suffix}. Sign in at "
        + (console or "/console/ on the control plane")
        + ".",
    )


def _console_url(obj: Context) -> str | None:
    """The console's address, as agents would be told it (None when it is not known)."""
    try:
        return serving.token_origin(obj.settings).origin + "/console/"
    except ConfigError:
        return None
