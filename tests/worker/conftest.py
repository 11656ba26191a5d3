"""Fixtures for the worker suite: short socket paths, the test NVML/CUDA libraries, an image."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.agent.conftest import fake_nvml_dir  # noqa: F401 - the compiled NVML/CUDA twins
from tests.harness.probe_image import build_test_image


@pytest.fixture
def socket_dir():
    """A short directory for sockets: a unix socket path must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mfw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def test_image(docker_client, tmp_path_factory):
    """A tiny local image built from a file tree (a static binary, FROM scratch): no pull."""
    image = build_test_image(docker_client, tmp_path_factory.mktemp("image"))
    yield image
    docker_client.images.remove(image.tag, force=True)  # by tag: another build may share the id
