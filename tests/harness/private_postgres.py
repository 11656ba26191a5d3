"""A PostgreSQL server of one test's own, which the test may restart or stop without
touching the server every other test shares (scripts/test starts that one)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .control_plane import free_port, unavailable


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if not found:
        unavailable("PostgreSQL is not installed: scripts/test installs Debian's postgresql")
    return Path(found[-1])


def _as_postgres(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@dataclass
class PrivatePostgres:
    bin: Path
    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def ctl(self, *args: str) -> None:
        subprocess.run(
            _as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.directory / "data"), *args]),
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.directory} -c fsync=off"
        self.ctl("-l", str(self.directory / "server.log"), "-w", "-o", options, "start")

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut; the server comes back."""
        self.ctl("-l", str(self.directory / "server.log"), "-w", "-m", "fast", "restart")


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    pg_bin = _pg_bin()
    directory = Path(tempfile.mkdtemp(prefix="modelforge-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    server = PrivatePostgres(pg_bin, directory, free_port())
    subprocess.run(
        _as_postgres(
            [str(pg_bin / "initdb"), "-D", str(directory / "data"), "-A", "trust"]
            + ["-U", "postgres", "--no-sync"]
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            server.ctl("-m", "immediate", "stop")
        shutil.rmtree(directory, ignore_errors=True)
