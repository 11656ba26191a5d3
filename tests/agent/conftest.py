"""Fixtures for the agent suite: the compiled test NVML library, agent processes, control planes."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.harness.agent_process import RestartableControlPlane
from tests.harness.control_plane import make_settings, unavailable
from tests.harness.nvml import CUDA_SOURCE, NVML_SOURCE


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory):
    """A directory holding libnvidia-ml.so.1 and libcuda.so.1 built from tests/nvml/*.c."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        unavailable("no C compiler: scripts/test installs gcc")
    out = tmp_path_factory.mktemp("nvml")
    # The CUDA driver twin (issue 13) serves the worker's GPU computation in the smoke.
    for library, source in (("libnvidia-ml.so.1", NVML_SOURCE), ("libcuda.so.1", CUDA_SOURCE)):
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out / library),
             str(source)],
            check=True,
        )  # fmt: skip
    return out


@pytest.fixture
def restartable_control_plane(tmp_path):
    """A control plane on a fixed loopback port over one SQLite file, that a test can stop."""
    settings = make_settings(
        tmp_path / "cp",
        heartbeat_interval_seconds=1,
        stale_after_seconds=2,
        offline_after_seconds=4,
    )
    plane = RestartableControlPlane(settings)
    try:
        yield plane
    finally:
        plane.stop()
