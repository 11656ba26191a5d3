"""The settings toolkit the control plane, the agent and the worker declare their variables
against: the spec of a variable, the unknown-name check with its hint, the type parsers, one
rule for blank values, and the ``--help`` section that lists them. Standard library only.

The one rule for blank values: a variable that is unset *or* set to nothing but whitespace
takes its default (``NAME=`` in an env file, or a compose file's ``${NAME:-}``, means "not
set"); any other value is used with its surrounding whitespace removed.

Each program keeps its own settings module that declares a :class:`Settings` table and
parses its values with it; that module is the only one of the program that reads
``os.environ``.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SettingSpec:
    """One variable: its name, its default (``None``: no default) and what it means."""

    name: str
    default: str | None
    meaning: str


class SettingTable:
    """A program's declared variables, and the parsers that read them from an environment.

    ``error`` is the program's own configuration error (its CLI prints it in one line and
    exits 2). Names starting with one of ``prefixes`` must be declared; ``foreign_prefixes``
    and ``foreign_names`` belong to the other programs and are left alone. ``unknown_hint``
    ends the refusal of an unknown name when no declared name is close to it.
    """

    def __init__(
        self,
        specs: Sequence[SettingSpec],
        *,
        prefixes: tuple[str, ...],
        error: type[Exception],
        unknown_hint: str,
        foreign_prefixes: tuple[str, ...] = (),
        foreign_names: Iterable[str] = (),
        retired: Mapping[str, str] | None = None,
    ) -> None:
        self.specs = tuple(specs)
        self.names = frozenset(spec.name for spec in self.specs)
        if len(self.names) != len(self.specs):
            raise ValueError("a setting is declared twice")
        self.defaults = {spec.name: spec.default for spec in self.specs}
        self.prefixes = prefixes
        self.error = error
        self.unknown_hint = unknown_hint
        self.foreign_prefixes = foreign_prefixes
        self.foreign_names = frozenset(foreign_names)
        # Names a release used and a later one dropped: ignored, with why, so an env file
        # written for the older release still starts (an unknown name stays fatal).
        self.retired = dict(retired or {})

    # -- names -------------------------------------------------------------------------

    def nearest(self, name: str) -> str | None:
        """The declared name closest to a mistyped one, if any is close."""
        matches = difflib.get_close_matches(name, sorted(self.names), n=1, cutoff=0.6)
        return matches[0] if matches else None

    def check_names(self, env: Mapping[str, str]) -> None:
        """Refuse the first (sorted) undeclared name of ours, with the nearest one as hint;
        a retired one is logged as ignored."""
        for name in sorted(env):
            if not name.startswith(self.prefixes) or name in self.names:
                continue
            if name in self.retired:
                log.warning("%s is no longer used and is ignored: %s", name, self.retired[name])
                continue
            if name.startswith(self.foreign_prefixes) or name in self.foreign_names:
                continue
            hint = self.nearest(name)
            suffix = f"; did you mean {hint}?" if hint else f"; {self.unknown_hint}"
            raise self.error(f"unknown setting {name}{suffix}")

    # -- values --------------------------------------------------------------------------

    def value(self, env: Mapping[str, str], name: str) -> str | None:
        """The value of a declared variable under the one blank rule (module docstring)."""
        if name not in self.names:
            raise KeyError(f"{name} is not a declared setting")
        raw = env.get(name)
        if raw is None or not raw.strip():
            return self.defaults[name]
        return raw.strip()

    def integer(self, env: Mapping[str, str], name: str, minimum: int, maximum: int) -> int:
        raw = self.value(env, name) or ""
        try:
            value = int(raw)
        except ValueError:
            raise self.error(f"{name}={raw!r} is not a whole number") from None
        if not minimum <= value <= maximum:
            raise self.error(f"{name}={value} is outside {minimum}..{maximum}")
        return value

    def number(self, env: Mapping[str, str], name: str, minimum: float, maximum: float) -> float:
        raw = self.value(env, name) or ""
        try:
            value = float(raw)
        except ValueError:
            raise self.error(f"{name}={raw!r} is not a number") from None
        if not minimum <= value <= maximum:
            raise self.error(f"{name}={value:g} is outside {minimum:g}..{maximum:g}")
        return value

    def boolean(self, env: Mapping[str, str], name: str) -> bool:
        raw = (self.value(env, name) or "").lower()
        if raw in TRUE_WORDS:
            return True
        if raw in FALSE_WORDS:
            return False
        raise self.error(f"{name}={raw!r} is not true or false")

    def choice(self, env: Mapping[str, str], name: str, choices: Sequence[str]) -> str:
        """One of ``choices``, compared in their own case (all lower or all upper)."""
        raw = self.value(env, name) or ""
        value = raw.upper() if all(c.isupper() for c in choices) else raw.lower()
        if value not in choices:
            *first, last = choices
            shown = f"{', '.join(first)} or {last}" if first else last
            raise self.error(f"{name}={value!r} is not {shown}")
        return value

    def log_level(self, env: Mapping[str, str], name: str) -> str:
        return self.choice(env, name, LOG_LEVELS)

    # -- help ----------------------------------------------------------------------------

    def help_rows(self) -> list[tuple[str, str]]:
        """(name, meaning [default]) for every variable, as ``--help`` lists them."""
        return [
            (spec.name, spec.meaning + (f" [default: {spec.default}]" if spec.default else ""))
            for spec in self.specs
        ]

    def write_help(self, formatter: Any) -> None:
        """The "Environment variables" section of a click command's ``--help``."""
        with formatter.section("Environment variables"):
            formatter.write_dl(self.help_rows())
