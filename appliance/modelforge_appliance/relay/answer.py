"""A client request's answer from a node, on the relay's event loop (docs/architecture.md §12).

``Relay`` owns the loop: a thread of the control-plane process running asyncio, on which
every relayed stream waits for its head and carries its body, so no stream holds a thread.
Connections the one-port front hands over are served on it (``runtime/client_loop.py``);
a request that reached waitress instead waits on the loop from its thread
(``answer_blocking``).

In order, a request:

1. takes a place in flight (``shares.Shares``): past the relay's, its key's or its
   deployment's bound, 503 STREAM_LIMIT naming the bound;
2. waits for a slot on its node's tunnel, in turn with other keys;
3. opens its stream and waits for the runtime's head, at most the head deadline
   (MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS, slot wait included: 504 HEAD_TIMEOUT). A server
   lost before the head gets the request once more, on another running server of the
   deployment, so the client sees one answer; without another, 502 NODE_LINK_LOST;
4. carries the body: SSE events as they come with a ``: keepalive`` comment on a quiet
   stream, any other body cut after MODELFORGE_RELAY_IDLE_TIMEOUT_SECONDS without a byte.
   After the head, an SSE stream ends with an ``error`` event and its terminator, never a
   hang. The stream is closed (and reset on the node) however it ends, its client gone
   included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from modelforge_contract import relay as rel

from ..core.errors import ApiError
from ..identity import credentials
from ..store.database import Store
from . import routing
from .hub import (
    BodyIdle,
    Head,
    HeadTimeout,
    Hub,
    LinkLost,
    Stream,
    StreamLimit,
    StreamReset,
    may_fail_over,
)
from .limits import FLUSH_SECONDS, UsageBook
from .routing import Target
from .shares import Refused, Shares, Ticket

log = logging.getLogger(__name__)

KEEPALIVE = rel.SSE_KEEPALIVE
# How often the live tunnels' credentials are looked at again: a revoked credential or a
# decommissioned node (by the API, the CLI or a restore) loses its tunnel within this.
REVALIDATE_SECONDS = 1.0
# Store calls of the loop's requests (a failover's pick) run on these threads.
STORE_THREADS = 4


@dataclass(frozen=True)
class Request:
    """What the client route decided: where, what, and whose."""

    target: Target
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    key: str


@dataclass
class Answer:
    """The runtime's answer as the client gets it: the allow-listed headers (with the one
    Content-Length of a sized body), and the body as it arrives."""

    status: int
    headers: list[tuple[str, str]]
    sse: bool
    chunks: AsyncIterator[bytes]


def _link_lost() -> ApiError:
    return ApiError(
        "the node serving this request lost its link to the control plane",
        code=rel.NODE_LINK_LOST,
        status=502,
        next_step="Send the request again; another running server takes it if there is one.",
    )


def _refusal(failure: Exception, head_timeout: float) -> ApiError:
    """What the client gets for a stream that failed before its head."""
    if isinstance(failure, HeadTimeout):
        return ApiError(
            f"the runtime did not begin its answer within {head_timeout:g} s",
            code=rel.HEAD_TIMEOUT,
            status=504,
            next_step="Send it again later, or with a smaller request; "
            "MODELFORGE_RELAY_HEAD_TIMEOUT_SECONDS sets the deadline.",
        )
    if isinstance(failure, StreamReset) and failure.code == rel.BODY_ENCODED:
        return ApiError(
            "the runtime compressed its answer, and the relay passes only what it can scrub "
            "of the node's paths",
            code=rel.BODY_ENCODED,
            status=502,
            next_step="Remove the deployment's argument that turns compression on "
            "(`modelforge deployments set NAME --arg …` or `--no-args`).",
        )
    if isinstance(failure, StreamReset):
        return ApiError(
            f"the node refused the request ({failure.code})",
            code=rel.NODE_LINK_LOST,
            status=502,
            next_step="Send it again; check the server with `modelforge deployments show`.",
        )
    return _link_lost()


def stream_limit(message: str) -> ApiError:
    return ApiError(
        f"the relay is at a bound: {message}",
        code=rel.STREAM_LIMIT,
        status=503,
        next_step="Send it again shortly; docs/configuration.md says how to size the relay's "
        "bounds.",
        extra={"retry_after_seconds": 1},
    )


def _code(failure: Exception) -> str:
    if isinstance(failure, StreamReset):
        return failure.code
    if isinstance(failure, HeadTimeout):
        return rel.HEAD_TIMEOUT
    if isinstance(failure, BodyIdle):
        return rel.BODY_IDLE_TIMEOUT
    return rel.NODE_LINK_LOST


def _error_event(code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}})
    return f"event: error\ndata: {body}\n\ndata: [DONE]\n\n".encode()


USAGE_BODY_MAX_BYTES = 4 * 1024 * 1024  # a JSON answer this large is parsed for its usage


def _usage_of(value: object) -> tuple[int, int] | None:
    usage = value.get("usage") if isinstance(value, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0
    completion = (
        completion if isinstance(completion, int) and not isinstance(completion, bool) else 0
    )
    return max(prompt, 0), max(completion, 0)


class Usage:
    """The tokens a relayed answer reports: the ``usage`` of a JSON body, or of the SSE
    event that carries one (the agent forwards whole events, so a chunk holds whole ones)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.body = bytearray()
        self.found: tuple[int, int] | None = None

    def see(self, chunk: bytes) -> None:
        if self.sse:
            if b'"usage"' not in chunk:
                return
            for line in chunk.replace(b"\r", b"\n").split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    try:
                        found = _usage_of(json.loads(line[6:]))
                    except ValueError:
                        continue
                    self.found = found or self.found
        elif len(self.body) + len(chunk) <= USAGE_BODY_MAX_BYTES:
            self.body += chunk

    def tokens(self) -> tuple[int, int] | None:
        if not self.sse and self.body:
            try:
                return _usage_of(json.loads(self.body))
            except ValueError:
                return None
        return self.found


class Relay:
    """The relay's event loop and what runs on it: shares, heads, bodies."""

    def __init__(
        self,
        store: Store,
        hub: Hub,
        metrics: Any,
        shares: Shares,
        head_timeout: float,
        idle_timeout: float,
        usage: UsageBook | None = None,
    ) -> None:
        self.store, self.hub, self.metrics, self.shares = store, hub, metrics, shares
        self.usage = usage or UsageBook(store)
        self.head_timeout, self.idle_timeout = head_timeout, idle_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.store_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Lock()

    # -- the loop -----------------------------------------------------------------------

    def start(self) -> asyncio.AbstractEventLoop:
        """The running loop (started on first use, on a thread of its own)."""
        with self._started:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                self.store_threads = concurrent.futures.ThreadPoolExecutor(
                    STORE_THREADS, thread_name_prefix="relay-store"
                )
                loop.set_default_executor(self.store_threads)
                ready = threading.Event()
                loop.call_soon(ready.set)
                loop.call_soon(lambda: loop.create_task(self._revalidate()))
                loop.call_soon(lambda: loop.create_task(self._flush_usage()))
                self._thread = threading.Thread(
                    target=loop.run_forever, name="relay-loop", daemon=True
                )
                self._thread.start()
                ready.wait()
                self.loop = loop
            return self.loop

    def stop(self) -> None:
        with self._started:
            loop, thread, self.loop, self._thread = self.loop, self._thread, None, None
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):  # each task's own cleanup runs first
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
        if self.store_threads is not None:
            self.store_threads.shutdown(wait=False, cancel_futures=True)
        try:  # what the keys used since the last flush
            self.usage.flush()
        except Exception as exc:
            log.warning("could not write the API keys' usage: %s", type(exc).__name__)

    async def _flush_usage(self) -> None:
        """Write the keys' usage every FLUSH_SECONDS (never once per request)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            try:
                await loop.run_in_executor(None, self.usage.flush)
            except Exception as exc:  # kept in memory; written next time
                log.warning("could not write the API keys' usage: %s", type(exc).__name__)

    async def _revalidate(self) -> None:
        """Close, at once, each tunnel whose credential was revoked or whose node was
        decommissioned since it opened: its streams end (one before its head goes to
        another server), and the agent's next tunnel is refused."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(REVALIDATE_SECONDS)
            live = self.hub.tunnels_by_credential()
            if not live:
                continue
            try:
                valid = await loop.run_in_executor(
                    None, credentials.still_valid, self.store, list(live)
                )
            except Exception as exc:  # the store is away: looked at again next time
                log.warning("could not look at the tunnels' credentials: %s", type(exc).__name__)
                continue
            for credential_id, tunnel in live.items():
                if credential_id not in valid:
                    self.hub.going(
                        tunnel, "CREDENTIAL_REVOKED", "its credential is no longer valid"
                    )

    # -- a request, on the loop ---------------------------------------------------------

    async def answer(self, request: Request) -> Answer:
        """The runtime's head and a body to iterate (which must be iterated to its end or
        closed: that ends the stream and gives its place back). ApiError before the head."""
        try:
            ticket = self.shares.admit(request.key, request.target.deployment)
        except Refused as refused:
            self.metrics.relay_errors.labels(request.target.deployment, rel.STREAM_LIMIT).inc()
            raise stream_limit(str(refused)) from None
        try:
            target, stream, head = await self._answered(request, ticket)
        except BaseException:
            self.shares.leave(ticket)
            self.usage.add(request.key, request.target.deployment, error=True)
            raise
        sse = any(
            n.lower() == "content-type" and v.startswith("text/event-stream")
            for n, v in head.headers
        )
        # Only the allow-listed headers: a node is not trusted with the client's browser or
        # with a proxy in front (Set-Cookie, CORS, Location, X-Accel-Redirect never pass).
        headers = list(rel.client_headers(head.headers))
        # A whole body's one length (the agent sets it after scrubbing) frames the answer
        # without chunking; the body is held to it, so a node cannot frame two answers in one.
        length = rel.single_content_length(head.headers)
        if not sse and length is not None:
            headers.append(("Content-Length", str(length)))
        chunks = self._body(stream, sse, target.deployment, ticket, request.key, head.status)
        return Answer(head.status, headers, sse, chunks)

    async def _answered(self, request: Request, ticket: Ticket) -> tuple[Target, Stream, Head]:
        """The stream that got the runtime's head, and its server (failover: once)."""
        deadline = time.monotonic() + self.head_timeout
        target, tried, counted = request.target, [], False
        while True:
            failure: Exception
            if not self.shares.take_slot(ticket, target.node_id) and not await self.shares.slot(
                ticket, target.node_id, deadline - time.monotonic()
            ):
                self.metrics.relay_errors.labels(target.deployment, rel.HEAD_TIMEOUT).inc()
                raise _refusal(HeadTimeout(), self.head_timeout)
            try:
                stream = self.hub.open(
                    target.node_id,
                    target.server_id,
                    "POST",
                    request.path,
                    request.headers,
                    request.body,
                )
            except StreamLimit:  # the shares keep below it: only if set lower than them
                self.shares.release(ticket)
                self.metrics.relay_errors.labels(target.deployment, rel.STREAM_LIMIT).inc()
                raise stream_limit("the streams a node's tunnel carries") from None
            else:
                failure = LinkLost()
            if stream is not None:
                if not counted:
                    self.metrics.relay_requests.labels(target.deployment).inc()
                    counted = True
                stream.watch()
                try:
                    head = await stream.head_of(max(deadline - time.monotonic(), 0.0))
                    return target, stream, head
                except (LinkLost, StreamReset) as failed:
                    stream.close()
                    failure = failed
                except BaseException:  # the client went away meanwhile
                    stream.close()
                    raise
            self.shares.release(ticket)
            tried.append(target.server_id)
            again = None
            if len(tried) == 1 and may_fail_over(failure):
                again = await self._other_server(target, tried)
            if again is None:
                if stream is None and isinstance(failure, LinkLost):
                    raise routing.unreachable(target.deployment)
                self.metrics.relay_errors.labels(target.deployment, _code(failure)).inc()
                raise _refusal(failure, self.head_timeout) from None
            log.info("deployment %s: server %s lost before its answer began (%s); sent once "
                     "more, to server %s", target.deployment, target.server_id,
                     _code(failure), again.server_id)  # fmt: skip
            self.metrics.relay_failovers.labels(target.deployment).inc()
            target = again

    async def _other_server(self, target: Target, tried: list[str]) -> Target | None:
        def pick() -> Target | None:
            try:
                return routing.pick(self.store, self.hub, target.deployment, exclude=tried)
            except ApiError:  # none other runs, or none is reachable now
                return None

        return await asyncio.get_running_loop().run_in_executor(None, pick)

    async def _body(
        self, stream: Stream, sse: bool, deployment: str, ticket: Ticket, key: str, status: int
    ) -> AsyncIterator[bytes]:
        """The relayed body; the stream is closed (and reset on the node) however it ends,
        and the key's usage counted (the runtime's own token counts)."""
        started = time.monotonic()
        usage = Usage(sse)
        counted = False

        def count(whole: bool) -> None:
            nonlocal counted
            if counted:
                return
            counted = True
            tokens = usage.tokens() or (0, 0)
            self.metrics.relay_tokens.labels(deployment, "prompt").inc(tokens[0])
            self.metrics.relay_tokens.labels(deployment, "completion").inc(tokens[1])
            self.usage.add(key, deployment, prompt=tokens[0], completion=tokens[1],
                           error=not whole or status >= 400)  # fmt: skip

        # A sized body's last piece is held until the body is whole and counted: its client
        # knows it has the answer once the last byte arrives, and a key's next request must
        # see these tokens. An event stream ends only with its terminator, sent after this.
        held = b""
        try:
            async for chunk in stream.body_of(
                KEEPALIVE if sse else None, None if sse else self.idle_timeout
            ):
                usage.see(chunk)
                if sse:
                    yield chunk
                    continue
                if held:
                    yield held
                held = chunk
            count(whole=True)
            if held:
                yield held
        except (LinkLost, StreamReset, BodyIdle) as failure:
            self.metrics.relay_errors.labels(deployment, _code(failure)).inc()
            count(whole=False)
            if sse:
                yield _error_event(_code(failure), "the node serving this stream stopped")
            elif held:  # a sized body cut short: the client sees fewer bytes than it said
                yield held
        finally:
            stream.close()
            self.shares.leave(ticket)
            self.metrics.relay_seconds.labels(deployment).observe(time.monotonic() - started)
            count(whole=False)

    # -- a request on a waitress thread -------------------------------------------------

    def answer_blocking(self, request: Request) -> tuple[Answer, Iterator[bytes]]:
        """``answer`` for a request that reached waitress (a connection the front could not
        hand over): its thread waits on the loop; the body comes piece by piece, each asked
        for once waitress took the one before."""
        loop = self.start()
        answer = asyncio.run_coroutine_threadsafe(self.answer(request), loop).result()

        def pieces() -> Iterator[bytes]:
            try:
                while True:
                    try:
                        yield asyncio.run_coroutine_threadsafe(
                            anext_of(answer.chunks), loop
                        ).result()
                    except StopAsyncIteration:
                        return
            finally:
                asyncio.run_coroutine_threadsafe(answer.chunks.aclose(), loop).result()

        return answer, pieces()


async def _cancel_all() -> None:
    """Cancel every other task of the running loop, and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def anext_of(chunks: AsyncIterator[bytes]) -> bytes:
    return await chunks.__anext__()
