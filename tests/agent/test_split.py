"""One model across two nodes (issue 38): a real control plane splits the tiny GGUF between
two real agents' workers, the main node's ``llama-server --rpc`` and the helper's
``ggml-rpc-server``, both on their own loopback, linked only over the agents' tunnels. The
greedy text through the relay is one process's; a helper whose agent dies takes the group
down, and the group serves again once the agent is back, with no person."""

from __future__ import annotations

import os
import signal

import pytest
import requests

from modelforge_appliance.identity.api_keys import create_api_key
from modelforge_contract.deployments import ROLE_HELPER, ROLE_MAIN
from modelforge_contract.models import PATH_ADMIN_MODELS
from tests.harness.agent_process import AgentProcess, wait_until
from tests.harness.llama import GREEDY, LlamaServer
from tests.harness.tiny_gguf import N_EMBD, N_FF, N_HEAD, N_HEAD_KV, write_tiny_gguf

from .test_serve import (  # noqa: F401
    cp,
    deploy,
    deployment,
    model,
    replicate,
    serving_node,
    sockets,
    wait_servers,
    worker_servers,
)

pytestmark = pytest.mark.slow

PROMPT = "the model"
# One llama-server on the whole tiny GGUF says this (tests/worker/test_llama_server_binary.py).
GOLDEN = "ll d for q with8 w n w nj runse with agent"
# One layer of the tiny GGUF in f32: two norms, q, k, v, the output projection and the
# feed-forward's three matrices (tests/harness/tiny_gguf.py).
_E, _KV, _FF = N_EMBD, N_EMBD // N_HEAD * N_HEAD_KV, N_FF
LAYER_BYTES = 4 * (2 * _E + 2 * _E * _E + 2 * _KV * _E + 3 * _FF * _E)
# A larger model of the same kind: about 3 MB, six layers.
DEEPER = {"n_embd": 128, "n_layer": 6, "n_ff": 384, "n_head": 4, "n_head_kv": 2}


def relayed_text(plane, key: str, deployment: str = "tiny-split") -> requests.Response:
    return requests.post(
        f"{plane.url}/v1/completions",
        json={"model": deployment, "prompt": PROMPT, "max_tokens": 16, **GREEDY},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def split_pair(cp, tmp_path, sockets, binary, prefix, model="tiny", **main_settings):  # noqa: F811
    """Two nodes, the model split across them and running as ``<model>-split``; the API key
    to call it."""
    main = serving_node(cp, tmp_path, sockets, f"{prefix}-main", binary, **main_settings)
    helper = serving_node(cp, tmp_path, sockets, f"{prefix}-helper", binary)
    # Replicated to the main node only: the helper needs no copy, the main node sends it
    # its tensors.
    name = f"{model}-split"
    split = {"split": [main.node_id, helper.node_id]}
    made = deploy(cp, name, [main], model=model, settings=split, replicate=True)
    assert made.status_code == 201, made.text
    wait_servers(cp, name, "running", timeout=180)
    _, key = create_api_key(cp.store, prefix, "tests")
    return main, helper, made.json(), key


def test_a_model_split_over_two_nodes_answers_as_one_and_comes_back_after_a_helper_is_lost(
    cp,  # noqa: F811 - test_serve's fixtures, imported above
    tmp_path,
    sockets,  # noqa: F811
    model,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    main, helper, view, key = split_pair(cp, tmp_path, sockets, llama_server_binary, "split")
    try:
        roles = {s["node_id"]: s["role"] for s in view["servers"]}
        assert roles == {main.node_id: ROLE_MAIN, helper.node_id: ROLE_HELPER}
        # The main server waited for its helper to run: it started once, and never failed.
        running = {s["role"]: s for s in deployment(cp, "tiny-split")["servers"]}
        assert running[ROLE_MAIN]["restarts"] == 0
        assert running[ROLE_MAIN]["started_at"] >= running[ROLE_HELPER]["started_at"]
        assert view["settings"]["split"] == [main.node_id, helper.node_id]
        assert len(view["settings"]["shares"]) == 2 and sum(view["settings"]["shares"]) > 0.99

        # The helper runs ggml-rpc-server on its loopback; the main llama-server dials it
        # only through its agent's listener.
        [held] = worker_servers(helper).values()
        assert held["role"] == ROLE_HELPER
        [served] = worker_servers(main).values()
        assert served["role"] == ROLE_MAIN

        answer = relayed_text(cp, key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == GOLDEN
        # The helper holds its layers: the main node sent it at least the one layer of the
        # two that is its share (about 148 KB of f32 weights), over the link.
        assert cp.server.app.hub.link_bytes["to_helpers"] >= LAYER_BYTES
        assert cp.server.app.hub.link_bytes["from_helpers"] > 0
        # llama-server opens and closes a connection per question it asks a helper while it
        # loads; each closed one is forgotten on both agents and in the hub.
        # llama-server keeps one connection to its helper.
        assert cp.server.app.hub.links() == 1
        listed = requests.get(
            f"{cp.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
        ).json()
        assert [m["id"] for m in listed["data"]] == ["tiny-split"]

        # The helper's agent dies: its links end, the main llama-server exits, and the
        # group waits; the agent back, the group serves the same text again by itself.
        helper.agent.process.send_signal(signal.SIGKILL)
        helper.agent.process.wait(timeout=10)
        helper.agent.close()
        wait_until(lambda: cp.server.app.hub.links() == 0, timeout=30, what="links ended")
        helper.agent = AgentProcess(helper.agent.env, tmp_path / "split-helper" / "agent-2.log")

        def serves_again():
            again = relayed_text(cp, key)
            return again.json()["choices"][0]["text"] if again.status_code == 200 else None

        assert wait_until(serves_again, timeout=180, what="the group serving again") == GOLDEN
        shown = wait_servers(cp, "tiny-split", "running")
        restarts = {s["role"]: s["restarts"] for s in shown["servers"]}
        assert restarts[ROLE_MAIN] >= 1  # it went down with its helper, and came back
        assert "SIGABRT" in main.agent.log()  # llama-server aborts when a helper goes
    finally:
        helper.close()
        main.close()


def test_a_larger_model_split_says_what_one_process_says_and_a_stalled_helper_ends_its_link(
    cp,  # noqa: F811
    tmp_path,
    sockets,  # noqa: F811
    llama_server_binary,
):  # fmt: skip
    """A larger generated model (six layers of four times the width), split in two, greedily
    says what one llama-server says on the whole file. RPC has no timeout: a helper that
    stops answering would hang llama-server forever (its /health still 200). The main
    node's agent ends the link instead, the request fails, the main server starts again,
    and once the helper answers the group serves."""
    source = tmp_path / "deep"
    source.mkdir()
    deep = write_tiny_gguf(source / "deep.gguf", **DEEPER)
    with LlamaServer(llama_server_binary, deep, tmp_path / "whole.log") as whole:
        whole.wait_healthy()
        golden = whole.complete(PROMPT, 16)
    made = cp.admin(
        "POST", PATH_ADMIN_MODELS, json={"name": "deep", "source": {"path": str(source)}}
    )
    assert made.status_code == 201, made.text
    main, helper, _, key = split_pair(
        cp, tmp_path, sockets, llama_server_binary, "stall", model="deep", rpc_stall_seconds="2"
    )
    GOLDEN = golden  # noqa: N806 - the whole model's text, as in the tiny model's test
    try:
        answer = relayed_text(cp, key, "deep-split")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == GOLDEN and GOLDEN
        [held] = worker_servers(helper).values()
        os.kill(held["ident"]["pid"], signal.SIGSTOP)  # the helper's ggml-rpc-server hangs
        try:
            stalled = relayed_text(cp, key, "deep-split")
            assert stalled.status_code == 502, stalled.text
            assert stalled.json()["error"]["code"] == "NODE_LINK_LOST"
            main.agent.wait_for_log(r"link \d+: no answer for 2 s; ending it", timeout=60)
        finally:
            os.kill(held["ident"]["pid"], signal.SIGCONT)

        def serves_again():
            again = relayed_text(cp, key, "deep-split")
            return again.json()["choices"][0]["text"] if again.status_code == 200 else None

        assert wait_until(serves_again, timeout=180, what="the group serving again") == GOLDEN
        shown = wait_servers(cp, "deep-split", "running")
        assert {s["role"]: s["restarts"] for s in shown["servers"]}[ROLE_MAIN] >= 1
    finally:
        helper.close()
        main.close()
