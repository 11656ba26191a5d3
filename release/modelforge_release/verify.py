"""Check the files a SHA256SUMS lists, the way ``sha256sum -c`` does, reading names relative
to the directory that holds SHA256SUMS rather than the current directory."""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .digest import sha256_file
from .sums import display_name, parse_sums

log = logging.getLogger(__name__)


@dataclass
class CheckOutcome:
    matched: int = 0
    mismatched: int = 0
    unreadable: int = 0
    missing_ignored: int = 0
    listed: int = 0

    @property
    def verified(self) -> int:
        return self.matched + self.mismatched

    @property
    def ok(self) -> bool:
        return self.listed > 0 and not self.mismatched and not self.unreadable and self.verified > 0


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def summary_lines(outcome: CheckOutcome, sums_name: str, ignore_missing: bool) -> list[str]:
    """The warnings ``sha256sum -c`` ends with, worded the same way."""
    if outcome.listed == 0:
        return [f"{sums_name}: no properly formatted checksum lines found"]
    lines = []
    if outcome.unreadable:
        lines.append("WARNING: " + _plural(outcome.unreadable, "listed file could not be read", "listed files could not be read"))  # fmt: skip
    if outcome.mismatched:
        lines.append("WARNING: " + _plural(outcome.mismatched, "computed checksum did NOT match", "computed checksums did NOT match"))  # fmt: skip
    if ignore_missing and outcome.verified == 0 and not outcome.unreadable:
        lines.append(f"{sums_name}: no file was verified")
    return lines


def check_sums(
    sums_path: Path,
    *,
    ignore_missing: bool = False,
    quiet: bool = False,
    out: TextIO,
    err: TextIO,
    progress: TextIO | None = None,
    prog: str = "modelforge-release",
) -> CheckOutcome:
    """Verify every entry; print per-file lines on ``out`` and warnings on ``err``.

    Raises ``MalformedLine`` before any file is read if a line is malformed or unsafe, so a
    bad SHA256SUMS never costs a pass over gigabytes.
    """
    entries = parse_sums(sums_path.read_bytes(), str(sums_path))
    base = sums_path.parent
    outcome = CheckOutcome(listed=len(entries))
    for entry in entries:
        shown = display_name(entry.name)
        try:
            actual = sha256_file(base / entry.name, shown, progress)
        except OSError as exc:
            if ignore_missing and exc.errno == errno.ENOENT:
                outcome.missing_ignored += 1
                continue
            outcome.unreadable += 1
            err.write(f"{prog}: {shown}: {exc.strerror or exc}\n")
            out.write(f"{shown}: FAILED open or read\n")
            out.flush()
            continue
        if actual == entry.digest:
            outcome.matched += 1
            if not quiet:
                out.write(f"{shown}: OK\n")
        else:
            outcome.mismatched += 1
            log.info("%s: expected %s, computed %s", shown, entry.digest, actual)
            out.write(f"{shown}: FAILED\n")
        out.flush()
    for line in summary_lines(outcome, str(sums_path), ignore_missing):
        err.write(f"{prog}: {line}\n")
    err.flush()
    return outcome
