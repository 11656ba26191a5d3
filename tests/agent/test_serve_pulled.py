"""A model pulled from a hub serves like an imported one (issue 39): pulled by the real
``modelforge models pull`` from the hub's stand-in on 127.0.0.1 (one quantisation of a repo
by --include), replicated to a real node, deployed with llama.cpp's real ``llama-server``,
and answering a client through the control plane's relay, greedily the same as the GGUF
served directly; the hub token used for the pull is on no node."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_contract.hub import PATH_ADMIN_HUB_TOKEN
from tests.harness.agent_process import wait_until
from tests.harness.control_plane import make_settings, run_cli, serve, store_env
from tests.harness.hub_stand_in import HubStandIn
from tests.harness.llama import GREEDY

from .test_serve import deployment, replicate, serving_node, sockets, wait_servers  # noqa: F401

pytestmark = pytest.mark.slow

REPO = "tiny-org/tiny-GGUF"
TOKEN = "hf_servetoken_" + "Kx3" * 12


@pytest.fixture
def hub(tiny_gguf):
    gguf = Path(tiny_gguf).read_bytes()
    with HubStandIn() as stand_in:
        stand_in.add_repo(
            REPO,
            {"tiny-Q4_K_M.gguf": gguf, "tiny-Q8_0.gguf": gguf + b"\x00" * 4096},
            private=True,
            tokens=(TOKEN,),
        )
        yield stand_in


@pytest.fixture
def cp(tmp_path, hub):
    settings = make_settings(
        tmp_path / "cp", heartbeat_interval_seconds=1, serve_lease_seconds=4, hub_endpoint=hub.url
    )
    with serve(settings) as plane:
        yield plane


def test_a_pulled_model_replicates_deploys_and_answers_through_the_relay(
    cp,
    hub,
    tmp_path,
    sockets,  # noqa: F811 - test_serve's fixture, imported above
    llama_server_binary,
    tiny_gguf,
):  # fmt: skip
    assert cp.admin("PUT", PATH_ADMIN_HUB_TOKEN, json={"token": TOKEN}).status_code == 200
    env = store_env(cp.settings, HF_ENDPOINT=hub.url)
    pulled = run_cli(
        "models", "pull", "tiny", f"hf://{REPO}", "--include", "*Q4_K_M.gguf", env=env, timeout=120
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    assert list(hub.served) == ["tiny-Q4_K_M.gguf"]

    node = serving_node(cp, tmp_path, sockets, "pulled-a", llama_server_binary)
    try:
        replicate(cp, [node])
        body = {"name": "tiny-pulled", "model": "tiny", "runtime": "llama.cpp",
                "node_ids": [node.node_id]}  # fmt: skip
        made = cp.admin("POST", "/api/v1/admin/deployments", json=body)
        assert made.status_code == 201, made.text
        wait_servers(cp, "tiny-pulled", "running", timeout=120)
        hub_of_cp = cp.server.app.hub
        wait_until(lambda: hub_of_cp.connected(node.node_id), timeout=60, what="tunnel")
        _, key = create_api_key(cp.store, "pulled", "tests")
        prompt = {"model": "tiny-pulled", "prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
        answer = requests.post(
            f"{cp.url}/v1/completions",
            json=prompt,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        relayed = answer.json()["choices"][0]["text"]
        [server] = deployment(cp, "tiny-pulled")["servers"]
        assert server["state"] == "running"
        # The node holds the pulled bytes, and nothing of the token that fetched them.
        held = [p for p in node.state_volume.rglob("*.gguf") if p.is_file()]
        assert held and all(p.read_bytes() == Path(tiny_gguf).read_bytes() for p in held)
        for path in node.state_volume.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path
        assert TOKEN not in node.agent.log()
        assert relayed  # greedy text from the pulled GGUF
    finally:
        node.close()
