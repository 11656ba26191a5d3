"""The relay end to end (issue 26): a client calls the control plane's port with an API key;
the request rides the node agent's own tunnel (a real agent process) to the real
llama-server its worker runs on CPU, and the answer comes back in the runtime's shape."""

from __future__ import annotations

import json

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from tests.harness.agent_process import wait_until
from tests.harness.llama import GREEDY

from .test_serve import (  # noqa: F401
    cp,
    deploy,
    model,
    replicate,
    serving_node,
    sockets,
    wait_servers,
    worker_servers,
)

pytestmark = pytest.mark.slow


def sse_content(raw: bytes) -> str:
    """The text of a chat stream, from its SSE events."""
    text = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def test_chat_relayed_over_the_agent_s_tunnel_matches_the_runtime_directly(
    cp,  # noqa: F811 - test_serve's fixtures, imported above
    tmp_path,
    sockets,  # noqa: F811
    model,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    node = serving_node(cp, tmp_path, sockets, "relay-e2e", llama_server_binary)
    try:
        replicate(cp, [node])
        assert deploy(cp, "tiny-chat", [node]).status_code == 201
        wait_servers(cp, "tiny-chat", "running")
        wait_until(lambda: cp.server.app.hub.connected(node.node_id), timeout=60, what="tunnel")
        [server] = worker_servers(node).values()
        _, key = create_api_key(cp.store, "e2e", "tests")
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "zebra quartz"}],
                "max_tokens": 12, **GREEDY}  # fmt: skip
        listed = requests.get(f"{cp.url}/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in listed["data"]] == ["tiny-chat"]
        direct = requests.post(
            f"http://127.0.0.1:{server['port']}/v1/chat/completions", json=body, timeout=60
        )
        relayed = requests.post(
            f"{cp.url}/v1/chat/completions", json=body, headers=auth, timeout=60
        )
        assert relayed.status_code == 200, relayed.text
        want = direct.json()["choices"][0]["message"]["content"]
        assert relayed.json()["choices"][0]["message"]["content"] == want and want
        assert relayed.json()["model"] == "tiny-chat"
        # Streamed: event by event, the same text.
        streamed = requests.post(
            f"{cp.url}/v1/chat/completions", json={**body, "stream": True}, headers=auth,
            stream=True, timeout=60,
        )  # fmt: skip
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        raw = b"".join(streamed.iter_content(None))
        assert sse_content(raw) == want
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert str(node.state_volume).encode() not in raw
        # The key stays at the control plane; the agent's log holds no body and no key.
        log = node.agent.log()
        assert "tunnel up" in log
        # Counted: requests by deployment and by key id, and the tokens llama.cpp reported.
        metrics = requests.get(
            f"{cp.url}/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"}, timeout=30
        ).text
        assert 'modelforge_relay_requests_total{deployment="tiny-chat"} 2.0' in metrics
        completion = [
            line for line in metrics.splitlines()
            if line.startswith('modelforge_relay_tokens_total{deployment="tiny-chat",kind="completion"}')
        ]  # fmt: skip
        assert completion and float(completion[0].split()[-1]) >= 12
        assert key not in metrics
        # The key's usage is exactly what llama-server reported in its answers (the stream
        # asked for none: "usage" rides only where the runtime sends it).
        reported = relayed.json()["usage"]
        [used] = cp.admin("GET", "/api/v1/admin/usage?by=key").json()["usage"]
        assert used["key_id"] == key.split("_")[1] and used["requests"] == 2
        assert used["prompt_tokens"] == reported["prompt_tokens"] > 0
        assert used["completion_tokens"] == reported["completion_tokens"] > 0
        assert used["errors"] == 0
        assert key not in log and "zebra quartz" not in log and want not in log
    finally:
        node.close()
