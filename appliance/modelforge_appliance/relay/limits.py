"""API keys' limits and what each key used (docs/clients.md, "Keys with limits").

- **Scope**: a key limited to some deployments gets 403 API_KEY_SCOPE for any other
  ``model``.
- **Requests per minute**: a sliding minute per key, in this process's memory; past it 429
  RATE_LIMITED with Retry-After (when the oldest request of the minute leaves it).
- **Tokens per day** (prompt + completion, as the runtime reported them, UTC days): once a
  key's tokens of the day reach its limit, 429 QUOTA_EXCEEDED until midnight UTC. A request
  is held to what finished before it began, so requests in flight together overshoot the
  limit by at most their own tokens.

``UsageBook`` counts requests, tokens and errors per key, deployment and UTC day in memory
and writes them in batches (``flush``, every few seconds and when the control plane stops):
no store write per request. A key's tokens of the day are read from the store once, then
kept up to date in memory, so the limit survives a restart.
"""

from __future__ import annotations

import collections
import datetime
import math
import threading
from typing import Any

import peewee as pw

from modelforge_contract import API_KEY_SCOPE, QUOTA_EXCEEDED, RATE_LIMITED

from ..core.errors import ApiError
from ..identity.api_keys import ApiKeyCaller
from ..store.database import Store
from ..store.tables import ApiKey, UsageDay

MINUTE = 60.0
FLUSH_SECONDS = 5.0
USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "errors")
BY = ("key", "user", "deployment", "day")


def day_of(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).date().isoformat()


def seconds_to_midnight(now: float) -> int:
    """Whole seconds until the next UTC day begins (at least 1)."""
    return max(1, math.ceil(86400 - now % 86400))


class UsageBook:
    """Requests, tokens and errors per (day, key, deployment), batched to the store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        self._writing: dict[tuple[str, str, str], list[int]] = {}  # the batch being written
        self._today: dict[str, tuple[str, int]] = {}  # key -> (day, its tokens that day)
        self._flush_lock = threading.Lock()

    def add(
        self,
        key_id: str,
        deployment: str,
        *,
        prompt: int = 0,
        completion: int = 0,
        error: bool = False,
    ) -> None:
        """One request of ``key_id`` to ``deployment``, now."""
        day = day_of(self.store.clock.now())
        with self._lock:
            counts = self._pending.setdefault((day, key_id, deployment), [0, 0, 0, 0])
            counts[0] += 1
            counts[1] += prompt
            counts[2] += completion
            counts[3] += int(error)
            known = self._today.get(key_id)
            if known is not None and known[0] == day:
                self._today[key_id] = (day, known[1] + prompt + completion)

    def tokens_today(self, key_id: str) -> int:
        """The key's prompt and completion tokens of this UTC day, written or not."""
        day = day_of(self.store.clock.now())
        with self._lock:
            known = self._today.get(key_id)
            if known is not None and known[0] == day:
                return known[1]
        with self._flush_lock:  # no batch half-written while the store is read
            with self.store.connection():
                stored = (
                    UsageDay.select(
                        pw.fn.COALESCE(
                            pw.fn.SUM(UsageDay.prompt_tokens + UsageDay.completion_tokens), 0
                        )
                    )
                    .where((UsageDay.day == day) & (UsageDay.key_id == key_id))
                    .scalar()
                )
            with self._lock:
                pending = sum(
                    c[1] + c[2]
                    for (d, k, _), c in self._pending.items()
                    if d == day and k == key_id
                )
                tokens = int(stored or 0) + pending
                self._today[key_id] = (day, tokens)
                return tokens

    def flush(self) -> None:
        """Write what was counted since the last flush (added to the stored counts)."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
                self._today = {k: v for k, v in self._today.items() if v[0] == day_of(
                    self.store.clock.now())}  # fmt: skip
            if not batch:
                return
            try:
                with self.store.write():
                    for (day, key_id, deployment), counts in batch.items():
                        values = dict(zip(USAGE_FIELDS, counts, strict=True))
                        UsageDay.insert(
                            day=day, key_id=key_id, deployment=deployment, **values
                        ).on_conflict(
                            conflict_target=[UsageDay.day, UsageDay.key_id, UsageDay.deployment],
                            update={
                                getattr(UsageDay, f): getattr(UsageDay, f) + values[f]
                                for f in USAGE_FIELDS
                            },
                        ).execute()
            except Exception:
                with self._lock:  # kept for the next flush
                    for where, counts in batch.items():
                        mine = self._pending.setdefault(where, [0, 0, 0, 0])
                        for index, value in enumerate(counts):
                            mine[index] += value
                raise


class Limits:
    """Each API key held to its scope, its requests per minute and its tokens per day."""

    def __init__(self, store: Store, book: UsageBook) -> None:
        self.store, self.book = store, book
        self._lock = threading.Lock()
        self._minute: dict[str, collections.deque[float]] = {}

    def admit(self, key: ApiKeyCaller, deployment: str) -> None:
        """Refuse the request (ApiError) when the key may not make it now; else count it."""
        if not key.may_call(deployment):
            allowed = ", ".join(sorted(key.deployments or ()))
            raise ApiError(
                f"this API key may call only: {allowed}",
                code=API_KEY_SCOPE,
                status=403,
                next_step="Send one of those as `model`, or ask an administrator for a key "
                "that may call this deployment.",
                extra={"deployments": sorted(key.deployments or ())},
            )
        now = self.store.clock.now()
        if key.tokens_per_day is not None:
            used = self.book.tokens_today(key.key_id)
            if used >= key.tokens_per_day:
                raise ApiError(
                    f"this API key used {used} of its {key.tokens_per_day} tokens of today (UTC)",
                    code=QUOTA_EXCEEDED,
                    status=429,
                    next_step="Wait for the next UTC day (Retry-After), or ask an "
                    "administrator for a larger limit.",
                    extra={
                        "retry_after_seconds": seconds_to_midnight(now),
                        "limit": key.tokens_per_day,
                        "used": used,
                    },
                )
        if key.rpm is not None:
            with self._lock:
                window = self._minute.setdefault(key.key_id, collections.deque())
                while window and window[0] <= now - MINUTE:
                    window.popleft()
                if len(window) >= key.rpm:
                    wait = max(1, math.ceil(window[0] + MINUTE - now))
                    raise ApiError(
                        f"this API key may make {key.rpm} requests a minute",
                        code=RATE_LIMITED,
                        status=429,
                        next_step="Send it again after the time Retry-After gives.",
                        extra={"retry_after_seconds": wait, "limit": key.rpm},
                    )
                window.append(now)


def usage_report(store: Store, by: str, since: str | None) -> list[dict[str, Any]]:
    """Usage summed by key (with its name), user (the keys' owner), deployment or day, from
    ``since`` (a UTC date,
    YYYY-MM-DD) on; flush the book first for counts to the second."""
    column = {
        "key": UsageDay.key_id,
        "user": ApiKey.owner,
        "deployment": UsageDay.deployment,
        "day": UsageDay.day,
    }[by]
    sums = [pw.fn.SUM(getattr(UsageDay, f)).alias(f) for f in USAGE_FIELDS]
    query = UsageDay.select(column.alias("group"), *sums)
    if by == "user":  # the key's owner; a key no longer in the store counts for nobody
        query = query.join(ApiKey, on=(ApiKey.key_id == UsageDay.key_id))
    query = query.group_by(column).order_by(column)
    if since is not None:
        query = query.where(UsageDay.day >= since)
    with store.connection():
        rows = list(query.dicts())
        names = {}
        if by == "key":
            keys = [row["group"] for row in rows]
            names = dict(
                ApiKey.select(ApiKey.key_id, ApiKey.name).where(ApiKey.key_id.in_(keys)).tuples()
            )
    out = []
    for row in rows:
        entry: dict[str, Any] = {"key_id" if by == "key" else by: row["group"]}
        if by == "key":
            entry["name"] = names.get(row["group"])
        entry.update({f: int(row[f] or 0) for f in USAGE_FIELDS})
        out.append(entry)
    return out
