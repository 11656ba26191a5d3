"""llama.cpp's ``llama-server`` for the -cpu worker image: the static binary that
``scripts/llama-server-build`` builds from the pinned llama-cpp-python sdist and caches
outside the checkout (the binary is never committed).

``$MODELFORGE_RELEASE_LLAMA_SERVER`` names a binary to use instead (another architecture's,
built on a machine of that architecture); otherwise the script runs, which prints its cached
binary at once or builds it (about 6.5 minutes on 2 cores, the first time).
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

from .image_checks import ELF_MAGIC, UnreadableElf, elf_dependencies
from .images import BuildContext, BuildError
from .rootfs import Tree

LLAMA_SERVER_ENV = "MODELFORGE_RELEASE_LLAMA_SERVER"
BUILD_SCRIPT = Path("scripts") / "llama-server-build"
# In the image: on PATH, and named by the worker's setting (ImageSpec.env). The helper of a
# model split across nodes sits beside it, where the worker looks for it.
IMAGE_PATH = "usr/local/bin/llama-server"
RPC_SERVER = "ggml-rpc-server"
RPC_IMAGE_PATH = f"usr/local/bin/{RPC_SERVER}"
_E_MACHINE = {"amd64": 62, "arm64": 183}  # EM_X86_64, EM_AARCH64
_PT_INTERP = 3


def built_binary(ctx: BuildContext) -> Path:
    """The binary: ``$MODELFORGE_RELEASE_LLAMA_SERVER``, else scripts/llama-server-build's."""
    explicit = os.environ.get(LLAMA_SERVER_ENV)
    if explicit:
        return Path(explicit)
    script = ctx.source / BUILD_SCRIPT
    if not script.is_file():
        raise BuildError(f"{script} is missing; is --source a ModelForge checkout?")
    ctx.say(
        f"llama-server: {BUILD_SCRIPT} (cached after the first build, which takes about "
        "6.5 minutes on 2 cores)"
    )
    result = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise BuildError(f"{BUILD_SCRIPT} failed (exit {result.returncode}):\n{tail}")
    return Path(lines[-1])


def static_problem(data: bytes, architecture: str) -> str | None:
    """Why ``data`` is not a static executable for ``architecture``; None when it is one."""
    if not data.startswith(ELF_MAGIC):
        return "it is not an ELF file"
    try:
        dependencies = elf_dependencies(data)
    except UnreadableElf as exc:
        return f"its ELF headers cannot be read ({exc})"
    machine = struct.unpack_from("<H", data, 0x12)[0]
    if machine != _E_MACHINE.get(architecture):
        return f"it is built for ELF machine {machine}, not {architecture}"
    needed = dependencies[0] if dependencies else []
    if needed:
        return f"it links to {', '.join(needed)}"
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        if struct.unpack_from("<I", data, phoff + index * phentsize)[0] == _PT_INTERP:
            return "it asks for a dynamic loader (PT_INTERP)"
    return None


def llama_server_layer(ctx: BuildContext, tree: Tree) -> None:
    """llama-server and, from the same build (beside it), ggml-rpc-server."""
    binary = built_binary(ctx)
    for path, in_image in ((binary, IMAGE_PATH), (binary.parent / RPC_SERVER, RPC_IMAGE_PATH)):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise BuildError(
                f"cannot read {path.name} at {path}: {exc} (scripts/llama-server-build "
                f"builds both; with {LLAMA_SERVER_ENV}, put {RPC_SERVER} beside it)"
            ) from None
        problem = static_problem(data, ctx.lock.architecture)
        if problem is not None:
            raise BuildError(
                f"{path} cannot go into an image built from an empty root: {problem} "
                f"(build it with {BUILD_SCRIPT} on a {ctx.lock.architecture} machine, or set "
                f"{LLAMA_SERVER_ENV})"
            )
        tree.add_file(in_image, data, executable=True, origin=str(BUILD_SCRIPT))
