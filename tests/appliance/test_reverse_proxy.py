"""The nginx example of docs/reverse-proxy.md, run as written: Debian's nginx terminates TLS in
front of the real control plane, a real agent enrolls and heartbeats through it, and an agent's
tunnel and a client's streamed completion pass through it, event by event, in the one-port and
the two-port form. Beside it, which X-Forwarded-* headers the control plane believes: only
those of a listed proxy."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from modelforge_appliance.identity import sessions
from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_appliance.store.tables import SignInThrottle
from modelforge_contract.relay import PATH_CLIENT_CHAT_COMPLETIONS
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.transport import make_session
from modelforge_node_agent.tunnel import TunnelClient
from tests.harness.agent_process import AgentProcess, agent_env, wait_until
from tests.harness.console_client import PASSWORD, set_password
from tests.harness.control_plane import error_code, free_port, make_settings, serve, unavailable
from tests.harness.pki import issue_server_cert, make_ca
from tests.harness.relay_origin import Origin

from .test_deployments import ServingNode, deploy, held, tiny_model
from .test_relay import read_event

ROOT = Path(__file__).resolve().parents[2]
NAME = "cp.modelforge.test"


def nginx_binary() -> str:
    path = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if path is None:
        unavailable("nginx is not installed: scripts/test installs Debian's nginx-light as root")
    return path


def documented_blocks() -> tuple[str, str]:
    """The nginx site file from docs/reverse-proxy.md and its two-port tunnel upstream,
    exactly as documented."""
    text = (ROOT / "docs" / "reverse-proxy.md").read_text()
    blocks = re.findall(r"```nginx\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 2, (
        "docs/reverse-proxy.md should show one nginx site file and the two-port form's upstream"
    )
    return blocks[0], blocks[1]


def documented_site() -> str:
    """The nginx site file from docs/reverse-proxy.md, exactly as documented."""
    return documented_blocks()[0]


def two_port_site(tunnel_port: int) -> str:
    """The site file with its tunnel upstream replaced by the two-port form's, as the
    document says (the tunnel port's documented 127.0.0.1:8001 made ``tunnel_port``)."""
    site, upstream = documented_blocks()
    one_port = re.findall(r"^upstream modelforge_tunnel \{\n.*?^\}\n", site, re.DOTALL | re.M)
    assert len(one_port) == 1, "the site file should have one upstream modelforge_tunnel"
    assert upstream.startswith("upstream modelforge_tunnel {"), upstream
    return site.replace(
        one_port[0], substitute(upstream, [("127.0.0.1:8001", f"127.0.0.1:{tunnel_port}")])
    )


def substitute(site: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in site, f"the documented example no longer contains {old!r}"
        site = site.replace(old, new)
    return site


def make_pki(directory: Path) -> Path:
    """A private CA made as docs/node-agent.md says (Python 3.13 agents refuse OpenSSL's
    defaults) and a certificate for NAME it signed, as NAME.pem and NAME.key."""
    make_ca(directory, "ca")
    issue_server_cert(directory, "ca", NAME, [NAME])
    return directory / "ca.pem"


def start_nginx(work: Path, site: str) -> subprocess.Popen:
    for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (work / temp).mkdir()
    user = "user root;\n" if os.getuid() == 0 else ""
    conf = work / "nginx.conf"
    conf.write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {work}/nginx.pid;\n"
        f"error_log {work}/error.log warn;\nevents {{ worker_connections 256; }}\n"
        "http {\n    access_log off;\n"
        f"    client_body_temp_path {work}/body;\n    proxy_temp_path {work}/proxy;\n"
        f"    fastcgi_temp_path {work}/fastcgi;\n    uwsgi_temp_path {work}/uwsgi;\n"
        f"    scgi_temp_path {work}/scgi;\n{site}\n}}\n"
    )
    nginx = nginx_binary()
    check = subprocess.run([nginx, "-t", "-p", str(work), "-e", str(work / "error.log"), "-c", str(conf)],
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
    return subprocess.Popen(
        [nginx, "-p", str(work), "-e", str(work / "error.log"), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text() if log.exists() else "nginx exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("nginx did not listen")


@pytest.mark.slow
def test_the_documented_nginx_example_carries_enrollment_and_heartbeats(tmp_path):
    nginx_binary()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_pki(pki)
    proxy_port = free_port()
    origin = f"https://{NAME}:{proxy_port}"
    settings = replace(
        make_settings(tmp_path / "state"), public_api_origin=origin, trusted_proxies=("127.0.0.1",)
    )
    with serve(settings) as cp:
        site = substitute(
            documented_site(),
            [
                ("/etc/modelforge/tls/", f"{pki}/"),
                ("cp.lan", NAME),
                ("listen 443 ssl;", f"listen 127.0.0.1:{proxy_port} ssl;"),
                ("127.0.0.1:8000", cp.url.removeprefix("http://")),
            ],
        )
        work = tmp_path / "nginx"
        work.mkdir()
        nginx = start_nginx(work, site)
        try:
            wait_for_port(proxy_port, nginx, work / "error.log")
            # Through the proxy, as a node sees it: TLS verified against the private CA.
            agent_settings = load_settings(
                {
                    "MODELFORGE_AGENT_CONTROL_PLANE_URL": origin,
                    "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS": "127.0.0.1",
                    "MODELFORGE_AGENT_CA_CERT_PATH": str(ca),
                }
            )
            session = make_session(agent_settings)
            assert session.get(f"{origin}/healthz", timeout=10).json() == {"status": "ok"}

            # The body limit is the control plane's: a body at the limit reaches it (and is
            # refused as not JSON), one byte more is refused by nginx in the same shape. The
            # enroll call reads its body without a credential (a heartbeat checks the
            # credential first, so its body would never be read).
            def post(size: int):
                return session.post(
                    f"{origin}/api/v1/agent/enroll",
                    data=b"x" * size,
                    headers={
                        "Content-Type": "application/json",
                        "X-ModelForge-Agent-Protocol": "1",
                    },
                    timeout=30,
                )

            limit = cp.settings.max_body_bytes
            at_limit = post(limit)
            assert (at_limit.status_code, at_limit.json()["error"]["code"]) == (
                400,
                "BODY_NOT_JSON",
            )
            over = post(limit + 1)
            assert (over.status_code, over.json()["error"]["code"]) == (413, "BODY_TOO_LARGE")
            assert set(over.json()["error"]) == {"code", "message", "next_step"}

            # A client's own X-Forwarded-For cannot change the address that is counted: nginx
            # replaces it with the client's address (here 127.0.0.1), so forged headers all
            # land in one throttle bucket, and the audit trail names the real client.
            set_password(cp)
            for attempt in range(sessions.FREE_FAILURES):
                forged = session.post(
                    f"{origin}/console/sign-in",
                    json={"password": "wrong"},
                    headers={"X-Forwarded-For": f"198.51.100.{attempt}"},
                    timeout=30,
                )
                assert forged.status_code == 401, forged.text
            refused = session.post(
                f"{origin}/console/sign-in",
                json={"password": PASSWORD},
                headers={"X-Forwarded-For": "198.51.100.200"},
                timeout=30,
            )
            assert refused.status_code == 429, refused.text
            with cp.store.connection():
                counted = [row.address for row in SignInThrottle.select()]
            assert "127.0.0.1" in counted
            assert not [address for address in counted if address.startswith("198.51.100.")]

            minted = cp.mint()
            assert minted["api_origin"] == origin
            env = agent_env(
                control_plane_url=origin,
                control_plane_host_address="127.0.0.1",
                ca_cert_path=ca,
                enrollment_token=minted["token"],
                accelerator_mode="cpu",
                state_volume=tmp_path / "agent-state",
            )
            with AgentProcess(env, tmp_path / "agent.log") as agent:

                def online():
                    nodes = cp.admin("GET", "/api/v1/admin/hardware/nodes").json()["nodes"]
                    return nodes if nodes and nodes[0]["liveness"] == "online" else None

                nodes = wait_until(online, timeout=30, what="the agent online through nginx")
                agent.terminate()
            assert nodes[0]["hostname"]
        finally:
            nginx.terminate()
            nginx.wait(timeout=10)


def client_request(port: int, ca: Path, body: dict, key: str) -> http.client.HTTPResponse:
    """A client's POST of a chat completion to nginx on ``port``, TLS verified against the
    private CA; a socket timeout bounds every read (a held event fails, never hangs)."""
    context = ssl.create_default_context(cafile=str(ca))
    connection = http.client.HTTPSConnection(NAME, port, context=context, timeout=60)
    connection.sock = context.wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=60), server_hostname=NAME
    )
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    connection.request("POST", PATH_CLIENT_CHAT_COMPLETIONS, json.dumps(body).encode(), headers)
    return connection.getresponse()


@pytest.mark.slow
@pytest.mark.parametrize("form", ["one-port", "two-port"])
def test_a_tunnel_and_a_streamed_completion_pass_the_documented_nginx(tmp_path, form):
    """An agent's tunnel client, with the agent's TLS settings (private CA, pinned address),
    comes up through the documented nginx while nginx holds a reused connection to the
    control plane, and a client's streamed chat completion through nginx arrives event by
    event: each is read before the runtime (a gated stdlib origin) writes the next."""
    nginx_binary()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_pki(pki)
    proxy_port = free_port()
    origin = f"https://{NAME}:{proxy_port}"
    tunnel_port = free_port() if form == "two-port" else None
    # No public origin: the scripted node enrolls on the control plane's own port.
    settings = replace(
        make_settings(tmp_path / "state"),
        trusted_proxies=("127.0.0.1",),
        tunnel_listen=("127.0.0.1", tunnel_port) if tunnel_port else None,
    )
    runtime = Origin()
    stop = threading.Event()
    with serve(settings) as cp:
        site = documented_site() if tunnel_port is None else two_port_site(tunnel_port)
        site = substitute(
            site,
            [
                ("/etc/modelforge/tls/", f"{pki}/"),
                ("cp.lan", NAME),
                ("listen 443 ssl;", f"listen 127.0.0.1:{proxy_port} ssl;"),
                ("127.0.0.1:8000", cp.url.removeprefix("http://")),
            ],
        )
        work = tmp_path / "nginx"
        work.mkdir()
        nginx = start_nginx(work, site)
        try:
            wait_for_port(proxy_port, nginx, work / "error.log")
            agent_settings = load_settings(
                {
                    "MODELFORGE_AGENT_CONTROL_PLANE_URL": origin,
                    "MODELFORGE_AGENT_CONTROL_PLANE_HOST_ADDRESS": "127.0.0.1",
                    "MODELFORGE_AGENT_CA_CERT_PATH": str(ca),
                    "MODELFORGE_AGENT_STATE_VOLUME": str(tmp_path / "agent-state"),
                    "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
                }
            )
            # nginx now keeps an idle connection to the control plane: the tunnel must not
            # be sent on it (the control plane takes a tunnel only on a new connection).
            session = make_session(agent_settings)
            assert session.get(f"{origin}/healthz", timeout=10).json() == {"status": "ok"}

            # A running server of deployment svc on a scripted node; its tunnel is the
            # agent's real client, through nginx.
            model = tiny_model(cp, tmp_path)
            node = ServingNode(cp, "behind-nginx")
            held(cp, model, node)
            assert deploy(cp, "svc", [node]).status_code == 201
            [entry] = node.servers()
            server_id = entry["server_id"]
            lease = node.claim_server(server_id).json()["lease"]
            node.renew_server(server_id, lease["lease_id"], "running")
            _, key = create_api_key(cp.store, "tests", "tests")
            model_dir = str(agent_settings.artifacts_dir / "models" / ("a" * 64))
            TunnelClient(
                agent_settings,
                lambda: node.credential,
                lambda sid: (runtime.port, "svc", model_dir) if sid == server_id else None,
                stop,
                steps=(0.05, 0.1, 0.2),
            ).start()
            wait_until(
                lambda: cp.server.app.hub.connected(node.node_id),
                timeout=30,
                what=f"the agent's tunnel up through nginx ({form})",
            )

            events = [{"choices": [{"delta": {"content": f"word{i} "}}]} for i in range(4)]
            expected = runtime.sse(events)
            runtime.chunks = [c + b"\n\n" for c in expected.split(b"\n\n") if c]
            runtime.gated = True
            runtime.release()  # the first event: the head goes with it
            body = {"model": "svc", "stream": True, "messages": []}
            response = client_request(proxy_port, ca, body, key)
            assert response.status == 200
            assert response.getheader("Content-Type") == "text/event-stream"
            buffer = bytearray()
            seen = []
            for index, chunk in enumerate(runtime.chunks):
                if index:
                    runtime.release()  # one more event, only once the last one arrived
                seen.append(read_event(response, buffer))
                assert seen[-1] == chunk, index
            assert b"".join(seen) == expected
            assert runtime.requests[0]["body"] == json.dumps(body).encode()
            assert "Authorization" not in runtime.requests[0]["headers"]
        finally:
            stop.set()
            nginx.terminate()
            nginx.wait(timeout=10)
            runtime.close()


PROXIED = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "cp.lan"}


def _enroll_through(cp, token: str, headers: dict) -> requests.Response:
    return cp.enroll(token, hostname="behind-proxy", headers=headers)


def test_enrollment_through_a_trusted_tls_proxy_matches_the_public_origin(tmp_path):
    """Behind a trusted TLS proxy, enrollment compared the public https://cp.lan origin
    with the proxy's own plain http://127.0.0.1 hop and refused every node: the origin the
    trusted proxy forwards is the one that must match."""
    settings = replace(
        make_settings(tmp_path / "state"),
        public_api_origin="https://cp.lan",
        trusted_proxies=("127.0.0.1",),
    )
    with serve(settings) as cp:
        token = cp.mint()["token"]
        assert _enroll_through(cp, token, {}).status_code == 403  # plain http://127.0.0.1
        assert _enroll_through(cp, token, PROXIED).status_code == 201


def test_forwarded_headers_from_an_untrusted_client_are_ignored(tmp_path):
    """X-Forwarded-Proto and X-Forwarded-Host were believed from any client, so a caller
    could claim the public origin from anywhere: with no trusted proxy they are ignored and
    the enrollment is refused ENROLLMENT_ORIGIN_MISMATCH."""
    settings = replace(make_settings(tmp_path / "state"), public_api_origin="https://cp.lan")
    with serve(settings) as cp:
        refused = _enroll_through(cp, cp.mint()["token"], PROXIED)
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "ENROLLMENT_ORIGIN_MISMATCH"


@pytest.mark.parametrize(
    ("proxies", "status"),
    [(("10.9.9.9", "127.0.0.1"), 201), (("10.9.9.9", "::1"), 403)],
    ids=["listed", "not-listed"],
)
def test_forwarded_headers_are_believed_only_from_a_listed_proxy(tmp_path, proxies, status):
    """Forwarded headers were believed from a peer that is not on the
    MODELFORGE_TRUSTED_PROXY list (127.0.0.1 while only ::1 was listed): only a listed
    address is believed."""
    settings = replace(
        make_settings(tmp_path / "state"),
        public_api_origin="https://cp.lan",
        trusted_proxies=proxies,
    )
    with serve(settings) as cp:
        response = cp.enroll(cp.mint()["token"], hostname="behind-proxy", headers=PROXIED)
        assert response.status_code == status, response.text


def test_a_malformed_forwarded_header_from_the_proxy_is_a_json_400(tmp_path):
    """A malformed X-Forwarded-Proto from the trusted proxy ('https, http') did not get the
    one JSON error shape: it is a 400 REQUEST_MALFORMED."""
    settings = replace(make_settings(tmp_path / "state"), trusted_proxies=("127.0.0.1",))
    with serve(settings) as cp:
        response = requests.get(
            cp.url + "/healthz", headers={"X-Forwarded-Proto": "https, http"}, timeout=10
        )
        assert (response.status_code, error_code(response)) == (400, "REQUEST_MALFORMED")
