"""The four ModelForge images: what each is made of and how it runs, and the facts of one
build (version, revision, epoch, caches). ``layers.py`` makes the layers from pinned
Debian packages and locked wheels, ``build.py`` writes and loads the images, and no base
image is pulled.

Layers (shared layers are stored once, in dockerd and in the bundle):

    modelforge-control-plane       python, control-plane
    modelforge-node-agent          python, node-agent
    modelforge-runtime-worker-cpu  python, worker, llama-server
    modelforge-runtime-worker      python, worker, cuda
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from modelforge_contract.manifest import (
    CONTROL_PLANE_IMAGE,
    IMAGE_NAMES,
    NODE_AGENT_IMAGE,
    RUNTIME_WORKER_CPU_IMAGE,
    RUNTIME_WORKER_IMAGE,
    SOURCE_URL,
)

from .debian import DebianError, DebianLock, load_lock
from .names import LABEL_PYZ

log = logging.getLogger(__name__)

# The service user every image runs as (distroless' "nonroot"); state directories are its.
SERVICE_UID = 65532
SERVICE_USER = f"{SERVICE_UID}:{SERVICE_UID}"
LICENSES = "Apache-2.0"
LABEL_DESCRIPTION = "org.opencontainers.image.description"
LABEL_DEBIAN_LOCK = "io.modelforge.debian-lock-sha256"
PYTHON = "python3.11"
SITE_PACKAGES = f"usr/local/lib/{PYTHON}/dist-packages"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHIV_ROOT = "opt/modelforge/shiv"


class BuildError(DebianError):
    """The images cannot be built; the message says why and what to do."""


@dataclass(frozen=True)
class ImageSpec:
    name: str
    description: str
    layers: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    exposed_ports: tuple[str, ...] = ()
    extra_labels: tuple[str, ...] = ()


IMAGES = (
    ImageSpec(
        CONTROL_PLANE_IMAGE,
        "ModelForge control plane and console (modelforge.pyz on Debian's Python)",
        ("python", "control-plane"),
        ("modelforge", "serve"),
        env=(
            ("MODELFORGE_STATE_DIR", "/var/lib/modelforge"),
            ("MODELFORGE_LISTEN", "0.0.0.0:8000"),
            # modelforge.pyz is unpacked at build time: a read-only container needs no
            # writable cache directory to start.
            ("SHIV_ROOT", "/" + SHIV_ROOT),
        ),
        exposed_ports=("8000/tcp",),
        extra_labels=(LABEL_PYZ,),
    ),
    ImageSpec(
        NODE_AGENT_IMAGE,
        "ModelForge Node Agent; the NVIDIA Container Toolkit injects libnvidia-ml.so.1",
        ("python", "node-agent"),
        ("python3", "-m", "modelforge_node_agent.main"),
        env=(("NVIDIA_DRIVER_CAPABILITIES", "utility"),),
    ),
    ImageSpec(
        RUNTIME_WORKER_IMAGE,
        "ModelForge Runtime Worker with the CUDA runtime (libcudart.so.12)",
        ("python", "worker", "cuda"),
        ("python3", "-m", "modelforge_worker"),
        env=(("NVIDIA_DRIVER_CAPABILITIES", "compute,utility"),),
    ),
    ImageSpec(
        RUNTIME_WORKER_CPU_IMAGE,
        "ModelForge Runtime Worker for CPU-only nodes, with llama-server (llama.cpp)",
        ("python", "worker", "llama-server"),
        ("python3", "-m", "modelforge_worker"),
        env=(("MODELFORGE_WORKER_LLAMA_SERVER", "/usr/local/bin/llama-server"),),
    ),
)
SPECS = {spec.name: spec for spec in IMAGES}
assert tuple(SPECS) == IMAGE_NAMES[:2] + (RUNTIME_WORKER_IMAGE, RUNTIME_WORKER_CPU_IMAGE)


@dataclass
class BuildContext:
    source: Path  # the checkout
    version: str
    revision: str
    source_url: str | None  # None: no source label
    epoch: int
    cache_dir: Path  # downloads (.deb files, wheels), kept between builds
    work_dir: Path  # layer tars and staging, per checkout
    dist: Path  # where the pyz files go
    progress: TextIO | None = None
    lock: DebianLock = field(init=False)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lock = load_lock(self.source / "packaging" / "images" / "debian-packages.lock")

    @property
    def created(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.epoch))

    @property
    def multiarch(self) -> str:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(self.lock.architecture)
        if machine is None:
            raise BuildError(f"unsupported architecture {self.lock.architecture}")
        return f"{machine}-linux-gnu"

    def say(self, message: str) -> None:
        log.info("%s", message)
        if self.progress is not None:
            self.progress.write(f"{message}\n")
            self.progress.flush()


# -- source facts --------------------------------------------------------------------------


def git(source: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(source), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


def default_revision(source: Path) -> str:
    """The commit, marked -dirty when the working tree differs from it."""
    commit = git(source, "rev-parse", "HEAD")
    if commit is None:
        return "unknown"
    return commit + (
        "-dirty" if git(source, "status", "--porcelain", "--untracked-files=no") else ""
    )


def default_epoch(source: Path) -> int:
    stamp = git(source, "log", "-1", "--format=%ct")
    return int(stamp) if stamp and stamp.isdigit() else 315532800


def default_source_url(source: Path) -> str | None:
    """The git remote 'origin' as a URL for org.opencontainers.image.source; None (no label)
    when the checkout has no origin or it is a local path, which means nothing elsewhere.
    An scp-like remote (git@host:owner/repo.git) becomes its https URL."""
    remote = git(source, "remote", "get-url", "origin") or ""
    scp_like = re.fullmatch(r"[\w.-]+@([\w.-]+):(?!//)(\S+?)(?:\.git)?/?", remote)
    if scp_like:
        remote = f"https://{scp_like.group(1)}/{scp_like.group(2)}"
    return remote if SOURCE_URL.fullmatch(remote) else None


def glibc_version(lock: DebianLock) -> tuple[int, int]:
    libc = lock.packages.get("libc6")
    match = re.match(r"(\d+)\.(\d+)", libc.version if libc else "")
    if match is None:
        raise BuildError("the Debian lock has no libc6; it cannot make a Python image")
    return int(match.group(1)), int(match.group(2))
