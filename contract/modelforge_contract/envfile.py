"""``KEY=VALUE`` env files as systemd's ``EnvironmentFile=`` and ``docker run --env-file``
read them: one setting a line, ``#`` comments, optional ``export`` and matching quotes.

Written values are never quoted (docker would keep the quotes), so :func:`format_env_file`
refuses a value that only quoting could carry. Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

_UNSAFE = re.compile(r"[\s\"'\\$`#]")


def parse_env_file(text: str, where: str = "env file") -> dict[str, str]:
    """The settings in ``text``; ValueError naming the line that is not NAME=VALUE."""
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.removeprefix("export ").partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"{where}:{number} is not NAME=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name.strip()] = value
    return values


def format_env_file(values: dict[str, str], header: str) -> str:
    """``# header`` then ``NAME=VALUE`` lines; ValueError for a value that needs quoting."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, value in values.items():
        if not name.isidentifier() or _UNSAFE.search(value):
            raise ValueError(
                f"{name}={value!r}: env files here hold values without spaces, quotes, "
                "backslashes, $, ` or #"
            )
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def read_env_file(path: Path, error: type[Exception]) -> dict[str, str]:
    """PATH read as systemd's EnvironmentFile= reads it; any fault raises ERROR (the caller's
    configuration error) with one line naming the file and the cause."""
    try:
        return parse_env_file(path.read_text(encoding="utf-8"), str(path))
    except OSError as exc:
        raise error(f"cannot read env file {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(str(exc)) from None
