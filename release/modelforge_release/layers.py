"""The layers the images are made of, each a tree built from pinned inputs:

python         Debian's Python 3.11 and the C libraries its standard library needs
control-plane  modelforge.pyz, unpacked for a read-only start, and env (for its #! line)
node-agent     modelforge_node_agent with its locked wheels
worker         modelforge_worker with its locked wheels
cuda           the CUDA runtime from the nvidia-cuda-runtime-cu12 wheel
llama-server   llama.cpp's static llama-server and ggml-rpc-server (scripts/llama-server-build), for
               the -cpu worker
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from .debs import fetch, read_deb
from .images import (
    PYTHON,
    SERVICE_UID,
    SHIV_ROOT,
    SITE_PACKAGES,
    BuildContext,
    BuildError,
    glibc_version,
)
from .llama_server import llama_server_layer
from .names import AGENT_PYZ, CONTROL_PLANE_PYZ, WORKER_PYZ, control_plane_archive
from .python_packages import ensure_pip, install_locked
from .rootfs import Tree


def debian_layer(ctx: BuildContext, layer: str, tree: Tree) -> None:
    """The lock's packages for ``layer``, chiselled, plus a record of each for scanners."""
    packages = ctx.lock.layer_packages(layer)
    files = fetch(packages, ctx.cache_dir / "debs")
    for pkg in packages:
        deb = read_deb(files[pkg.name], pkg.sha256)
        tree.add_deb(pkg, deb, ctx.lock.slices.get(pkg.name))
        # The distroless convention: one control stanza per package, no scripts, so
        # vulnerability scanners can see what is inside without dpkg's database.
        stanza = "".join(
            f"{key}: {deb.control[key]}\n"
            for key in ("Package", "Source", "Version", "Architecture")
            if key in deb.control
        )
        tree.add_file(f"var/lib/dpkg/status.d/{pkg.name}", stanza.encode(), origin=pkg.name)


def python_layer(ctx: BuildContext, tree: Tree) -> None:
    debian_layer(ctx, "python", tree)
    for directory in ("bin", "sbin", "lib", "lib64"):
        tree.add_symlink(directory, f"usr/{directory}")
    tree.add_file(
        "etc/passwd",
        b"root:x:0:0:root:/root:/usr/sbin/nologin\n"
        + f"nonroot:x:{SERVICE_UID}:{SERVICE_UID}:nonroot:/home/nonroot:/usr/sbin/nologin\n".encode()
        + b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    )
    tree.add_file(
        "etc/group",
        f"root:x:0:\nnonroot:x:{SERVICE_UID}:\nnogroup:x:65534:\n".encode(),
    )
    tree.add_file("etc/nsswitch.conf", b"passwd: files\ngroup: files\nhosts: files dns\n")
    # libc-bin (ldconfig) is left out; this is what it would install, for the NVIDIA
    # Container Toolkit's ldconfig hook.
    tree.add_file("etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    tree.add_dir("tmp", mode=0o1777)
    tree.add_dir("root", mode=0o700)
    tree.add_dir("home/nonroot", mode=0o700, uid=SERVICE_UID, gid=SERVICE_UID)
    tree.add_dir("usr/local/bin")
    tree.add_dir(SITE_PACKAGES)


def first_party(ctx: BuildContext, tree: Tree, packages: dict[str, str]) -> None:
    for package, folder in packages.items():
        source = ctx.source / folder / package
        if not (source / "__init__.py").is_file():
            raise BuildError(
                f"{source} is not a Python package; is --source a ModelForge checkout?"
            )
        tree.add_staged(source, f"{SITE_PACKAGES}/{package}", origin=f"{folder}/{package}")


def locked_wheels(ctx: BuildContext, tree: Tree, requirements: str, origin: str) -> Path:
    pip = ensure_pip(
        ctx.work_dir, ctx.source / "packaging" / "requirements-build.txt", ctx.cache_dir
    )
    staging = ctx.work_dir / "staging" / origin
    install_locked(
        pip,
        ctx.source / "packaging" / requirements,
        staging,
        cache_dir=ctx.cache_dir,
        architecture=ctx.lock.architecture,
        glibc=glibc_version(ctx.lock),
        python_version=PYTHON.removeprefix("python"),
    )
    tree.add_staged(staging, SITE_PACKAGES, origin=requirements)
    return staging


def launcher(module: str) -> bytes:
    """A console script for the image's Python (no shell: the kernel reads the #! line)."""
    return (
        f"#!/usr/bin/{PYTHON}\n"
        "import runpy\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    ).encode()


def control_plane_layer(ctx: BuildContext, tree: Tree) -> None:
    debian_layer(ctx, "control-plane", tree)
    # The archive for the image's architecture, installed as modelforge.pyz (as under systemd).
    pyz = ctx.dist / control_plane_archive(ctx.lock.architecture)
    tree.add_file(f"opt/modelforge/{CONTROL_PLANE_PYZ}", pyz.read_bytes(), executable=True)
    tree.add_symlink("usr/local/bin/modelforge", f"/opt/modelforge/{CONTROL_PLANE_PYZ}")
    # What shiv would unpack on first start, unpacked now under SHIV_ROOT: the name is
    # the archive's file name and its build id, exactly as shiv's bootstrap looks for it.
    with zipfile.ZipFile(pyz) as archive:
        build_id = json.loads(archive.read("environment.json"))["build_id"]
        prefix = f"{SHIV_ROOT}/{CONTROL_PLANE_PYZ}_{build_id}"
        for info in archive.infolist():
            if info.filename.startswith("site-packages/") and not info.is_dir():
                executable = bool((info.external_attr >> 16) & 0o111)
                tree.add_file(f"{prefix}/{info.filename}", archive.read(info), executable)
    tree.add_dir("var/lib/modelforge", mode=0o700, uid=SERVICE_UID, gid=SERVICE_UID)


def node_agent_layer(ctx: BuildContext, tree: Tree) -> None:
    locked_wheels(ctx, tree, "requirements-agent.txt", "node-agent")
    first_party(ctx, tree, {"modelforge_contract": "contract", "modelforge_node_agent": "agent"})
    tree.add_file(
        "usr/local/bin/modelforge-node-agent", launcher("modelforge_node_agent.main"), True
    )
    tree.add_dir("var/lib/modelforge-node-agent", mode=0o700, uid=SERVICE_UID, gid=SERVICE_UID)
    # The artifact root the compose files mount a volume on (the worker mounts it read-only):
    # Docker copies this ownership into the empty volume, so the agent may write it.
    tree.add_dir("var/lib/modelforge-artifacts", mode=0o750, uid=SERVICE_UID, gid=SERVICE_UID)


def worker_layer(ctx: BuildContext, tree: Tree) -> None:
    locked_wheels(ctx, tree, "requirements-worker.txt", "worker")
    first_party(ctx, tree, {"modelforge_contract": "contract", "modelforge_worker": "worker"})
    tree.add_file("usr/local/bin/modelforge-runtime-worker", launcher("modelforge_worker"), True)
    # Where the worker's unix socket lives, shared with the agent through a volume.
    tree.add_dir("run/modelforge-worker", mode=0o755, uid=SERVICE_UID, gid=SERVICE_UID)


def cuda_layer(ctx: BuildContext, tree: Tree) -> None:
    staging = locked_wheels(ctx, tree, "requirements-worker-cuda.txt", "cuda")
    # Headers are for compilers, not for running.
    for path in list(tree.entries):
        if "/nvidia/cuda_runtime/include" in f"/{path}":
            del tree.entries[path]
    libraries = sorted((staging / "nvidia" / "cuda_runtime" / "lib").glob("libcudart.so.*"))
    if not libraries:
        raise BuildError("the nvidia-cuda-runtime wheel holds no libcudart.so.*")
    for library in libraries:
        # Where the dynamic loader finds it without LD_LIBRARY_PATH or an ld.so.cache.
        tree.add_symlink(
            f"usr/lib/{ctx.multiarch}/{library.name}",
            f"/{SITE_PACKAGES}/nvidia/cuda_runtime/lib/{library.name}",
        )


LAYER_BUILDERS: dict[str, Callable[[BuildContext, Tree], None]] = {
    "python": python_layer,
    "control-plane": control_plane_layer,
    "node-agent": node_agent_layer,
    "worker": worker_layer,
    "cuda": cuda_layer,
    "llama-server": llama_server_layer,
}
LAYER_DESCRIPTIONS = {
    "python": "Debian bookworm Python 3.11 runtime, chiselled from pinned packages",
    "control-plane": "modelforge.pyz, unpacked for read-only start, and env",
    "node-agent": "modelforge_node_agent with its locked wheels",
    "worker": "modelforge_worker with its locked wheels",
    "cuda": "CUDA runtime from the nvidia-cuda-runtime-cu12 wheel",
    "llama-server": "llama.cpp's static llama-server and ggml-rpc-server, built from the pinned "
    "llama-cpp-python sdist",
}


# -- pyz archives ---------------------------------------------------------------------------------


def build_pyz(ctx: BuildContext) -> None:
    """Every shiv archive into ``dist``: the control plane's for each machine, the agent's and
    the worker's (the control-plane image carries the one for its architecture as
    modelforge.pyz)."""
    started = time.monotonic()
    ctx.say(
        f"building the control-plane archives, {AGENT_PYZ} and {WORKER_PYZ} "
        "(packaging/build_pyz.py)"
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ctx.source / "packaging" / "build_pyz.py"),
            "appliance",
            "agent",
            "worker",
            "--dist",
            str(ctx.dist),
            "--work-dir",
            str(ctx.source / "build" / "pyz"),
            "--pip-cache",
            str(ctx.cache_dir / "pip"),
        ],
        env={**os.environ, "SOURCE_DATE_EPOCH": str(ctx.epoch)},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise BuildError(f"packaging/build_pyz.py failed:\n{tail}")
    ctx.timings["pyz"] = time.monotonic() - started
