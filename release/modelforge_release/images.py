"""The four ModelForge images, built from pinned Debian packages and locked wheels.

No base image is pulled. Each layer is a tree assembled here (``rootfs.py``) and written
as a deterministic tar; the image configurations are JSON made here too; the four images
go into dockerd in one ``docker load`` of an archive in the ``docker save`` layout that
this module writes. dockerd keeps the layers exactly as given, so the RootFS layer
digests are the SHA-256 of the tars built here, the same on every build of the same
commit, wherever the checkout lives.

Layers (shared layers are stored once, in dockerd and in the bundle):

    modelforge-control-plane       python, control-plane
    modelforge-node-agent          python, node-agent
    modelforge-runtime-worker-cpu  python, worker
    modelforge-runtime-worker      python, worker, cuda
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from modelforge_contract import PROTOCOL_VERSION
from modelforge_contract.manifest import (
    CONTROL_PLANE_IMAGE,
    IMAGE_NAMES,
    LABEL_AGENT_PROTOCOL,
    LABEL_CREATED,
    LABEL_LICENSES,
    LABEL_REVISION,
    LABEL_SOURCE,
    LABEL_TITLE,
    LABEL_VERSION,
    NODE_AGENT_IMAGE,
    RUNTIME_WORKER_CPU_IMAGE,
    RUNTIME_WORKER_IMAGE,
)

from .debian import DebianError, DebianLock, fetch, load_lock, read_deb
from .names import AGENT_PYZ, CONTROL_PLANE_PYZ
from .python_packages import ensure_pip, install_locked
from .rootfs import Layer, Tree, forbidden_paths, merged_view, missing_libraries, write_layer

log = logging.getLogger(__name__)

# The service user every image runs as (distroless' "nonroot"); state directories are its.
SERVICE_UID = 65532
SERVICE_USER = f"{SERVICE_UID}:{SERVICE_UID}"
LICENSES = "Apache-2.0"
LABEL_DESCRIPTION = "org.opencontainers.image.description"
LABEL_DEBIAN_LOCK = "io.modelforge.debian-lock-sha256"
LABEL_PYZ = "io.modelforge.control-plane-pyz-sha256"
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
        "ModelForge Runtime Worker for CPU-only nodes",
        ("python", "worker"),
        ("python3", "-m", "modelforge_worker"),
    ),
)
SPECS = {spec.name: spec for spec in IMAGES}
assert tuple(SPECS) == IMAGE_NAMES[:2] + (RUNTIME_WORKER_IMAGE, RUNTIME_WORKER_CPU_IMAGE)


@dataclass
class BuildContext:
    source: Path  # the checkout
    version: str
    revision: str
    source_url: str
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


@dataclass
class BuiltImage:
    spec: ImageSpec
    layers: list[Layer]
    config: bytes

    def tag(self, version: str) -> str:
        return f"{self.spec.name}:{version}"

    @property
    def config_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.config).hexdigest()


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


def default_source_url(source: Path) -> str:
    return git(source, "remote", "get-url", "origin") or "local checkout (no git remote)"


def glibc_version(lock: DebianLock) -> tuple[int, int]:
    libc = lock.packages.get("libc6")
    match = re.match(r"(\d+)\.(\d+)", libc.version if libc else "")
    if match is None:
        raise BuildError("the Debian lock has no libc6; it cannot make a Python image")
    return int(match.group(1)), int(match.group(2))


# -- layers ----------------------------------------------------------------------------------


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
    pyz = ctx.dist / CONTROL_PLANE_PYZ
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
}
LAYER_DESCRIPTIONS = {
    "python": "Debian bookworm Python 3.11 runtime, chiselled from pinned packages",
    "control-plane": "modelforge.pyz, unpacked for read-only start, and env",
    "node-agent": "modelforge_node_agent with its locked wheels",
    "worker": "modelforge_worker with its locked wheels",
    "cuda": "CUDA runtime from the nvidia-cuda-runtime-cu12 wheel",
}


# -- pyz archives ---------------------------------------------------------------------------------


def build_pyz(ctx: BuildContext) -> None:
    """Both shiv archives into ``dist`` (the control-plane image carries modelforge.pyz)."""
    started = time.monotonic()
    ctx.say(f"building {CONTROL_PLANE_PYZ} and {AGENT_PYZ} (packaging/build_pyz.py)")
    result = subprocess.run(
        [
            sys.executable,
            str(ctx.source / "packaging" / "build_pyz.py"),
            "appliance",
            "agent",
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


# -- configurations and the archive ----------------------------------------------------------


def image_labels(ctx: BuildContext, spec: ImageSpec) -> dict[str, str]:
    labels = {
        LABEL_TITLE: spec.name,
        LABEL_DESCRIPTION: spec.description,
        LABEL_VERSION: ctx.version,
        LABEL_REVISION: ctx.revision,
        LABEL_CREATED: ctx.created,
        LABEL_SOURCE: ctx.source_url,
        LABEL_LICENSES: LICENSES,
        LABEL_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
        LABEL_DEBIAN_LOCK: ctx.lock.digest(),
    }
    if LABEL_PYZ in spec.extra_labels:
        labels[LABEL_PYZ] = hashlib.sha256((ctx.dist / CONTROL_PLANE_PYZ).read_bytes()).hexdigest()
    return labels


def image_config(ctx: BuildContext, spec: ImageSpec, layers: list[Layer]) -> bytes:
    config: dict[str, Any] = {
        "User": SERVICE_USER,
        "Env": [f"PATH={PATH}", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"]
        + [f"{name}={value}" for name, value in spec.env],
        "Cmd": list(spec.cmd),
        "WorkingDir": "/",
        "Labels": image_labels(ctx, spec),
    }
    if spec.exposed_ports:
        config["ExposedPorts"] = {port: {} for port in spec.exposed_ports}
    document = {
        "architecture": ctx.lock.architecture,
        "os": "linux",
        "created": ctx.created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {
                "created": ctx.created,
                "created_by": f"modelforge-release images: {layer.name} layer",
                "comment": LAYER_DESCRIPTIONS[layer.name],
            }
            for layer in layers
        ],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def write_archive(images: list[BuiltImage], version: str, target: Path, epoch: int) -> None:
    """The images in the ``docker save`` layout that ``docker load`` reads."""
    manifest = []
    written: set[str] = set()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, data: bytes | None = None, path: Path | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime = epoch
            info.mode = 0o644
            if path is not None:
                info.size = path.stat().st_size
                with path.open("rb") as file:
                    tar.addfile(info, file)
            else:
                assert data is not None
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

        for image in images:
            config_name = image.config_digest.removeprefix("sha256:") + ".json"
            layer_names = []
            for layer in image.layers:
                name = layer.diff_id.removeprefix("sha256:") + "/layer.tar"
                if name not in written:
                    add(name, path=layer.path)
                    written.add(name)
                layer_names.append(name)
            add(config_name, image.config)
            manifest.append(
                {"Config": config_name, "RepoTags": [image.tag(version)], "Layers": layer_names}
            )
        add("manifest.json", json.dumps(manifest, indent=1).encode())


# -- the whole build -----------------------------------------------------------------------------


def build_layers(ctx: BuildContext, names: list[str]) -> dict[str, tuple[Tree, Layer]]:
    built: dict[str, tuple[Tree, Layer]] = {}
    for index, name in enumerate(names, start=1):
        started = time.monotonic()
        tree = Tree(name)
        LAYER_BUILDERS[name](ctx, tree)
        layer = write_layer(tree, ctx.work_dir / "layers" / f"{name}.tar", ctx.epoch)
        ctx.timings[f"layer {name}"] = time.monotonic() - started
        ctx.say(
            f"[{index}/{len(names)}] layer {name}: {layer.files} files, "
            f"{layer.size / (1 << 20):.1f} MiB, {layer.diff_id[:19]}… "
            f"({time.monotonic() - started:.1f}s)"
        )
        built[name] = (tree, layer)
    return built


def check_image(ctx: BuildContext, spec: ImageSpec, trees: list[Tree]) -> None:
    view = merged_view(trees)
    forbidden = forbidden_paths(view)
    if forbidden:
        raise BuildError(f"{spec.name} would contain {', '.join('/' + p for p in forbidden)}")
    libraries = (f"usr/lib/{ctx.multiarch}", "usr/lib", "usr/lib64")
    missing = missing_libraries(view, libraries)
    if missing:
        raise BuildError(f"{spec.name}: " + "; ".join(missing[:10]))


def build_images(ctx: BuildContext, names: tuple[str, ...] = IMAGE_NAMES) -> list[BuiltImage]:
    """Build the pyz files and every layer; check and describe each image. Nothing is loaded."""
    started = time.monotonic()
    if ctx.lock.architecture not in ("amd64", "arm64"):
        raise BuildError(f"unsupported architecture {ctx.lock.architecture}")
    build_pyz(ctx)
    wanted = [SPECS[name] for name in names]
    layer_names = list(dict.fromkeys(layer for spec in wanted for layer in spec.layers))
    built = build_layers(ctx, layer_names)
    images = []
    for spec in wanted:
        trees = [built[name][0] for name in spec.layers]
        check_image(ctx, spec, trees)
        layers = [built[name][1] for name in spec.layers]
        images.append(BuiltImage(spec, layers, image_config(ctx, spec, layers)))
    ctx.timings["build"] = time.monotonic() - started
    return images


def load_images(client: Any, ctx: BuildContext, images: list[BuiltImage]) -> dict[str, Any]:
    """One ``docker load`` of all images; then dockerd's own view of each, checked."""
    started = time.monotonic()
    archive = ctx.work_dir / f"images-{ctx.version}.tar"
    write_archive(images, ctx.version, archive, ctx.epoch)
    size = archive.stat().st_size
    ctx.say(f"loading {len(images)} images into dockerd ({size / (1 << 20):.1f} MiB)")
    with archive.open("rb") as file:
        # The answer is a stream of progress messages; the load is done when it ends.
        for message in client.api.load_image(file):
            if isinstance(message, dict) and message.get("error"):
                raise BuildError(f"docker load failed: {message['error']}")
    archive.unlink()
    result = {}
    for image in images:
        tag = image.tag(ctx.version)
        attrs = client.images.get(tag).attrs
        loaded = attrs["RootFS"]["Layers"]
        expected = [layer.diff_id for layer in image.layers]
        if loaded != expected:
            raise BuildError(
                f"dockerd reports layers {loaded} for {tag}, the build made {expected}"
            )
        result[image.spec.name] = {
            "tag": tag,
            "image_id": attrs["Id"],
            "rootfs_layers": loaded,
            "size": attrs["Size"],
        }
        ctx.say(f"{tag}: {attrs['Id'][:19]}…, {attrs['Size'] / 1e6:.1f} MB")
    ctx.timings["load"] = time.monotonic() - started
    return result


def clean_work_dir(ctx: BuildContext) -> None:
    shutil.rmtree(ctx.work_dir / "layers", ignore_errors=True)
    shutil.rmtree(ctx.work_dir / "staging", ignore_errors=True)


# -- Dockerfiles for Compose source builds ----------------------------------------------------

DOCKERFILE_DIR = Path("packaging") / "images"


def dockerfile(spec: ImageSpec) -> str:
    """The Dockerfile Compose's ``build:`` uses for a development build of ``spec``: the
    same layers and configuration, re-added by the classic builder from ``scratch``."""
    env = [f"PATH={PATH}", "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"]
    env += [f"{name}={value}" for name, value in spec.env]
    labels = {
        LABEL_TITLE: spec.name,
        LABEL_DESCRIPTION: spec.description,
        LABEL_VERSION: "local",
        LABEL_LICENSES: LICENSES,
        LABEL_AGENT_PROTOCOL: str(PROTOCOL_VERSION),
    }
    lines = [
        f"# Source build of {spec.name} for Compose's `build:` (development only: a release",
        "# uses the image `modelforge-release images` loads, with reproducible layers).",
        "# Run `modelforge-release images --version <any>` first; it writes the layers added",
        "# here from pinned Debian packages and locked wheels. No base image is pulled.",
        "# Generated by release/modelforge_release/images.py (python3 -m modelforge_release.images);",
        "# a test keeps the two the same.",
        "FROM scratch",
        *[f"ADD build/images/layers/{layer}.tar /" for layer in spec.layers],
        "ENV " + " \\\n    ".join(env),
        "LABEL " + " \\\n      ".join(f'{key}="{value}"' for key, value in labels.items()),
        *[f"EXPOSE {port}" for port in spec.exposed_ports],
        f"USER {SERVICE_USER}",
        "WORKDIR /",
        "CMD " + json.dumps(list(spec.cmd)),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Write packaging/images/<name>.Dockerfile for every image (run from the checkout)."""
    for spec in IMAGES:
        path = DOCKERFILE_DIR / f"{spec.name}.Dockerfile"
        path.write_text(dockerfile(spec), encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
