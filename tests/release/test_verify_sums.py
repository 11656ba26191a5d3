"""``modelforge-release verify-sums`` answers as ``sha256sum -c`` does, on the same files."""

from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.harness.debian_roots import DEBIAN_ARCH, debian_root_or_skip, in_root
from tests.harness.release_cli import (
    RELEASE,
    RELEASE_FILES,
    flip_byte,
    make_files,
    release,
    sha256sum,
)

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

NAMES = list(RELEASE_FILES)


@pytest.fixture
def bundle(tmp_path):
    """A release directory with files and a SHA256SUMS made by the real sha256sum."""
    make_files(tmp_path, RELEASE_FILES)
    (tmp_path / "SHA256SUMS").write_bytes(sha256sum(*NAMES, cwd=tmp_path).stdout)
    return tmp_path


def stderr_lines(result: subprocess.CompletedProcess, prog: bytes) -> list[bytes]:
    return [line.removeprefix(prog + b": ") for line in result.stderr.splitlines()]


def test_accepts_a_file_made_by_sha256sum(bundle):
    result = release("verify-sums", cwd=bundle)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"".join(name.encode() + b": OK\n" for name in NAMES)
    assert result.stdout == sha256sum("-c", "SHA256SUMS", cwd=bundle).stdout


def test_sha256sum_accepts_our_file(tmp_path):
    make_files(tmp_path, RELEASE_FILES)
    assert release("sums", *NAMES, cwd=tmp_path).returncode == 0
    check = sha256sum("--strict", "-c", "SHA256SUMS", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.count(b": OK\n") == len(NAMES)


def test_names_are_read_relative_to_the_sums_directory(bundle, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    result = release("verify-sums", "--sums", bundle / "SHA256SUMS", cwd=elsewhere)
    assert result.returncode == 0, result.stderr


ODD_NAMES = {"a.pyz": b"a", "new\nline": b"b", "back\\slash": b"c", "carriage\rreturn": b"d"}
# verify-sums shows every name that needs it escaped, as coreutils 9.7 (Debian 13) does.
ODD_NAMES_CHECKED = b"a.pyz: OK\n\\new\\nline: OK\n\\back\\\\slash: OK\n\\carriage\\rreturn: OK\n"
# coreutils 9.1 (Debian 12) escaped only the name with a newline.
ODD_NAMES_CHECKED_9_1 = b"a.pyz: OK\n\\new\\nline: OK\nback\\slash: OK\ncarriage\rreturn: OK\n"


def coreutils_version() -> tuple[int, ...]:
    first = sha256sum("--version").stdout.decode().splitlines()[0]
    return tuple(int(part) for part in first.rsplit(" ", 1)[1].split("."))


def test_binary_mode_and_escaped_names_from_sha256sum(tmp_path):
    make_files(tmp_path, ODD_NAMES)
    (tmp_path / "SHA256SUMS").write_bytes(sha256sum("-b", *ODD_NAMES, cwd=tmp_path).stdout)
    assert b" *a.pyz\n" in (tmp_path / "SHA256SUMS").read_bytes()
    result = release("verify-sums", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ODD_NAMES_CHECKED
    reference = sha256sum("-c", "SHA256SUMS", cwd=tmp_path)
    if coreutils_version() >= (9, 7):
        assert result.stdout == reference.stdout
    else:  # an older sha256sum on this machine: it differs only as documented
        assert reference.stdout == ODD_NAMES_CHECKED_9_1


@pytest.mark.slow
def test_escaped_names_as_coreutils_9_7_in_a_debian_13_root_shows_them():
    """The real sha256sum of Debian 13 (coreutils 9.7) over the same files and SHA256SUMS."""
    root = debian_root_or_skip("trixie", DEBIAN_ARCH[os.uname().machine])
    work = Path(tempfile.mkdtemp(prefix="verify-sums-", dir=root / "tmp"))
    try:
        make_files(work, ODD_NAMES)
        (work / "SHA256SUMS").write_bytes(sha256sum(*ODD_NAMES, cwd=work).stdout)
        inside = f"/tmp/{work.name}"
        version = subprocess.run(
            in_root(root, ["sha256sum", "--version"], {}), capture_output=True, timeout=60
        )
        assert b"coreutils) 9.7" in version.stdout, version.stdout
        reference = subprocess.run(
            in_root(root, ["sha256sum", "-c", "SHA256SUMS"], {}, cwd=inside),
            capture_output=True,
            timeout=60,
        )
        assert reference.returncode == 0, reference.stderr
        assert reference.stdout == ODD_NAMES_CHECKED
        result = release("verify-sums", cwd=work)
        assert result.stdout == reference.stdout
    finally:
        shutil.rmtree(work)


def test_corrupted_file_fails_like_sha256sum(bundle):
    # A flipped byte always changes the file; writing a fixed byte did not when the
    # archive already held that byte there.
    flip_byte(bundle / "modelforge-x86_64.pyz", 40_000)
    result = release("verify-sums", cwd=bundle)
    reference = sha256sum("-c", "SHA256SUMS", cwd=bundle)
    assert result.returncode == 1
    assert b"modelforge-x86_64.pyz: FAILED\n" in result.stdout
    assert result.stdout == reference.stdout
    assert stderr_lines(result, b"modelforge-release") == stderr_lines(reference, b"sha256sum")
    assert stderr_lines(result, b"modelforge-release") == [
        b"WARNING: 1 computed checksum did NOT match"
    ]


def test_uppercase_hex_is_accepted_and_still_compared(bundle):
    sums = bundle / "SHA256SUMS"
    lines = sums.read_bytes().splitlines(keepends=True)
    sums.write_bytes(b"".join(line[:64].upper() + line[64:] for line in lines))
    assert release("verify-sums", cwd=bundle).returncode == 0
    (bundle / "modelforge-x86_64.pyz").write_bytes(b"replaced")
    assert release("verify-sums", cwd=bundle).returncode == 1


def test_missing_file_fails_open_or_read(bundle):
    (bundle / "modelforge-node-agent.pyz").unlink()
    (bundle / "modelforge-x86_64.pyz").write_bytes(b"changed")
    result = release("verify-sums", cwd=bundle)
    reference = sha256sum("-c", "SHA256SUMS", cwd=bundle)
    assert result.returncode == 1
    assert b"modelforge-node-agent.pyz: FAILED open or read\n" in result.stdout
    assert result.stdout == reference.stdout
    assert stderr_lines(result, b"modelforge-release") == stderr_lines(reference, b"sha256sum")


def test_ignore_missing_skips_absent_files_but_not_an_empty_check(bundle):
    (bundle / "modelforge-node-agent.pyz").unlink()
    result = release("verify-sums", "--ignore-missing", cwd=bundle)
    assert result.returncode == 0, result.stderr
    assert b"modelforge-node-agent.pyz" not in result.stdout
    for name in NAMES:
        (bundle / name).unlink(missing_ok=True)
    nothing = release("verify-sums", "--ignore-missing", cwd=bundle)
    reference = sha256sum("-c", "--ignore-missing", "SHA256SUMS", cwd=bundle)
    assert nothing.returncode == reference.returncode == 1
    assert stderr_lines(nothing, b"modelforge-release") == stderr_lines(reference, b"sha256sum")


def test_quiet_prints_only_failures(bundle):
    (bundle / "modelforge-x86_64.pyz").write_bytes(b"changed")
    result = release("verify-sums", "--quiet", cwd=bundle)
    assert result.returncode == 1
    assert result.stdout == b"modelforge-x86_64.pyz: FAILED\n"
    assert result.stdout == sha256sum("-c", "--quiet", "SHA256SUMS", cwd=bundle).stdout


def test_comments_blank_lines_and_crlf_are_tolerated(bundle):
    sums = bundle / "SHA256SUMS"
    body = sums.read_bytes().replace(b"\n", b"\r\n")
    sums.write_bytes(b"# release 0.1.0\n\n" + body)
    assert release("verify-sums", cwd=bundle).returncode == 0


@pytest.mark.parametrize(
    "line",
    [
        b"not a sum  modelforge-x86_64.pyz",
        b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85  short-by-one",
        b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 single-space",
        b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  ",
        b"\\e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  bad\\escape",
    ],
)
def test_malformed_line_exits_2_naming_it_before_reading_anything(bundle, line):
    (bundle / NAMES[0]).write_bytes(b"corrupted")  # listed before the bad line: never reported
    sums = bundle / "SHA256SUMS"
    lines = sums.read_bytes().splitlines(keepends=True)
    sums.write_bytes(b"".join(lines[:2]) + line + b"\n" + b"".join(lines[2:]))
    result = release("verify-sums", cwd=bundle)
    assert result.returncode == 2
    assert b"SHA256SUMS: line 3: " in result.stderr
    assert result.stdout == b""


EMPTY_SUM = b"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.parametrize(
    "line",
    [
        EMPTY_SUM + b"  ../outside",
        EMPTY_SUM + b"  /etc/hostname",
        EMPTY_SUM + b"  sub/../../outside",
        EMPTY_SUM + b" *./../outside",
        b"\\" + EMPTY_SUM + b"  ../new\\nline",  # escaped form, as sha256sum writes it
    ],
)
def test_names_leaving_the_directory_are_refused(tmp_path, line):
    release_dir = tmp_path / "release"
    release_dir.mkdir()
    (tmp_path / "outside").write_bytes(b"")
    (tmp_path / "new\nline").write_bytes(b"")
    (release_dir / "SHA256SUMS").write_bytes(b"# header\n" + line + b"\n")
    result = release("verify-sums", cwd=release_dir)
    assert result.returncode == 2, result.stdout
    assert b"SHA256SUMS: line 2: " in result.stderr
    assert result.stdout == b""


def test_empty_sums_fails(tmp_path):
    (tmp_path / "SHA256SUMS").write_bytes(b"# nothing listed\n")
    result = release("verify-sums", cwd=tmp_path)
    assert result.returncode == 1
    assert b"no properly formatted checksum lines found" in result.stderr


@pytest.mark.slow
def test_progress_only_for_large_files_on_a_terminal(tmp_path):
    big = tmp_path / "big.tar"
    with big.open("wb") as file:
        file.truncate(300 << 20)  # sparse is fine here: the meter is under test, not the disk
    make_files(tmp_path, {"small.pyz": b"small"})
    (tmp_path / "SHA256SUMS").write_bytes(sha256sum("big.tar", "small.pyz", cwd=tmp_path).stdout)

    piped = release("verify-sums", cwd=tmp_path)
    assert piped.returncode == 0
    assert piped.stderr == b""

    controller, terminal = pty.openpty()
    try:
        process = subprocess.run(
            [str(RELEASE), "verify-sums"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=terminal,
            timeout=120,
        )
        os.close(terminal)
        terminal = -1
        shown = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    assert process.returncode == 0
    assert process.stdout == b"big.tar: OK\nsmall.pyz: OK\n"
    assert re.search(rb"\rbig\.tar: \d+ / 300 MiB \(\d+%\)", shown), shown
    assert b"small.pyz" not in shown
