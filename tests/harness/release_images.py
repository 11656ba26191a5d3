"""The real images, bundles and tarball rewrites the image and bundle tests share.

Everything a test creates in the shared dockerd carries a unique name (a release version
``0.1.0-test.<hex>``, ``mf-test-<hex>`` tags, containers and compose projects) and is
removed by the test that made it; nothing is pruned.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from modelforge_contract.manifest import IMAGE_NAMES
from modelforge_release.names import release_names

from .caches import machine_cache
from .control_plane import clean_env
from .release_cli import RELEASE

ROOT = Path(__file__).resolve().parents[2]
# Any fixed value: builds of the same tree with the same epoch must match.
SOURCE_DATE_EPOCH = "1767225600"


def cache_dir() -> Path:
    """Downloads kept between runs (.deb files, wheels)."""
    return machine_cache("release")


def unique(prefix: str = "mf-test") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def release_env(**extra: str) -> dict[str, str]:
    return clean_env(
        SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH, MODELFORGE_RELEASE_CACHE=str(cache_dir()), **extra
    )


def run_release(*args: Any, timeout: int = 900, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RELEASE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=kwargs.pop("env", release_env()),
        **kwargs,
    )


def run_copy_release(copy: Path, *args: Any, timeout: int = 900) -> subprocess.CompletedProcess:
    """The release tool of a copy of the tree, run from that copy's own code."""
    env = release_env(PYTHONPATH=f"{copy / 'release'}:{copy / 'contract'}")
    return subprocess.run(
        [sys.executable, "-m", "modelforge_release", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=copy,
    )


def copy_tree(target: Path) -> Path:
    """The checkout's sources, without what builds and tests leave behind."""
    ignore = shutil.ignore_patterns(
        ".venv", "build", "dist", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "var"
    )
    shutil.copytree(ROOT, target, ignore=ignore)
    return target


def tags(version: str) -> list[str]:
    return [f"{name}:{version}" for name in IMAGE_NAMES]


def remove_tags(client: Any, names: list[str]) -> None:
    """Untag what a test created; an image goes only when no other tag holds it. A tag a
    container still uses is an error: the test that made that container leaked it."""
    import docker.errors

    for name in names:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(name, noprune=False)


def files_of(client: Any, image: str) -> dict[str, tarfile.TarInfo]:
    """Every path in the image's filesystem, as a container created from it sees it."""
    container = client.containers.create(image, name=unique())
    try:
        stream = io.BufferedReader(_Chunks(container.export()), buffer_size=1 << 20)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            return {info.name.rstrip("/"): info for info in tar}
    finally:
        container.remove(force=True)


class _Chunks(io.RawIOBase):
    def __init__(self, chunks: Any) -> None:
        self.chunks = iter(chunks)
        self.pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            try:
                self.pending = next(self.chunks)
            except StopIteration:
                return 0
        size = min(len(buffer), len(self.pending))
        buffer[:size] = self.pending[:size]
        self.pending = self.pending[size:]
        return size


def wait_for_healthz(container: Any, url: str, timeout: float = 60) -> Any:
    """Poll a control plane in a container until /healthz answers 200; fail with its log
    if the container stops or the deadline passes."""
    import requests

    deadline = time.monotonic() + timeout
    while True:
        container.reload()
        assert container.status == "running", container.logs().decode()
        try:
            response = requests.get(url, timeout=2)
            if response.status_code == 200:
                return response
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer:\n{container.logs().decode()}"
        time.sleep(0.2)


@contextlib.contextmanager
def control_plane_container(
    client: Any,
    version: str,
    prefix: str,
    environment: dict[str, str] | None = None,
    volumes: dict[str, dict[str, str]] | None = None,
) -> Iterator[tuple[Any, str, str]]:
    """The control-plane image run locked down (read-only root, no capabilities), its store in
    a volume of its own, published on 127.0.0.1 only, with liveness fast enough for a test;
    once it answers and ``modelforge init`` ran: (container, URL, admin token). Container and
    volume are removed at the end."""
    from .control_plane import free_port

    name, port = unique(prefix), free_port()
    container = client.containers.run(
        f"modelforge-control-plane:{version}",
        name=name,
        detach=True,
        read_only=True,
        tmpfs={"/tmp": ""},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        ports={"8000/tcp": ("127.0.0.1", port)},
        volumes={name: {"bind": "/var/lib/modelforge", "mode": "rw"}, **(volumes or {})},
        environment={
            "MODELFORGE_HEARTBEAT_INTERVAL_SECONDS": "1",
            "MODELFORGE_NODE_STALE_AFTER_SECONDS": "5",
            "MODELFORGE_NODE_OFFLINE_AFTER_SECONDS": "10",
            **(environment or {}),
        },
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_healthz(container, url + "/healthz")
        code, (output, said) = container.exec_run(["modelforge", "init", "--json"], demux=True)
        assert code == 0, (said or b"").decode()
        yield container, url, json.loads(output)["admin_token"]
    finally:
        container.remove(force=True)
        client.volumes.get(name).remove(force=True)


def wait_for(
    what: str, check: Callable[[], Any], logs: Callable[[], str], timeout: float = 90
) -> Any:
    """Poll until ``check`` returns something true; the deadline only bounds a failure, whose
    message carries ``logs()``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{logs()}"
        time.sleep(0.25)


def compose_service(client: Any, project: str, service: str) -> Any:
    """The one container of a Compose project's service, by the labels Compose gives it."""
    found = client.containers.list(
        all=True,
        ignore_removed=True,
        filters={
            "label": [
                f"com.docker.compose.project={project}",
                f"com.docker.compose.service={service}",
            ]
        },
    )
    assert len(found) == 1, f"{service}: {found}"
    return found[0]


# -- release directories and their mutations -------------------------------------------------


def bundle_files(directory: Path) -> dict[str, Path]:
    manifest = next(directory.glob("modelforge-*-manifest.json"))
    version = manifest.name.removeprefix("modelforge-").removesuffix("-manifest.json")
    return {
        "version": version,  # type: ignore[dict-item]
        "manifest": manifest,
        "tarball": directory / f"modelforge-{version}-images.tar",
        "sums": directory / "SHA256SUMS",
    }


def clone_bundle(source: Path, target: Path, copy_tarball: bool = False) -> Path:
    """A release directory to mutate; the big tarball is hard-linked unless it will change."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name.endswith("-images.tar") and not copy_tarball:
            os.link(path, target / path.name)
        else:
            shutil.copyfile(path, target / path.name)
    return target


def resum(directory: Path) -> None:
    """Write SHA256SUMS again, so a mutation is caught by the check meant for it."""
    files = bundle_files(directory)
    version = files["version"]
    names = release_names(version)
    result = run_release(
        "sums",
        "--template",
        ROOT / "SHA256SUMS.template",
        "--version",
        version,
        "--output",
        directory / "SHA256SUMS",
        *[directory / name for name in names],
    )
    assert result.returncode == 0, result.stderr


def edit_manifest(directory: Path, change: Callable[[dict], None]) -> None:
    path = bundle_files(directory)["manifest"]
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def rewrite_tar(
    source: Path,
    target: Path,
    change: Callable[[str, bytes], bytes | tuple[str, bytes] | None],
    before: list[tuple[tarfile.TarInfo, bytes]] = (),  # type: ignore[assignment]
    after: list[tuple[tarfile.TarInfo, bytes]] = (),  # type: ignore[assignment]
) -> None:
    """Copy a tarball member by member. For small files ``change(name, data)`` returns None
    (keep), new bytes, ``(new name, new bytes)``, or b"" (drop the file). ``before`` and
    ``after`` are raw entries (links, devices, odd names) written around the copy."""
    with (
        tarfile.open(source) as tar_in,
        tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as out,
    ):
        for info, data in before:
            out.addfile(info, io.BytesIO(data) if info.isfile() else None)
        for info in tar_in.getmembers():
            if info.isfile() and info.size < (4 << 20):
                data = tar_in.extractfile(info).read()  # type: ignore[union-attr]
                new = change(info.name.removeprefix("./"), data)
                if new == b"":
                    continue
                if isinstance(new, tuple):
                    info.name, data = new
                elif new is not None:
                    data = new
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
            elif info.isfile():
                out.addfile(info, tar_in.extractfile(info))
            else:
                out.addfile(info)
        for info, data in after:
            out.addfile(info, io.BytesIO(data) if info.isfile() else None)


def raw_entry(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = ""
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    return info, data


def layer_offset(tarball: Path, image: str, index: int) -> tuple[str, int, int]:
    """(member name, data offset, size) of one layer file of one image in either layout."""
    with tarfile.open(tarball) as tar:
        names = {info.name.removeprefix("./"): info for info in tar.getmembers()}

        def read(name: str) -> Any:
            return json.loads(tar.extractfile(names[name]).read())  # type: ignore[union-attr]

        if "manifest.json" in names:
            entry = next(
                e
                for e in read("manifest.json")
                if any(t.startswith(image + ":") for t in e["RepoTags"])
            )
            name = entry["Layers"][index]
            info = names[name]
            while info.issym():
                name = os.path.normpath(os.path.join(os.path.dirname(name), info.linkname))
                info = names[name]
        else:
            descriptor = next(
                d
                for d in read("index.json")["manifests"]
                if d["annotations"]["org.opencontainers.image.ref.name"].startswith(image + ":")
            )
            manifest = read("blobs/" + descriptor["digest"].replace(":", "/"))
            name = "blobs/" + manifest["layers"][index]["digest"].replace(":", "/")
            info = names[name]
        return name, info.offset_data, info.size


def _history_comment(config: dict) -> None:
    config["history"][-1]["comment"] = "rebuilt by another tool; same files, same labels"


def image_config_name(tarball: Path, image: str) -> str:
    """The file name of one image's configuration in a docker-save tarball."""
    with tarfile.open(tarball) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    return next(e for e in manifest if any(t.startswith(image + ":") for t in e["RepoTags"]))[
        "Config"
    ]


def rewrite_config_docker(
    source: Path, target: Path, image: str, change: Callable[[dict], None] = _history_comment
) -> str:
    """The docker-save tarball with one image's configuration changed by ``change`` (by
    default in a way that changes its id but none of what the manifest records: a history
    comment), its file renamed to its new digest as docker names it. Returns the new id."""
    with tarfile.open(source) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        entry = next(e for e in manifest if any(t.startswith(image + ":") for t in e["RepoTags"]))
        config = json.loads(tar.extractfile(entry["Config"]).read())  # type: ignore[union-attr]
    change(config)
    new_config = json.dumps(config, sort_keys=True).encode()
    new_id = hashlib.sha256(new_config).hexdigest()
    old_name = entry["Config"]
    entry["Config"] = f"{new_id}.json"

    def rename(name: str, data: bytes) -> bytes | tuple[str, bytes] | None:
        if name == "manifest.json":
            return json.dumps(manifest).encode()
        if name == old_name:
            return f"{new_id}.json", new_config
        return None

    rewrite_tar(source, target, rename)
    return "sha256:" + new_id


def skopeo_oci_tarball(docker_archive: Path, version: str, work: Path, target: Path) -> None:
    """The four images of a docker-save tarball as an OCI layout, written by skopeo (gzip
    layers), tarred as a release tarball."""
    layout = work / "oci-layout"
    for name in IMAGE_NAMES:
        tag = f"{name}:{version}"
        result = subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                f"docker-archive:{docker_archive}:{tag}",
                f"oci:{layout}:{tag}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(layout.rglob("*")):
            tar.add(path, arcname=path.relative_to(layout).as_posix(), recursive=False)
    shutil.rmtree(layout)
