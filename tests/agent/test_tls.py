"""TLS: verification on by default, a private CA, and a pinned host address that keeps the name."""

from __future__ import annotations

import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from modelforge_node_agent.client import ControlPlaneClient, TransportFailure
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.transport import make_session
from tests.harness.agent_process import AgentProcess, agent_env
from tests.harness.control_plane import free_port
from tests.harness.pki import CA_EXTENSIONS, SERVER_EXTENSIONS, issue_server_cert, make_ca
from tests.harness.stand_in_server import answer_json

NAME = "cp.modelforge.test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A private CA made as docs/node-agent.md says, two server certificates it signed (one
    for NAME, one for another name), and a CA made with OpenSSL's defaults that signed a
    certificate for NAME."""
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    issue_server_cert(d, "ca", "server", [NAME])
    issue_server_cert(d, "ca", "other", ["other.modelforge.test"])
    make_ca(d, "defaults-ca", careful=False)
    issue_server_cert(d, "defaults-ca", "defaults", [NAME])
    return d


class TlsServer(ThreadingHTTPServer):
    """HTTPS on 127.0.0.1 that records the SNI name and Host header of each request."""

    daemon_threads = True

    def __init__(self, cert, key):
        self.seen: list[tuple[str | None, str | None]] = []
        self.sni: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805
                outer.seen.append((outer.sni[-1] if outer.sni else None, handler.headers["Host"]))
                answer_json(handler, 200, b'{"compatibility": "COMPATIBLE"}')

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.sni_callback = lambda sock, name, ctx: self.sni.append(name)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self):
        return self.server_address[1]


@pytest.fixture
def tls_server(pki):
    servers = []

    def start(stem="server"):
        server = TlsServer(pki / f"{stem}.pem", pki / f"{stem}.key")
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def call(server, **env):
    settings = load_settings(
        {
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": f"https://{NAME}:{server.port}",
            "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS": "127.0.0.1",
            **env,
        }
    )
    client = ControlPlaneClient(settings.control_plane_url, make_session(settings))
    return client.call("POST", "/api/v1/agent/heartbeat", {})


def test_private_ca_with_host_address_verifies_the_url_host(pki, tls_server):
    server = tls_server()
    assert call(server, MODELFORGE_AGENT_CA_CERT_PATH=str(pki / "ca.pem")) == {
        "compatibility": "COMPATIBLE"
    }
    # Dialled 127.0.0.1, but the handshake and the Host header named the URL's host.
    assert server.seen == [(NAME, f"{NAME}:{server.port}")]


def test_verification_is_on_by_default(tls_server):
    with pytest.raises(TransportFailure) as failure:
        call(tls_server())
    assert failure.value.describe() == "TLSError on POST /api/v1/agent/heartbeat"


def test_hostname_is_still_verified_with_a_private_ca(pki, tls_server):
    server = tls_server("other")  # signed by the trusted CA, for another name
    with pytest.raises(TransportFailure) as failure:
        call(server, MODELFORGE_AGENT_CA_CERT_PATH=str(pki / "ca.pem"))
    assert failure.value.name == "TLSError"
    assert server.seen == []


def test_tls_verify_false_works_and_warns_on_every_start(tls_server, tmp_path):
    server = tls_server("other")
    assert call(server, MODELFORGE_AGENT_TLS_VERIFY="false") == {"compatibility": "COMPATIBLE"}
    env = agent_env(
        control_plane_url=f"https://{NAME}:{free_port()}",
        control_plane_host_address="127.0.0.1",
        tls_verify="false",
        enrollment_token="mfe_0123456789abcdef_" + "G" * 43,
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
    )
    for attempt in range(2):
        with AgentProcess(env, tmp_path / f"start{attempt}.log") as agent:
            agent.wait_for_log("ConnectError on POST /api/v1/agent/enroll")
            agent.terminate()
            assert "WARNING MODELFORGE_AGENT_TLS_VERIFY=false" in agent.log()


def test_a_ca_made_with_openssl_defaults_is_named_as_the_cause_on_python_3_13(pki, tls_server):
    """Python 3.13 verifies in strict X.509 mode: a CA without keyUsage is refused, and the
    failure line says so; older Pythons accept it (the same CA works on Debian 12)."""
    server = tls_server("defaults")
    ca = str(pki / "defaults-ca.pem")
    if sys.version_info < (3, 13):
        assert call(server, MODELFORGE_AGENT_CA_CERT_PATH=ca) == {"compatibility": "COMPATIBLE"}
        return
    with pytest.raises(TransportFailure) as failure:
        call(server, MODELFORGE_AGENT_CA_CERT_PATH=ca)
    line = failure.value.describe()
    assert line.startswith("TLSError on POST /api/v1/agent/heartbeat: the CA certificate has no ")
    assert "keyUsage=critical,keyCertSign,cRLSign" in line
    assert "docs/node-agent.md" in line


def test_the_documented_ca_is_the_one_these_tests_make():
    """docs/node-agent.md shows the extensions and openssl options tests/harness/pki.py uses."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "node-agent.md").read_text()
    for extension in (*CA_EXTENSIONS, *SERVER_EXTENSIONS):
        assert extension in docs, extension
