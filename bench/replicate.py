"""One model to 1, 2 and 4 real node agents through ``modelforge serve``, side by side with
a bare nginx ``sendfile`` copy of the same file to as many readers, in the same run.

    .venv/bin/python bench/replicate.py [--size-mib 1024] [--agents 1,2,4] [--no-kill]

Prints, per fan-out, MB/s per node for the replication (request to verified presence: the
transfer, the agent's streaming sha256, fsync, rename and the hard-linked model directory)
and for the nginx copy (the same bytes to disk with fsync, no hash), their ratio, the
control plane's peak RSS while it serves, and the sha256 ceiling of one core. Then one
agent is killed with SIGKILL at half way and restarted: the bytes the control plane served
beyond the model's size are what the resume fetched again. Goal: >= 0.8 of the nginx copy,
flat RSS, 0 bytes fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _load import free_port, modelforge, modelforge_env, start_modelforge, wait_until_serving

CHUNK = 1 << 20
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "NVIDIA_"))}


def make_model(path: Path, size: int) -> None:
    """Incompressible bytes, written once (the page cache then holds them for every run)."""
    with open(path, "wb") as handle:
        left = size
        while left:
            part = os.urandom(min(CHUNK * 8, left))
            handle.write(part)
            left -= len(part)


def sha256_ceiling(path: Path) -> float:
    """MB/s of one core hashing the file from the page cache."""
    digest, began = hashlib.sha256(), time.perf_counter()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return path.stat().st_size / (time.perf_counter() - began) / 1e6


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssWatch(threading.Thread):
    """The peak RSS of a process, sampled every 0.1 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.peak = max(self.peak, rss_of(self.pid))


def download(port: int, path: str, out: Path, headers: dict[str, str] | None = None) -> None:
    """GET to a file in 1 MiB reads, then fsync: what a copy to disk costs, nothing more."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", path, headers=headers or {})
    answer = connection.getresponse()
    if answer.status != 200:
        raise SystemExit(f"GET {path}: {answer.status} {answer.read()[:200]!r}")
    with open(out, "wb") as handle:
        while block := answer.read(CHUNK):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    connection.close()


def nginx_copy(model: Path, readers: int, scratch: Path) -> float:
    """MB/s per reader of ``readers`` parallel copies from nginx (sendfile on)."""
    port = free_port()
    root = scratch / "nginx"
    root.mkdir(exist_ok=True)
    (root / "model.bin").unlink(missing_ok=True)
    os.link(model, root / "model.bin")
    conf = root / "nginx.conf"
    conf.write_text(
        f"daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;\n"
        # As root the workers would drop to nobody, who cannot read the bench's 0700 dir.
        + ("user root;\n" if os.geteuid() == 0 else "")
        + "events { worker_connections 64; }\n"
        + f"http {{ access_log off; sendfile on; tcp_nopush on; client_body_temp_path {root};\n"
        f"  proxy_temp_path {root}; fastcgi_temp_path {root}; uwsgi_temp_path {root};\n"
        f"  scgi_temp_path {root};\n"
        f"  server {{ listen 127.0.0.1:{port}; root {root}; }} }}\n"
    )
    server = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(root)])
    try:
        wait_until_serving(port, server)
        outs = [scratch / f"copy-{i}" for i in range(readers)]
        failures: list[BaseException] = []

        def copy(out: Path) -> None:
            try:
                download(port, "/model.bin", out)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the main thread
                failures.append(exc)

        threads = [threading.Thread(target=copy, args=(out,)) for out in outs]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        took = time.perf_counter() - began
        if failures:
            raise SystemExit(f"the nginx copy failed: {failures[0]!r} ({root}/error.log)")
        for out in outs:
            out.unlink()
        return model.stat().st_size / took / 1e6
    finally:
        server.send_signal(signal.SIGQUIT)
        server.wait(timeout=10)


class Admin:
    def __init__(self, port: int, token: str) -> None:
        self.port, self.headers = port, {"X-ModelForge-Admin-Token": token}

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = json.dumps(body).encode() if body is not None else None
        headers = {**self.headers, **({"Content-Type": "application/json"} if data else {})}
        connection.request(method, path, body=data, headers=headers)
        answer = connection.getresponse()
        raw = answer.read()
        connection.close()
        if answer.status >= 400:
            raise SystemExit(f"{method} {path}: {answer.status} {raw[:300]!r}")
        return json.loads(raw) if raw else {}

    def metric(self, name: str) -> float:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        connection.request("GET", "/metrics", headers=self.headers)
        text = connection.getresponse().read().decode()
        connection.close()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


class Fleet:
    """Real node agents (cpu mode, no worker needed to hold models) on one control plane."""

    def __init__(self, admin: Admin, url: str, root: Path, log) -> None:
        self.admin, self.url, self.root, self.log = admin, url, root, log
        self.agents: dict[str, subprocess.Popen] = {}
        self.envs: dict[str, dict[str, str]] = {}

    def start(self, name: str) -> None:
        if name not in self.envs:
            token = self.admin.call(
                "POST",
                "/api/v1/admin/node-enrollments",
                {"display_name": name, "expires_in_seconds": 900},
            )["token"]
            self.envs[name] = {
                **clean_env(),
                "MODELFORGE_AGENT_CONTROL_PLANE_URL": self.url,
                "MODELFORGE_AGENT_ENROLLMENT_TOKEN": token,
                "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu",
                "MODELFORGE_AGENT_STATE_VOLUME": str(self.root / name),
                "MODELFORGE_AGENT_HOSTNAME": name,
                "MODELFORGE_AGENT_WORKER_SOCKET": str(self.root / f"{name}-none.sock"),
                "MODELFORGE_AGENT_LOG_LEVEL": "WARNING",
            }
        self.agents[name] = subprocess.Popen(
            [sys.executable, "-m", "modelforge_node_agent.main"],
            env=self.envs[name],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def node_ids(self, names: list[str]) -> list[str]:
        deadline = time.monotonic() + 120
        while True:
            nodes = self.admin.call("GET", "/api/v1/admin/hardware/nodes")["nodes"]
            online = {n["display_name"]: n["node_id"] for n in nodes if n["liveness"] == "online"}
            if all(name in online for name in names):
                return [online[name] for name in names]
            if time.monotonic() > deadline:
                raise SystemExit(f"nodes {names} did not come online")
            time.sleep(0.2)

    def stop(self) -> None:
        for process in self.agents.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.agents.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def replicas(admin: Admin, model: str) -> list[dict]:
    return admin.call("GET", f"/api/v1/admin/models/{model}/replicas")["replicas"]


def wait_present(
    admin: Admin, model: str, node_ids: list[str], on_poll=None
) -> tuple[dict[str, float], dict[str, float]]:
    """When each node's replica was first seen downloading and when present (by this
    process's clock, polled every 50 ms; an agent reports a state change at once)."""
    present: dict[str, float] = {}
    started: dict[str, float] = {}
    deadline = time.monotonic() + 1800
    while len(present) < len(node_ids):
        now = time.perf_counter()
        for replica in replicas(admin, model):
            if replica["node_id"] not in node_ids:
                continue
            if replica["state"] == "failed":
                raise SystemExit(f"replica on {replica['node_id']} failed: {replica['error']}")
            if replica["state"] in ("downloading", "present"):
                started.setdefault(replica["node_id"], now)
            if replica["state"] == "present":
                present.setdefault(replica["node_id"], now)
            elif on_poll is not None:
                on_poll(replica)
        if time.monotonic() > deadline:
            raise SystemExit("replication did not finish in 30 min")
        time.sleep(0.05)
    return started, present


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--agents", default="1,2,4", help="fan-outs to measure, e.g. 1,2,4")
    parser.add_argument("--no-kill", action="store_true", help="skip the kill -9 resume run")
    args = parser.parse_args()
    fanouts = [int(part) for part in args.agents.split(",")]

    scratch = Path(tempfile.mkdtemp(prefix="mfb-replicate-", dir="/var/tmp"))
    state = scratch / "control-plane"
    # Agents hear of a replica through their next heartbeat's models_generation: a 2 s
    # interval keeps the wait short (it is reported, not counted in the transfer).
    env = modelforge_env(
        str(state),
        MODELFORGE_HEARTBEAT_INTERVAL_SECONDS="2",
        MODELFORGE_NODE_STALE_AFTER_SECONDS="6",
        MODELFORGE_NODE_OFFLINE_AFTER_SECONDS="12",
    )
    log = open(scratch / "processes.log", "ab")  # noqa: SIM115 - closed in finally
    size = args.size_mib * CHUNK
    model = scratch / "model.bin"
    make_model(model, size)
    server = fleet = None
    try:
        ceiling = sha256_ceiling(model)
        admin_token = json.loads(modelforge(env, "init", "--json"))["admin_token"]
        began = time.perf_counter()
        modelforge(env, "models", "import", "bench", str(model), "--json")
        imported = size / (time.perf_counter() - began) / 1e6
        port, server = start_modelforge(env, stdout=log, stderr=subprocess.STDOUT)
        wait_until_serving(port, server)
        admin = Admin(port, admin_token)
        fleet = Fleet(admin, f"http://127.0.0.1:{port}", scratch / "agents", log)
        print(
            f"model {args.size_mib} MiB; sha256 on one core {ceiling:,.0f} MB/s; "
            f"import (hash + copy into the cache) {imported:,.0f} MB/s",
            flush=True,
        )
        rows = []
        for fanout in fanouts:
            reference = nginx_copy(model, fanout, scratch)
            names = [f"n{fanout}-{i}" for i in range(fanout)]
            for name in names:
                fleet.start(name)
            node_ids = fleet.node_ids(names)
            watch = RssWatch(server.pid)
            idle_rss = rss_of(server.pid)
            watch.start()
            asked = time.perf_counter()
            admin.call("POST", "/api/v1/admin/models/bench/replicas", {"node_ids": node_ids})
            started, present = wait_present(admin, "bench", node_ids)
            watch.done.set()
            watch.join()
            # The transfer: first seen downloading to verified and laid out, per node.
            speeds = [size / (present[n] - started[n]) / 1e6 for n in node_ids]
            slowest = min(speeds)
            noticed = max(started.values()) - asked
            rows.append((fanout, slowest, reference, idle_rss, watch.peak, noticed))
            print(
                f"{fanout} agent(s): {slowest:,.0f} MB/s per node (slowest; all "
                f"{', '.join(f'{s:,.0f}' for s in sorted(speeds))}; the last began "
                f"{noticed:.1f} s after the request); nginx copy "
                f"{reference:,.0f} MB/s per reader; ratio {slowest / reference:.2f}; "
                f"control plane RSS {idle_rss / 2**20:.0f} -> {watch.peak / 2**20:.0f} MiB",
                flush=True,
            )
            for node_id in node_ids:  # free the disk before the next fan-out
                admin.call("DELETE", f"/api/v1/admin/models/bench/replicas/{node_id}")
        refetched = None
        if not args.no_kill:
            fleet.start("killed")
            (node_id,) = fleet.node_ids(["killed"])
            served_before = admin.metric("modelforge_blob_bytes_served_total")
            admin.call("POST", "/api/v1/admin/models/bench/replicas", {"node_ids": [node_id]})
            half = {"done": False}

            def kill_at_half(replica: dict) -> None:
                mine = replica["node_id"] == node_id and not half["done"]
                if mine and replica.get("bytes_done", 0) >= size // 2:
                    half["done"] = True
                    fleet.agents["killed"].kill()
                    fleet.agents["killed"].wait()
                    fleet.start("killed")

            wait_present(admin, "bench", [node_id], on_poll=kill_at_half)
            refetched = admin.metric("modelforge_blob_bytes_served_total") - served_before - size
            print(
                f"kill -9 at {'half way' if half['done'] else 'never (finished first)'}: "
                f"{refetched:,.0f} bytes fetched again ({refetched / CHUNK:.2f} MiB)",
                flush=True,
            )
        print()
        print(
            "| agents | MB/s per node | nginx copy MB/s per reader | ratio | "
            "request → last node downloading | CP RSS idle → peak |"
        )
        print("|---|---|---|---|---|---|")
        for fanout, speed, reference, idle, peak, noticed in rows:
            print(
                f"| {fanout} | {speed:,.0f} | {reference:,.0f} | {speed / reference:.2f} | "
                f"{noticed:.1f} s | {idle / 2**20:.0f} → {peak / 2**20:.0f} MiB |"
            )
    finally:
        if fleet is not None:
            fleet.stop()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=10)
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
