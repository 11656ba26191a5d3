"""modelforge-release sign: an SSH signature over SHA256SUMS that stock OpenSSH accepts, and
the check verify-bundle --signers runs. Every key here is minted by the test with the host's
ssh-keygen and lives in the test's temporary directory."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from modelforge_release.signing import NAMESPACE, verify_sums_signature
from tests.harness.control_plane import unavailable
from tests.harness.release_cli import release

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

SUMS = b"0" * 64 + b"  modelforge-1.0.0-images.tar\n"
PASSPHRASE = "correct horse battery staple"


@pytest.fixture(scope="module")
def keygen() -> str:
    path = shutil.which("ssh-keygen")
    if path is None:
        unavailable("ssh-keygen is missing: scripts/test installs openssh-client as root")
    return path


def mint_key(keygen: str, directory: Path, name: str, *args: str, passphrase: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / name
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", passphrase, "-C", name, "-f", str(key), *args],
        check=True,
        capture_output=True,
    )
    return key


def signers_file(path: Path, *entries: tuple[str, Path]) -> Path:
    lines = [
        f'{principal} namespaces="{NAMESPACE}" {key.with_suffix(".pub").read_text().strip()}'
        for principal, key in entries
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def release_dir(tmp_path) -> Path:
    directory = tmp_path / "modelforge-1.0.0"
    directory.mkdir()
    (directory / "SHA256SUMS").write_bytes(SUMS)
    return directory


def stock_verify(keygen: str, directory: Path, signers: Path, principal: str, namespace=NAMESPACE):
    """Exactly the command docs/release-verification.md gives a release engineer."""
    with (directory / "SHA256SUMS").open("rb") as sums:
        return subprocess.run(
            [keygen, "-Y", "verify", "-f", str(signers), "-I", principal, "-n", namespace]
            + ["-s", str(directory / "SHA256SUMS.sig")],
            stdin=sums,
            capture_output=True,
            text=True,
        )


def test_a_signature_stock_ssh_keygen_accepts(keygen, release_dir, tmp_path):
    key = mint_key(keygen, tmp_path / "keys", "release-2026")
    signed = release("sign", "--key", key, release_dir)
    assert signed.returncode == 0, signed.stderr
    assert b"wrote " in signed.stdout
    public = key.with_suffix(".pub").read_text().split()[1]
    assert public.encode() in signed.stdout  # the allowed_signers line to publish
    assert (release_dir / "SHA256SUMS.sig").stat().st_mode & 0o777 == 0o644
    signers = signers_file(tmp_path / "allowed_signers", ("releases@modelforge", key))
    ok = stock_verify(keygen, release_dir, signers, "releases@modelforge")
    assert ok.returncode == 0, ok.stderr
    assert "Good" in ok.stdout
    # Another namespace (a git commit signature, say) is not a release signature.
    assert stock_verify(keygen, release_dir, signers, "releases@modelforge", "git").returncode
    check = verify_sums_signature(release_dir, signers)
    assert check.ok and check.principal == "releases@modelforge"
    # The private key went nowhere near the release directory or the output.
    secret = key.read_bytes()
    assert sorted(p.name for p in release_dir.iterdir()) == ["SHA256SUMS", "SHA256SUMS.sig"]
    assert secret not in signed.stdout + signed.stderr


def test_a_signature_ssh_keygen_made_is_checked_the_same_way(keygen, release_dir, tmp_path):
    key = mint_key(keygen, tmp_path / "keys", "stock")
    subprocess.run(
        [keygen, "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(release_dir / "SHA256SUMS")],
        check=True,
        capture_output=True,
    )
    signers = signers_file(tmp_path / "allowed_signers", ("stock@modelforge", key))
    assert verify_sums_signature(release_dir, signers, "stock@modelforge").ok


def test_a_changed_sums_file_a_foreign_key_a_wrong_namespace_or_no_signature_fail(
    keygen, release_dir, tmp_path
):
    ours = mint_key(keygen, tmp_path / "keys", "ours")
    theirs = mint_key(keygen, tmp_path / "keys", "theirs")
    signers = signers_file(tmp_path / "allowed_signers", ("releases@modelforge", ours))

    missing = verify_sums_signature(release_dir, signers)
    assert not missing.ok and "unsigned" in missing.message

    assert release("sign", "--key", theirs, release_dir).returncode == 0
    foreign = verify_sums_signature(release_dir, signers)
    assert not foreign.ok and "not signed by a key in allowed_signers" in foreign.message

    assert release("sign", "--key", ours, release_dir).returncode == 0
    assert verify_sums_signature(release_dir, signers).ok
    (release_dir / "SHA256SUMS").write_bytes(SUMS.replace(b"0" * 64, b"1" * 64))
    changed = verify_sums_signature(release_dir, signers)
    assert not changed.ok and "does not verify" in changed.message

    (release_dir / "SHA256SUMS").write_bytes(SUMS)
    other_namespace = signers_file(tmp_path / "git_signers", ("releases@modelforge", ours))
    other_namespace.write_text(other_namespace.read_text().replace(NAMESPACE, "git"))
    wrong = verify_sums_signature(release_dir, other_namespace)
    assert not wrong.ok

    (release_dir / "SHA256SUMS.sig").write_text("-----BEGIN SSH SIGNATURE-----\nAAAA\n")
    malformed = verify_sums_signature(release_dir, signers)
    assert not malformed.ok


def test_during_a_rotation_either_key_verifies(keygen, release_dir, tmp_path):
    old = mint_key(keygen, tmp_path / "keys", "release-2025")
    new = mint_key(keygen, tmp_path / "keys", "release-2026")
    signers = signers_file(
        tmp_path / "allowed_signers",
        ("releases@modelforge", old),
        ("releases@modelforge", new),
    )
    for key in (old, new):
        assert release("sign", "--key", key, release_dir).returncode == 0
        assert verify_sums_signature(release_dir, signers).ok
        assert stock_verify(keygen, release_dir, signers, "releases@modelforge").returncode == 0


def test_an_encrypted_key_reads_its_passphrase_from_a_descriptor(keygen, release_dir, tmp_path):
    key = mint_key(keygen, tmp_path / "keys", "encrypted", passphrase=PASSPHRASE)
    signers = signers_file(tmp_path / "allowed_signers", ("releases@modelforge", key))
    outcomes = []
    for passphrase, code in ((b"wrong\n", 2), (PASSPHRASE.encode() + b"\n", 0)):
        read, write = os.pipe()
        os.write(write, passphrase)
        os.close(write)
        try:
            result = subprocess.run(
                [release_exe(), "sign", "--key", str(key), "--passphrase-fd", str(read)]
                + [str(release_dir)],
                pass_fds=(read,),
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
        finally:
            os.close(read)
        assert result.returncode == code, result.stderr
        assert PASSPHRASE.encode() not in result.stdout + result.stderr
        outcomes.append(result.stderr)
    assert b"the passphrase is wrong" in outcomes[0]
    assert verify_sums_signature(release_dir, signers).ok


def test_an_encrypted_key_asks_on_the_terminal_without_echo(keygen, release_dir, tmp_path):
    key = mint_key(keygen, tmp_path / "keys", "encrypted", passphrase=PASSPHRASE)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal session of its own, as a release engineer has
        try:
            argv = [release_exe(), "sign", "--key", str(key), str(release_dir)]
            os.execv(argv[0], argv)  # noqa: S606
        finally:
            os._exit(127)
    seen = b""
    try:
        seen += read_until(fd, b"Passphrase for ")
        os.write(fd, PASSPHRASE.encode() + b"\n")
        seen += read_until(fd, b"allowed_signers line")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    assert PASSPHRASE.encode() not in seen  # typed, never echoed
    assert (release_dir / "SHA256SUMS.sig").is_file()


def test_an_encrypted_key_without_a_terminal_or_descriptor_is_refused(
    keygen, release_dir, tmp_path
):
    key = mint_key(keygen, tmp_path / "keys", "encrypted", passphrase=PASSPHRASE)
    result = subprocess.run(
        [release_exe(), "sign", "--key", str(key), str(release_dir)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        start_new_session=True,  # no controlling terminal
    )
    assert result.returncode == 2
    assert "--passphrase-fd" in result.stderr
    assert not (release_dir / "SHA256SUMS.sig").exists()


@pytest.mark.parametrize("case", ["inside", "readable", "rsa", "not-a-key", "no-sums"])
def test_keys_and_directories_that_cannot_be_used_are_refused(keygen, release_dir, tmp_path, case):
    key = mint_key(keygen, tmp_path / "keys", "release")
    if case == "inside":
        key = mint_key(keygen, release_dir / "keys", "release")
    elif case == "readable":
        key.chmod(0o644)
    elif case == "rsa":
        key = tmp_path / "keys" / "rsa"
        subprocess.run(
            [keygen, "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(key)],
            check=True,
            capture_output=True,
        )
    elif case == "not-a-key":
        key.write_text("hello\n")
    else:
        (release_dir / "SHA256SUMS").unlink()
    secret = key.read_bytes() if key.exists() else b""
    result = release("sign", "--key", key, release_dir)
    assert result.returncode == 2, result.stdout
    message = result.stderr.decode()
    expected = {
        "inside": "inside the release directory",
        "readable": "chmod 600",
        "rsa": "not an Ed25519 key",
        "not-a-key": "not an OpenSSH private key",
        "no-sums": "cannot read",
    }[case]
    assert expected in message
    for line in secret.splitlines()[1:-1]:  # the key's body, if it has one
        assert line not in result.stderr
    assert not (release_dir / "SHA256SUMS.sig").exists()


def release_exe() -> str:
    from tests.harness.release_cli import RELEASE

    return str(RELEASE)


def read_until(fd: int, marker: bytes, limit: float = 60.0) -> bytes:
    """Terminal output up to ``marker`` (the deadline only stops a hung child)."""
    data = b""
    deadline = time.monotonic() + limit
    while marker not in data:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {marker!r} from the terminal; saw {data!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_only_the_release_principal_s_key_counts(keygen, release_dir, tmp_path):
    """verify-bundle --signers took any principal of the file, and a negated one: now the key
    must be trusted for the release principal, as ssh-keygen -Y verify -I says."""
    key = mint_key(keygen, tmp_path / "keys", "release")
    assert release("sign", "--key", key, release_dir).returncode == 0
    public = key.with_suffix(".pub").read_text().strip()
    other = signers_file(tmp_path / "other", ("someone@example", key))
    refused = verify_sums_signature(release_dir, other)
    assert not refused.ok
    assert "someone@example, not to the release principal releases@modelforge" in refused.message
    assert verify_sums_signature(release_dir, other, "someone@example").ok
    negated = tmp_path / "negated"
    negated.write_text(f'!releases@modelforge,* namespaces="{NAMESPACE}" {public}\n')
    assert not verify_sums_signature(release_dir, negated).ok
    assert stock_verify(keygen, release_dir, negated, "releases@modelforge").returncode != 0
    # the command line says the same, exit 1
    result = release("verify-bundle", "--signers", other, release_dir)
    assert result.returncode == 1 and b"not to the release principal" in result.stderr
