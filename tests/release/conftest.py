"""Session fixtures: the four images built once into the real dockerd, and release bundles
made from them in both tarball layouts (docker save, and OCI written by skopeo)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.agent.conftest import fake_nvml_dir  # noqa: F401 - the compiled test NVML library
from tests.harness.control_plane import unavailable
from tests.harness.release_images import (
    remove_tags,
    resum,
    run_release,
    skopeo_oci_tarball,
    tags,
    unique,
)


@pytest.fixture(scope="session")
def release_version() -> str:
    # A version no other run or helper uses: every tag this session makes is its own.
    return f"0.1.0-test.{unique('v').removeprefix('v-')}"


@pytest.fixture(scope="session")
def pyz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("images-dist")


@pytest.fixture(scope="session")
def built_images(docker_client, release_version, pyz_dir):
    """``modelforge-release images --json`` for this session's version; untagged at the end."""
    result = run_release("images", "--version", release_version, "--dist", pyz_dir, "--json")
    if result.returncode != 0:
        pytest.fail(f"modelforge-release images failed:\n{result.stderr[-4000:]}")
    built = json.loads(result.stdout)
    built["stderr"] = result.stderr
    try:
        yield built
    finally:
        remove_tags(docker_client, tags(release_version))


@pytest.fixture(scope="session")
def release_bundle(built_images, release_version, pyz_dir, tmp_path_factory) -> Path:
    """A release directory in the layout dockerd 20.10 saves (manifest.json, <id>/layer.tar)."""
    out = tmp_path_factory.mktemp("bundle") / f"modelforge-{release_version}"
    result = run_release(
        "bundle", "--version", release_version, "--out", out, "--dist", pyz_dir, "--json"
    )
    if result.returncode != 0:
        pytest.fail(f"modelforge-release bundle failed:\n{result.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def oci_bundle(release_bundle, release_version, tmp_path_factory) -> Path:
    """The same release with the tarball in the OCI layout, converted by skopeo."""
    if shutil.which("skopeo") is None:
        unavailable("skopeo is missing: scripts/test installs Debian's skopeo as root")
    work = tmp_path_factory.mktemp("oci")
    out = work / f"modelforge-{release_version}"
    out.mkdir()
    for path in release_bundle.iterdir():
        if not path.name.endswith("-images.tar"):
            shutil.copyfile(path, out / path.name)
    tarball = f"modelforge-{release_version}-images.tar"
    skopeo_oci_tarball(release_bundle / tarball, release_version, work, out / tarball)
    resum(out)
    return out
