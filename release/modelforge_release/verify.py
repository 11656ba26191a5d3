"""The verifiers that need no daemon.

``check_sums`` checks the files a SHA256SUMS lists, the way ``sha256sum -c`` does, reading
names relative to the directory that holds SHA256SUMS rather than the current directory.
``verify_bundle`` checks a whole release directory: the signature over SHA256SUMS when
given the allowed signers, SHA256SUMS, then the image tarball against the release manifest.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from modelforge_contract.manifest import (
    CONTROL_PLANE_IMAGE,
    IMAGE_NAMES,
    ManifestError,
    entry_differences,
    parse_manifest,
)

from .digest import sha256_file
from .names import (
    CONTROL_PLANE_ARCHIVES,
    LABEL_PYZ,
    RELEASE_PRINCIPAL,
    SIGNATURE_NAME,
    SUMS_NAME,
)
from .sums import SumsError, display_name, parse_sums

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


# -- verify-bundle --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a release directory: the file, and where known the image and
    the field (manifest terms: ``images.<image>.<field>``)."""

    file: str
    message: str
    image: str | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = f"images.{self.image}" if self.image else ""
        if self.field:
            where = f"{where}.{self.field}" if where else self.field
        return f"{self.file}: {where}: {self.message}" if where else f"{self.file}: {self.message}"

    def as_json(self) -> dict[str, str | None]:
        return {
            "file": self.file,
            "image": self.image,
            "field": self.field,
            "message": self.message,
        }


@dataclass
class BundleReport:
    directory: Path
    version: str | None = None
    layout: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # name -> OK / FAILED / FAILED open or read
    images: dict[str, bool] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    signature: str = "not checked"
    signed_by: str | None = None

    @property
    def ok(self) -> bool:
        return not self.findings and bool(self.images) and all(self.images.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "directory": str(self.directory),
            "version": self.version,
            "layout": self.layout,
            "files": [{"name": name, "status": status} for name, status in self.files.items()],
            "images": {name: {"ok": ok} for name, ok in self.images.items()},
            "signature": {"checked": self.signature, "signed_by": self.signed_by},
            "problems": [finding.as_json() for finding in self.findings],
        }


def _manifest_findings(path: Path, text: str) -> tuple[dict[str, Any] | None, list[Finding]]:
    try:
        return parse_manifest(text), []
    except ManifestError as exc:
        if not exc.problems:
            return None, [Finding(path.name, str(exc))]
        return None, [
            Finding(path.name, problem.message, image, problem.field or None)
            for image, problem in exc.problems
        ]


NOT_SIGNED_CHECKED = (
    "not checked (no --signers): the files match SHA256SUMS, but who wrote SHA256SUMS was "
    "not checked"
)


def _sums_findings(entries: list[Any], expected_names: list[str], version: str) -> list[Finding]:
    """SHA256SUMS as the release writes it: each of the release's files once, in
    SHA256SUMS.template's order, and nothing else."""
    findings: list[Finding] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            findings.append(Finding(SUMS_NAME, f"line {entry.line}: lists {entry.name} again"))
        seen.add(entry.name)
        if entry.name not in expected_names:
            findings.append(
                Finding(SUMS_NAME, f"lists {entry.name}, which is not a file of release {version}")
            )
    for name in expected_names:
        if entries and name not in seen:
            findings.append(Finding(SUMS_NAME, f"does not list {name}"))
    listed = list(dict.fromkeys(entry.name for entry in entries if entry.name in expected_names))
    if listed != [name for name in expected_names if name in listed]:
        findings.append(
            Finding(
                SUMS_NAME,
                "lists the files out of order (a release lists them as SHA256SUMS.template "
                f"does: {', '.join(expected_names)})",
            )
        )
    return findings


def _stray_files(directory: Path, expected_names: list[str]) -> list[Finding]:
    """Whatever lies in the release directory that SHA256SUMS does not cover."""
    allowed = {*expected_names, SUMS_NAME, SIGNATURE_NAME}
    return [
        Finding(path.name, "is in the release directory but SHA256SUMS does not list it")
        for path in sorted(directory.iterdir())
        if path.name not in allowed
    ]


def verify_bundle(
    directory: Path,
    progress: TextIO | None = None,
    signers: Path | None = None,
    principal: str = RELEASE_PRINCIPAL,
) -> BundleReport:
    """The signature first (with ``signers``, an ``allowed_signers`` file, by PRINCIPAL's
    key), then
    SHA256SUMS (exactly the release's files, in order, each matching, nothing else in the
    directory), then the image tarball against the manifest, image by image: tag,
    architecture, os, every label, the runtime configuration and the RootFS layers, whose
    files must hash to them. No daemon; the tarball is read once."""
    from .archive import ArchiveError, read_archive
    from .names import release_names, tarball_name
    from .signing import verify_sums_signature

    report = BundleReport(directory)
    if signers is None:
        report.signature = NOT_SIGNED_CHECKED
    else:
        check = verify_sums_signature(directory, signers, principal)
        report.signature, report.signed_by = check.message, check.principal
        if not check.ok:
            report.findings.append(Finding(SIGNATURE_NAME, check.message))
    manifests = sorted(directory.glob("modelforge-*-manifest.json"))
    if len(manifests) != 1:
        report.findings.append(
            Finding(
                directory.name or str(directory),
                f"expected one modelforge-<version>-manifest.json, found {len(manifests)}",
            )
        )
        return report
    manifest_path = manifests[0]
    report.version = manifest_path.name.removeprefix("modelforge-").removesuffix("-manifest.json")
    try:
        manifest, findings = _manifest_findings(
            manifest_path, manifest_path.read_text(encoding="utf-8")
        )
    except (OSError, UnicodeDecodeError) as exc:
        manifest, findings = None, [Finding(manifest_path.name, f"cannot be read ({exc})")]
    report.findings += findings
    if manifest is not None and manifest["version"] != report.version:
        report.findings.append(
            Finding(
                manifest_path.name,
                f"says version {manifest['version']}, its name says {report.version}",
            )
        )

    # 1. SHA256SUMS lists exactly this release's files, in order, and each matches.
    expected_names = release_names(report.version)
    sums_path = directory / SUMS_NAME
    try:
        entries = parse_sums(sums_path.read_bytes(), SUMS_NAME)
    except OSError as exc:
        entries = []
        report.findings.append(Finding(SUMS_NAME, f"cannot be read ({exc.strerror or exc})"))
    except SumsError as exc:
        entries = []
        report.findings.append(Finding(SUMS_NAME, str(exc).removeprefix(f"{SUMS_NAME}: ")))
    report.findings += _sums_findings(entries, expected_names, report.version)
    report.findings += _stray_files(directory, expected_names)
    tarball = tarball_name(report.version)
    computed: dict[str, str] = {}
    for entry in entries:
        if entry.name == tarball or entry.name in computed:
            continue  # the tarball is hashed while it is read below
        try:
            actual = sha256_file(directory / entry.name, entry.name, progress)
        except OSError as exc:
            report.files[entry.name] = "FAILED open or read"
            report.findings.append(Finding(entry.name, f"cannot be read ({exc.strerror or exc})"))
            continue
        computed[entry.name] = actual
        report.files[entry.name] = "OK" if actual == entry.digest else "FAILED"
        if actual != entry.digest:
            report.findings.append(
                Finding(entry.name, f"SHA-256 is {actual}, SHA256SUMS says {entry.digest}")
            )
    if manifest is not None:
        report.findings += _archive_pin_findings(manifest, computed, manifest_path.name)

    # 2. The tarball against the manifest, image by image.
    try:
        archive = read_archive(directory / tarball, progress)
    except OSError as exc:
        report.files[tarball] = "FAILED open or read"
        report.findings.append(Finding(tarball, f"cannot be read ({exc.strerror or exc})"))
        return report
    except ArchiveError as exc:
        report.findings.append(Finding(tarball, str(exc).removeprefix(f"{tarball}: ")))
        return report
    report.layout = archive.layout
    report.findings += [Finding(tarball, problem) for problem in archive.problems]
    listed_digest = next((entry.digest for entry in entries if entry.name == tarball), None)
    if listed_digest is not None:
        report.files[tarball] = "OK" if archive.sha256 == listed_digest else "FAILED"
        if archive.sha256 != listed_digest:
            report.findings.append(
                Finding(tarball, f"SHA-256 is {archive.sha256}, SHA256SUMS says {listed_digest}")
            )
    if manifest is None:
        return report
    matched: set[int] = set()
    for name in IMAGE_NAMES:
        entry = manifest["images"].get(name)
        if entry is None:
            report.images[name] = False
            report.findings.append(
                Finding(manifest_path.name, "is missing from the manifest", name)
            )
            continue
        image = archive.find(entry["tag"])
        if image is None:
            report.images[name] = False
            report.findings.append(
                Finding(tarball, f"no image in the tarball is tagged {entry['tag']}", name, "tag")
            )
            continue
        matched.add(id(image))
        found = [
            Finding(tarball, message, name, field_name) for field_name, message in image.problems
        ]
        found += [
            Finding(
                tarball,
                f"the image is also tagged {tag}, which docker load would take over",
                name,
                "tag",
            )
            for tag in sorted(set(image.tags) - {entry["tag"]})
        ]
        found += [
            Finding(tarball, problem.message, name, problem.field)
            for problem in entry_differences(entry, image.entry(entry["tag"]))
        ]
        report.images[name] = not found
        report.findings += found
    for image in archive.images:
        if id(image) not in matched:
            tags = ", ".join(image.tags) or f"untagged, {image.source}"
            report.findings.append(
                Finding(tarball, f"carries an image the manifest does not list ({tags})")
            )
    return report


def _archive_pin_findings(
    manifest: dict[str, Any], computed: dict[str, str], manifest_file: str
) -> list[Finding]:
    """The release's control-plane archive for the image's architecture is the one the
    image carries: its SHA-256 is the image's ``io.modelforge.control-plane-pyz-sha256``."""
    entry = manifest["images"].get(CONTROL_PLANE_IMAGE)
    if entry is None:
        return []
    archive = CONTROL_PLANE_ARCHIVES.get(entry["architecture"])
    pinned = entry["labels"].get(LABEL_PYZ)
    if pinned is None:
        return [
            Finding(
                manifest_file,
                "has no label pinning the control-plane archive it carries",
                CONTROL_PLANE_IMAGE,
                f"labels.{LABEL_PYZ}",
            )
        ]
    actual = computed.get(archive or "")
    if archive is None or actual is None or actual == pinned:
        return []
    return [
        Finding(
            archive,
            f"is not the archive the image carries: its SHA-256 is {actual}, the image pins "
            f"{pinned}",
            CONTROL_PLANE_IMAGE,
            f"labels.{LABEL_PYZ}",
        )
    ]
