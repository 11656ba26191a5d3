"""Test certificates made with the openssl command line, the way docs/node-agent.md tells an
operator to make them (``careful``), or with OpenSSL's defaults, which Python 3.13 refuses."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .control_plane import unavailable

# docs/node-agent.md, "Private CA": the CA and the server certificate, as documented.
CA_EXTENSIONS = ("basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign")
SERVER_EXTENSIONS = (
    "basicConstraints=CA:FALSE",
    "keyUsage=critical,digitalSignature,keyEncipherment",
    "extendedKeyUsage=serverAuth",
    "subjectKeyIdentifier=hash",
    "authorityKeyIdentifier=keyid",
)


def openssl(directory: Path, *args: str) -> None:
    if shutil.which("openssl") is None:
        unavailable("openssl is needed to make test certificates (scripts/test installs it)")
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory, timeout=60)


def make_ca(directory: Path, stem: str, careful: bool = True) -> Path:
    """STEM.pem and STEM.key: a CA with the documented extensions, or OpenSSL's defaults only
    (basicConstraints and key identifiers, but no keyUsage)."""
    directory.mkdir(parents=True, exist_ok=True)
    extensions = [arg for ext in CA_EXTENSIONS for arg in ("-addext", ext)] if careful else []
    openssl(
        directory,
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", f"{stem}.key", "-out", f"{stem}.pem",
        "-subj", f"/CN=ModelForge test CA {stem}",
        *extensions,
    )  # fmt: skip
    return directory / f"{stem}.pem"


def issue_server_cert(directory: Path, ca_stem: str, stem: str, names: list[str]) -> Path:
    """STEM.pem and STEM.key for ``names`` (DNS names or IP addresses), signed by CA_STEM."""
    alt = ",".join(
        f"IP:{name}" if name.replace(".", "").isdigit() else f"DNS:{name}" for name in names
    )
    (directory / f"{stem}.ext").write_text(
        "\n".join([*SERVER_EXTENSIONS, f"subjectAltName={alt}"]) + "\n"
    )
    openssl(
        directory,
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key",
        "-out", f"{stem}.csr", "-subj", f"/CN={names[0]}",
    )  # fmt: skip
    openssl(
        directory,
        "x509", "-req", "-in", f"{stem}.csr", "-CA", f"{ca_stem}.pem", "-CAkey", f"{ca_stem}.key",
        "-CAcreateserial", "-out", f"{stem}.pem", "-days", "2", "-extfile", f"{stem}.ext",
    )  # fmt: skip
    return directory / f"{stem}.pem"


@contextmanager
def tls_listener(cert: Path, key: Path) -> Iterator[int]:
    """A TLS endpoint on 127.0.0.1 that completes handshakes and hangs up; yields its port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    # accept() is not woken by close() from another thread: poll, so the end is prompt.
    listener.settimeout(0.1)

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            raw.settimeout(10)
            with contextlib.suppress(OSError), context.wrap_socket(raw, server_side=True):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
