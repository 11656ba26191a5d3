"""SHA256SUMS in GNU coreutils format: lines, escaping, the template, and the atomic write.

A line is ``<64 hex>  <name>`` (text mode) or ``<64 hex> *<name>`` (binary mode, read only).
Names are relative to the directory holding SHA256SUMS. As coreutils does, a name holding a
backslash, newline or carriage return is written escaped, with the line prefixed by ``\\``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from modelforge_contract.files import write_atomically

from .digest import sha256_file

log = logging.getLogger(__name__)

HEX_LENGTH = 64
VERSION_PLACEHOLDER = "{version}"
_HEX = re.compile(rb"[0-9a-fA-F]{64}")
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r"}
_UNESCAPES = {ord("\\"): "\\", ord("n"): "\n", ord("r"): "\r"}


class SumsError(Exception):
    """A SHA256SUMS or template problem the user must fix (exit 2)."""


class MalformedLine(SumsError):
    def __init__(self, source: str, line: int, reason: str) -> None:
        super().__init__(f"{source}: line {line}: {reason}")
        self.line = line


@dataclass(frozen=True)
class Entry:
    digest: str  # lower-case hex
    name: str  # as on disk, relative to the SHA256SUMS directory
    binary: bool = False
    line: int = 0


def unsafe_name_reason(name: str) -> str | None:
    """Why ``name`` may not appear in SHA256SUMS, or None: it must stay inside its directory."""
    if not name:
        return "empty file name"
    if name.startswith("/"):
        return f"absolute file name {name!r} refused"
    if ".." in name.split("/"):
        return f"file name {name!r} leaves the SHA256SUMS directory ('..')"
    if "\0" in name:
        return "file name contains a NUL byte"
    return None


def format_line(digest: str, name: str) -> bytes:
    """One line exactly as ``sha256sum`` (coreutils 9) writes it in text mode."""
    if any(char in name for char in _ESCAPES):
        escaped = "".join(_ESCAPES.get(char, char) for char in name)
        return b"\\" + f"{digest}  ".encode() + os.fsencode(escaped) + b"\n"
    return f"{digest}  ".encode() + os.fsencode(name) + b"\n"


def display_name(name: str) -> str:
    """The name as ``sha256sum -c`` of current coreutils (9.7, in Debian 13) prints it:
    escaped, with a leading ``\\``, when it holds a backslash, newline or carriage return —
    the same form as in SHA256SUMS. (coreutils 9.1, in Debian 12, escaped only names with a
    newline and printed a carriage return raw, which can garble a terminal line.)"""
    if any(char in name for char in _ESCAPES):
        return "\\" + "".join(_ESCAPES.get(char, char) for char in name)
    return name


def _unescape(name: str) -> str | None:
    out, chars = [], iter(name)
    for char in chars:
        if char == "\\":
            following = next(chars, "")
            if not following or ord(following) not in _UNESCAPES:
                return None
            out.append(_UNESCAPES[ord(following)])
        else:
            out.append(char)
    return "".join(out)


def parse_line(raw: bytes, source: str, number: int) -> Entry | None:
    """One SHA256SUMS line, read the way ``sha256sum -c`` reads it; None for comments/blanks."""
    if raw.startswith(b"#"):
        return None
    raw = raw.removesuffix(b"\r")  # files written on Windows
    if not raw:
        return None
    text = raw.lstrip(b" \t")
    escaped = text.startswith(b"\\")
    text = text[1:] if escaped else text
    if not _HEX.match(text):
        raise MalformedLine(source, number, "expected 64 hex digits, two spaces and a file name")
    separator = text[HEX_LENGTH : HEX_LENGTH + 2]
    # coreutils wants whitespace then ' ' (text) or '*' (binary); a single space is BSD's
    # reversed format, which it refuses too: a name with a leading space would be ambiguous.
    if (
        len(separator) != 2
        or separator[:1] not in (b" ", b"\t")
        or separator[1:] not in (b" ", b"*")
    ):
        raise MalformedLine(source, number, "expected two spaces (or ' *') between sum and name")
    name = os.fsdecode(text[HEX_LENGTH + 2 :])
    if escaped:
        unescaped = _unescape(name)
        if unescaped is None:
            raise MalformedLine(source, number, "bad backslash escape in file name")
        name = unescaped
    reason = unsafe_name_reason(name)
    if reason:
        raise MalformedLine(source, number, reason)
    digest = text[:HEX_LENGTH].decode("ascii").lower()
    return Entry(digest, name, binary=separator[1:] == b"*", line=number)


def parse_sums(data: bytes, source: str) -> list[Entry]:
    """Every entry of a SHA256SUMS file; the first malformed or unsafe line raises."""
    entries = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        entry = parse_line(raw, source, number)
        if entry:
            entries.append(entry)
    return entries


def read_template(path: Path, version: str | None) -> list[str]:
    """Release file names in release order, ``{version}`` filled in; ``#`` lines are comments."""
    names: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if VERSION_PLACEHOLDER in line:
            if version is None:
                raise SumsError(f"{path}: line {number} needs --version ({line})")
            line = line.replace(VERSION_PLACEHOLDER, version)
        if "{" in line or "}" in line:
            raise SumsError(f"{path}: line {number}: unknown placeholder in {line!r}")
        reason = unsafe_name_reason(line)
        if reason:
            raise SumsError(f"{path}: line {number}: {reason}")
        if line in names:
            raise SumsError(f"{path}: line {number}: {line} is listed twice")
        names.append(line)
    if not names:
        raise SumsError(f"{path}: lists no files")
    return names


def check_version(version: str) -> None:
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+_-]*", version):
        raise SumsError(f"--version {version!r}: use letters, digits and . + _ - only")


def names_relative_to(directory: Path, files: Iterable[Path]) -> list[tuple[str, Path]]:
    """(name in SHA256SUMS, path) for each file; every file must sit under ``directory``."""
    base = Path(os.path.abspath(directory))
    named: dict[str, Path] = {}
    for path in files:
        name = os.path.relpath(os.path.abspath(path), base)
        if unsafe_name_reason(name):
            raise SumsError(f"{path} is not inside {base}, where SHA256SUMS is written")
        if name in named:
            raise SumsError(f"{path} is given twice")
        named[name] = path
    return list(named.items())


def order_by_template(
    named: list[tuple[str, Path]], template: Sequence[str]
) -> list[tuple[str, Path]]:
    """The files in template order; a file the template lacks, or a template file not given,
    is an error: a release must hold exactly what the template says."""
    given = dict(named)
    extra = sorted(set(given) - set(template))
    if extra:
        raise SumsError(f"not in the template: {', '.join(extra)}")
    absent = [name for name in template if name not in given]
    if absent:
        raise SumsError(f"listed in the template but not given: {', '.join(absent)}")
    return [(name, given[name]) for name in template]


def compute_entries(
    named: Sequence[tuple[str, Path]], progress: TextIO | None = None
) -> list[Entry]:
    """Hash every file (OSError propagates: nothing has been written yet)."""
    return [Entry(sha256_file(path, name, progress), name) for name, path in named]


def write_sums(path: Path, entries: Sequence[Entry]) -> None:
    """SHA256SUMS, atomically, public (0644)."""
    write_atomically(
        path, b"".join(format_line(entry.digest, entry.name) for entry in entries), mode=0o644
    )
    log.info("wrote %s", path)
