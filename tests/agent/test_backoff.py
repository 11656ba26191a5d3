"""Backoff: 1 s, 2 s, 4 s, 8 s, 16 s, capped, with jitter below the step, reset on success."""

from __future__ import annotations

import logging
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from modelforge_node_agent.backoff import BACKOFF_STEPS, JITTER, Backoff
from modelforge_node_agent.client import ControlPlaneClient
from modelforge_node_agent.publisher import call_with_backoff
from tests.harness.control_plane import free_port
from tests.harness.stand_in_server import answer_json

LINE = re.compile(r"^(\S+) on POST /api/v1/agent/heartbeat \(backoff 1s…16s\): retry in (\d+)s")


def test_schedule_caps_at_16_seconds_and_jitter_only_shortens():
    backoff = Backoff(rng=random.Random(7))
    waits = [backoff.next_step() for _ in range(9)]
    assert [step for step, _ in waits] == [1, 2, 4, 8, 16, 16, 16, 16, 16]
    assert all(step * (1 - JITTER) <= wait <= step for step, wait in waits)
    assert len({round(wait, 6) for step, wait in waits if step == 16}) > 1, "no jitter"
    backoff.reset()
    assert backoff.next_step()[0] == 1


def recorded_waits(stop_after: int):
    waits: list[float] = []
    stop = threading.Event()

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) >= stop_after:
            stop.set()
        return stop.is_set()

    return waits, stop, wait


def test_real_schedule_against_a_closed_port_is_capped(caplog):
    """The real 1…16 s schedule, with the waits recorded instead of slept."""
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}", requests.Session())
    waits, stop, wait = recorded_waits(stop_after=8)
    with caplog.at_level(logging.WARNING):
        answer = call_with_backoff(
            client,
            "POST",
            "/api/v1/agent/heartbeat",
            dict,
            stop=stop,
            wait=wait,
            retry_refusal=lambda refusal: True,
        )
    assert answer is None
    lines = [LINE.match(record.getMessage()) for record in caplog.records]
    assert all(lines), [record.getMessage() for record in caplog.records]
    assert {match.group(1) for match in lines} == {"ConnectError"}
    assert [int(match.group(2)) for match in lines] == [1, 2, 4, 8, 16, 16, 16, 16]
    assert all(0 < w <= step for w, step in zip(waits, [1, 2, 4, 8, 16, 16, 16, 16], strict=True))
    assert list(BACKOFF_STEPS) == [1, 2, 4, 8, 16]


class Flaky(ThreadingHTTPServer):
    """Answers 503 or 200 from a list, in order."""

    daemon_threads = True

    def __init__(self, statuses):
        self.statuses = list(statuses)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 - the handler's self
                answer_json(handler, self.statuses.pop(0), b'{"compatibility": "COMPATIBLE"}')

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_backoff_resets_after_a_success(caplog):
    server = Flaky([503, 503, 503, 200, 503, 200])
    try:
        client = ControlPlaneClient(
            f"http://127.0.0.1:{server.server_address[1]}", requests.Session()
        )
        waits, stop, wait = recorded_waits(stop_after=100)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                assert call_with_backoff(
                    client,
                    "POST",
                    "/api/v1/agent/heartbeat",
                    dict,
                    stop=stop,
                    wait=wait,
                    retry_refusal=lambda refusal: refusal.transient,
                ) == {"compatibility": "COMPATIBLE"}
    finally:
        server.shutdown()
        server.server_close()
    steps = [re.search(r"retry in (\d+)s", r.getMessage()).group(1) for r in caplog.records]
    assert steps == ["1", "2", "4", "1"]
