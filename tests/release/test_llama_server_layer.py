"""The -cpu worker image's llama-server layer takes only a static executable for the lock's
architecture: the binary scripts/llama-server-build made, never a dynamically linked one."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from modelforge_release.images import BuildError
from modelforge_release.llama_server import (
    IMAGE_PATH,
    RPC_IMAGE_PATH,
    llama_server_layer,
    static_problem,
)
from modelforge_release.rootfs import Tree

ARCHITECTURE = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), "unknown")
OTHER = "arm64" if ARCHITECTURE == "amd64" else "amd64"


def context(architecture: str = ARCHITECTURE) -> SimpleNamespace:
    return SimpleNamespace(
        lock=SimpleNamespace(architecture=architecture),
        source=Path(__file__).resolve().parents[2],
        say=lambda message: None,
    )


def test_the_built_llama_server_is_static_for_this_machine_only(llama_server_binary):
    data = llama_server_binary.read_bytes()
    assert static_problem(data, ARCHITECTURE) is None
    assert f"not {OTHER}" in static_problem(data, OTHER)


def test_a_dynamically_linked_program_or_a_script_is_refused(tmp_path):
    python = Path(os.path.realpath(sys.executable)).read_bytes()
    assert static_problem(python, ARCHITECTURE).startswith("it links to ")
    assert static_problem(b"#!/bin/sh\necho\n", ARCHITECTURE) == "it is not an ELF file"


def test_the_layer_puts_the_named_binary_on_the_path(llama_server_binary, monkeypatch):
    monkeypatch.setenv("MODELFORGE_RELEASE_LLAMA_SERVER", str(llama_server_binary))
    tree = Tree("llama-server")
    llama_server_layer(context(), tree)
    entry = tree.entries[IMAGE_PATH]
    assert entry.mode == 0o755 and entry.content() == llama_server_binary.read_bytes()
    # ggml-rpc-server of the same build, beside it: a helper of a model split across nodes.
    helper = tree.entries[RPC_IMAGE_PATH]
    beside = llama_server_binary.parent / "ggml-rpc-server"
    assert helper.mode == 0o755 and helper.content() == beside.read_bytes()


def test_the_layer_refuses_a_binary_that_would_not_run_from_an_empty_root(monkeypatch):
    monkeypatch.setenv("MODELFORGE_RELEASE_LLAMA_SERVER", os.path.realpath(sys.executable))
    with pytest.raises(BuildError, match="cannot go into an image built from an empty root"):
        llama_server_layer(context(), Tree("llama-server"))
