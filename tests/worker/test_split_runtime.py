"""A split's main server, as the worker starts it (issue 38): how many layers its GGUF has,
which of them stay on this node, and the shares llama.cpp's devices get (the RPC helpers
first, then this node's GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelforge_worker.runtimes import ServeSpec
from modelforge_worker.runtimes.gguf_header import GgufError, layer_count
from modelforge_worker.runtimes.llama_cpp import command, split_placement
from tests.harness.tiny_gguf import N_LAYER, write_tiny_gguf


def spec(**fields) -> ServeSpec:
    base = dict(
        server_id="s1", runtime="llama.cpp", served_name="big", model_dir=Path("/models"),
        model_file="m.gguf", gpus=(), port=4000, context_length=None, args=(), image_id=None,
        accelerator_mode="cpu", role="main", rpc=("127.0.0.1:5001", "127.0.0.1:5002"),
        tensor_split=(0.5, 0.25, 0.25),
    )  # fmt: skip
    return ServeSpec(**{**base, **fields})


def test_the_layer_count_is_read_from_the_gguf_header(tmp_path):
    assert layer_count(write_tiny_gguf(tmp_path / "tiny.gguf")) == N_LAYER
    assert layer_count(write_tiny_gguf(tmp_path / "deep.gguf", n_layer=7)) == 7
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(GgufError, match="not a GGUF"):
        layer_count(tmp_path / "not.gguf")
    cut = (tmp_path / "tiny.gguf").read_bytes()[:40]
    (tmp_path / "cut.gguf").write_bytes(cut)
    with pytest.raises(GgufError, match="ends inside its header"):
        layer_count(tmp_path / "cut.gguf")


def test_a_cpu_main_keeps_its_share_of_the_layers_and_offloads_the_rest_to_its_helpers():
    # 8 layers, half kept here: the first 4 on this CPU, 4 plus the output to the devices.
    offloaded, shares = split_placement(spec(), 8)
    assert offloaded == 8 + 1 - 4 and shares == [0.25, 0.25]
    # Always at least one layer on the helpers, however large this node's share.
    assert split_placement(spec(tensor_split=(0.99, 0.005, 0.005)), 8)[0] == 2
    argv = command(Path("/bin/llama-server"), spec(), 8)
    assert argv[argv.index("--rpc") + 1] == "127.0.0.1:5001,127.0.0.1:5002"
    assert argv[argv.index("--tensor-split") + 1] == "0.25,0.25"
    assert argv[argv.index("--override-tensor") + 1] == r"^output\.weight$=CPU"
    assert argv[argv.index("--cache-ram") + 1] == "0"


def test_a_gpu_main_lists_its_gpus_after_the_helpers_with_its_share_divided_among_them():
    offloaded, shares = split_placement(
        spec(gpus=("GPU-a", "GPU-b"), accelerator_mode="nvidia"), None
    )
    assert offloaded == 999 and shares == [0.25, 0.25, 0.25, 0.25]
