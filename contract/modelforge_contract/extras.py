"""One line instead of a traceback when a console script is installed without its extra.

``pip install .`` without ``[appliance]`` (or ``[agent]``) installs the command but not what
it imports; the entry points catch that import and name the extra to install.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from . import EXIT_USAGE


def missing_extra_message(program: str, extra: str, module: str) -> str:
    return (
        f"{program}: the {extra} extra is not installed (no module named {module!r}); install "
        f"it with: pip install 'modelforge[{extra}]' (from a checkout: pip install -e "
        f"'.[{extra}]')"
    )


def exit_if_extra_missing(
    exc: ModuleNotFoundError, program: str, extra: str, modules: frozenset[str]
) -> NoReturn:
    """Exit 2 naming EXTRA when the missing module is one of its MODULES; re-raise otherwise."""
    module = (exc.name or "").split(".")[0]
    if module not in modules:
        raise exc
    print(missing_extra_message(program, extra, module), file=sys.stderr)
    sys.exit(EXIT_USAGE)
