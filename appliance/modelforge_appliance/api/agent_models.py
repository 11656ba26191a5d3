"""Agent model routes: what to hold, and the blobs (docs/architecture.md §10).

``GET /agent/models`` answers the caller's node its manifests and the digests to remove;
``GET /agent/blobs/sha256:<hex>`` serves one seed-cache blob, whole or one ``Range``,
through waitress's ``wsgi.file_wrapper`` after a seek (its fast path; waitress sends no
more than the Content-Length). A blob no replica on the caller's node lists is 403
BLOB_NOT_ASSIGNED whether or not the cache holds it.
"""

from __future__ import annotations

import io
import os
import re

import bottle

from modelforge_contract import COMPATIBLE
from modelforge_contract.models import (
    BLOB_NOT_ASSIGNED,
    HEX_RE,
    PATH_AGENT_BLOB,
    PATH_AGENT_MODELS,
    RANGE_NOT_SATISFIABLE,
)

from ..core.errors import ApiError, Forbidden, NotFound
from ..models import cache, replicas
from ..web.auth import AGENT, NO_BODY, AgentCall
from ..web.http import ApiContext, error_response, json_response

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for one ``Range`` header, None for the whole file (no
    header, a malformed or a multi-range one: RFC 9110 lets a server ignore it); raises
    416 RANGE_NOT_SATISFIABLE when it lies outside the file."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or (not match.group(1) and not match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:  # bytes=-n: the last n bytes
        count = _position(last)
        if count == 0 or size == 0:
            raise _unsatisfiable(size)
        return max(0, size - count), size - 1
    start = _position(first)
    asked_end = _position(last) if last else None
    if asked_end is not None and asked_end < start:
        return None  # invalid: ignored
    end = size - 1 if asked_end is None else min(asked_end, size - 1)
    if start >= size:
        raise _unsatisfiable(size)
    return start, end


# Past any file's size; a longer number is read as this, not parsed (CPython refuses to turn
# more than 4,300 digits into an int, and a Range header may hold any number of them).
_BEYOND_ANY_FILE = 1 << 64


def _position(digits: str) -> int:
    """A byte position or count of a Range header, at most _BEYOND_ANY_FILE."""
    significant = digits.lstrip("0")
    return int(significant or "0") if len(significant) < 20 else _BEYOND_ANY_FILE


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(
        f"the range lies outside the blob's {size} bytes",
        code=RANGE_NOT_SATISFIABLE,
        status=416,
        next_step="Discard the partial file and fetch the blob from its start.",
        extra={"size": size, "compatibility": COMPATIBLE},
    )


def add_routes(app: bottle.Bottle, context: ApiContext) -> None:
    store, metrics, state_dir = context.store, context.metrics, context.settings.state_dir

    @app.get(PATH_AGENT_MODELS, auth=AGENT, body=NO_BODY)
    def desired(agent: AgentCall):
        answer = replicas.desired_for(store, agent.caller.node_id)
        return json_response({**answer, "compatibility": COMPATIBLE})

    @app.get(PATH_AGENT_BLOB, auth=AGENT, body=NO_BODY)
    def blob(digest: str, agent: AgentCall):
        hexdigest = digest[len("sha256:") :] if digest.startswith("sha256:") else ""
        if not HEX_RE.fullmatch(hexdigest):
            raise NotFound(f"{digest[:80]!r} is not a blob digest (sha256:<64 hex digits>)")
        if not replicas.blob_assigned(store, agent.caller.node_id, hexdigest):
            raise Forbidden(
                f"no model asked of this node lists blob sha256:{hexdigest}",
                code=BLOB_NOT_ASSIGNED,
                next_step="Fetch GET /agent/models again; only its manifests' blobs are served.",
            )
        path = cache.blob_file(state_dir, hexdigest)
        try:
            handle = ServedFile(path, metrics.blob_bytes_served)
        except FileNotFoundError:
            raise cache.CacheInvalid(f"the seed cache has lost blob sha256:{hexdigest}") from None
        size = os.fstat(handle.fileno()).st_size
        try:
            wanted = byte_range(bottle.request.environ.get("HTTP_RANGE"), size)
        except ApiError as refusal:
            handle.close()
            response = error_response(refusal)
            response.set_header("Content-Range", f"bytes */{size}")
            return response
        start, end = wanted if wanted is not None else (0, size - 1)
        length = max(0, end - start + 1)
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
            "Accept-Ranges": "bytes",
            "ETag": f'"sha256:{hexdigest}"',
            "Cache-Control": "no-store",
        }
        if wanted is not None:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        handle.seek(start)
        handle.start = start
        # bottle hands a file to wsgi.file_wrapper; waitress then sends Content-Length
        # bytes from the file's position with sendfile-like buffers (never all in memory).
        environ = bottle.request.environ
        body = handle if "wsgi.file_wrapper" in environ else _limited(handle, length)
        return bottle.HTTPResponse(body, status=206 if wanted else 200, headers=headers)


class ServedFile(io.BufferedReader):
    """A cache blob being sent: on close (the server closes it once sent, or when the client
    went away) it counts the bytes read past ``start``, so the bytes-served metric says what
    left, not what was asked for. A real file, so waitress keeps its file_wrapper path."""

    def __init__(self, path, counter) -> None:
        super().__init__(io.FileIO(path, "rb"), buffer_size=CHUNK_READ)
        self.counter, self.start = counter, 0

    def close(self) -> None:
        if not self.closed:
            self.counter.inc(max(0, self.tell() - self.start))
        super().close()


CHUNK_READ = 1 << 20


def _limited(handle, length: int):
    """The range in chunks, for a server without wsgi.file_wrapper."""
    try:
        while length > 0:
            chunk = handle.read(min(cache.CHUNK, length))
            if not chunk:
                return
            length -= len(chunk)
            yield chunk
    finally:
        handle.close()
