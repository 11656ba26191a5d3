"""Look-alike names: the key two names share when a person could not tell them apart.

Hostnames come from the nodes themselves, so a compromised node can claim one that reads
exactly like another node's in the console: ``gpu‑01`` with a non-breaking hyphen, a
Cyrillic ``о`` for a Latin ``o``, ``gpu-0l`` for ``gpu-01``. ``lookalike_key`` folds such
variants together, in this order:

1. NFKC, which undoes compatibility forms (full-width letters, ligatures, the non-breaking
   hyphen U+2011 becomes U+2010), then case folding;
2. the removal of invisible characters (``invisible``): format characters such as the
   zero-width space and the soft hyphen, variation selectors, the Hangul fillers. Names
   refuse format characters since this release (core/validation.py), but a store may hold
   some from before;
3. the skeleton of Unicode Technical Standard #39 (``skeleton``) over Unicode's own
   confusables data, ``vendor/confusables.txt`` (Version 13.0.0, unmodified; its source and
   hash are in ``vendor/VENDORED.json``), then case folding and the skeleton once more, so
   ``0`` (whose prototype is ``O``) and ``o`` meet.

Two names with the same key are confusable. Different keys are no promise that two names
are not: the data knows characters, not every font.
"""

from __future__ import annotations

import unicodedata
from functools import cache, lru_cache
from importlib import resources

# Invisible, but neither format characters nor controls: the combining grapheme joiner,
# the Hangul fillers, the Mongolian free variation selectors and the variation selectors
# (the rest of Unicode's Default_Ignorable_Code_Point that Python can name by category).
_IGNORABLE = frozenset(
    [chr(c) for c in (0x034F, 0x115F, 0x1160, 0x3164, 0xFFA0)]
    + [chr(c) for c in range(0x180B, 0x1810)]
    + [chr(c) for c in range(0xFE00, 0xFE10)]
    + [chr(c) for c in range(0xE0100, 0xE01F0)]
)
# Refused in names (core/validation.py): format characters (Cf: zero-width space and
# joiners, the soft hyphen, bidirectional marks, the byte order mark) and the line and
# paragraph separators, which break a name across lines.
_REFUSED_IN_NAMES = frozenset({"Cf", "Zl", "Zp"})


def invisible(char: str) -> bool:
    """Whether the character draws nothing where it stands."""
    return unicodedata.category(char) == "Cf" or char in _IGNORABLE


def first_refused_in_name(text: str) -> str | None:
    """The first character a name may not hold, or None: a format character or separator."""
    return next((c for c in text if unicodedata.category(c) in _REFUSED_IN_NAMES), None)


@cache
def _prototypes() -> dict[str, str]:
    """Each confusable character and its prototype, from confusables.txt's
    ``source ; target ; type # comment`` lines (code points in hex)."""
    data = resources.files(__package__).joinpath("vendor").joinpath("confusables.txt")
    table: dict[str, str] = {}
    for line in data.read_text(encoding="utf-8-sig").splitlines():
        fields = line.split("#", 1)[0].split(";")
        if len(fields) < 2:
            continue
        source, target = fields[0].strip(), fields[1].split()
        table[chr(int(source, 16))] = "".join(chr(int(point, 16)) for point in target)
    return table


def skeleton(text: str) -> str:
    """UTS #39's skeleton: NFD, every character replaced by its prototype, NFD again."""
    table = _prototypes()
    mapped = "".join(table.get(char, char) for char in unicodedata.normalize("NFD", text))
    return unicodedata.normalize("NFD", mapped)


@lru_cache(maxsize=16384)
def lookalike_key(name: str) -> str:
    """What ``name`` looks like: equal for names a person could take for one another."""
    folded = unicodedata.normalize("NFKC", name).casefold()
    visible = "".join(char for char in folded if not invisible(char))
    return skeleton(skeleton(visible).casefold())
