"""What every ``modelforge`` subcommand shares: lazily loaded settings and store, output."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from modelforge_contract import EXIT_USAGE
from modelforge_contract.logs import configure_logging

from .. import statelock
from ..settings import Settings, load_settings
from ..store import Store

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


class Context:
    def __init__(self, env_file: Path | None) -> None:
        self.env_file = env_file
        self._settings: Settings | None = None
        self._store: Store | None = None
        self._lock: statelock.StateLock | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(env_file=self.env_file)
            configure_logging(
                self._settings.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        return self._settings

    def store(self) -> Store:
        """The one store of this command, opened and migrated on first use.

        The state lock comes first and is held until the command ends: while a restore
        runs, the command is refused (exit 2) before it reads, migrates or writes anything.
        """
        from ..backup import clear_interrupted_restore
        from ..server import open_store

        if self._store is None:
            if self._lock is None:
                self._lock = statelock.acquire(self.settings, exclusive=False)
                clear_interrupted_restore(self.settings)
            self._store = open_store(self.settings)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def fail(message: str, code: int = EXIT_USAGE) -> None:
    click.echo(f"modelforge: {message}", err=True)
    sys.exit(code)


def emit(as_json: bool, payload: Any, text: str) -> None:
    click.echo(json.dumps(payload, indent=2) if as_json else text)


def confirmed(question: str) -> bool:
    """Ask on the terminal; no answer (closed stdin, Ctrl-D) means no."""
    try:
        return click.confirm(question, default=False)
    except click.Abort:
        click.echo("", err=True)
        return False
