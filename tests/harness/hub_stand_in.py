"""A stand-in of the Hugging Face Hub's file routes on 127.0.0.1, for ``models pull``.

No hub is reachable from the tests, so the real ``huggingface_hub`` client is pointed at
this one with ``HF_ENDPOINT``. It answers what that client asks for a pull, as the hub does
(huggingface_hub 2.4's ``hf_api.model_info``, ``file_download.get_hf_file_metadata`` and
``http_get``, and ``utils/_http.hf_raise_for_status`` for the refusals):

- ``GET /api/models/{org}/{repo}[/revision/{revision}]?blobs=True``: the commit (``sha``),
  ``gated``, ``private`` and ``siblings`` with ``rfilename``, ``size``, ``blobId`` (the git
  blob id) and, for an LFS file, ``lfs: {sha256, size, pointerSize}``.
- ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``: ``X-Repo-Commit``; a file kept in
  git is answered here with ``ETag: "<blob id>"``; an LFS file with a 302 to the stand-in's
  CDN (another port, so another origin) carrying ``X-Linked-Etag: "<sha256>"`` and
  ``X-Linked-Size``, as the hub's redirect to its CDN does.
- ``GET /cdn/{sha256}`` on the CDN port: the bytes, ``Accept-Ranges: bytes``, 206 with
  ``Content-Range`` for ``Range: bytes=N-``.
- Refusals with the hub's ``X-Error-Code``: ``RepoNotFound`` (404, or 401 for a private
  repository asked without its token), ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo`` (401 without a token, 403 with one that has no access); 429 with
  ``Retry-After`` while ``rate_limited``.

What the tests control and read: the bytes of every file body served (``served``, by file
path), every ``Authorization`` header each port saw, a body paused after N bytes until
released (``pause``), cut once after N bytes (``cut``), or served with bytes other than
listed (``corrupt``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

PIECE = 64 * 1024
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class RepoFile:
    data: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.data)

    @functools.cached_property
    def sha256(self) -> str:  # hashed once: a bench serves hundreds of MiB
        return hashlib.sha256(self.data).hexdigest()

    @functools.cached_property
    def git_oid(self) -> str:
        """The git blob id (what the hub's ETag is for a file kept in git)."""
        return hashlib.sha1(b"blob %d\0" % self.size + self.data, usedforsecurity=False).hexdigest()


@dataclass
class StandInRepo:
    repo_id: str
    files: dict[str, RepoFile]
    commit: str = field(default_factory=lambda: secrets.token_hex(20))
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    tokens: frozenset[str] = frozenset()  # the tokens that may read it
    listed_sizes: dict[str, int] = field(default_factory=dict)  # sizes listed, if not the real

    def resolve(self, revision: str) -> str | None:
        if revision == self.commit:
            return self.commit
        return self.refs.get(revision)


@dataclass
class Body:
    """One file body the stand-in began to send: from byte ``start``, ``sent`` bytes so far."""

    path: str
    start: int
    sent: int = 0


def safetensors_bytes(floats: int, seed: int = 7) -> bytes:
    """A small safetensors file: one F32 tensor of ``floats`` seeded values."""
    header = json.dumps(
        {"weight": {"dtype": "F32", "shape": [floats], "data_offsets": [0, 4 * floats]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    body = hashlib.shake_256(seed.to_bytes(8, "little")).digest(4 * floats)
    return struct.pack("<Q", len(header)) + header + body


class HubStandIn:
    """The hub's routes on one loopback port and its CDN's on another."""

    def __init__(self) -> None:
        self.repos: dict[str, StandInRepo] = {}
        self.lock = threading.Lock()
        self.served: Counter[str] = Counter()  # body bytes written, by file path
        self.bodies: list[Body] = []  # every body begun: its file, first byte, bytes written
        self.requests: list[tuple[str, str, str]] = []  # (port name, method, path)
        self.authorizations: dict[str, list[str | None]] = {"hub": [], "cdn": []}
        self.rate_limited = False
        self._pauses: dict[str, tuple[int, threading.Event]] = {}
        self._cuts: dict[str, int] = {}
        self._corrupt: set[str] = set()
        self.hub = self._server("hub")
        self.cdn = self._server("cdn")
        self.url = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in (self.hub, self.cdn)
        ]
        for thread in self._threads:
            thread.start()

    def _server(self, name: str) -> ThreadingHTTPServer:
        stand_in = self

        class Handler(_Handler):
            port_name = name
            hub = stand_in

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server

    # -- what the tests set up --------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        refs: dict[str, str] | None = None,
        gated: bool = False,
        private: bool = False,
        tokens: tuple[str, ...] = (),
        listed_sizes: dict[str, int] | None = None,
    ) -> StandInRepo:
        repo = StandInRepo(
            repo_id,
            {p: RepoFile(d, p.endswith(LFS_SUFFIXES)) for p, d in files.items()},
            gated=gated,
            private=private,
            tokens=frozenset(tokens),
            listed_sizes=dict(listed_sizes or {}),
        )
        repo.refs = {"main": repo.commit, **(refs or {})}
        self.repos[repo_id] = repo
        return repo

    def pause(self, path: str, after: int) -> threading.Event:
        """The next body of path stops after ``after`` bytes until the event is set."""
        release = threading.Event()
        self._pauses[path] = (after, release)
        return release

    def cut(self, path: str, after: int) -> None:
        """The next body of path is cut off (the connection closed) after ``after`` bytes."""
        self._cuts[path] = after

    def corrupt(self, path: str) -> None:
        """Serve path with one byte changed from what the listing says."""
        self._corrupt.add(path)

    def repair(self, path: str) -> None:
        """Serve path as listed again."""
        self._corrupt.discard(path)

    def tokens_seen(self) -> set[str]:
        return {a for values in self.authorizations.values() for a in values if a}

    def close(self) -> None:
        for _, release in self._pauses.values():
            release.set()
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by the handler ------------------------------------------------------------

    def by_sha256(self, hexdigest: str) -> tuple[str, RepoFile] | None:
        for repo in self.repos.values():
            for path, file in repo.files.items():
                if file.sha256 == hexdigest:
                    return path, file
        return None


_API = re.compile(r"/api/models/([^/]+/[^/]+?)(?:/revision/([^/?]+))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    port_name = "hub"
    hub: HubStandIn

    def log_message(self, format: str, *args: object) -> None:
        return None

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        path = urlsplit(self.path).path
        with self.hub.lock:
            self.hub.requests.append((self.port_name, self.command, path))
            self.hub.authorizations[self.port_name].append(self.headers.get("Authorization"))
        try:
            if self.port_name == "cdn":
                return self._cdn(path, head)
            if self.hub.rate_limited:
                return self._refuse(429, "RateLimited", extra={"Retry-After": "30"})
            api = _API.fullmatch(path)
            if api:
                return self._model_info(api.group(1), unquote(api.group(2) or "main"))
            resolve = _RESOLVE.fullmatch(path)
            if resolve:
                return self._resolve(resolve.group(1), unquote(resolve.group(2)),
                                     unquote(resolve.group(3)), head)  # fmt: skip
            return self._refuse(404, None)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _token(self) -> str | None:
        value = self.headers.get("Authorization") or ""
        return value.removeprefix("Bearer ") or None

    def _refuse(self, status: int, code: str | None, extra: dict | None = None) -> None:
        body = json.dumps({"error": code or "not found"}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str) -> StandInRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._refuse(401 if not self._token() else 404, "RepoNotFound")
            return None
        if repo.private and self._token() not in repo.tokens:
            self._refuse(401 if not self._token() else 404, "RepoNotFound")
            return None
        return repo

    def _model_info(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.resolve(revision)
        if commit is None:
            return self._refuse(404, "RevisionNotFound")
        siblings = []
        for path, file in sorted(repo.files.items()):
            size = repo.listed_sizes.get(path, file.size)
            sibling = {"rfilename": path, "size": size, "blobId": file.git_oid}
            if file.lfs:
                sibling["lfs"] = {"sha256": file.sha256, "size": size, "pointerSize": 134}
            siblings.append(sibling)
        info = {
            "_id": repo.commit[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "lastModified": "2025-12-01T00:00:00.000Z",
            "siblings": siblings,
        }
        body = json.dumps(info).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = repo.resolve(revision)
        if commit is None:
            return self._refuse(404, "RevisionNotFound")
        if repo.gated and self._token() not in repo.tokens:
            return self._refuse(403 if self._token() else 401, "GatedRepo")
        file = repo.files.get(path)
        if file is None:
            return self._refuse(404, "EntryNotFound", extra={"X-Repo-Commit": commit})
        if file.lfs:
            self.send_response(302)
            self.send_header("Location", f"{self.hub.cdn_url}/cdn/{file.sha256}?path={quote(path)}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header(
                "ETag", f'"{hashlib.sha1(file.sha256.encode(), usedforsecurity=False).hexdigest()}"'
            )
            self.send_header("X-Linked-Etag", f'"{file.sha256}"')
            self.send_header("X-Linked-Size", str(file.size))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._body(path, file, head, {"X-Repo-Commit": commit, "ETag": f'"{file.git_oid}"'})

    def _cdn(self, path: str, head: bool) -> None:
        found = self.hub.by_sha256(path.removeprefix("/cdn/"))
        if found is None:
            return self._refuse(404, None)
        self._body(found[0], found[1], head, {"ETag": f'"{found[1].sha256}"'})

    def _body(self, path: str, file: RepoFile, head: bool, headers: dict[str, str]) -> None:
        data = file.data
        if path in self.hub._corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = 0
        wanted = _RANGE.fullmatch(self.headers.get("Range") or "")
        if wanted and int(wanted.group(1)) >= len(data):
            return self._refuse(416, None, extra={"Content-Range": f"bytes */{len(data)}"})
        if wanted:
            start = int(wanted.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if head:
            return
        with self.hub.lock:
            pause = self.hub._pauses.pop(path, None)
            cut = self.hub._cuts.pop(path, None)
            body = Body(path, start)
            self.hub.bodies.append(body)
        offset = start
        while offset < len(data):
            piece = data[offset : offset + PIECE]
            if pause is not None and body.sent + len(piece) > pause[0]:
                piece = piece[: pause[0] - body.sent]
                self._write(body, piece)
                offset += len(piece)
                pause[1].wait(600)
                pause = None
                continue
            if cut is not None and body.sent + len(piece) >= cut:
                self._write(body, piece[: cut - body.sent])
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._write(body, piece)
            offset += len(piece)

    def _write(self, body: Body, piece: bytes) -> None:
        self.wfile.write(piece)
        self.wfile.flush()
        with self.hub.lock:
            self.hub.served[body.path] += len(piece)
            body.sent += len(piece)
