"""org.opencontainers.image.source is where the source is published, or absent: never the
path of the clone the images were built from."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from modelforge_release.images import default_source_url
from tests.harness.release_cli import release


def checkout(tmp_path: Path, origin: str | None) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    if origin is not None:
        subprocess.run(["git", "-C", str(tmp_path), "remote", "add", "origin", origin], check=True)
    return tmp_path


@pytest.mark.parametrize(
    ("origin", "label"),
    [
        (
            "https://github.com/modelforge/modelforge.git",
            "https://github.com/modelforge/modelforge.git",
        ),
        ("ssh://git@git.example.org/team/modelforge", "ssh://git@git.example.org/team/modelforge"),
        ("git@github.com:modelforge/modelforge.git", "https://github.com/modelforge/modelforge"),
        ("/home/me/src/modelforge", None),  # a local clone's origin means nothing elsewhere
        ("../modelforge", None),
        (None, None),
    ],
)
def test_the_default_is_the_origin_when_it_is_a_url(tmp_path, origin, label):
    assert default_source_url(checkout(tmp_path, origin)) == label


def test_a_source_url_that_is_not_a_url_is_refused_before_anything_is_built(tmp_path):
    result = release("images", "--source-url", "/home/me/modelforge", "--dist", tmp_path)
    assert result.returncode == 2, result.stderr
    assert b"--source-url '/home/me/modelforge' is not a URL" in result.stderr
    assert list(tmp_path.iterdir()) == []
