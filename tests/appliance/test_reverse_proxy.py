"""The nginx example of docs/reverse-proxy.md, run as written: Debian's nginx terminates TLS in
front of the real control plane, and a real agent enrolls and heartbeats through it. Beside it,
which X-Forwarded-* headers the control plane believes: only those of a listed proxy."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from modelforge_appliance.identity import sessions
from modelforge_appliance.store.tables import SignInThrottle
from modelforge_node_agent.settings import load_settings
from modelforge_node_agent.transport import make_session
from tests.harness.agent_process import AgentProcess, agent_env, wait_until
from tests.harness.console_client import PASSWORD, set_password
from tests.harness.control_plane import error_code, free_port, make_settings, serve, unavailable
from tests.harness.pki import issue_server_cert, make_ca

ROOT = Path(__file__).resolve().parents[2]
NAME = "cp.modelforge.test"


def nginx_binary() -> str:
    path = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if path is None:
        unavailable("nginx is not installed: scripts/test installs Debian's nginx-light as root")
    return path


def documented_site() -> str:
    """The nginx site file from docs/reverse-proxy.md, exactly as documented."""
    text = (ROOT / "docs" / "reverse-proxy.md").read_text()
    blocks = re.findall(r"```nginx\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, "docs/reverse-proxy.md should show one nginx site file"
    return blocks[0]


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
