"""A split model's link on the agent (agent/links.py), between a real local socket and the
tunnel's frames: credit both ways, credit granted back in steps, a stall ended only while
a request is in flight, and a helper that closes first counted as lost."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from modelforge_contract import tunnel as wire
from modelforge_node_agent.links import GRANT_BYTES, POLL_SECONDS, LinkPump
from tests.harness.agent_process import wait_until


class Tunnel:
    """Stands in for the tunnel's send: the frames the link sent, in order."""

    def __init__(self) -> None:
        self.frames: list[wire.Frame] = []
        self.lock = threading.Lock()

    def send(self, frame: wire.Frame) -> bool:
        with self.lock:
            self.frames.append(frame)
        return True

    def of(self, kind: wire.FrameType) -> list[wire.Frame]:
        with self.lock:
            return [f for f in self.frames if f.type == kind]


@pytest.fixture
def link():
    here, there = socket.socketpair()
    tunnel = Tunnel()
    state = {"lost": 0, "busy": True, "finished": 0}

    def lost() -> None:
        state["lost"] += 1

    def finished(_pump) -> None:
        state["finished"] += 1

    pump = LinkPump(wire.LINK_STREAM_BIT | 1, here, tunnel.send, finished, 0.2,
                    busy=lambda: state["busy"], lost=lost)  # fmt: skip
    pump.start()
    yield pump, there, tunnel, state
    pump.close(tell=False)
    there.close()


def test_bytes_go_both_ways_within_credit_and_credit_returns_in_quarter_window_steps(link):
    pump, local, tunnel, _ = link
    local.sendall(b"hello")
    wait_until(lambda: tunnel.of(wire.DATA), timeout=10, what="DATA")
    assert tunnel.of(wire.DATA)[0].payload == b"hello"
    # What the other side sends reaches the local socket; credit goes back per GRANT_BYTES.
    chunk = b"x" * 65536
    for _ in range(GRANT_BYTES // len(chunk)):
        pump.on_data(chunk)
    got = b""
    while len(got) < GRANT_BYTES:
        got += local.recv(1 << 20)
    wait_until(lambda: tunnel.of(wire.WINDOW), timeout=10, what="a WINDOW")
    [window] = tunnel.of(wire.WINDOW)
    assert wire.window_of(window) == GRANT_BYTES
    # More credit than the link ever sent is the other side breaking the contract.
    with pytest.raises(wire.FrameError):
        pump.on_window(wire.WINDOW_BYTES)


def test_a_stall_ends_the_link_only_while_a_request_is_in_flight(link):
    pump, local, tunnel, state = link
    state["busy"] = False
    local.sendall(b"a question")  # no answer comes, but nobody is waiting on one
    wait_until(lambda: tunnel.of(wire.DATA), timeout=10, what="DATA")
    assert not pump.closed and not tunnel.of(wire.RESET)
    state["busy"] = True  # a client request of its server is in flight now
    wait_until(lambda: tunnel.of(wire.RESET), timeout=10, what="the stall's RESET")
    [reset] = tunnel.of(wire.RESET)
    assert wire.json_of(reset)["code"] == "LINK_STALLED"
    assert pump.closed and state["lost"] == 1
    assert local.recv(16) == b""  # llama-server's end is closed: it stops waiting


def test_a_helper_closing_first_is_lost_and_llama_server_closing_first_is_not(link):
    pump, local, tunnel, state = link
    pump.on_end()  # the helper's side closed while llama-server still holds this one
    assert state["lost"] == 1
    assert local.recv(16) == b""  # told: its read ends

    here, there = socket.socketpair()
    calm = {"lost": 0}
    quiet = LinkPump(
        12, here, tunnel.send, lambda _p: None, lost=lambda: calm.__setitem__("lost", 1)
    )
    quiet.start()
    there.shutdown(socket.SHUT_WR)  # llama-server is done with this connection
    wait_until(lambda: any(f.stream_id == 12 for f in tunnel.of(wire.END)), timeout=10, what="END")
    quiet.on_end()  # and then the helper closes its side: both ways over, cleanly
    wait_until(lambda: quiet.closed, timeout=10, what="the link forgotten")
    assert calm["lost"] == 0
    there.close()


def test_a_local_side_slow_to_read_keeps_its_link_and_gets_every_byte_in_order(link):
    pump, local, _, _ = link
    data = bytes(range(256)) * 4096  # 1 MiB: more than the socket pair holds
    for at in range(0, len(data), 65536):
        pump.on_data(data[at : at + 65536])
    time.sleep(4 * POLL_SECONDS)  # the runtime is busy and does not read for a while
    got = b""
    while len(got) < len(data) and (chunk := local.recv(1 << 20)):
        got += chunk
    assert got == data and not pump.closed
