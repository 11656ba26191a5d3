"""Extra runtime arguments may not take over what the worker sets: the address, the port,
the served name, the model, or anything that fetches or dials out. Both spellings of a long
option count (``--api_key`` is ``--api-key``), with or without ``=value``."""

from __future__ import annotations

import pytest

from modelforge_contract.deployments import RESERVED_ARGS, arg_name, reserved_arg

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "9"], "--port"),
        (["--host=0.0.0.0"], "--host"),
        (["--api_key", "x"], "--api_key"),
        (["--model_url=http://x"], "--model_url"),
        (["--hf_repo", "org/repo"], "--hf_repo"),
        (["--served_model_name=other"], "--served_model_name"),
        (["-hfd", "org/draft"], "-hfd"),
        (["--mmproj-url", "http://x/p.gguf"], "--mmproj-url"),
        (["--mmproj_url=http://x/p.gguf"], "--mmproj_url"),
        (["--rpc", "10.0.0.2:50052"], "--rpc"),
        (["--docker-repo", "ai/x"], "--docker-repo"),
        (["--hf_token=hf_x"], "--hf_token"),
        (["-c", "4096", "--ssl_key_file", "k.pem"], "--ssl_key_file"),
    ],
)
def test_a_reserved_argument_is_found_in_either_spelling(args, named):
    assert reserved_arg(args) == named


@pytest.mark.parametrize(
    "args",
    [["-c", "4096"], ["--ctx-size=4096", "--threads", "4"], ["--n_gpu_layers", "99"], []],
)
def test_ordinary_arguments_pass(args):
    assert reserved_arg(args) is None


def test_short_options_keep_their_underscores_and_the_set_is_in_dash_spelling():
    assert arg_name("-hf_x") == "-hf_x"
    assert arg_name("--a_b_c=d_e") == "--a-b-c"
    assert all("_" not in name for name in RESERVED_ARGS)


def test_a_runtime_s_own_set_is_checked_the_same_way():
    assert reserved_arg(["--tokenizer_mode", "x"], frozenset({"--tokenizer-mode"})) == (
        "--tokenizer_mode"
    )
    assert reserved_arg(["--tokenizer_mode", "x"]) is None
