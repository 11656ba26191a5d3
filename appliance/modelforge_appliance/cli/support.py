"""What every ``modelforge`` subcommand shares: lazily loaded settings and store, output."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click

from modelforge_contract import EXIT_CHECK_FAILED, EXIT_USAGE
from modelforge_contract.logs import configure_logging

from ..core.settings import Settings, load_settings
from ..store import statelock
from ..store.backup import clear_interrupted_restore
from ..store.database import Store, open_store
from . import locate
from .ownership import require_state_owner

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON.")

_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class Context:
    def __init__(self, env_file: Path | None, debug: bool = False) -> None:
        # Without --env-file, the settings scripts/run left in this virtualenv (locate.py).
        self.env_file = env_file or locate.venv_settings_file()
        self.debug = debug
        self._settings: Settings | None = None
        self._store: Store | None = None
        self._lock: statelock.StateLock | None = None

    @property
    def database_url(self) -> str | None:
        """The store's URL once settings are loaded (for error messages), else None."""
        return self._settings.database_url if self._settings else None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(env_file=self.env_file)
            configure_logging(
                self._settings.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        return self._settings

    def store(self, create: bool = False) -> Store:
        """The one store of this command, opened and migrated on first use.

        Only ``init`` and ``serve`` pass ``create``; any other command on a missing store
        exits 2 naming where it looked, and leaves nothing behind. The owner check comes
        first (a lock file or WAL made by another user would lock the service out), then
        the state lock, held until the command ends: while a restore runs, the command is
        refused (exit 2) before it reads, migrates or writes anything. Says on stderr which
        store it uses.
        """
        if self._store is None:
            require_state_owner(self.settings)
            if not create:
                # Before the lock, which would create the state directory.
                locate.require_store_file(self.settings, self.env_file)
            if self._lock is None:
                self._lock = statelock.acquire(self.settings, exclusive=False)
                clear_interrupted_restore(self.settings)
            if create:
                self._store = open_store(self.settings)
            else:
                self._store = locate.open_existing_store(self.settings, self.env_file)
            self.announce_store()
        return self._store

    def announce_store(self) -> None:
        """Say on stderr which store this command uses, and where that came from."""
        source = f" (settings from {self.env_file})" if self.env_file else ""
        click.echo(f"modelforge: store {locate.describe_store(self.settings)}{source}", err=True)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def duration_seconds(text: str, option: str, low: int, high: int, examples: str) -> int:
    """Whole seconds from ``90s``, ``10m``, ``1h``, ``2d`` or plain seconds, between ``low``
    and ``high`` (as the ``examples`` say); a usage error naming ``option`` otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise click.BadParameter(
            f"{text!r} is not a duration; use one such as {examples}", param_hint=option
        )
    seconds = int(match.group(1)) * _UNIT[match.group(2)]
    if not low <= seconds <= high:
        raise click.BadParameter(
            f"{text!r} is not between {_shown(low)} and {_shown(high)}", param_hint=option
        )
    return seconds


def _shown(seconds: int) -> str:
    """300 as 5m, 86400 as 24h, 30 days as 30d."""
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds % size == 0 and seconds >= size * (2 if unit == "d" else 1):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def fail(message: str, code: int = EXIT_USAGE) -> None:
    click.echo(f"modelforge: {message}", err=True)
    sys.exit(code)


def emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=2) if as_json else text)


def confirmed(question: str) -> bool:
    """Ask on stderr (stdout stays for the answer); no answer (closed stdin, Ctrl-D) means no."""
    try:
        return click.confirm(question, default=False, err=True)
    except click.Abort:
        click.echo("", err=True)
        return False


def confirm_or_refuse(question: str, yes: bool, as_json: bool) -> None:
    """Go on when --yes was given or the operator agrees; a script (--json) must say --yes."""
    if yes:
        return
    if as_json:
        fail("--json does not ask questions: add --yes to go ahead")
    if not confirmed(question):
        fail("nothing was changed", code=EXIT_CHECK_FAILED)


def files_text(count: int) -> str:
    """``1 file``, ``3 files``."""
    return "1 file" if count == 1 else f"{count} files"


def size_text(count: int) -> str:
    """Bytes in binary units: ``512 B``, ``3.0 MiB``, ``1.2 TiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
