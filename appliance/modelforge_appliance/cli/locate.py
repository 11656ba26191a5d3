"""Which store a command uses, where that came from, and that it exists.

``scripts/run`` writes the store's location into its virtualenv (``.venv/modelforge.env``,
beside the ``modelforge`` it runs), so ``.venv/bin/modelforge …`` in the same clone finds the
store the server uses, as pip finds ``pip.conf`` in a virtualenv. The environment and
``--env-file`` still win. Only ``init`` and ``serve`` create a store; every other command
refuses a missing one, naming where it looked.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.clock import Clock
from ..core.settings import Settings
from ..runtime.doctor import sqlite_file
from ..store.database import Store, redact_url
from ..store.migrations import SCHEMA_VERSION
from .errors import CliError

VENV_SETTINGS_NAME = "modelforge.env"


def venv_settings_file() -> Path | None:
    """The settings scripts/run left in this program's virtualenv, if it runs from one."""
    if sys.prefix == sys.base_prefix:
        return None
    path = Path(sys.prefix) / VENV_SETTINGS_NAME
    return path if path.is_file() else None


def describe_store(settings: Settings) -> str:
    path = sqlite_file(settings.database_url)
    return str(path) if path is not None else redact_url(settings.database_url)


def missing_store(settings: Settings, settings_file: Path | None) -> CliError:
    where = describe_store(settings)
    hint = f" (settings from {settings_file})" if settings_file else ""
    return CliError(
        f"no ModelForge store at {where}{hint}",
        "run `modelforge init` (scripts/run does) for a new one; or point MODELFORGE_STATE_DIR "
        "or --env-file at the control plane's settings (under systemd: /etc/modelforge/"
        "modelforge.env, see docs/install-systemd.md)",
    )


def require_store_file(settings: Settings, settings_file: Path | None) -> None:
    """Exit 2 when a SQLite store's file does not exist (opening it would create it)."""
    path = sqlite_file(settings.database_url)
    if path is not None and not path.is_file():
        raise missing_store(settings, settings_file)


def open_existing_store(settings: Settings, settings_file: Path | None) -> Store:
    """The store, migrated; exit 2 when there is none yet (nothing is created here).

    A SQLite store is a file; a PostgreSQL database without the ModelForge schema is no
    store yet either.
    """
    require_store_file(settings, settings_file)
    store = Store(settings.database_url, Clock())
    try:
        version = store.current_version()
        if not store.is_sqlite and version == 0:
            raise missing_store(settings, settings_file)
        if version != SCHEMA_VERSION:  # a current store needs no write (and no fsync) here
            store.migrate()
    except BaseException:
        store.close()
        raise
    return store
