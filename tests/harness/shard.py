"""A pytest plugin: with MF_TEST_SHARD=K/N, keep only the test files of shard K of N.

scripts/test runs the quick part as N runs side by side (scripts/lib/pythons.sh). A file
stays whole in one shard, so its module fixtures are made once; files go round the shards
in the order of their paths, so each run gets a share of every folder.
"""

from __future__ import annotations

import os

SHARD_ENV = "MF_TEST_SHARD"


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' as (K, N), 1 <= K <= N; ValueError naming the variable otherwise."""
    index, _, count = text.partition("/")
    try:
        k, n = int(index), int(count)
    except ValueError:
        raise ValueError(f"{SHARD_ENV}={text!r} must be K/N, as 1/2") from None
    if not 1 <= k <= n:
        raise ValueError(f"{SHARD_ENV}={text!r} must be K/N with 1 <= K <= N")
    return k, n


def shard_of(files: list[str], k: int, n: int) -> set[str]:
    """The files of shard K of N: every N-th one of the sorted paths, from the K-th."""
    return set(sorted(set(files))[k - 1 :: n])


def pytest_collection_modifyitems(config, items) -> None:
    text = os.environ.get(SHARD_ENV, "1/1")
    k, n = parse_shard(text)
    if n == 1:
        return
    mine = shard_of([item.nodeid.split("::")[0] for item in items], k, n)
    kept = [item for item in items if item.nodeid.split("::")[0] in mine]
    left = [item for item in items if item.nodeid.split("::")[0] not in mine]
    if left:
        config.hook.pytest_deselected(items=left)
    items[:] = kept
