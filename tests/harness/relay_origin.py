"""A stdlib stand-in for a model runtime on 127.0.0.1, scripted by the test, for the relay
tests of the fast suite (the slow suite relays to the real llama-server).

``POST /v1/chat/completions`` (and the other relayed routes) answer with the script the
test set: an SSE stream whose chunks are released one at a time by ``release()``, so a
test can see an event arrive before the next is even written, or a JSON body. The origin
records each request's body and whether its client went away mid-answer.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    # An agent opens a connection per stream: dozens at once (the default backlog, 5,
    # resets some of them).
    request_queue_size = 1024


class Origin:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.json_body: bytes | None = None
        self.content_type = "text/event-stream"
        self.extra_headers: list[tuple[str, str]] = []  # sent with every answer
        self.gated = False
        self._gate: queue.Queue[None] = queue.Queue()
        self.requests: list[dict[str, Any]] = []
        self.client_gone = threading.Event()
        self.finished = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                origin.requests.append(
                    {"path": self.path, "body": body, "headers": dict(self.headers.items())}
                )
                if origin.json_body is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(origin.json_body)))
                    for name, value in origin.extra_headers:
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(origin.json_body)
                    origin.finished.set()
                    return
                self.send_response(200)
                self.send_header("Content-Type", origin.content_type)
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                for name, value in origin.extra_headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.flush()
                try:
                    for chunk in origin.chunks:
                        if origin.gated:
                            origin._gate.get()
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError:
                    origin.client_gone.set()
                    return
                finally:
                    origin.finished.set()
                self.close_connection = True

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def release(self, count: int = 1) -> None:
        """Let ``count`` more chunks be written (a gated script)."""
        for _ in range(count):
            self._gate.put(None)

    def sse(self, events: list[dict[str, Any]], terminator: bytes = b"\n\n") -> bytes:
        """The SSE bytes of ``events`` (as llama.cpp writes them) and a final [DONE]."""
        parts = [b"data: " + json.dumps(e).encode() + terminator for e in events]
        return b"".join([*parts, b"data: [DONE]" + terminator])

    def close(self) -> None:
        while not self._gate.empty():
            self._gate.get_nowait()
        for _ in range(len(self.chunks) + 1):
            self._gate.put(None)
        self.server.shutdown()
        self.server.server_close()
