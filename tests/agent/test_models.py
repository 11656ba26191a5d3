"""Models on real agents (issue 24): a real control plane (waitress, SQLite) replicates an
imported model to node agent processes, which pull, verify and lay it out; and the agent's
blob store on real files."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import socket
import subprocess
import threading

import pytest

from modelforge_contract import EXIT_USAGE
from modelforge_contract.models import (
    DIGEST_MISMATCH,
    DISK_FULL,
    DOWNLOAD_FAILED,
    INSUFFICIENT_SPACE,
    PATH_ADMIN_MODELS,
)
from modelforge_node_agent.blobs import BlobStore, DigestMismatch
from tests.harness.agent_process import AgentProcess, agent_env, run_agent, wait_until
from tests.harness.control_plane import make_settings, serve
from tests.harness.work_node import fast_agent_settings, short_dir, start_node

MODELS = PATH_ADMIN_MODELS
# Real agents pulling real files: the heavy part of the suite, once, on its own (scripts/test).
SLOW = pytest.mark.slow


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the blob store on real files -----------------------------------------------------------


def store_in(tmp_path) -> BlobStore:
    store = BlobStore(tmp_path / "artifacts", tmp_path / "quarantine")
    store.prepare()
    return store


def manifest_of(files: dict[str, bytes], name="m", revision="r1") -> dict:
    entries = [{"path": p, "size": len(d), "sha256": sha(d)} for p, d in sorted(files.items())]
    return {"name": name, "revision": revision, "files": entries}


def test_a_partial_resumes_from_its_bytes_and_commits_read_only(tmp_path):
    store = store_in(tmp_path)
    data = os.urandom(3 * 1024 * 1024 + 5)
    handle, hasher, have = store.open_partial(sha(data))
    handle.write(data[:1000])
    handle.close()
    handle, hasher, have = store.open_partial(sha(data))
    assert have == 1000  # the resume point is what is on disk, hashed again
    handle.write(data[have:])
    hasher.update(data[have:])
    blob = store.commit(sha(data), handle, hasher)
    assert blob == store.blob_path(sha(data)) and blob.read_bytes() == data
    assert oct(blob.stat().st_mode & 0o777) == "0o444"
    assert not store.partial_path(sha(data)).exists()


def test_a_blob_that_does_not_hash_goes_to_quarantine_not_blobs(tmp_path):
    store = store_in(tmp_path)
    claimed = sha(b"the real bytes")
    with pytest.raises(DigestMismatch) as raised:
        store.write_blob(claimed, [b"other bytes"])
    assert not store.has_blob(claimed) and not store.partial_path(claimed).exists()
    [kept] = list((tmp_path / "quarantine").iterdir())
    assert kept == raised.value.quarantined and kept.name.startswith(claimed + ".")
    assert kept.read_bytes() == b"other bytes"


def test_models_are_hard_links_and_removal_keeps_shared_blobs(tmp_path):
    store = store_in(tmp_path)
    shared, own_a, own_b = b"shared weights", b"config a", b"config b"
    a = manifest_of({"w/shared.bin": shared, "config.json": own_a}, "a")
    b = manifest_of({"shared.bin": shared, "config.json": own_b}, "b")
    for data in (shared, own_a, own_b):
        store.write_blob(sha(data), [data])
    hex_a, hex_b = "a" * 64, "b" * 64
    store.link_model(hex_a, a)
    store.link_model(hex_b, b)
    linked = store.model_dir(hex_a) / "w" / "shared.bin"
    assert linked.read_bytes() == shared
    assert linked.stat().st_ino == store.blob_path(sha(shared)).stat().st_ino
    assert store.missing_bytes(a) == 0 and set(store.present_models()) == {hex_a, hex_b}
    assert store.remove_model(hex_a) == 1  # only config a: b still links the shared blob
    assert not store.model_dir(hex_a).exists() and not store.has_blob(sha(own_a))
    assert store.has_blob(sha(shared)) and set(store.present_models()) == {hex_b}
    assert store.remove_model(hex_b) == 2
    assert list(store.blobs.iterdir()) == []


def mode(path) -> int:
    return path.stat().st_mode & 0o7777


def test_what_the_worker_opens_is_group_readable_whatever_the_umask(tmp_path):
    """The runtime worker (another user in the agent's group on a systemd node) opens
    models/<hex>/ at the same path: the root, blobs, models and manifests are 0750 and the
    blobs 0444, while partial downloads and quarantine stay the agent's (0700), even under
    the unit's UMask=0077."""
    previous = os.umask(0o077)
    try:
        # systemd's StateDirectoryMode=0700 made the root before the agent started.
        (tmp_path / "artifacts").mkdir(mode=0o700)
        store = store_in(tmp_path)
        weights, config = b"weights", b"{}"
        for data in (weights, config):
            store.write_blob(sha(data), [data])
        model = store.link_model(
            "c" * 64, manifest_of({"deep/er/w.gguf": weights, "config.json": config})
        )
    finally:
        os.umask(previous)
    root = tmp_path / "artifacts"
    shared = [root, root / "blobs", store.blobs, store.models, store.manifests, model]
    shared += [model / "deep", model / "deep" / "er"]
    assert {str(p): oct(mode(p)) for p in shared} == {str(p): "0o750" for p in shared}
    assert mode(model / "deep" / "er" / "w.gguf") == 0o444  # a hard link to the blob
    assert mode(store.manifests / f"{'c' * 64}.json") == 0o644
    for private in (store.partial, tmp_path / "quarantine"):
        assert mode(private) == 0o700, private
    # A root the agent owns is opened to the group again at every start (systemd may have
    # set it back to its StateDirectoryMode); partial/ is narrowed back to the agent.
    os.chmod(root, 0o700)
    os.chmod(store.partial, 0o750)  # noqa: S103 - what prepare must narrow again
    store.prepare()
    assert mode(root) == 0o750 and mode(store.partial) == 0o700


def test_missing_bytes_counts_partials_and_each_blob_once(tmp_path):
    store = store_in(tmp_path)
    data = b"x" * 5000
    manifest = manifest_of({"a.bin": data, "b.bin": data})
    assert store.missing_bytes(manifest) == 5000
    handle, _, _ = store.open_partial(sha(data))
    handle.write(data[:2000])
    handle.close()
    assert store.missing_bytes(manifest) == 3000


# -- real agents ----------------------------------------------------------------------------


@pytest.fixture
def cp(tmp_path):
    settings = make_settings(tmp_path / "cp", heartbeat_interval_seconds=1)
    with serve(settings) as plane:
        yield plane


@pytest.fixture
def sockets():
    with short_dir() as path:
        yield path


def import_model(cp, name, files: dict[str, bytes], tmp_path) -> dict:
    source = tmp_path / f"src-{name}"
    for path, data in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_bytes(data)
    answer = cp.admin("POST", MODELS, json={"name": name, "source": {"path": str(source)}})
    assert answer.status_code == 201, answer.text
    return answer.json()


def replicas(cp, name) -> dict[str, dict]:
    answer = cp.admin("GET", f"{MODELS}/{name}/replicas")
    assert answer.status_code == 200, answer.text
    return {r["node_id"]: r for r in answer.json()["replicas"]}


def wait_for_states(cp, name, wanted: dict[str, str], timeout=90) -> dict[str, dict]:
    def reached():
        shown = replicas(cp, name)
        states = {node_id: r["state"] for node_id, r in shown.items()}
        return shown if states == wanted else None

    return wait_until(reached, timeout=timeout, what=f"replicas {wanted}")


def online_node(cp, tmp_path, sockets, name, **settings):
    node = start_node(cp, tmp_path / name, sockets, name, with_worker=False, **settings)

    def online():
        answer = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node.node_id}")
        return answer.status_code == 200 and answer.json().get("liveness") == "online"

    try:
        wait_until(lambda: (node.state_volume / "identity.json").exists(), timeout=60)
        wait_until(online, timeout=60, what=f"{name} online")
    except BaseException:
        node.close()
        raise
    return node


FILES = {
    "config.json": b'{"hidden_size": 8}',
    "weights/model.safetensors": os.urandom(3 * 1024 * 1024 + 17),
    "tokenizer.json": b'{"v": 1}',
}


@SLOW
def test_replicated_to_two_agents_present_identical_hard_linked_then_removed(cp, tmp_path, sockets):
    model = import_model(cp, "tiny", FILES, tmp_path)
    digest_hex = model["digest"].removeprefix("sha256:")
    a = online_node(cp, tmp_path, sockets, "models-a")
    b = online_node(cp, tmp_path, sockets, "models-b")
    try:
        made = cp.admin(
            "POST", f"{MODELS}/tiny/replicas", json={"node_ids": [a.node_id, b.node_id]}
        )
        assert made.status_code == 202, made.text
        shown = wait_for_states(cp, "tiny", {a.node_id: "present", b.node_id: "present"})
        assert {r["bytes_done"] for r in shown.values()} == {model["size_bytes"]}
        for node in (a, b):
            root = node.state_volume / "artifacts"
            model_dir = root / "models" / digest_hex
            for path, data in FILES.items():
                linked = model_dir / path
                assert linked.read_bytes() == data
                blob = root / "blobs" / "sha256" / sha(data)
                assert linked.stat().st_ino == blob.stat().st_ino  # a hard link, not a copy
                assert blob.stat().st_mode & 0o777 == 0o444
            assert list((root / "partial").iterdir()) == []
        # Removal: the node deletes its files, then stops reporting it; the row goes.
        gone = cp.admin("DELETE", f"{MODELS}/tiny/replicas/{a.node_id}")
        assert gone.status_code == 202, gone.text
        wait_for_states(cp, "tiny", {b.node_id: "present"})
        root = a.state_volume / "artifacts"
        assert not (root / "models" / digest_hex).exists()
        assert list((root / "blobs" / "sha256").iterdir()) == []
        assert (b.state_volume / "artifacts" / "models" / digest_hex).is_dir()
    finally:
        a.close()
        b.close()


@SLOW
def test_a_tampered_cache_blob_fails_digest_mismatch_into_quarantine(cp, tmp_path, sockets):
    model = import_model(cp, "tampered", FILES, tmp_path)
    weights = sha(FILES["weights/model.safetensors"])
    cached = cp.settings.state_dir / "models" / "blobs" / "sha256" / weights
    data = bytearray(cached.read_bytes())
    data[12345] ^= 0xFF  # same size, other bytes
    os.chmod(cached, 0o644)
    cached.write_bytes(bytes(data))
    node = online_node(cp, tmp_path, sockets, "models-t")
    try:
        made = cp.admin("POST", f"{MODELS}/tampered/replicas", json={"node_ids": [node.node_id]})
        assert made.status_code == 202, made.text
        shown = wait_for_states(cp, "tampered", {node.node_id: "failed"})
        assert shown[node.node_id]["error"]["code"] == DIGEST_MISMATCH
        root = node.state_volume / "artifacts"
        assert not (root / "blobs" / "sha256" / weights).exists()
        assert not (root / "models" / model["digest"].removeprefix("sha256:")).exists()
        [kept] = list((node.state_volume / "quarantine").iterdir())
        assert kept.name.startswith(weights + ".") and kept.read_bytes() == bytes(data)
        # The cache mended (as a re-import would), a replicate again is a retry: present.
        cached.write_bytes(FILES["weights/model.safetensors"])
        again = cp.admin("POST", f"{MODELS}/tampered/replicas", json={"node_ids": [node.node_id]})
        assert again.status_code == 202, again.text
        wait_for_states(cp, "tampered", {node.node_id: "present"})
        assert (root / "blobs" / "sha256" / weights).read_bytes() == FILES[
            "weights/model.safetensors"
        ]
    finally:
        node.close()


def test_a_cache_blob_longer_than_its_manifest_fails_after_a_few_starts(cp, tmp_path, sockets):
    """The agent pulled such a blob from the start again and again, with no pause and no end
    (2,246 MiB in 12 s): now it backs off between starts and fails DOWNLOAD_FAILED."""
    import_model(cp, "longer", FILES, tmp_path)
    weights = sha(FILES["weights/model.safetensors"])
    cached = cp.settings.state_dir / "models" / "blobs" / "sha256" / weights
    os.chmod(cached, 0o644)
    with cached.open("ab") as handle:
        handle.write(b"more than the manifest says")
    node = online_node(cp, tmp_path, sockets, "models-l")
    try:
        made = cp.admin("POST", f"{MODELS}/longer/replicas", json={"node_ids": [node.node_id]})
        assert made.status_code == 202, made.text
        shown = wait_for_states(cp, "longer", {node.node_id: "failed"})
        error = shown[node.node_id]["error"]
        assert error["code"] == DOWNLOAD_FAILED
        assert "sent more than the blob's" in error["message"]
        assert "4 times from the start" in error["message"]
        root = node.state_volume / "artifacts"
        assert not (root / "blobs" / "sha256" / weights).exists()
    finally:
        node.close()


def mount_tmpfs(path, size: str) -> bool:
    """A size-limited tmpfs at ``path`` (root only); False where it cannot be made."""
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@SLOW
def test_preflight_insufficient_space_on_a_small_artifact_root(cp, tmp_path, sockets):
    mount = tmp_path / "small"
    mount.mkdir()
    if not mount_tmpfs(mount, "1m"):
        if os.environ.get("CI"):
            pytest.fail("CI must be able to mount a tmpfs (run the agent tests as root)")
        pytest.skip("needs root to mount a size-limited tmpfs")
    try:
        model = import_model(cp, "toolarge", FILES, tmp_path)
        node = online_node(cp, tmp_path, sockets, "models-s", artifact_root=str(mount / "art"))
        try:
            made = cp.admin(
                "POST", f"{MODELS}/toolarge/replicas", json={"node_ids": [node.node_id]}
            )
            assert made.status_code == 202, made.text
            shown = wait_for_states(cp, "toolarge", {node.node_id: "failed"})
            assert shown[node.node_id]["error"]["code"] == INSUFFICIENT_SPACE
            art = mount / "art"
            assert list((art / "partial").iterdir()) == []
            assert list((art / "blobs" / "sha256").iterdir()) == []
            assert not (art / "models" / model["digest"].removeprefix("sha256:")).exists()
        finally:
            node.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# -- through a proxy the test controls ------------------------------------------------------


class HoldingProxy:
    """A TCP proxy on 127.0.0.1 to the control plane. While ``hold_after`` is set, a
    connection that has forwarded that many bytes towards the agent forwards nothing more
    (the connection stays open: a stall). Only blob answers grow that large; heartbeats
    and inventories on the same keep-alive connections stay far below it. ``sent`` counts
    every byte forwarded towards the agent."""

    def __init__(self, target_port: int, hold_after: int | None = None) -> None:
        self.target_port, self.hold_after = target_port, hold_after
        self.sent = 0
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()  # the control plane is down: as a refused connection
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_agent: bool) -> None:
        forwarded = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                while to_agent and self.hold_after is not None and forwarded >= self.hold_after:
                    if self._closed.wait(0.05):
                        return
                sink.sendall(data)
                forwarded += len(data)
                if to_agent:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


BIG = {"config.json": b"{}", "weights.bin": os.urandom(6 * 1024 * 1024 + 3)}
MIB = 1024 * 1024


def through(cp, proxy):
    """The control plane's helpers with its URL the proxy's, so a token is minted for the
    origin the agent uses."""
    return dataclasses.replace(cp, url=proxy.url)


def partial_of(node, data: bytes):
    return node.state_volume / "artifacts" / "partial" / sha(data)


def size_of(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@SLOW
def test_killed_mid_pull_and_restarted_resumes_fetching_at_most_one_chunk_again(
    cp, tmp_path, sockets
):
    model = import_model(cp, "big", BIG, tmp_path)
    proxy = HoldingProxy(int(cp.url.rsplit(":", 1)[1]), hold_after=int(2.5 * MIB))
    node = online_node(through(cp, proxy), tmp_path, sockets, "models-k")
    try:
        made = cp.admin("POST", f"{MODELS}/big/replicas", json={"node_ids": [node.node_id]})
        assert made.status_code == 202, made.text
        partial = partial_of(node, BIG["weights.bin"])
        wait_until(lambda: size_of(partial) >= 2 * MIB, timeout=60, what="2 MiB pulled")
        node.agent.process.kill()  # SIGKILL: no goodbye, the partial file as it is
        node.agent.process.wait(timeout=10)
        kept = size_of(partial)
        assert 2 * MIB <= kept < len(BIG["weights.bin"])
        with proxy._lock:
            proxy.sent = 0
        proxy.hold_after = None
        # The same agent again: enrolled already, the same state volume and proxy.
        env = agent_env(
            control_plane_url=proxy.url,
            accelerator_mode="cpu",
            state_volume=node.state_volume,
            hostname="models-k",
            **fast_agent_settings(sockets / "models-k.sock"),
        )
        node.agent = AgentProcess(env, tmp_path / "models-k" / "agent2.log")
        wait_for_states(cp, "big", {node.node_id: "present"})
        remaining = len(BIG["weights.bin"]) - kept
        # Everything after the restart (the rest of the blob, plus a few small answers)
        # is within one chunk of what was missing: the pull resumed, it did not restart.
        assert remaining <= proxy.sent <= remaining + MIB
        model_dir = node.state_volume / "artifacts" / "models" / model["digest"][7:]
        assert (model_dir / "weights.bin").read_bytes() == BIG["weights.bin"]
    finally:
        node.close()
        proxy.close()


@SLOW
def test_a_stalled_download_is_detected_and_resumed(cp, tmp_path, sockets):
    import_model(cp, "stall", BIG, tmp_path)
    proxy = HoldingProxy(int(cp.url.rsplit(":", 1)[1]), hold_after=int(1.5 * MIB))
    node = online_node(through(cp, proxy), tmp_path, sockets, "models-st", model_stall_seconds="1")
    try:
        made = cp.admin("POST", f"{MODELS}/stall/replicas", json={"node_ids": [node.node_id]})
        assert made.status_code == 202, made.text
        # Every connection stalls after 1.5 MiB: each stall is cut and the pull resumes
        # where it was, until the blob is whole.
        wait_for_states(cp, "stall", {node.node_id: "present"}, timeout=120)
        assert node.agent.log().count("stalled at") >= 3
    finally:
        node.close()
        proxy.close()


@SLOW
def test_the_control_plane_restarted_mid_pull_and_the_pull_finishes(
    restartable_control_plane, tmp_path, sockets
):
    rcp = restartable_control_plane
    import_model(rcp.plane, "restart", BIG, tmp_path)
    proxy = HoldingProxy(rcp.port, hold_after=int(2.5 * MIB))
    node = online_node(through(rcp.plane, proxy), tmp_path, sockets, "models-r")
    try:
        made = rcp.plane.admin(
            "POST", f"{MODELS}/restart/replicas", json={"node_ids": [node.node_id]}
        )
        assert made.status_code == 202, made.text
        partial = partial_of(node, BIG["weights.bin"])
        wait_until(lambda: size_of(partial) >= 2 * MIB, timeout=60, what="2 MiB pulled")
        rcp.stop()  # the blob's connection goes with it, mid-answer
        proxy.hold_after = None
        rcp.start()
        wait_for_states(rcp.plane, "restart", {node.node_id: "present"}, timeout=120)
        model_dir = node.state_volume / "artifacts" / "models"
        [laid_out] = list(model_dir.iterdir())
        assert (laid_out / "weights.bin").read_bytes() == BIG["weights.bin"]
    finally:
        node.close()
        proxy.close()


@SLOW
def test_a_disk_filling_part_way_fails_disk_full_and_keeps_the_partial(cp, tmp_path, sockets):
    import shutil

    mount = tmp_path / "filling"
    mount.mkdir()
    if not mount_tmpfs(mount, "8m"):
        if os.environ.get("CI"):
            pytest.fail("CI must be able to mount a tmpfs (run the agent tests as root)")
        pytest.skip("needs root to mount a size-limited tmpfs")
    try:
        import_model(cp, "filling", BIG, tmp_path)
        proxy = HoldingProxy(int(cp.url.rsplit(":", 1)[1]), hold_after=int(1.5 * MIB))
        art = mount / "art"
        node = online_node(
            through(cp, proxy), tmp_path, sockets, "models-f", artifact_root=str(art)
        )
        try:
            made = cp.admin("POST", f"{MODELS}/filling/replicas", json={"node_ids": [node.node_id]})
            assert made.status_code == 202, made.text
            partial = art / "partial" / sha(BIG["weights.bin"])
            wait_until(lambda: size_of(partial) >= MIB, timeout=60, what="1 MiB pulled")
            # The preflight passed; now something else takes the space, and the pull goes on.
            filler = mount / "filler"
            with open(filler, "wb") as handle:
                handle.write(b"\0" * (shutil.disk_usage(mount).free - 256 * 1024))
            proxy.hold_after = None
            shown = wait_for_states(cp, "filling", {node.node_id: "failed"})
            assert shown[node.node_id]["error"]["code"] == DISK_FULL
            assert size_of(partial) >= MIB  # kept, for a resume once there is room
            assert not (art / "blobs" / "sha256" / sha(BIG["weights.bin"])).exists()
            assert list((art / "models").iterdir()) == []
        finally:
            node.close()
            proxy.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_an_unusable_artifact_root_stops_the_agent_with_exit_2(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    env = agent_env(
        control_plane_url="http://127.0.0.1:9",
        accelerator_mode="cpu",
        state_volume=tmp_path / "state",
        artifact_root=not_a_dir / "art",
    )
    done = run_agent(env)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "artifact root" in done.stderr and "MODELFORGE_AGENT_ARTIFACT_ROOT" in done.stderr


@SLOW
def test_two_models_sharing_a_blob_fetch_it_once(cp, tmp_path, sockets):
    import_model(cp, "one", BIG, tmp_path)
    import_model(cp, "two", {"weights.bin": BIG["weights.bin"], "other.json": b"[]"}, tmp_path)
    proxy = HoldingProxy(int(cp.url.rsplit(":", 1)[1]))
    node = online_node(through(cp, proxy), tmp_path, sockets, "models-sh")
    try:
        for name in ("one", "two"):
            made = cp.admin("POST", f"{MODELS}/{name}/replicas", json={"node_ids": [node.node_id]})
            assert made.status_code == 202, made.text
        for name in ("one", "two"):
            wait_for_states(cp, name, {node.node_id: "present"})
        assert proxy.sent < 2 * len(BIG["weights.bin"])
        dirs = list((node.state_volume / "artifacts" / "models").iterdir())
        inodes = {(d / "weights.bin").stat().st_ino for d in dirs}
        assert len(dirs) == 2 and len(inodes) == 1
    finally:
        node.close()
        proxy.close()
