"""Release images and bundle: image sizes, build and bundle times, ``verify-bundle`` against
``sha256sum`` on the same tarball, same run.

    .venv/bin/python bench/bundle.py                  # needs dockerd; as scripts/test runs it
    .venv/bin/python bench/bundle.py --pad-mib 2048 --runs 5

1. ``modelforge-release images`` for a throw-away version: each step's time, each image's
   size (dockerd's "Size", uncompressed).
2. ``modelforge-release bundle``: save and SHA256SUMS time, tarball size.
3. ``sha256sum TARBALL`` against ``modelforge-release verify-bundle DIR`` (which also checks
   the manifest, the pyz files and every layer), interleaved, best of --runs, page cache warm.
4. The same on a padded release: the node agent image with one more layer of --pad-mib of
   random bytes, loaded and bundled the same way, where the interpreter's start no longer
   hides the throughput; peak RSS shows whether memory follows the tarball's size.

Everything it tags is ``<name>:<version>-bench.<hex>`` and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verify import RELEASE, Run, best, own_peak_rss_bytes, timed, warm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "release"), str(ROOT / "contract")]

from modelforge_contract import __version__  # noqa: E402
from modelforge_contract.manifest import IMAGE_NAMES, NODE_AGENT_IMAGE  # noqa: E402
from modelforge_release.build import BuiltImage, image_config, load_images  # noqa: E402
from modelforge_release.images import SPECS, BuildContext  # noqa: E402
from modelforge_release.rootfs import Layer, Tree, write_layer  # noqa: E402


def release(*args: str) -> tuple[float, str]:
    began = time.perf_counter()
    result = subprocess.run([str(RELEASE), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"modelforge-release {args[0]} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - began, result.stdout


def compare(directory: Path, runs: int) -> tuple[Run, Run, int]:
    tarball = next(directory.glob("*-images.tar"))
    warm(tarball)
    sha, ours = [], []
    for _ in range(runs):
        sha.append(timed(["sha256sum", str(tarball)]))
        ours.append(timed([str(RELEASE), "verify-bundle", str(directory)]))
    return best(sha), best(ours), tarball.stat().st_size


def report(label: str, sha: Run, ours: Run, size: int) -> None:
    sha_rate, our_rate = size / sha.seconds / 1e6, size / ours.seconds / 1e6
    print(f"{label}: {size / 2**20:.0f} MiB tarball")
    print(
        f"  sha256sum      {sha_rate:7.0f} MB/s  {sha.seconds:6.3f} s  peak RSS {sha.peak_rss_bytes / 2**20:6.1f} MiB"
    )
    print(
        f"  verify-bundle  {our_rate:7.0f} MB/s  {ours.seconds:6.3f} s  peak RSS {ours.peak_rss_bytes / 2**20:6.1f} MiB"
    )
    print(f"  ratio verify-bundle / sha256sum: {our_rate / sha_rate:.2f} (target >= 0.9)")


def padded_agent(version: str, pad_mib: int, work: Path) -> None:
    """The node agent image plus one layer of random bytes, loaded as <agent>:<version>."""
    import docker

    ctx = BuildContext(
        source=ROOT,
        version=version,
        revision="bench",
        source_url="bench",
        epoch=1767225600,
        cache_dir=work,
        work_dir=work,
        dist=ROOT / "dist",
    )
    spec = SPECS[NODE_AGENT_IMAGE]
    layers = []
    for name in spec.layers:
        path = ROOT / "build" / "images" / "layers" / f"{name}.tar"
        layers.append(Layer(name, path, "sha256:" + _sha256(path), path.stat().st_size, 0))
    block = os.urandom(64 << 20)
    tree = Tree("pad")
    for index in range(max(1, pad_mib // 64)):
        tree.add_file(f"opt/pad/{index:04d}.bin", block[:-1] + bytes([index % 256]))
    pad = write_layer(tree, work / "pad.tar", ctx.epoch)
    layers.append(Layer("node-agent", pad.path, pad.diff_id, pad.size, pad.files))
    image = BuiltImage(spec, layers, image_config(ctx, spec, layers))
    load_images(docker.from_env(timeout=600), ctx, [image])


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="best of this many, each tool")
    parser.add_argument(
        "--pad-mib", type=int, default=1024, help="extra layer of the padded release"
    )
    parser.add_argument(
        "--make-padded", nargs=3, metavar=("VERSION", "MIB", "WORK"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.make_padded:
        version, mib, work_dir = args.make_padded
        padded_agent(version, int(mib), Path(work_dir))
        return
    import docker

    client = docker.from_env(timeout=600)
    version = f"{__version__}-bench.{secrets.token_hex(3)}"
    work = Path(tempfile.mkdtemp(prefix="modelforge-bench-bundle-"))
    tags = [f"{name}:{version}" for name in IMAGE_NAMES] + [f"{NODE_AGENT_IMAGE}:{version}-pad"]
    try:
        seconds, out = release(
            "images", "--version", version, "--dist", str(work / "dist"), "--json"
        )
        built = json.loads(out)
        print(
            f"images: {seconds:.1f} s wall ({', '.join(f'{k} {v:.1f}s' for k, v in built['seconds'].items())})"
        )
        for name in IMAGE_NAMES:
            size = client.api.inspect_image(built["images"][name]["tag"])["Size"]
            print(f"  {name:32s} {size / 1e6:6.1f} MB")
        seconds, out = release(
            "bundle",
            "--version",
            version,
            "--out",
            str(work / "bundle"),
            "--dist",
            str(work / "dist"),
            "--json",
        )
        made = json.loads(out)
        print(
            f"bundle: {seconds:.1f} s wall (save {made['seconds']['save']:.1f}s, SHA256SUMS {made['seconds']['sums']:.1f}s)"
        )
        report("release bundle", *compare(work / "bundle", args.runs))

        padded = f"{version}-pad"
        # In a child process: a launcher that held the padding would lift every child's peak
        # RSS to its own (Linux carries ru_maxrss across exec).
        subprocess.run(
            [sys.executable, __file__, "--make-padded", padded, str(args.pad_mib), str(work)],
            check=True,
        )
        print(f"padded: node agent + {args.pad_mib} MiB layer")
        _padded_release(client, padded, work, args.runs)
    finally:
        for tag in tags:
            with contextlib.suppress(docker.errors.APIError):
                client.images.remove(tag)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"best of {args.runs}, page cache warm; MB = 10^6 bytes; {os.cpu_count()} CPUs; launcher peak {own_peak_rss_bytes() / 2**20:.1f} MiB"
    )


def _padded_release(client, version: str, work: Path, runs: int) -> None:
    """A release directory with the padded agent alone, its manifest made like bundle's."""
    from modelforge_release.bundle import _save
    from modelforge_release.dockerd import image_entry
    from modelforge_release.names import release_names
    from modelforge_release.sums import compute_entries, names_relative_to, write_sums

    out = work / "padded"
    out.mkdir()
    tag = f"{NODE_AGENT_IMAGE}:{version}"
    entry = image_entry(client.api.inspect_image(tag), tag)
    began = time.perf_counter()
    _save(client, [tag], out / f"modelforge-{version}-images.tar", 1767225600, None)
    print(f"  docker save, rewritten canonically: {time.perf_counter() - began:.1f} s")
    manifest = {
        "schema": 2,
        "version": version,
        "revision": "bench",
        "created": "2026-01-01T00:00:00Z",
        "images": {NODE_AGENT_IMAGE: entry},
    }
    (out / f"modelforge-{version}-manifest.json").write_text(json.dumps(manifest))
    names = release_names(version)
    for name in names[2:]:
        shutil.copyfile(work / "dist" / name, out / name)
    write_sums(
        out / "SHA256SUMS", compute_entries(names_relative_to(out, [out / n for n in names]))
    )
    tarball = out / names[0]
    warm(tarball)
    sha, ours = [], []
    for _ in range(runs):
        sha.append(timed(["sha256sum", str(tarball)]))
        ours.append(_timed_allow_missing(out))
    report(
        "padded release (agent only; the three other images reported missing)",
        best(sha),
        best(ours),
        tarball.stat().st_size,
    )


def _timed_allow_missing(directory: Path) -> Run:
    """verify-bundle exits 1 here (a one-image manifest); the time and memory still count."""
    began = time.perf_counter()
    process = subprocess.Popen(
        [str(RELEASE), "verify-bundle", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - began
    errors = process.stderr.read().decode()
    process.stderr.close()
    unexpected = [
        line
        for line in errors.splitlines()
        if "missing from the manifest" not in line
        and "problem(s)" not in line
        and "was not checked" not in line
    ]
    if unexpected:
        raise SystemExit(
            "verify-bundle found more than the missing images:\n" + "\n".join(unexpected)
        )
    return Run(seconds, usage.ru_maxrss * 1024)


if __name__ == "__main__":
    main()
