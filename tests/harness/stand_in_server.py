"""What the agent tests' small stand-in HTTP servers share."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


def answer_json(handler: BaseHTTPRequestHandler, status: int, raw: bytes) -> None:
    """Drain the request body, then answer status with a JSON body."""
    handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)
