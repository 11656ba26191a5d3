"""The paths a model manifest may hold: what the control plane imports and an agent joins
under its model directory. Nothing a terminal acts on or shows reordered gets in."""

from __future__ import annotations

import re

import pytest

from modelforge_contract.models import ManifestError, check_relative_path

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython


@pytest.mark.parametrize(
    "path",
    ["model.gguf", "a/b/c.safetensors", "tokenizer.json", "Übersetzung/модель.bin", "日本.txt"],
)
def test_ordinary_names_pass(path):
    assert check_relative_path(path) == path


@pytest.mark.parametrize(
    ("path", "code_point"),
    [
        ("evil\x1b[2J.gguf", "U+001B"),  # an escape sequence
        ("del\x7f.bin", "U+007F"),
        ("c1\x9b31m.bin", "U+009B"),  # the 8-bit CSI
        ("model\u202egguf.exe", "U+202E"),  # right-to-left override
        ("a\u2066b.bin", "U+2066"),  # left-to-right isolate
        ("zero\u200bwidth.bin", "U+200B"),
        ("line\u2028sep.bin", "U+2028"),
        ("dir/tab\tname", "U+0009"),
    ],
)
def test_controls_format_characters_and_separators_are_refused_naming_the_character(
    path, code_point
):
    with pytest.raises(ManifestError, match=re.escape(code_point)):
        check_relative_path(path)


@pytest.mark.parametrize("path", ["", "/abs", "a/../b", "a//b", "./a", "a\\b", "nul\x00"])
def test_paths_that_could_leave_the_model_directory_are_refused(path):
    with pytest.raises(ManifestError):
        check_relative_path(path)
