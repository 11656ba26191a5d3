"""The four images, built into the real dockerd from pinned Debian packages (no pull)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from modelforge_contract import PROTOCOL_VERSION
from modelforge_contract.manifest import (
    IMAGE_NAMES,
    LABEL_AGENT_PROTOCOL,
    LABEL_CREATED,
    LABEL_REVISION,
    LABEL_SOURCE,
    LABEL_VERSION,
    NODE_AGENT_IMAGE,
    REQUIRED_LABELS,
    entry_problems,
)
from modelforge_release.dockerd import image_entry
from tests.harness.nvml import h100_80g_x8, write_nvml_config
from tests.harness.release_images import (
    ROOT,
    bundle_files,
    copy_tree,
    files_of,
    release_env,
    remove_tags,
    run_copy_release,
    unique,
    wait_for_healthz,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SERVICE_USER = "65532:65532"
STATE_DIRS = {
    "modelforge-control-plane": {"var/lib/modelforge"},
    # The identity, and the artifact root the compose files mount a volume on.
    "modelforge-node-agent": {"var/lib/modelforge-node-agent", "var/lib/modelforge-artifacts"},
    "modelforge-runtime-worker": {"run/modelforge-worker"},
    "modelforge-runtime-worker-cpu": {"run/modelforge-worker"},
}


def test_images_are_built_with_progress_and_described_as_json(built_images, release_version):
    assert sorted(built_images["images"]) == sorted(IMAGE_NAMES)
    for name, image in built_images["images"].items():
        assert image["tag"] == f"{name}:{release_version}"
        assert image["image_id"].startswith("sha256:")
    # Progress on the long steps: every layer, the load, each image.
    assert re.search(r"\[1/6\] layer python: \d+ files", built_images["stderr"])
    assert "loading 4 images into dockerd" in built_images["stderr"]


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_no_image_holds_a_shell_a_package_manager_or_a_driver_library(
    docker_client, built_images, name
):
    files = files_of(docker_client, built_images["images"][name]["tag"])
    assert "usr/bin/python3.11" in files and files["bin"].issym()
    for forbidden in (
        "bin/sh",
        "usr/bin/sh",
        "usr/bin/bash",
        "usr/bin/dash",
        "usr/bin/apt",
        "usr/bin/apt-get",
        "usr/bin/dpkg",
        "var/lib/dpkg/info",
        "var/lib/dpkg/status",
    ):
        assert forbidden not in files, forbidden
    assert not [path for path in files if re.search(r"(^|/)libnvidia-ml\.so", path)]
    assert not [path for path, info in files.items() if info.isfile() and info.mode & 0o6000]
    # Package files belong to root; only the service's state directory is the service user's.
    owned = {path for path, info in files.items() if info.uid or info.gid}
    assert owned == {*STATE_DIRS[name], "home/nonroot"}
    # What scanners read instead of dpkg's database: one control stanza per package.
    assert "var/lib/dpkg/status.d/libc6" in files


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_every_image_carries_the_labels_and_runs_as_the_service_user(
    docker_client, built_images, release_version, name
):
    tag = built_images["images"][name]["tag"]
    attrs = docker_client.api.inspect_image(tag)
    entry = image_entry(attrs, tag)
    assert entry_problems(name, entry, release_version) == []
    labels = entry["labels"]
    assert set(REQUIRED_LABELS) <= set(labels)
    assert labels[LABEL_VERSION] == release_version
    assert labels[LABEL_AGENT_PROTOCOL] == str(PROTOCOL_VERSION)
    assert labels[LABEL_CREATED] == "2026-01-01T00:00:00Z"  # SOURCE_DATE_EPOCH
    assert attrs["Config"]["User"] == SERVICE_USER
    assert attrs["Os"] == "linux" and attrs["Architecture"] == "amd64"
    uid = docker_client.containers.run(
        tag,
        ["python3", "-c", "import os; print(os.getuid(), os.getgid())"],
        remove=True,
        network_mode="none",
    )
    assert uid.decode().split() == ["65532", "65532"]


def test_the_node_agent_image_is_small(docker_client, built_images):
    size = docker_client.api.inspect_image(built_images["images"][NODE_AGENT_IMAGE]["tag"])["Size"]
    assert size <= 60_000_000, f"{size / 1e6:.1f} MB"


def test_a_second_build_elsewhere_gives_the_same_release_byte_for_byte(
    docker_client, release_bundle, release_version, tmp_path
):
    """The same commit built again, from a copy of the tree in another directory with its
    own work and dist directories, gives the same SHA256SUMS: the same tarball (every
    layer, every configuration), the same manifest, the same archives. The images are
    tagged as the first build tagged them; identical builds leave every tag in place."""
    first = json.loads(bundle_files(release_bundle)["manifest"].read_text())
    labels = first["images"][NODE_AGENT_IMAGE]["labels"]
    copy = copy_tree(tmp_path / "elsewhere" / "modelforge")
    built = run_copy_release(
        copy,
        "images",
        "--version",
        release_version,
        "--revision",
        labels[LABEL_REVISION],
        # The label is there only when the checkout's origin is a URL; the copy's is not.
        *(["--source-url", labels[LABEL_SOURCE]] if LABEL_SOURCE in labels else []),
        "--dist",
        tmp_path / "dist",
        "--json",
    )
    assert built.returncode == 0, built.stderr[-4000:]
    again = json.loads(built.stdout)["images"]
    for name in IMAGE_NAMES:
        assert again[name]["image_id"] == first["images"][name]["image_id"], name
    out = tmp_path / "second" / release_bundle.name
    bundled = run_copy_release(
        copy, "bundle", "--version", release_version, "--out", out, "--dist", tmp_path / "dist"
    )
    assert bundled.returncode == 0, bundled.stderr[-4000:]
    assert (out / "SHA256SUMS").read_bytes() == (release_bundle / "SHA256SUMS").read_bytes()


def run_preflight(docker_client, tag, **kwargs):
    container = docker_client.containers.run(
        tag,
        ["python3", "-m", "modelforge_node_agent.main", "--preflight"],
        environment={
            "MODELFORGE_AGENT_ACCELERATOR_MODE": "nvidia",
            **kwargs.pop("environment", {}),
        },
        network_mode="none",
        detach=True,
        name=unique(),
        **kwargs,
    )
    try:
        status = container.wait(timeout=120)["StatusCode"]
        return status, container.logs().decode()
    finally:
        container.remove(force=True)


def test_agent_preflight_fails_closed_without_nvml_and_passes_with_the_test_library(
    docker_client, built_images, fake_nvml_dir, tmp_path
):
    tag = built_images["images"][NODE_AGENT_IMAGE]["tag"]
    status, output = run_preflight(docker_client, tag)
    assert status == 3, output
    assert "NVIDIA_NVML_UNAVAILABLE" in output
    # As the NVIDIA Container Toolkit would: the host's libnvidia-ml.so.1 appears in the
    # image's library directory.
    config = write_nvml_config(h100_80g_x8(), tmp_path / "nvml.conf")
    status, output = run_preflight(
        docker_client,
        tag,
        environment={"FAKE_NVML_CONFIG": "/etc/fake-nvml.conf"},
        volumes={
            str(fake_nvml_dir / "libnvidia-ml.so.1"): {
                "bind": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                "mode": "ro",
            },
            str(config): {"bind": "/etc/fake-nvml.conf", "mode": "ro"},
        },
    )
    assert status == 0, output
    assert "NVIDIA_" not in output.replace("NVIDIA_VISIBLE_DEVICES", "")


def test_the_runtime_worker_images_hold_the_worker_and_only_the_gpu_one_the_cuda_runtime(
    docker_client, built_images
):
    probe = (
        "import ctypes, docker, pynvml, modelforge_worker\n"
        "try:\n"
        "    cudart = ctypes.CDLL('libcudart.so.12')\n"
        "except OSError:\n"
        "    print('no cudart')\n"
        "else:\n"
        "    version = ctypes.c_int()\n"
        "    cudart.cudaRuntimeGetVersion(ctypes.byref(version))\n"
        "    print('cudart', version.value)\n"
    )
    gpu = docker_client.containers.run(
        built_images["images"]["modelforge-runtime-worker"]["tag"],
        ["python3", "-c", probe],
        remove=True,
        network_mode="none",
    )
    assert re.fullmatch(r"cudart 12\d{3}\n", gpu.decode())
    cpu = docker_client.containers.run(
        built_images["images"]["modelforge-runtime-worker-cpu"]["tag"],
        ["python3", "-c", probe],
        remove=True,
        network_mode="none",
    )
    assert cpu.decode() == "no cudart\n"
    for name in ("modelforge-runtime-worker", "modelforge-runtime-worker-cpu"):
        cmd = docker_client.api.inspect_image(built_images["images"][name]["tag"])["Config"]["Cmd"]
        assert cmd == ["python3", "-m", "modelforge_worker"]


# Run inside the -cpu worker image (no shell, no curl): llama-server on the tiny GGUF, bound
# to the container's loopback, /health, then a greedy completion; prints the text.
LLAMA_PROBE = """
import json, os, subprocess, time, urllib.request
server = subprocess.Popen([os.environ["MODELFORGE_WORKER_LLAMA_SERVER"], "-m", "/model/tiny.gguf",
    "--host", "127.0.0.1", "--port", "8181", "--alias", "tiny", "-c", "256", "--threads", "2"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while True:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8181/health", timeout=2).status == 200:
            break
    except OSError:
        assert server.poll() is None and time.monotonic() < deadline, "llama-server did not start"
        time.sleep(0.05)
body = {"prompt": "the model", "max_tokens": 16, "temperature": 0, "top_k": 1, "seed": 42}
request = urllib.request.Request("http://127.0.0.1:8181/v1/completions",
    data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
print(json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"][0]["text"])
server.terminate()
server.wait()
"""


def test_the_cpu_worker_image_runs_its_static_llama_server_on_the_tiny_gguf(
    docker_client, built_images, tiny_gguf
):
    """llama-server from scripts/llama-server-build, in the image built from an empty root,
    named by the worker's setting; the same greedy text as on the host."""
    from tests.worker.test_llama_server_binary import GOLDEN

    tag = built_images["images"]["modelforge-runtime-worker-cpu"]["tag"]
    env = docker_client.api.inspect_image(tag)["Config"]["Env"]
    assert "MODELFORGE_WORKER_LLAMA_SERVER=/usr/local/bin/llama-server" in env
    files = files_of(docker_client, tag)
    assert files["usr/local/bin/llama-server"].isfile()
    assert files["usr/local/bin/llama-server"].mode & 0o111
    assert files["usr/local/bin/ggml-rpc-server"].mode & 0o111  # beside it: a split's helper
    assert "usr/local/bin/llama-server" not in files_of(
        docker_client, built_images["images"]["modelforge-runtime-worker"]["tag"]
    )
    output = docker_client.containers.run(
        tag,
        ["python3", "-c", LLAMA_PROBE],
        remove=True,
        network_mode="none",
        volumes={str(tiny_gguf): {"bind": "/model/tiny.gguf", "mode": "ro"}},
    )
    assert output.decode() == GOLDEN + "\n"


def test_the_control_plane_image_starts_read_only_as_unraid_runs_it(
    docker_client, built_images, tmp_path
):
    """The Unraid template's flags: --user 99:100 --read-only --tmpfs /tmp --cap-drop ALL."""
    state = tmp_path / "appdata"
    state.mkdir(mode=0o700)
    os.chown(state, 99, 100)
    container = docker_client.containers.run(
        built_images["images"]["modelforge-control-plane"]["tag"],
        detach=True,
        name=unique(),
        user="99:100",
        read_only=True,
        tmpfs={"/tmp": "rw,noexec,nosuid,size=64m"},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        volumes={str(state): {"bind": "/var/lib/modelforge", "mode": "rw"}},
        ports={"8000/tcp": ("127.0.0.1", None)},
    )
    try:
        container.reload()
        port = container.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"]
        response = wait_for_healthz(container, f"http://127.0.0.1:{port}/healthz")
        # The first admin token, as docs/install-unraid.md says: docker exec … modelforge init
        exit_code, (out, err) = container.exec_run(
            ["modelforge", "init", "--json"], user="99:100", demux=True
        )
        assert exit_code == 0, (out or b"") + (err or b"")
        assert json.loads(out)["admin_token"].startswith("mfa_")
        assert response.json() == {"status": "ok"}
    finally:
        container.remove(force=True)


def test_compose_source_builds_give_the_release_image_s_files_and_configuration(
    docker_client, built_images, tmp_path
):
    """`docker-compose build` of docker-compose.node-agent.yml (v1, the classic builder):
    FROM scratch plus the layers `modelforge-release images` left, no pull."""
    image = f"{unique()}/node-agent:local"
    (tmp_path / "modelforge-node.env").write_text("MODELFORGE_AGENT_ACCELERATOR_MODE=cpu\n")
    env = release_env(
        MODELFORGE_NODE_AGENT_IMAGE=image,
        MODELFORGE_NODE_AGENT_ENV_FILE=str(tmp_path / "modelforge-node.env"),
    )
    result = subprocess.run(
        [
            "docker-compose",
            "-p",
            unique("mftest"),
            "-f",
            "docker-compose.node-agent.yml",
            "build",
            "node-agent",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        release_tag = built_images["images"][NODE_AGENT_IMAGE]["tag"]
        built, release = (
            docker_client.api.inspect_image(image),
            docker_client.api.inspect_image(release_tag),
        )
        for key in ("Cmd", "User", "Env", "WorkingDir"):
            assert built["Config"][key] == release["Config"][key], key

        def listing(tag):
            return {
                path: (info.type, info.mode, info.uid, info.size)
                for path, info in files_of(docker_client, tag).items()
            }

        assert listing(image) == listing(release_tag)
    finally:
        remove_tags(docker_client, [image])
