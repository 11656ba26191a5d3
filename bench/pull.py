"""``modelforge models pull`` against a plain ``curl`` of the same file, side by side in one run.

    .venv/bin/python bench/pull.py [--size-mib 256] [--rounds 3]

The stand-in of the hub's file routes (tests/harness/hub_stand_in.py, the one the tests use)
serves one LFS file of incompressible bytes on 127.0.0.1. Each round times, from the same
stand-in:

- ``curl``: the file fetched from the stand-in's CDN into a file in a fresh directory, then
  fsync'ed (``curl -o`` then ``sync -f``): the floor of what moving the bytes costs;
- ``pull``: ``modelforge models pull`` in its own process into a fresh state directory,
  from the command to the model in the seed cache: the revision resolved, the free-space
  check, the download through huggingface_hub, the streaming sha256 check, fsync, the
  rename into the cache and the catalog's row.

It prints MB/s of each, the median of the rounds, and their ratio, and the sha256 ceiling
of one core, which bounds the pull on a slow CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _load import modelforge, modelforge_env  # noqa: E402

from tests.harness.hub_stand_in import HubStandIn  # noqa: E402

REPO = "bench-org/bench-model"
FILE = "model.safetensors"


def sha256_ceiling(data: bytes) -> float:
    began = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - began) / 1e6


def curl_once(url: str, size: int) -> float:
    with tempfile.TemporaryDirectory(prefix="modelforge-bench-curl-") as folder:
        target = Path(folder) / FILE
        began = time.perf_counter()
        subprocess.run(["curl", "-sSf", "-o", str(target), url], check=True)
        subprocess.run(["sync", "-f", str(target)], check=True)
        took = time.perf_counter() - began
        assert target.stat().st_size == size
    return size / took / 1e6


def pull_once(hub_url: str, size: int) -> float:
    state = tempfile.mkdtemp(prefix="modelforge-bench-pull-")
    try:
        env = modelforge_env(state, HF_ENDPOINT=hub_url)
        modelforge(env, "init")
        began = time.perf_counter()
        modelforge(env, "models", "pull", "bench", f"hf://{REPO}", "--json")
        took = time.perf_counter() - began
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return size / took / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("curl") is None:
        print("bench/pull.py needs curl on PATH", file=sys.stderr)
        return 2
    size = args.size_mib * 2**20
    data = os.urandom(size)
    with HubStandIn() as hub:
        repo = hub.add_repo(REPO, {FILE: data, "config.json": b'{"hidden_size": 8}'})
        url = f"{hub.cdn_url}/cdn/{repo.files[FILE].sha256}"
        curl, pull = [], []
        for _ in range(args.rounds):  # interleaved: both see the same machine
            curl.append(curl_once(url, size))
            pull.append(pull_once(hub.url, size))
    curl_mbs, pull_mbs = statistics.median(curl), statistics.median(pull)
    print(f"file: {args.size_mib} MiB, {args.rounds} rounds, median of each")
    print(f"curl -o + sync      {curl_mbs:8.1f} MB/s   ({', '.join(f'{v:.0f}' for v in curl)})")
    print(f"modelforge pull     {pull_mbs:8.1f} MB/s   ({', '.join(f'{v:.0f}' for v in pull)})")
    print(f"ratio pull / curl   {pull_mbs / curl_mbs:8.2f}")
    print(f"sha256, one core    {sha256_ceiling(data):8.1f} MB/s")
    print(f"load average        {os.getloadavg()[0]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
