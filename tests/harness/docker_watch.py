"""A pass-through in front of the real dockerd that inspects each container as it is asked
to start, before dockerd sees the start.

On a host without the NVIDIA container runtime dockerd creates a container with a GPU
device request but refuses to start it ('could not select device driver'), and the worker
then removes it at once: the only moment to read what dockerd holds for it is between the
two. Every byte goes through unchanged; only the start request waits for the inspection.
"""

from __future__ import annotations

import contextlib
import re
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

_START = re.compile(rb"POST /(?:v[0-9.]+/)?containers/([A-Za-z0-9_.-]+)/start[ ?]")


class DockerStartWatch:
    """``unix://<path>`` to give as DOCKER_HOST; ``started`` maps each container id (or
    name) asked to start to dockerd's inspection of it at that moment."""

    def __init__(self, docker_client: Any, upstream: str = "/var/run/docker.sock") -> None:
        self.docker_client, self.upstream = docker_client, upstream
        self.dir = Path(tempfile.mkdtemp(prefix="mfdw-", dir="/tmp"))
        self.path = self.dir / "docker.sock"
        self.started: dict[str, dict[str, Any]] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                # The client waits for each answer before it asks again, so a request
                # begins a read.
                found = _START.match(data) if requests else None
                if found:
                    container = found.group(1).decode()
                    self.started[container] = self.docker_client.api.inspect_container(container)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def device_requests(self) -> list:
        """The HostConfig.DeviceRequests of every container asked to start, in order."""
        return [seen["HostConfig"].get("DeviceRequests") for seen in self.started.values()]

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            self.dir.rmdir()
