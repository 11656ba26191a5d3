"""The ``modelforge`` CLI's one error handler: every failure is one line, a next step and a
documented exit code; the Python traceback only with ``--debug``.

Exit codes (README.md, docs/cli.md): 0 ok; 1 the answer is "no" (not ready, a doctor check
failed, alerts at ``--fail-on``, a prompt declined); 2 usage or configuration (a bad option or
setting, no store yet, a path that cannot be used, the wrong user); 7 not found; 8 the store
is unreachable; 9 the operating system refused (disk full, I/O error); 70 a bug.
"""

from __future__ import annotations

import errno
import sqlite3
import sys
import traceback
from typing import NoReturn
from urllib.parse import urlsplit

import click
import peewee as pw

from modelforge_contract import (
    EXIT_CHECK_FAILED,
    EXIT_INTERNAL,
    EXIT_NOT_FOUND,
    EXIT_STORE_UNREACHABLE,
    EXIT_SYSTEM,
    EXIT_USAGE,
    mask_secrets,
)

from ..core.errors import ApiError, NotFound, StoreUnavailable
from ..store.database import redact_url

PROG = "modelforge"

# An OSError about a path the operator named or configured: fix the path or the user.
_PATH_ERRNOS = {
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}
_OS_NEXT_STEPS = {
    errno.ENOENT: "check the path; create the missing directory first, or choose another path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "name a file, not a directory",
    errno.EACCES: "run as a user who may use that path (the state directory's owner for the "
    "store), or choose another path",
    errno.EPERM: "run as a user who may use that path, or choose another path",
    errno.EROFS: "that file system is read-only; choose a writable path",
    errno.EEXIST: "the path exists already; choose another or remove it",
    errno.ENOSPC: "free space on that file system (df -h), then retry",
    errno.EDQUOT: "the user's disk quota is used up; free space, then retry",
    errno.EIO: "the disk reported an I/O error; check the system log (dmesg) and the disk",
}


class CliError(Exception):
    """A failure the CLI explains itself: one line, a next step, an exit code."""

    def __init__(
        self, message: str, next_step: str | None = None, exit_code: int = EXIT_USAGE
    ) -> None:
        super().__init__(message)
        self.message = message
        self.next_step = next_step
        self.exit_code = exit_code


def refused(exc: ApiError) -> CliError:
    """A service's refusal as the CLI's one line: exit 7 for something unknown, 1 for a
    conflict or a check that failed (the answer is no), 2 for anything else."""
    if isinstance(exc, NotFound):
        return CliError(f"{exc.message} ({exc.code})", exc.next_step, EXIT_NOT_FOUND)
    code = EXIT_CHECK_FAILED if exc.status in (409, 500) else EXIT_USAGE
    return CliError(f"{exc.message} ({exc.code})", exc.next_step, code)


def only_match(
    reference: str, found: list[str], *, kind: str, by: str, listing: str, id_of: str = ""
) -> str:
    """The one id ``reference`` names among ``found`` (sorted); NotFound naming the command
    that lists them, or a usage error listing the first few when it names several."""
    if not found:
        raise NotFound(f"no {kind} {reference!r} ({by})", next_step=f"list them with `{listing}`")
    if len(found) > 1:
        shown = ", ".join(found[:6]) + (" …" if len(found) > 6 else "")
        raise CliError(
            f"{reference!r} names {len(found)} {kind}s: {shown}",
            f"give more of the {id_of or kind} id (or the whole id)",
        )
    return found[0]


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def _store_error(exc: BaseException, database_url: str | None) -> CliError:
    """PostgreSQL and SQLite failures: what the driver said, where, and what to check."""
    cause = exc.__cause__ or exc.__context__ or exc
    said = _first_line(str(exc) or str(cause)) or type(exc).__name__
    password = urlsplit(database_url).password if database_url else None
    if password:  # never repeat a password, even if a driver did
        said = said.replace(password, "***")
    where = redact_url(database_url) if database_url else "the store"
    postgres = database_url is not None and database_url.startswith(("postgres", "postgresql"))
    lowered = said.lower()
    if postgres:
        step = (
            "check that PostgreSQL runs and accepts this user and database "
            "(pg_isready), and that MODELFORGE_DATABASE_URL is right"
        )
    elif "locked" in lowered or "busy" in lowered:
        step = "another program holds the store; retry in a moment"
    elif "readonly" in lowered or "unable to open" in lowered:
        step = "run as the state directory's owner, and check that the store file is writable"
    elif "malformed" in lowered or "not a database" in lowered:
        step = (
            "the store file is damaged: restore it from a backup (docs/runbooks/backup-restore.md)"
        )
    elif "disk is full" in lowered or "disk i/o" in lowered:
        return CliError(
            f"the store at {where} failed: {said}", _OS_NEXT_STEPS[errno.ENOSPC], EXIT_SYSTEM
        )
    else:
        step = "check the store file and its directory, then retry"
    return CliError(f"cannot use the store at {where}: {said}", step, EXIT_STORE_UNREACHABLE)


def _os_error(exc: OSError) -> CliError:
    where = f" {exc.filename}" if exc.filename else ""
    reason = exc.strerror or type(exc).__name__
    code = EXIT_USAGE if exc.errno in _PATH_ERRNOS else EXIT_SYSTEM
    step = _OS_NEXT_STEPS.get(exc.errno or 0, "check the system log, then retry")
    return CliError(f"cannot use{where}: {reason}", step, code)


def explain(exc: BaseException, database_url: str | None = None) -> CliError:
    """The one-line explanation and exit code for any failure of a command."""
    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, NotFound):
        return CliError(exc.message, exc.next_step, EXIT_NOT_FOUND)
    if isinstance(exc, StoreUnavailable):
        return CliError(exc.message, exc.next_step, EXIT_STORE_UNREACHABLE)
    if isinstance(exc, ApiError):
        return CliError(exc.message, exc.next_step, EXIT_USAGE)
    if isinstance(exc, pw.PeeweeException | sqlite3.Error) or type(exc).__module__.startswith(
        "psycopg2"
    ):
        return _store_error(exc, database_url)
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, MemoryError):
        return CliError("out of memory", "free memory, then retry", EXIT_SYSTEM)
    return CliError(
        f"internal error: {type(exc).__name__}: {_first_line(str(exc))}",
        f"this is a bug; rerun with `{PROG} --debug …` for the traceback and report it",
        EXIT_INTERNAL,
    )


def report(exc: BaseException, *, debug: bool, database_url: str | None = None) -> NoReturn:
    """Print the failure as one masked line (and the trace with --debug), then exit."""
    if debug:
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        click.echo(mask_secrets(trace), err=True, nl=False)
    failure = explain(exc, database_url)
    line = failure.message + (f"; next step: {failure.next_step}" if failure.next_step else "")
    click.echo(f"{PROG}: {mask_secrets(line)}", err=True)
    sys.exit(failure.exit_code)
