"""llama.cpp's real ``llama-server`` (the static binary scripts/llama-server-build makes) on
the tests' tiny GGUF: healthy, bound to the loopback only, the same greedy text every run
and on every endpoint, which is what the serving tests' golden strings rest on."""

from __future__ import annotations

import requests

from tests.harness.llama import GREEDY, LlamaServer

PROMPT = "the model"
# Greedy decoding of 16 tokens after PROMPT (tests/harness/tiny_gguf.py, seed 20251202).
GOLDEN = "ll d for q with8 w n w nj runse with agent"


def test_llama_server_serves_the_tiny_gguf_greedily_on_the_loopback_only(
    llama_server_binary, tiny_gguf, tmp_path
):
    with LlamaServer(llama_server_binary, tiny_gguf, tmp_path / "first.log") as server:
        server.wait_healthy()
        assert server.listening_addresses() == [f"127.0.0.1:{server.port}"]
        models = requests.get(f"{server.base_url}/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == ["tiny"]

        assert server.complete(PROMPT, 16) == GOLDEN
        body = {"prompt": PROMPT, "max_tokens": 16, **GREEDY}
        events = server.stream("/v1/completions", body)
        assert "".join(event["choices"][0]["text"] for event in events) == GOLDEN
        chat = server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, **GREEDY},
        )
        assert chat["model"] == "tiny"
        assert chat["choices"][0]["message"]["content"].strip()
        # end-of-sequence never wins: generation runs to max_tokens
        assert chat["choices"][0]["finish_reason"] == "length"
        assert chat["usage"]["completion_tokens"] == 8

    # A second launch of the same file says the same.
    with LlamaServer(llama_server_binary, tiny_gguf, tmp_path / "second.log") as again:
        again.wait_healthy()
        assert again.complete(PROMPT, 16) == GOLDEN
