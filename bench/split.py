"""One model across nodes (issue 38), side by side in one run: tokens/s alone, split in two
directly over loopback (llama.cpp's own RPC cost), and split in two and in three through
the product (a real control plane, real agents and workers, the links over the tunnels).

    .venv/bin/python bench/split.py [--tokens N] [--runs N] [--layers N] [--llama-server PATH]

The model is generated (tests/harness/tiny_gguf.py with larger dimensions: about 270 MB of
f32 at the defaults) so that each token costs real compute. Every figure is llama-server's
own decode rate (``timings.predicted_per_second``), the median of ``--runs`` greedy
completions of ``--tokens`` tokens after one warm-up. The tunnel hop's cost per round trip
is the per-token time split in two through the tunnels less split in two directly (one
helper: one round trip per token).

Everything shares this machine's cores: on 2 cores three llama.cpp processes compete, so
a split in three is slower here for want of cores, not of network. The load average is
printed with the results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _load import free_port, llama_server_binary, wait_until_serving  # noqa: E402

from tests.harness.agent_process import wait_until  # noqa: E402
from tests.harness.control_plane import make_settings, serve  # noqa: E402
from tests.harness.llama import GREEDY, LlamaServer  # noqa: E402
from tests.harness.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.harness.work_node import short_dir, start_node  # noqa: E402

PROMPT = "the model serves tokens on every node"
LARGER = {"n_embd": 1024, "n_ff": 2816, "n_head": 16, "n_head_kv": 4}


TEXTS: dict[str, str] = {}  # each case's greedy text: one process's, every way


def decode_rate(
    label: str, url: str, tokens: int, runs: int, headers: dict[str, str] | None = None
) -> float:
    """llama-server's own decode tokens/s, the median of ``runs`` after one warm-up."""
    body = {"model": "big", "prompt": PROMPT, "max_tokens": tokens, **GREEDY}
    rates = []
    for attempt in range(runs + 1):
        answer = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
        answer.raise_for_status()
        TEXTS[label] = answer.json()["choices"][0]["text"]
        if attempt:  # the first one warms up
            rates.append(float(answer.json()["timings"]["predicted_per_second"]))
    return statistics.median(rates)


def rpc_server(binary: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen(
        [str(binary.parent / "ggml-rpc-server"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until_serving(port, process)
    return process, port


def direct(binary: Path, model: Path, work: Path, layers: int, args: argparse.Namespace) -> dict:
    """Alone, and split in two over loopback without the product (as worker/llama_cpp does)."""
    found: dict[str, float] = {}
    with LlamaServer(binary, model, work / "alone.log", alias="big", context_length=512) as one:
        one.wait_healthy()
        found["alone"] = decode_rate("alone", one.base_url, args.tokens, args.runs)
    helper, port = rpc_server(binary)
    try:
        kept = layers // 2
        split = (
            "--rpc", f"127.0.0.1:{port}", "--n-gpu-layers", str(layers + 1 - kept),
            "--tensor-split", "1", "--override-tensor", r"^output\.weight$=CPU",
            "--cache-ram", "0",
        )  # fmt: skip
        with LlamaServer(
            binary, model, work / "split.log", alias="big", context_length=512, args=split
        ) as two:
            two.wait_healthy()
            label = "split in two, loopback"
            found[label] = decode_rate(label, two.base_url, args.tokens, args.runs)
    finally:
        helper.kill()
        helper.wait()
    return found


def through_the_product(binary: Path, model: Path, work: Path, args: argparse.Namespace) -> dict:
    """A real control plane and three real nodes: split in two, then in three."""
    from modelforge_appliance.identity.api_keys import create_api_key

    found: dict[str, float] = {}
    settings = make_settings(work / "cp", heartbeat_interval_seconds=1, serve_lease_seconds=10)
    with serve(settings) as cp, short_dir() as sockets:
        nodes = [
            start_node(
                cp,
                work / name,
                sockets,
                name,
                worker_settings={"MODELFORGE_WORKER_LLAMA_SERVER": str(binary)},
            )
            for name in ("main", "helper-1", "helper-2")
        ]
        try:
            for node in nodes:
                wait_until(lambda n=node: _ready(cp, n), timeout=120, what="a node ready")
            source = work / "import"
            source.mkdir()
            os.link(model, source / model.name)
            made = cp.admin(
                "POST",
                "/api/v1/admin/models",
                json={"name": "big", "source": {"path": str(source)}},
            )
            made.raise_for_status()
            replicated = cp.admin(
                "POST", "/api/v1/admin/models/big/replicas", json={"node_ids": [nodes[0].node_id]}
            )
            replicated.raise_for_status()
            wait_until(lambda: _present(cp), timeout=600, what="the model on the main node")
            _, key = create_api_key(cp.store, "bench", "bench")
            auth = {"Authorization": f"Bearer {key}"}
            for members, label in ((nodes[:2], "split in two, tunnels"),
                                   (nodes, "split in three, tunnels")):  # fmt: skip
                split = [n.node_id for n in members]
                body = {"name": "big", "model": "big", "runtime": "llama.cpp",
                        "node_ids": split[:1], "settings": {"split": split, "context_length": 512}}  # fmt: skip
                cp.admin("POST", "/api/v1/admin/deployments", json=body).raise_for_status()
                wait_until(lambda: _running(cp), timeout=600, what=f"{label} running")
                hub = cp.server.app.hub
                before = dict(hub.link_frames), dict(hub.link_bytes)
                found[label] = decode_rate(label, cp.url, args.tokens, args.runs, auth)
                tokens = args.tokens * (args.runs + 1)
                out = hub.link_frames["to_helpers"] - before[0]["to_helpers"]
                back = hub.link_frames["from_helpers"] - before[0]["from_helpers"]
                sent = hub.link_bytes["to_helpers"] - before[1]["to_helpers"]
                print(f"{label}: per token, {out / tokens:.1f} frames out ({sent / tokens / 1024:.1f}"
                      f" KiB) and {back / tokens:.1f} back over the links", flush=True)  # fmt: skip
                cp.admin("DELETE", "/api/v1/admin/deployments/big").raise_for_status()
                wait_until(lambda: _gone(cp), timeout=120, what="undeployed")
        finally:
            for node in nodes:
                node.close()
    return found


def _ready(cp, node) -> bool:
    if not (node.state_volume / "identity.json").exists():
        return False
    answer = cp.admin("GET", f"/api/v1/admin/hardware/nodes/{node.node_id}/readiness")
    return answer.status_code == 200 and bool(answer.json().get("ready"))


def _present(cp) -> bool:
    listed = cp.admin("GET", "/api/v1/admin/models/big/replicas").json()["replicas"]
    return bool(listed) and all(r["state"] == "present" for r in listed)


def _running(cp) -> bool:
    shown = cp.admin("GET", "/api/v1/admin/deployments/big")
    return shown.status_code == 200 and shown.json()["state"] == "running"


def _gone(cp) -> bool:
    return cp.admin("GET", "/api/v1/admin/deployments/big").status_code == 404


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--runs", type=int, default=3, help="completions measured per case")
    parser.add_argument("--layers", type=int, default=6, help="layers of the generated model")
    parser.add_argument("--llama-server", help="default: scripts/llama-server-build's")
    args = parser.parse_args()
    binary = llama_server_binary(args.llama_server)
    with tempfile.TemporaryDirectory(prefix="mf-split-") as tmp:
        work = Path(tmp)
        began = time.monotonic()
        model = write_tiny_gguf(work / "big.gguf", n_layer=args.layers, **LARGER)
        size = model.stat().st_size
        print(f"model: {args.layers} layers, {size / 1e6:.0f} MB, written in "
              f"{time.monotonic() - began:.1f} s", flush=True)  # fmt: skip
        found = direct(binary, model, work, args.layers, args)
        found.update(through_the_product(binary, model, work, args))
    alone = found["alone"]
    print(f"\n{'case':28} {'tokens/s':>9} {'ms/token':>9} {'vs alone':>9}")
    for label, rate in found.items():
        print(f"{label:28} {rate:9.1f} {1000 / rate:9.1f} {rate / alone:9.2f}")
    loopback, tunnels = found["split in two, loopback"], found["split in two, tunnels"]
    print(f"\nthe tunnels' cost per token, one helper: {1000 / tunnels - 1000 / loopback:+.1f} ms "
          f"(split in two through the tunnels less over loopback)")  # fmt: skip
    same = len(set(TEXTS.values())) == 1
    print(f"greedy text of every case the same as alone: {'yes' if same else 'NO'}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
