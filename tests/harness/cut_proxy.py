"""A TCP proxy on 127.0.0.1 that can cut every connection through it at once, as a NAT
rebinding or a proxy restart would: the tunnel's TCP connection dies, both ends live."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class CutProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.cuts = 0
        self.accepted = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.closed:  # accepted as it closed
                client.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def cut(self) -> int:
        """Kill every connection through the proxy at once; how many."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self.cuts += 1
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # A pump thread blocked in recv() holds the socket open past close(): shut it
                # down first, so both ends see the connection die now, not at a timeout.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
        return len(pairs)

    def close(self) -> None:
        """Cut every connection and take no new one. A thread blocked in accept() keeps a
        closed listener listening on Linux (a client reconnecting would get through): shut it
        down first, which ends the accept()."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.cut()
