"""What a private CA for the control plane's certificate must carry, said once for the agent's
failure lines and for ``modelforge doctor``.

CPython 3.13 (and urllib3 2.x on it) verify certificates in OpenSSL's strict X.509 mode
(``VERIFY_X509_STRICT``). A CA made with ``openssl req -x509`` and OpenSSL's defaults lacks
the keyUsage extension that mode requires, so agents on Python 3.13 (Debian 13, Proxmox VE 9)
refuse a control plane whose certificate agents on 3.11 accept. OpenSSL names the cause in
the verification message; these are the ones strict mode adds.
"""

from __future__ import annotations

CA_DOCS = "docs/node-agent.md, section Private CA"

# OpenSSL's verification message -> what is wrong, in the operator's words.
STRICT_X509_CAUSES = {
    "CA cert does not include key usage extension": (
        "the CA certificate has no keyUsage extension"
    ),
    "Basic Constraints of CA cert not marked critical": (
        "the CA certificate's basicConstraints extension is not marked critical"
    ),
    "Missing Authority Key Identifier": (
        "the server certificate has no authorityKeyIdentifier extension"
    ),
    "Missing Subject Key Identifier": "the CA certificate has no subjectKeyIdentifier extension",
    "Subject empty and Subject Alt Name extension not critical": (
        "the server certificate has an empty subject and a non-critical subjectAltName"
    ),
}


def strict_x509_cause(verify_message: str | None) -> str | None:
    """The cause and fix for a verification failure only strict mode reports, else None."""
    if not verify_message:
        return None
    for message, cause in STRICT_X509_CAUSES.items():
        if message.lower() in verify_message.lower():
            return (
                f"{cause}; Python 3.13 and newer refuse such a certificate. Remake the CA "
                f"with keyUsage=critical,keyCertSign,cRLSign (and reissue the server "
                f"certificate) as {CA_DOCS} shows"
            )
    return None
