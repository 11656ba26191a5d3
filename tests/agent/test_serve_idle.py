"""Load on demand on a real node (issue 34): a deployment with ``idle_unload_seconds`` that
nobody calls unloads (its llama-server process ends, it stays in GET /v1/models), and the
next client request starts it again and is answered, counted as a cold start; undeploy then
leaves no runtime process on the node."""

from __future__ import annotations

import time

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from tests.harness.agent_process import wait_until
from tests.harness.llama import GREEDY

from .test_serve import (  # noqa: F401
    DEPLOYMENTS,
    cp,
    deploy,
    deployment,
    llama_processes,
    model,
    replicate,
    serving_node,
    sockets,
    wait_servers,
)

pytestmark = pytest.mark.slow


def test_an_idle_deployment_unloads_and_the_next_request_starts_it(
    cp,  # noqa: F811 - test_serve's fixtures, imported above
    tmp_path,
    sockets,  # noqa: F811
    model,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    node = serving_node(cp, tmp_path, sockets, "idle-e2e", llama_server_binary)
    try:
        replicate(cp, [node])
        made = deploy(cp, "tiny-idle", [node], settings={"idle_unload_seconds": 2})
        assert made.status_code == 201, made.text
        wait_until(lambda: cp.server.app.hub.connected(node.node_id), timeout=60, what="tunnel")
        # Unused: it runs, then unloads by itself, its process gone.
        shown = wait_servers(cp, "tiny-idle", "idle", timeout=90)
        assert shown["state"] == "idle"
        wait_until(lambda: llama_processes(llama_server_binary) == [], timeout=30, what="freed")
        _, key = create_api_key(cp.store, "idle", "tests")
        auth = {"Authorization": f"Bearer {key}"}
        listed = requests.get(f"{cp.url}/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in listed["data"]] == ["tiny-idle"]  # still offered
        body = {"model": "tiny-idle", "prompt": "Once upon a time", "max_tokens": 8, **GREEDY}
        began = time.monotonic()
        answer = requests.post(f"{cp.url}/v1/completions", json=body, headers=auth, timeout=180)
        took = time.monotonic() - began
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"]
        print(f"cold start on the tiny GGUF: {took:.2f} s to the first answer")
        assert deployment(cp, "tiny-idle")["servers"][0]["state"] == "running"
        assert len(llama_processes(llama_server_binary)) == 1
        metrics = requests.get(
            f"{cp.url}/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"}, timeout=30
        ).text
        assert 'modelforge_relay_cold_starts_total{deployment="tiny-idle"} 1.0' in metrics
        # Undeploy leaves no runtime process on the node.
        assert cp.admin("DELETE", f"{DEPLOYMENTS}/tiny-idle").status_code == 200
        wait_until(lambda: deployment(cp, "tiny-idle") is None, timeout=60, what="undeployed")
        wait_until(lambda: llama_processes(llama_server_binary) == [], timeout=30, what="gone")
    finally:
        node.close()
