"""HTTPS to the control plane: certificate checks on, a private CA, a pinned host address.

``MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS`` makes the agent connect to that
address while the TLS handshake (SNI) and the certificate check still use the
URL's host name, and the Host header still names it, so the enrollment origin
lock on the control plane keeps working.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter

from modelforge_contract.tls import strict_x509_cause

from .settings import AgentSettings

log = logging.getLogger(__name__)

# (connect, read) seconds: bounded so one hung call delays only its own publication.
REQUEST_TIMEOUT = (5.0, 15.0)


class HostAddressAdapter(HTTPAdapter):
    """Dial ``address`` instead of the URL's host; verify and name the URL's host."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self.address = address
        super().__init__(**kwargs)

    def build_connection_pool_key_attributes(
        self, request: requests.PreparedRequest, verify: Any, cert: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(
            request, verify, cert
        )
        url_host = host_params["host"]
        host_params["host"] = self.address
        if host_params["scheme"] == "https":
            pool_kwargs["server_hostname"] = url_host
            pool_kwargs["assert_hostname"] = url_host
        return host_params, pool_kwargs

    def add_headers(self, request: requests.PreparedRequest, **kwargs: Any) -> None:
        # urllib3 would otherwise derive Host from the address it dials.
        request.headers.setdefault("Host", urlsplit(request.url).netloc)


def make_session(settings: AgentSettings) -> requests.Session:
    """A session for the control plane with the operator's TLS settings applied."""
    session = requests.Session()
    # Only the agent's own settings decide where it connects and whom it trusts:
    # no proxy variables, no REQUESTS_CA_BUNDLE, no .netrc credentials.
    session.trust_env = False
    session.verify = settings.tls_verify_value
    if settings.control_plane_host_address:
        adapter = HostAddressAdapter(settings.control_plane_host_address)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
    if not settings.tls_verify:
        # One loud warning per start (main) instead of one per request.
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return session


def exception_name(exc: BaseException) -> str:
    """A short, stable name for a transport failure, for log lines operators grep."""
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLSError"
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "ConnectTimeout"
    if isinstance(exc, requests.exceptions.ReadTimeout):
        return "ReadTimeout"
    if isinstance(exc, requests.exceptions.ConnectionError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, urllib3.exceptions.NameResolutionError):
                return "DNSError"
            cause = cause.__context__ or (cause.args[0] if cause.args else None)
            if not isinstance(cause, BaseException):
                break
        return "ConnectError"
    return type(exc).__name__


def tls_cause(exc: BaseException) -> str | None:
    """For a certificate refused only by strict X.509 checks (Python 3.13+), what to fix."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            return strict_x509_cause(cause.verify_message)
        nested = cause.args[0] if cause.args and isinstance(cause.args[0], BaseException) else None
        cause = cause.__cause__ or cause.__context__ or nested
    return None
