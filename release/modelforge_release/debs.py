"""Pinned ``.deb`` files: fetched once with apt into a cache, checked against the lock's
SHA-256 on every use, and read directly (ar archive, data and control tars) without dpkg."""

from __future__ import annotations

import hashlib
import io
import logging
import lzma
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .debian import DebianError, PinnedPackage

log = logging.getLogger(__name__)


def deb_file_name(pkg: PinnedPackage) -> str:
    return f"{pkg.name}_{pkg.version.replace(':', '%3a')}_{pkg.architecture}.deb"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(packages: list[PinnedPackage], cache_dir: Path) -> dict[str, Path]:
    """Each package's file from the cache, else from apt (one ``apt-get download`` for all
    that are missing); every SHA-256 is checked against the lock, cached or not."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    missing = []
    for pkg in packages:
        target = cache_dir / deb_file_name(pkg)
        if target.is_file() and sha256_of(target) == pkg.sha256:
            found[pkg.name] = target
        else:
            missing.append(pkg)
    if not missing:
        return found
    log.info("downloading %s", ", ".join(f"{pkg.name} {pkg.version}" for pkg in missing))
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as temp:
        result = subprocess.run(
            ["apt-get", "download", "-q", *[f"{pkg.name}={pkg.version}" for pkg in missing]],
            cwd=temp,
            capture_output=True,
            text=True,
            check=False,
        )
        for pkg in missing:
            downloaded = Path(temp) / deb_file_name(pkg)
            if result.returncode != 0 or not downloaded.is_file():
                reason = (result.stderr.strip().splitlines() or ["no file"])[-1]
                raise DebianError(
                    f"cannot download {pkg.name}={pkg.version} with apt-get ({reason}). Run "
                    "apt-get update; if Debian no longer serves that version, refresh the lock "
                    "with packaging/lock-debian.sh"
                )
            actual = sha256_of(downloaded)
            if actual != pkg.sha256:
                raise DebianError(
                    f"{pkg.name}={pkg.version}: downloaded file has SHA-256 {actual}, the lock "
                    f"pins {pkg.sha256}; refusing it"
                )
            target = cache_dir / deb_file_name(pkg)
            os.replace(downloaded, target)
            found[pkg.name] = target
    return found


# -- reading .deb files -------------------------------------------------------------------


def _ar_members(data: bytes, source: str) -> dict[str, bytes]:
    if not data.startswith(b"!<arch>\n"):
        raise DebianError(f"{source}: not a Debian package (no ar header)")
    members, offset = {}, 8
    while offset + 60 <= len(data):
        header = data[offset : offset + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = offset + 60
        members[name] = data[start : start + size]
        offset = start + size + (size & 1)
    return members


def _open_tar(name: str, blob: bytes, source: str) -> tarfile.TarFile:
    if name.endswith(".xz"):
        blob = lzma.decompress(blob)
    elif name.endswith(".gz"):
        import gzip

        blob = gzip.decompress(blob)
    elif not name.endswith(".tar"):
        raise DebianError(f"{source}: {name} uses a compression this tool cannot read")
    return tarfile.open(fileobj=io.BytesIO(blob), mode="r:")


@dataclass
class DebContents:
    control: dict[str, str]
    data: tarfile.TarFile

    def members(self) -> Iterator[tarfile.TarInfo]:
        return iter(self.data.getmembers())

    def read(self, member: tarfile.TarInfo) -> bytes:
        file = self.data.extractfile(member)
        if file is None:
            raise DebianError(f"{member.name} is not a regular file")
        return file.read()


def read_deb(path: Path, expected_sha256: str | None = None) -> DebContents:
    """The control fields and the data archive of a package (in memory: packages are small)."""
    blob = path.read_bytes()
    if expected_sha256 and hashlib.sha256(blob).hexdigest() != expected_sha256:
        raise DebianError(f"{path}: SHA-256 does not match the lock; delete it and rebuild")
    members = _ar_members(blob, str(path))
    control_name = next((n for n in members if n.startswith("control.tar")), None)
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if control_name is None or data_name is None:
        raise DebianError(f"{path}: no control or data archive inside")
    with _open_tar(control_name, members[control_name], str(path)) as control_tar:
        control_member = next(
            (m for m in control_tar.getmembers() if m.name.lstrip("./") == "control"), None
        )
        if control_member is None:
            raise DebianError(f"{path}: no control file")
        control_file = control_tar.extractfile(control_member)
        assert control_file is not None
        control_text = control_file.read().decode("utf-8")
    control: dict[str, str] = {}
    key = None
    for line in control_text.splitlines():
        if line[:1] in (" ", "\t") and key:
            control[key] += "\n" + line
        elif ":" in line:
            key, _, value = line.partition(":")
            control[key] = value.strip()
    return DebContents(control, _open_tar(data_name, members[data_name], str(path)))
