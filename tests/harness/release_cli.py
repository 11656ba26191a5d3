"""Run the installed ``modelforge-release`` and the real ``sha256sum`` side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from modelforge_release.names import DEPLOYMENT_FILES

RELEASE = Path(sys.executable).with_name("modelforge-release")


def release(*args: str | os.PathLike, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RELEASE), *map(str, args)], cwd=cwd, capture_output=True, timeout=120
    )


def sha256sum(*args: str | os.PathLike, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", *map(str, args)], cwd=cwd, capture_output=True, timeout=120)


def make_files(directory: Path, contents: dict[str, bytes]) -> list[Path]:
    paths = []
    for name, data in contents.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    return paths


RELEASE_FILES = {
    "modelforge-0.1.0-images.tar": os.urandom(300_000),
    "modelforge-0.1.0-manifest.json": b'{"images": []}\n',
    "modelforge-x86_64.pyz": os.urandom(70_000),
    "modelforge-aarch64.pyz": os.urandom(80_000),
    "modelforge-node-agent.pyz": b"",  # an empty file has a well-known sum
    "modelforge-runtime-worker.pyz": os.urandom(60_000),
    **{name: f"# {name}\n".encode() for name in DEPLOYMENT_FILES},
}


def flip_byte(path: Path, offset: int) -> None:
    """Changes one byte of the file whatever it held."""
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))
