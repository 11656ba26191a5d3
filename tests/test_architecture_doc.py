"""docs/architecture.md is where every pointer in the code lands, and each one resolves.

The repository refers into the architecture document in two forms only (its first section
says so): ``docs/architecture.md §N`` for a section and ``invariant N`` for one of the
numbered invariants. These tests scan every text file of the repository for both forms and
fail on one that names no heading of the document, on a pointer in another form, and on any
mention of the design document the project started from (it is not in the repository). They
also check that every test the invariants section names still exists.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
DOC_NAME = "docs/architecture.md"
THIS_FILE = Path(__file__).resolve()

SCANNED_DIRS = (
    "appliance",
    "agent",
    "worker",
    "contract",
    "release",
    "packaging",
    "scripts",
    "bench",
    "tests",
    "systemd",
    "docs",
)
SCANNED_FILES = ("README.md", "pyproject.toml")
SCANNED_GLOBS = ("docker-compose*.yml",)
SKIPPED_DIRS = {"__pycache__", "vendor", "node_modules"}

SECTION_PREFIX = f"{DOC_NAME} "
# A section id runs to its last letter or digit: "§7a", and "§2.3" whole (which is no section).
SECTION_ID = r"§([0-9A-Za-z.]*[0-9A-Za-z])"
SECTION_REF = re.compile(re.escape(SECTION_PREFIX) + SECTION_ID)
BARE_SECTION_REF = re.compile(SECTION_ID)
INVARIANT_REF = re.compile(r"\b[Ii]nvariant (\d+)\b")
PLURAL_INVARIANTS = re.compile(r"\b[Ii]nvariants \d")
# The design document the project started from: not in the repository, so never a target.
ABSENT_DOCUMENT = re.compile(r"\bDESIGN\b|DESIGN\.md")
# Pointers into the document in some other form than a section number.
LOOSE_POINTER = re.compile(
    r"architecture\.md,? (?:the|invariant|section)\b"
    r"|\b(?:layer map|invariants?|sections?) (?:of|in) docs/architecture\.md"
)

SECTION_HEADING = re.compile(r"^## §(\S+) ", re.M)
INVARIANT_HEADING = re.compile(r"^### Invariant (\d+): ", re.M)
NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)::([\w:]+)`")


@dataclass
class Scan:
    """What one text (or the whole repository) holds: references and misshapen pointers."""

    sections: list[tuple[str, int, str]] = field(default_factory=list)
    invariants: list[tuple[str, int, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)

    def extend(self, other: Scan) -> None:
        self.sections += other.sections
        self.invariants += other.invariants
        self.problems += other.problems
        self.absent += other.absent


def _line(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def scan_text(text: str, where: str, in_doc: bool = False) -> Scan:
    """The references in ``text``; ``in_doc``: the document itself, where a bare §N is fine."""
    scan = Scan()
    pattern = BARE_SECTION_REF if in_doc else SECTION_REF
    for match in pattern.finditer(text):
        scan.sections.append((where, _line(text, match.start()), match.group(1)))
    for match in INVARIANT_REF.finditer(text):
        scan.invariants.append((where, _line(text, match.start()), int(match.group(1))))
    if not in_doc:
        for match in re.finditer("§", text):
            if text[: match.start()].endswith(SECTION_PREFIX):
                continue
            scan.problems.append(
                f"{where}:{_line(text, match.start())}: a § that is not part of "
                f"'{SECTION_PREFIX}§N'"
            )
    for match in PLURAL_INVARIANTS.finditer(text):
        scan.problems.append(
            f"{where}:{_line(text, match.start())}: {match.group(0)!r}: name each one "
            "('invariant 7 and invariant 8')"
        )
    for match in LOOSE_POINTER.finditer(text):
        scan.problems.append(
            f"{where}:{_line(text, match.start())}: {match.group(0)!r}: point at a section "
            f"number ('{SECTION_PREFIX}§8') or an invariant ('invariant 4')"
        )
    for match in ABSENT_DOCUMENT.finditer(text):
        line = _line(text, match.start())
        quoted = text.splitlines()[line - 1].strip()
        scan.absent.append(f"{where}:{line}: {quoted}")
    return scan


def scanned_paths() -> list[Path]:
    paths = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for pattern in SCANNED_GLOBS:
        paths += sorted(ROOT.glob(pattern))
    for name in SCANNED_DIRS:
        for path in sorted((ROOT / name).rglob("*")):
            parts = path.relative_to(ROOT).parts
            if any(part in SKIPPED_DIRS or part.startswith(".") for part in parts):
                continue
            if path.is_file() and path.resolve() != THIS_FILE:
                paths.append(path)
    return paths


def read_text(path: Path) -> str | None:
    """The file as text, or None for a binary one (images, archives) or one gone since the
    listing (files move while others work in the checkout)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_repository() -> Scan:
    scan = Scan()
    for path in scanned_paths():
        text = read_text(path)
        if text is not None:
            where = str(path.relative_to(ROOT))
            scan.extend(scan_text(text, where, in_doc=path.resolve() == DOC.resolve()))
    return scan


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def section_ids(text: str) -> set[str]:
    return set(SECTION_HEADING.findall(text))


def invariant_numbers(text: str) -> list[int]:
    return [int(number) for number in INVARIANT_HEADING.findall(text)]


def unresolved(scan: Scan, text: str) -> list[str]:
    sections, invariants = section_ids(text), set(invariant_numbers(text))
    problems = []
    for where, line, section in scan.sections:
        if section not in sections:
            hint = ""
            if re.fullmatch(r"2\.\d+", section):
                hint = f" (an invariant: write 'invariant {section.split('.')[1]}')"
            problems.append(f"{where}:{line}: §{section} is no section of {DOC_NAME}{hint}")
    for where, line, number in scan.invariants:
        if number not in invariants:
            problems.append(f"{where}:{line}: invariant {number} is not in {DOC_NAME} §2")
    return problems


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return "#" + kept.replace(" ", "-")


# -- the document itself ------------------------------------------------------------------


def test_the_document_numbers_its_sections_and_all_eleven_invariants():
    text = doc_text()
    assert section_ids(text) >= {"1", "2", "3", "4", "5", "6", "7", "7a", "8"}
    assert invariant_numbers(text) == list(range(1, 12))


def test_every_anchor_the_document_lists_is_one_of_its_headings():
    text = doc_text()
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    anchors = {github_anchor(heading) for heading in headings}
    listed = re.findall(r"`(#[a-z0-9-]+)`", text)
    assert len(listed) >= 10, listed
    assert sorted(set(listed) - anchors) == []


def test_every_test_named_for_an_invariant_exists():
    text = doc_text()
    start = text.index("\n## §2 ")
    end = text.index("\n## ", start + 1)
    blocks = re.split(r"^### ", text[start:end], flags=re.M)[1:]
    assert len(blocks) == 11
    missing = []
    for block in blocks:
        heading = block.splitlines()[0]
        named = NAMED_TEST.findall(block)
        if not named:
            missing.append(f"{heading}: names no test")
        for relative, qualified in named:
            path = ROOT / relative
            if not path.is_file():
                missing.append(f"{heading}: {relative} does not exist")
                continue
            defined = {
                node.name
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            }
            wanted = qualified.split("::")
            if not set(wanted) <= defined or not wanted[-1].startswith("test_"):
                missing.append(f"{heading}: {relative} defines no {qualified}")
    assert missing == []


# -- the references in the repository ------------------------------------------------------


def test_every_section_and_invariant_reference_resolves():
    assert unresolved(scan_repository(), doc_text()) == []


def test_references_take_the_one_form():
    assert scan_repository().problems == []


def test_nothing_points_at_the_design_document_that_is_not_in_the_repository():
    assert scan_repository().absent == []


def test_the_scanner_finds_the_references_the_repository_holds():
    """The checks above pass vacuously if the scanner sees nothing: the repository holds
    dozens of references, in code, scripts and docs alike."""
    scan = scan_repository()
    outside_doc = [ref for ref in scan.sections if ref[0] != DOC_NAME]
    assert len(outside_doc) + len(scan.invariants) > 30
    assert len(outside_doc) > 15 and len(scan.invariants) > 15
    files = {ref[0] for ref in outside_doc} | {ref[0] for ref in scan.invariants}
    assert {"pyproject.toml", "scripts/test"} <= files
    assert any(name.startswith("tests/") for name in files)


def test_the_scanner_catches_each_kind_of_wrong_reference():
    design = "DESIGN"
    sample = "\n".join(
        [
            f"ok: ({DOC_NAME} §5) and (invariant 4), Invariant 11.",
            f"gone: ({DOC_NAME} §42) and invariant 42",
            f"an old number: ({DOC_NAME} §2.11)",
            f"elsewhere: ({design} §3) and {design}.md",
            "plural: invariants 7 and 8",
            f"loose: ({DOC_NAME}, the layer map)",
        ]
    )
    scan = scan_text(sample, "sample.py")
    assert [ref[2] for ref in scan.sections] == ["5", "42", "2.11"]
    assert [ref[2] for ref in scan.invariants] == [4, 11, 42]
    problems = unresolved(scan, doc_text())
    assert len(problems) == 3, problems
    assert any("write 'invariant 11'" in problem for problem in problems), problems
    assert len(scan.absent) == 2
    # the stray § of the old reference, the plural, the loose pointer
    assert len(scan.problems) == 3, scan.problems
    in_doc = scan_text("see §5 and §7a", DOC_NAME, in_doc=True)
    assert [ref[2] for ref in in_doc.sections] == ["5", "7a"] and in_doc.problems == []
