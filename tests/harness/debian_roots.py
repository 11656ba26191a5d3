"""Debian root filesystems made with debootstrap, to run the archives as on a real host.

A root holds a minimal Debian (``--variant=minbase``) plus that release's own ``python3``
and nothing else: whatever the archives need beyond the standard library, they must
carry. Roots are made once from the Debian mirror this machine's apt uses and kept in
``/var/cache/modelforge-test/debian`` (``MF_TEST_CACHE``); a root for another machine
architecture runs through qemu-user-static via binfmt_misc.

Programs run in a root through ``unshare``: a private mount and PID namespace with its
own /proc, so nothing stays mounted and nothing stays running once a command ends.
Networking is the host's, so a server in a root answers on the host's 127.0.0.1.

    python3 -m tests.harness.debian_roots trixie amd64   # make (or reuse) one root
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

CACHE = Path(os.environ.get("MF_TEST_CACHE", "/var/cache/modelforge-test")) / "debian"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# That release's python3 (3.11 on bookworm, 3.13 on trixie); nothing the archives bring.
PACKAGES = ("python3",)
STAMP = ".modelforge-root.json"
# Debian's names for the machines (`uname -m` -> dpkg architecture).
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class RootUnavailable(Exception):
    """A root cannot be made or entered here; the message says what is missing."""


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian archive this machine's apt uses (not its -security suite)."""
    override = os.environ.get("MF_TEST_DEBIAN_MIRROR")
    if override:
        return override
    files = sorted(apt_dir.glob("sources.list.d/*.sources")) + [apt_dir / "sources.list"]
    files += sorted(apt_dir.glob("sources.list.d/*.list"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            # deb822: stanzas separated by blank lines, "URIs: …" and "Suites: …" fields.
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(
                    (key.strip().lower(), value.strip())
                    for key, _, value in (
                        line.partition(":")
                        for line in stanza.splitlines()
                        if ":" in line and not line.lstrip().startswith("#")
                    )
                )
                suites = fields.get("suites", "").split()
                for uri in fields.get("uris", "").split():
                    if uri.rstrip("/").endswith("/debian") and not any(
                        suite.endswith("-security") for suite in suites
                    ):
                        return uri.rstrip("/")
        else:
            for line in text.splitlines():
                words = line.split("#", 1)[0].split()
                words = [word for word in words if not word.startswith("[")]
                if (
                    len(words) >= 3
                    and words[0] == "deb"
                    and words[1].rstrip("/").endswith("/debian")
                ):
                    return words[1].rstrip("/")
    return DEFAULT_MIRROR


def missing_tools() -> list[str]:
    """Debian packages this module needs on the host and lacks."""
    missing = []
    if shutil.which("debootstrap") is None:
        missing.append("debootstrap")
    if shutil.which("unshare") is None:
        missing.append("util-linux")
    return missing


def foreign_ready(arch: str) -> str | None:
    """Why binaries of ``arch`` cannot run here, or None when binfmt_misc + qemu can run them."""
    machine = {v: k for k, v in DEBIAN_ARCH.items()}[arch]
    if machine == os.uname().machine:
        return None
    entry = Path(f"/proc/sys/fs/binfmt_misc/qemu-{machine}")
    if not entry.is_file():
        return (
            f"{entry} is not registered: install qemu-user-static and binfmt-support, mount "
            "binfmt_misc and run `update-binfmts --enable qemu-" + machine + "` "
            "(scripts/test does this as root)"
        )
    text = entry.read_text()
    if not text.startswith("enabled"):
        return f"{entry} is disabled: update-binfmts --enable qemu-{machine}"
    if not re.search(r"^flags: .*F", text, re.M):
        return f"{entry} lacks the F flag, so qemu cannot be found inside a chroot"
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def debian_root(suite: str, arch: str) -> Path:
    """The cached root for ``suite`` on ``arch``, made with debootstrap when missing."""
    if os.geteuid() != 0:
        raise RootUnavailable("making and entering a Debian root needs root (chroot, mounts)")
    missing = missing_tools()
    if missing:
        raise RootUnavailable(f"install {' '.join(missing)} (scripts/test does this as root)")
    reason = foreign_ready(arch)
    if reason:
        raise RootUnavailable(reason)
    root = CACHE / f"{suite}-{arch}"
    want = {"suite": suite, "arch": arch, "variant": "minbase", "packages": list(PACKAGES)}
    with _locked(CACHE / f".{suite}-{arch}.lock"):
        stamp = root / STAMP
        if stamp.is_file() and json.loads(stamp.read_text()) == want:
            return root
        partial = CACHE / f"{suite}-{arch}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        mirror = debian_mirror()
        started = time.monotonic()
        log.info("debootstrap %s %s from %s into %s", suite, arch, mirror, root)
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--arch={arch}",
            f"--include={','.join(PACKAGES)}",
            suite,
            str(partial),
            mirror,
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr)[-3000:]
            log_file = partial / "debootstrap" / "debootstrap.log"
            if log_file.is_file():
                tail += "\n" + log_file.read_text(errors="replace")[-3000:]
            raise RootUnavailable(f"debootstrap {suite} {arch} failed:\n{tail}")
        # Make the root plain and fast to enter: no apt lists or package cache kept.
        shutil.rmtree(partial / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (partial / STAMP).write_text(json.dumps(want, sort_keys=True))
        log.info("made %s in %.0f s", root, time.monotonic() - started)
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
    return root


def debian_root_or_skip(suite: str, arch: str) -> Path:
    """debian_root() for a test: skipped where it cannot be made, failed with CI=true."""
    from .control_plane import unavailable

    try:
        return debian_root(suite, arch)
    except RootUnavailable as exc:
        unavailable(str(exc))


def in_root(root: Path, argv: Sequence[str], env: dict[str, str], cwd: str = "/") -> list[str]:
    """A command line that runs ``argv`` inside ``root`` with exactly ``env``."""
    return [
        "unshare",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        f"--mount-proc={root}/proc",
        "chroot",
        str(root),
        "/usr/bin/env",
        "-i",
        f"--chdir={cwd}",
        *[f"{key}={value}" for key, value in sorted(env.items())],
        *argv,
    ]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="debian_roots: %(message)s")
    suite, arch = argv
    try:
        print(debian_root(suite, arch))
    except RootUnavailable as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
