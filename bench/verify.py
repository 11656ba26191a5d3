"""``modelforge-release verify-sums`` against GNU ``sha256sum`` on the same file, same run.

    .venv/bin/python bench/verify.py [--size-mib 1024] [--flat-mib 256] [--runs 3]

Writes a file of real (non-sparse) bytes in a temporary directory, reads it once so the page
cache is warm for both tools, then times ``sha256sum FILE`` and ``modelforge-release
verify-sums`` on it, best of --runs each, interleaved. Prints MB/s for each, the ratio
(target >= 0.9) and each process's peak RSS; it repeats on a --flat-mib file to show that the
checker's memory does not grow with the file. Removes its files when done.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RELEASE = Path(sys.executable).with_name("modelforge-release")


@dataclass
class Run:
    seconds: float
    peak_rss_bytes: int


# Run in its own process: a child's peak RSS (ru_maxrss) starts from what its parent held when
# it spawned it, so the launcher itself must never hold the 64 MiB block.
WRITER = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
block = os.urandom(min(64 << 20, size))
view = memoryview(block)
with open(path, "wb") as file:
    left = size
    while left:
        left -= file.write(view[: min(left, len(block))])
    file.flush()
    os.fsync(file.fileno())
"""


def write_file(path: Path, size: int) -> None:
    """Real bytes on disk: one 64 MiB random block repeated (a sparse file would flatter reads)."""
    subprocess.run([sys.executable, "-c", WRITER, str(path), str(size)], check=True)


def own_peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(path: Path) -> None:
    with path.open("rb", buffering=0) as file:
        buffer = bytearray(1 << 20)
        while file.readinto(buffer):
            pass


def timed(command: list[str]) -> Run:
    """Wall time and the peak RSS of that one child (wait4, so no other child is counted)."""
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - began
    process.returncode = os.waitstatus_to_exitcode(status)
    errors = process.stderr.read()
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"{command[0]} exited {process.returncode}: {errors.decode()}")
    return Run(seconds, usage.ru_maxrss * 1024)  # ru_maxrss is KiB on Linux


def best(runs: list[Run]) -> Run:
    return Run(min(r.seconds for r in runs), max(r.peak_rss_bytes for r in runs))


def measure(directory: Path, size_mib: int, runs: int) -> tuple[Run, Run]:
    path = directory / f"bench-{size_mib}m.bin"
    sums = directory / f"SHA256SUMS-{size_mib}m"
    print(f"writing {size_mib} MiB to {path} …", flush=True)
    write_file(path, size_mib << 20)
    warm(path)
    # sha256sum writes the reference SHA256SUMS, so the check below is also a correctness one.
    line = subprocess.run(["sha256sum", path.name], cwd=directory, capture_output=True, check=True)
    sums.write_bytes(line.stdout)
    sha_runs, ours_runs = [], []
    for _ in range(runs):  # interleaved, so drift in the machine hits both alike
        sha_runs.append(timed(["sha256sum", str(path)]))
        ours_runs.append(timed([str(RELEASE), "verify-sums", "--quiet", "--sums", str(sums)]))
    path.unlink()
    return best(sha_runs), best(ours_runs)


def report(size_mib: int, sha: Run, ours: Run) -> float:
    size = size_mib << 20
    sha_rate, our_rate = size / sha.seconds / 1e6, size / ours.seconds / 1e6
    ratio = our_rate / sha_rate
    print(
        f"{size_mib:5d} MiB  sha256sum          {sha_rate:7.0f} MB/s  {sha.seconds:6.3f} s  "
        f"peak RSS {sha.peak_rss_bytes / 2**20:6.1f} MiB"
    )
    print(
        f"{size_mib:5d} MiB  verify-sums        {our_rate:7.0f} MB/s  {ours.seconds:6.3f} s  "
        f"peak RSS {ours.peak_rss_bytes / 2**20:6.1f} MiB"
    )
    print(f"{size_mib:5d} MiB  ratio verify-sums / sha256sum: {ratio:.2f} (target >= 0.9)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="the file measured for speed")
    parser.add_argument("--flat-mib", type=int, default=256, help="a smaller file, for memory")
    parser.add_argument("--runs", type=int, default=3, help="best of this many, each tool")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary files go")
    args = parser.parse_args()
    if not RELEASE.exists():
        raise SystemExit(f"{RELEASE} not found: pip install -e . in this virtualenv first")

    directory = Path(tempfile.mkdtemp(prefix="modelforge-bench-verify-", dir=args.dir))
    try:
        results = {
            size: measure(directory, size, args.runs) for size in (args.size_mib, args.flat_mib)
        }
    finally:
        shutil.rmtree(directory)
    print(
        f"best of {args.runs}, page cache warm; MB = 10^6 bytes; "
        f"{os.cpu_count()} CPUs, {shutil.which('sha256sum')}"
    )
    ratio = report(args.size_mib, *results[args.size_mib])
    report(args.flat_mib, *results[args.flat_mib])
    big, small = results[args.size_mib][1], results[args.flat_mib][1]
    print(
        f"verify-sums peak RSS: {big.peak_rss_bytes / 2**20:.1f} MiB at {args.size_mib} MiB, "
        f"{small.peak_rss_bytes / 2**20:.1f} MiB at {args.flat_mib} MiB "
        f"(difference {(big.peak_rss_bytes - small.peak_rss_bytes) / 2**20:+.1f} MiB); "
        f"this launcher's own peak, below which no child reads: "
        f"{own_peak_rss_bytes() / 2**20:.1f} MiB"
    )
    if ratio < 0.9:
        print("below the 0.9 target", file=sys.stderr)


if __name__ == "__main__":
    main()
