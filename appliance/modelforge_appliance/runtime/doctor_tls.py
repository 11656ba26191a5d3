"""``modelforge doctor --ca-cert``: will agents on Python 3.13 accept the control plane's
certificate? (Its own module: the doctor's other checks never touch the network.)"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

from modelforge_contract.tls import CA_DOCS, strict_x509_cause

# (ok, what was seen, the fix when not ok): doctor.py makes its "tls" check of it.
Outcome = tuple[bool, str, "str | None"]


def verify_origin(origin: str | None, ca_cert: Path, timeout: float = 10.0) -> Outcome:
    """Verify the public origin's certificate against the agents' CA, as Python 3.13 agents do.

    CPython 3.13 verifies in OpenSSL's strict X.509 mode, which refuses CA certificates made
    with OpenSSL's defaults (no keyUsage); the strict flags are set here whatever Python runs
    the doctor, so a CA that older agents accept but newer ones refuse is caught now.
    """
    parts = urlsplit(origin or "")
    if parts.scheme != "https" or not parts.hostname:
        return (
            False,
            f"MODELFORGE_PUBLIC_API_ORIGIN is {origin or 'not set'}: agents would not use TLS, "
            f"so {ca_cert} is never used",
            "set MODELFORGE_PUBLIC_API_ORIGIN to the https:// origin agents use (your TLS proxy)",
        )
    host, port = parts.hostname, parts.port or 443
    try:
        context = ssl.create_default_context(cafile=str(ca_cert))
    except (OSError, ssl.SSLError) as exc:
        return (
            False,
            f"cannot load {ca_cert} as a PEM CA bundle: {getattr(exc, 'strerror', None) or exc}",
            "point --ca-cert at the CA certificate (PEM) agents get as "
            "MODELFORGE_AGENT_CA_CERT_PATH",
        )
    context.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
    where = f"{host}:{port}"
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            version = tls.version()
    except ssl.SSLCertVerificationError as exc:
        cause = strict_x509_cause(exc.verify_message)
        if cause:
            return False, f"agents on Python 3.13+ refuse {where}: {cause}", CA_DOCS
        return (
            False,
            f"the certificate at {where} does not verify against {ca_cert}: {exc.verify_message}",
            f"serve a certificate for {host} issued by that CA (see {CA_DOCS})",
        )
    except (OSError, ssl.SSLError) as exc:
        return (
            False,
            f"no TLS handshake with {where}: {getattr(exc, 'strerror', None) or exc}",
            "start the TLS proxy in front of the control plane, or check "
            "MODELFORGE_PUBLIC_API_ORIGIN",
        )
    return True, f"{where} ({version}) verifies against {ca_cert} in strict mode", None
