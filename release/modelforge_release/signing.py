"""The release signature: ``SHA256SUMS.sig``, an SSH signature over ``SHA256SUMS``.

Signing uses ``cryptography`` (pinned in the ``release`` extra) to read an OpenSSH Ed25519
private key, encrypted or not, and writes the armoured ``SSHSIG`` format of OpenSSH's
PROTOCOL.sshsig with the namespace ``modelforge-release``. Anyone checks it with a stock
tool, offline::

    ssh-keygen -Y verify -f allowed_signers -I <principal> -n modelforge-release \\
        -s SHA256SUMS.sig < SHA256SUMS

Verification (``verify-bundle --signers``) runs that same ``ssh-keygen``, so an
``allowed_signers`` file means exactly what OpenSSH says it means (principals, namespaces,
validity windows, several keys during a rotation).

The private key is read once into memory and never written, logged, or named in an error
beyond its path; a passphrase is read without echo from the terminal, or from a file
descriptor for automation.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from modelforge_contract.files import write_atomically

from .names import RELEASE_PRINCIPAL, SIGNATURE_NAME, SUMS_NAME

NAMESPACE = "modelforge-release"
HASH_ALGORITHM = "sha512"
_MAGIC = b"SSHSIG"
_VERSION = 1
_ARMOUR_BEGIN = "-----BEGIN SSH SIGNATURE-----"
_ARMOUR_END = "-----END SSH SIGNATURE-----"


class SigningError(Exception):
    """The signature cannot be made; the message says why (never what the key holds)."""


@dataclass(frozen=True)
class SignatureCheck:
    ok: bool
    principal: str | None
    message: str


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def signed_data(message: bytes, namespace: str = NAMESPACE) -> bytes:
    """What the key signs (PROTOCOL.sshsig): the preamble, namespace and the message's hash."""
    digest = hashlib.sha512(message).digest()
    return (
        _MAGIC
        + _string(namespace.encode())
        + _string(b"")
        + _string(HASH_ALGORITHM.encode())
        + _string(digest)
    )


def armour(blob: bytes) -> str:
    """The signature blob as ``ssh-keygen -Y sign`` writes it: base64 in 70-column lines."""
    text = base64.b64encode(blob).decode()
    lines = [text[at : at + 70] for at in range(0, len(text), 70)]
    return "\n".join([_ARMOUR_BEGIN, *lines, _ARMOUR_END]) + "\n"


def _read_key_file(path: Path) -> bytes:
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise SigningError(f"{path} is not a file")
        if info.st_mode & 0o077:
            raise SigningError(
                f"{path} can be read by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"a signing key must be private: chmod 600 {path}"
            )
        return path.read_bytes()
    except OSError as exc:
        raise SigningError(f"cannot read the key {path}: {exc.strerror or exc}") from None


def _passphrase(path: Path, passphrase_fd: int | None) -> bytes:
    if passphrase_fd is not None:
        try:
            with os.fdopen(passphrase_fd, "rb", closefd=False) as source:
                line = source.readline()
        except OSError as exc:
            raise SigningError(
                f"cannot read the passphrase from file descriptor {passphrase_fd}: "
                f"{exc.strerror or exc}"
            ) from None
        return line.rstrip(b"\r\n")
    try:
        with open("/dev/tty"):
            pass
    except OSError:
        raise SigningError(
            f"{path} is encrypted and there is no terminal to ask for its passphrase: "
            "give it on a file descriptor with --passphrase-fd"
        ) from None
    return getpass.getpass(f"Passphrase for {path}: ").encode()


def load_signing_key(path: Path, passphrase_fd: int | None = None):  # -> Ed25519PrivateKey
    """An OpenSSH Ed25519 private key; asks for the passphrase if it is encrypted."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    data = _read_key_file(path)
    if b"-----BEGIN OPENSSH PRIVATE KEY-----" not in data:
        raise SigningError(
            f"{path} is not an OpenSSH private key (make one with ssh-keygen -t ed25519)"
        )
    password = None
    try:
        key = load_ssh_private_key(data, password=None)
    except TypeError:  # encrypted, and no password was given
        password = _passphrase(path, passphrase_fd)
        try:
            key = load_ssh_private_key(data, password=password)
        except ValueError:
            raise SigningError(f"{path}: the passphrase is wrong") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise SigningError(f"{path} cannot be read as an OpenSSH private key ({exc})") from None
    finally:
        del data, password
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path} is not an Ed25519 key; release signatures use Ed25519")
    return key


def public_key_line(key) -> str:
    """``ssh-ed25519 AAAA…``: what goes into an ``allowed_signers`` line."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()


def signature(key, message: bytes, namespace: str = NAMESPACE) -> str:
    """The armoured SSHSIG signature of ``message`` by ``key`` in ``namespace``."""
    public_blob = base64.b64decode(public_key_line(key).split()[1])
    raw = key.sign(signed_data(message, namespace))
    blob = (
        _MAGIC
        + struct.pack(">I", _VERSION)
        + _string(public_blob)
        + _string(namespace.encode())
        + _string(b"")
        + _string(HASH_ALGORITHM.encode())
        + _string(_string(b"ssh-ed25519") + _string(raw))
    )
    return armour(blob)


def sign_sums(
    directory: Path, key_path: Path, passphrase_fd: int | None = None
) -> tuple[Path, str]:
    """Write ``DIRECTORY/SHA256SUMS.sig`` over ``DIRECTORY/SHA256SUMS`` (atomically, 0644);
    answer its path and the key's public line (``ssh-ed25519 AAAA…``)."""
    sums = directory / SUMS_NAME
    if key_path.resolve().parent == directory.resolve() or directory.resolve() in (
        key_path.resolve().parents
    ):
        raise SigningError(
            f"the key {key_path} is inside the release directory {directory}; keep it "
            "elsewhere so it can never ship with the bundle"
        )
    try:
        message = sums.read_bytes()
    except OSError as exc:
        raise SigningError(f"cannot read {sums}: {exc.strerror or exc}") from None
    key = load_signing_key(key_path, passphrase_fd)
    target = directory / SIGNATURE_NAME
    write_atomically(target, signature(key, message).encode(), mode=0o644)
    return target, public_key_line(key)


def verify_sums_signature(
    directory: Path, signers: Path, principal: str = RELEASE_PRINCIPAL
) -> SignatureCheck:
    """``ssh-keygen -Y verify -I PRINCIPAL`` of SHA256SUMS.sig, namespace
    ``modelforge-release``, against an ``allowed_signers`` file: only a key the file trusts
    for the release principal counts (a line for another principal, or one that negates it,
    does not). ``-Y find-principals`` first, to say whose key signed when it is not."""
    sums, sig = directory / SUMS_NAME, directory / SIGNATURE_NAME
    if not sig.is_file():
        return SignatureCheck(False, None, f"{SIGNATURE_NAME} is missing: the release is unsigned")
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        return SignatureCheck(
            False,
            None,
            "ssh-keygen is not installed, so the signature cannot be checked "
            "(apt-get install openssh-client)",
        )
    found = subprocess.run(
        [keygen, "-Y", "find-principals", "-f", str(signers), "-s", str(sig)],
        capture_output=True,
        text=True,
        check=False,
    )
    principals = found.stdout.split()
    if found.returncode != 0 or not principals:
        detail = _first_line(found.stderr) or "no principal in it holds the signing key"
        return SignatureCheck(
            False, None, f"{SIGNATURE_NAME} is not signed by a key in {signers.name} ({detail})"
        )
    try:
        message = sums.read_bytes()
    except OSError as exc:
        return SignatureCheck(False, None, f"SHA256SUMS cannot be read ({exc.strerror or exc})")
    checked = subprocess.run(
        [keygen, "-Y", "verify", "-f", str(signers), "-I", principal, "-n", NAMESPACE]
        + ["-s", str(sig)],
        input=message,
        capture_output=True,
        check=False,
    )
    if checked.returncode == 0:
        return SignatureCheck(True, principal, f"signed by {principal}")
    if principal not in principals:
        return SignatureCheck(
            False,
            None,
            f"{SIGNATURE_NAME} is signed by a key {signers.name} gives to "
            f"{', '.join(principals)}, not to the release principal {principal}",
        )
    detail = _first_line(checked.stderr.decode("utf-8", "replace"))
    return SignatureCheck(
        False,
        None,
        f"{SIGNATURE_NAME} does not verify for SHA256SUMS in namespace {NAMESPACE} "
        f"({detail or 'SHA256SUMS was changed after signing'})",
    )


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""
