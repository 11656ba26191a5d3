"""The tunnel's framing: every frame type round trips, a byte stream is read the same however
it is chunked, every broken frame is a FrameError with its reason, and random bytes never
raise anything else nor make a reader hold more than one frame."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelforge_contract import relay, tunnel
from modelforge_contract.tunnel import (
    DATA,
    END,
    FLAG_END_STREAM,
    HEAD,
    HEADER_SIZE,
    LINK_STREAM_BIT,
    MAX_FRAME,
    MAX_JSON_PAYLOAD,
    MAX_PAYLOAD,
    OPEN,
    PING,
    PONG,
    RESET,
    RESUME,
    WINDOW,
    Frame,
    FrameError,
    FrameReader,
    FrameType,
    data_frame,
    data_frames,
    decode,
    encode,
    end_frame,
    going_away_frame,
    head_frame,
    json_of,
    link_frame,
    open_frame,
    ping_frame,
    pong_frame,
    reset_frame,
    resume_frame,
    window_frame,
    window_of,
)

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

HEADERS = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]


def every_kind_of_frame() -> list[Frame]:
    return [
        open_frame(1, "srv-1", "POST", "/v1/chat/completions", HEADERS),
        open_frame(2, "srv-1", "POST", "/v1/embeddings", [], resume_from=4096, end_stream=True),
        head_frame(1, 200, [("Content-Type", "text/event-stream")]),
        head_frame(3, 204, [], end_stream=True),
        data_frame(1, b'data: {"x": 1}\r\n\r\n'),
        data_frame(1, b"", end_stream=True),
        data_frame(7, bytes(range(256)) * 1024, end_stream=True),  # MAX_PAYLOAD exactly
        window_frame(1, 65536),
        window_frame(2**32 - 1, 2**32 - 1),
        end_frame(5),
        reset_frame(1, relay.STREAM_CANCELLED, "the client went away"),
        reset_frame(0, relay.TUNNEL_CLOSING, "shutting down"),
        going_away_frame(),  # an agent that stops says so (the spec's "Going away")
        ping_frame(b"12345678"),
        pong_frame(ping_frame(b"\x00" * 8)),
        resume_frame({1: 0, 9: 123456789}),
        resume_frame({}),
        link_frame(LINK_STREAM_BIT | 1, "srv-main", "srv-helper"),  # a main server dials
        link_frame(12, "srv-helper"),  # the control plane, to the helper's agent
    ]


def header(type_: int, stream_id: int, length: int, flags: int = 0, reserved: int = 0) -> bytes:
    return struct.pack(">BBHII", type_, flags, reserved, stream_id, length)


# -- the header and round trips ----------------------------------------------------------


def test_the_header_is_twelve_bytes_big_endian_then_the_payload():
    raw = encode(data_frame(0x01020304, b"hello", end_stream=True))
    assert raw == bytes([3, 1, 0, 0, 1, 2, 3, 4, 0, 0, 0, 5]) + b"hello"
    assert HEADER_SIZE == 12 and MAX_FRAME == 12 + MAX_PAYLOAD == 12 + 256 * 1024
    assert tunnel.WINDOW_BYTES == 1024 * 1024 and MAX_JSON_PAYLOAD == 64 * 1024
    assert tunnel.MAX_STREAMS_PER_TUNNEL == 64


def test_the_type_numbers_are_the_documented_ones():
    # The numbers are the wire: changing one breaks every agent in the field.
    assert {t.name: int(t) for t in FrameType} == {
        "OPEN": 1,
        "HEAD": 2,
        "DATA": 3,
        "WINDOW": 4,
        "END": 5,
        "RESET": 6,
        "PING": 7,
        "PONG": 8,
        "RESUME": 9,
        "LINK": 10,
    }
    assert FLAG_END_STREAM == 1


@pytest.mark.parametrize("frame", every_kind_of_frame(), ids=lambda f: f.type.name)
def test_every_frame_type_round_trips(frame):
    again = decode(encode(frame))
    assert again == frame and again.type is frame.type
    assert FrameReader().feed(encode(frame)) == [frame]


def test_the_json_payloads_read_back_as_built():
    opened = json_of(open_frame(1, "srv-1", "POST", "/v1/completions", HEADERS, resume_from=7))
    assert opened == {
        "server_id": "srv-1",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [["Content-Type", "application/json"], ["Accept", "text/event-stream"]],
        "resume_from": 7,
    }
    assert "resume_from" not in json_of(open_frame(1, "s", "POST", "/v1/embeddings", []))
    assert json_of(head_frame(2, 503, [("Retry-After", "1")])) == {
        "status": 503,
        "headers": [["Retry-After", "1"]],
    }
    assert json_of(reset_frame(3, "NODE_LINK_LOST", "gone")) == {
        "code": "NODE_LINK_LOST",
        "message": "gone",
    }
    going = going_away_frame()
    assert (going.type, going.stream_id) == (RESET, 0)
    assert json_of(going) == {"code": "TUNNEL_CLOSING", "message": "the node agent is stopping"}
    assert json_of(resume_frame({4: 10, 2: 0})) == {
        "streams": [{"stream_id": 2, "delivered": 0}, {"stream_id": 4, "delivered": 10}]
    }


def test_the_small_helpers():
    assert window_of(window_frame(9, 1024)) == 1024
    assert pong_frame(ping_frame(b"abcdefgh")) == Frame(PONG, 0, b"abcdefgh")
    assert data_frame(1, b"x", end_stream=True).end_stream
    assert not data_frame(1, b"x").end_stream
    long = reset_frame(1, "RUNTIME_UNREACHABLE", "x" * 5000)
    assert len(json_of(long)["message"]) == tunnel.RESET_MESSAGE_MAX_CHARS
    # A payload may come as any bytes-like object; the frame keeps bytes.
    assert Frame(DATA, 1, bytearray(b"ab")).payload == b"ab"
    # Unknown keys are kept, so a later release can add some.
    extra = Frame(HEAD, 1, b'{"status":200,"headers":[],"trailers":true}')
    assert json_of(extra)["trailers"] is True


def test_data_frames_splits_a_long_body_with_end_stream_on_the_last():
    body = bytes(range(256)) * 4096  # 1 MiB
    frames = data_frames(5, body + b"tail", end_stream=True)
    assert [len(f.payload) for f in frames] == [MAX_PAYLOAD] * 4 + [4]
    assert [f.end_stream for f in frames] == [False] * 4 + [True]
    assert b"".join(f.payload for f in frames) == body + b"tail"
    assert data_frames(5, b"") == [data_frame(5, b"")]
    assert not data_frames(5, b"x" * MAX_PAYLOAD)[-1].end_stream


def test_the_wire_paths():
    assert tunnel.PATH_AGENT_TUNNEL == "/api/v1/agent/tunnel"
    assert tunnel.PATH_AGENT_TUNNEL_DOWN == "/api/v1/agent/tunnel/down"
    assert tunnel.PATH_AGENT_TUNNEL_UP == "/api/v1/agent/tunnel/up"


# -- a byte stream, however chunked ----------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.sampled_from(every_kind_of_frame()), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=2_000_000), max_size=30),
)
def test_a_byte_stream_reads_back_the_same_frames_however_it_is_chunked(frames, cuts):
    stream = b"".join(encode(f) for f in frames)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    reader, seen = FrameReader(), []
    for start, end in zip(points, points[1:], strict=False):
        seen += reader.feed(stream[start:end])
        assert reader.buffered <= MAX_FRAME
    reader.close()
    assert seen == frames and reader.buffered == 0


def test_a_frame_fed_one_byte_at_a_time():
    frame = data_frame(3, b"payload" * 100, end_stream=True)
    reader = FrameReader()
    raw = encode(frame)
    out = [f for i in range(len(raw)) for f in reader.feed(raw[i : i + 1])]
    assert out == [frame]


def test_many_frames_in_one_chunk_come_out_in_order():
    frames = [data_frame(i, str(i).encode()) for i in range(1, 1001)]
    assert FrameReader().feed(b"".join(map(encode, frames))) == frames


def test_a_stream_that_ends_inside_a_frame_is_an_error():
    reader = FrameReader()
    reader.feed(encode(data_frame(1, b"abcdef"))[:-2])
    with pytest.raises(FrameError, match="inside a frame"):
        reader.close()
    FrameReader().close()  # at a boundary: fine


def test_an_oversized_length_fails_as_soon_as_the_header_is_in():
    reader = FrameReader()
    with pytest.raises(FrameError, match="over"):
        reader.feed(header(DATA, 1, MAX_PAYLOAD + 1))
    assert reader.buffered == 0
    # The reader stays broken: the tunnel is out of step and must close.
    with pytest.raises(FrameError):
        reader.feed(encode(end_frame(1)))


# -- every broken frame ------------------------------------------------------------------

BROKEN = [
    ("unknown type", header(0, 1, 0), "unknown frame type 0"),
    ("unknown type", header(11, 1, 0), "unknown frame type 11"),
    ("link on stream 0", header(10, 0, 2), "LINK: stream id 0 where a stream is required"),
    ("reserved", header(END, 1, 0, reserved=1), "reserved bits"),
    ("reserved", header(END, 1, 0, reserved=0x8000), "reserved bits"),
    ("flags", header(DATA, 1, 0, flags=0x02), "unknown flags"),
    ("flags", header(END, 1, 0, flags=FLAG_END_STREAM), "unknown flags"),
    ("flags", header(WINDOW, 1, 4, flags=0x80) + b"\0\0\0\1", "unknown flags"),
    ("oversized data", header(DATA, 1, MAX_PAYLOAD + 1), "over"),
    ("oversized json", header(OPEN, 1, MAX_JSON_PAYLOAD + 1), "over"),
    ("oversized json", header(RESUME, 0, MAX_JSON_PAYLOAD + 1), "over"),
    ("window size", header(WINDOW, 1, 3) + b"\0\0\1", "not 4"),
    ("window size", header(WINDOW, 1, 8) + b"\0" * 7 + b"\1", "not 4"),
    ("window zero", header(WINDOW, 1, 4) + b"\0\0\0\0", "zero increment"),
    ("ping size", header(PING, 0, 7) + b"1234567", "not 8"),
    ("pong size", header(PONG, 0, 9) + b"123456789", "not 8"),
    ("end payload", header(END, 1, 1) + b"x", "not 0"),
    ("stream 0", header(DATA, 0, 1) + b"x", "stream id 0"),
    ("stream 0", header(OPEN, 0, 2) + b"{}", "stream id 0"),
    ("stream 0", header(HEAD, 0, 2) + b"{}", "stream id 0"),
    ("stream 0", header(WINDOW, 0, 4) + b"\0\0\0\1", "stream id 0"),
    ("stream 0", header(END, 0, 0), "stream id 0"),
    ("tunnel frame on a stream", header(PING, 5, 8) + b"12345678", "tunnel frame"),
    ("tunnel frame on a stream", header(RESUME, 5, 2) + b"{}", "tunnel frame"),
]


@pytest.mark.parametrize(("case", "raw", "reason"), BROKEN, ids=[b[0] for b in BROKEN])
def test_every_broken_frame_is_a_frame_error_with_its_reason(case, raw, reason):
    with pytest.raises(FrameError, match=reason):
        decode(raw)
    with pytest.raises(FrameError, match=reason):
        FrameReader().feed(raw + b"\0" * 64)


def test_a_message_must_hold_exactly_one_frame():
    raw = encode(data_frame(1, b"abc"))
    with pytest.raises(FrameError, match="short frame"):
        decode(raw[:11])
    with pytest.raises(FrameError, match="header says"):
        decode(raw[:-1])
    with pytest.raises(FrameError, match="header says"):
        decode(raw + encode(end_frame(1)))


def test_frames_are_checked_when_built_too():
    # A sender cannot build what a receiver refuses.
    with pytest.raises(FrameError, match="stream id 0"):
        data_frame(0, b"x")
    with pytest.raises(FrameError, match="over"):
        data_frame(1, b"x" * (MAX_PAYLOAD + 1))
    with pytest.raises(FrameError, match="unknown frame type"):
        Frame(42, 1)
    with pytest.raises(FrameError, match="out of range"):
        window_frame(1, 0)
    with pytest.raises(FrameError, match="out of range"):
        Frame(END, 2**32)
    with pytest.raises(FrameError, match="not 8"):
        ping_frame(b"short")
    with pytest.raises(FrameError, match="headers"):
        head_frame(1, 200, [("Bad Name", "x")])
    with pytest.raises(FrameError, match="over"):
        head_frame(1, 200, [("X-Big", "x" * 8000)] * 10)


# What json_of refuses, each payload on the frame type that carries JSON.
BAD_JSON = [
    (OPEN, b"not json", "not JSON"),
    (OPEN, b"\xff\xfe{}", "not JSON"),
    (OPEN, "{}".encode("utf-16"), "not JSON"),
    (OPEN, b"[1, 2]", "not a JSON object"),
    (OPEN, b'"text"', "not a JSON object"),
    (OPEN, b"[" * 30000 + b"]" * 30000, "not JSON"),  # nested past the recursion limit
    (HEAD, b'{"status": NaN, "headers": []}', "not JSON"),
    (HEAD, b'{"status": 1' + b"0" * 5000 + b', "headers": []}', "not JSON"),
    (OPEN, b'{"method": "POST", "path": "/v1/x", "headers": []}', "server_id missing"),
    (OPEN, b'{"server_id": "", "method": "POST", "path": "/", "headers": []}', "server_id"),
    (OPEN, b'{"server_id": 1, "method": "POST", "path": "/", "headers": []}', "must be str"),
    (OPEN, b'{"server_id": "s", "method": "P T", "path": "/", "headers": []}', "method"),
    (OPEN, b'{"server_id": "s", "method": "POST", "path": "v1", "headers": []}', "path"),
    (OPEN, b'{"server_id": "s", "method": "POST", "path": "/a b", "headers": []}', "path"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":{}}', "must be list"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[["a"]]}', "pairs"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[["a",1]]}', "pairs"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[["a","x\\r\\nb: 1"]]}', "pairs"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[],"resume_from":-1}', "out of range"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[],"resume_from":9223372036854775808}', "out of range"),
    (OPEN, b'{"server_id":"s","method":"POST","path":"/","headers":[],"resume_from":true}', "must be int"),
    (HEAD, b'{"status": 99, "headers": []}', "status out of range"),
    (HEAD, b'{"status": 600, "headers": []}', "status out of range"),
    (HEAD, b'{"status": "200", "headers": []}', "must be int"),
    (HEAD, b'{"status": true, "headers": []}', "must be int"),
    (HEAD, b'{"status": 200}', "headers missing"),
    (RESET, b'{"code": "lower", "message": ""}', "code"),
    (RESET, b'{"code": "X", "message": null}', "must be str"),
    (RESET, b'{"code": "X", "message": "' + b"m" * 1001 + b'"}', "too long"),
    (RESUME, b'{"streams": {}}', "must be list"),
    (RESUME, b'{"streams": [1]}', "objects"),
    (RESUME, b'{"streams": [{"stream_id": 0, "delivered": 0}]}', "out of range"),
    (RESUME, b'{"streams": [{"stream_id": 1, "delivered": -1}]}', "out of range"),
    (RESUME, b'{"streams": [{"stream_id": 4294967296, "delivered": 0}]}', "out of range"),
    (RESUME, b'{"streams": [{"stream_id": 1, "delivered": 9223372036854775808}]}', "out of range"),
    (RESUME, b'{"streams": [{"stream_id": 1, "delivered": 0}, {"stream_id": 1, "delivered": 2}]}', "listed twice"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("frame_type", "payload", "reason"), BAD_JSON, ids=[f"{t.name}-{r}" for t, _, r in BAD_JSON]
)
def test_every_bad_json_payload_is_a_frame_error(frame_type, payload, reason):
    stream_id = 0 if frame_type is RESUME else 1
    frame = decode(encode(Frame(frame_type, stream_id, payload)))  # the framing is fine
    with pytest.raises(FrameError, match=reason):
        json_of(frame)


def test_too_many_headers_and_frames_without_json():
    pairs = [[f"x-{i}", "v"] for i in range(tunnel.MAX_HEADERS + 1)]
    body = json.dumps({"status": 200, "headers": pairs}).encode()
    with pytest.raises(FrameError, match="more than"):
        json_of(Frame(HEAD, 1, body))
    with pytest.raises(FrameError, match="no JSON payload"):
        json_of(data_frame(1, b"{}"))
    with pytest.raises(FrameError, match="not a WINDOW"):
        window_of(end_frame(1))
    with pytest.raises(FrameError, match="not a PING"):
        pong_frame(end_frame(1))


# -- fuzz: random bytes ------------------------------------------------------------------

# Headers that pass more often than random ones would, so the payload checks get fuzzed too.
_plausible_header = st.builds(
    lambda t, f, sid, n: struct.pack(">BBHII", t, f, 0, sid, n),
    st.integers(0, 11),
    st.sampled_from([0, 0, 1, 2]),
    st.sampled_from([0, 1, 2, 2**32 - 1]),
    st.sampled_from([0, 1, 2, 4, 8, 12, 100]),
)
_noise = st.lists(st.one_of(st.binary(max_size=64), _plausible_header), max_size=20).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(data=st.one_of(st.binary(max_size=400), _noise))
def test_decode_of_random_bytes_raises_only_frame_error(data):
    try:
        frame = decode(data)
    except FrameError:
        return
    assert encode(frame) == data
    if frame.type in (OPEN, HEAD, RESET, RESUME):
        with contextlib.suppress(FrameError):
            json_of(frame)


@settings(max_examples=500, deadline=None)
@given(data=st.one_of(st.binary(max_size=400), _noise), chunk=st.integers(1, 64))
def test_a_reader_fed_random_bytes_raises_only_frame_error_and_stays_bounded(data, chunk):
    reader = FrameReader()
    try:
        for start in range(0, len(data), chunk):
            for frame in reader.feed(data[start : start + chunk]):
                assert decode(encode(frame)) == frame
                if frame.type in (OPEN, HEAD, RESET, RESUME):
                    with contextlib.suppress(FrameError):
                        json_of(frame)
            assert reader.buffered <= MAX_FRAME
    except FrameError:
        pass


def test_a_reader_never_holds_more_than_one_frame_of_a_huge_chunk():
    # A whole megabyte at once: frames are cut straight from it, only the tail is kept.
    frames = data_frames(1, b"z" * (4 * MAX_PAYLOAD + 100))
    stream = b"".join(map(encode, frames))
    reader = FrameReader()
    assert reader.feed(stream[:-50]) == frames[:-1]
    assert reader.buffered == len(encode(frames[-1])) - 50
    assert reader.feed(stream[-50:]) == frames[-1:]


def test_carried_headers_keeps_in_order_only_what_a_frame_can_carry():
    headers = [
        ("Content-Type", "application/json"),
        ("User-Agent", "u" * 8193),  # over the value bound
        ("Bad Name", "x"),  # not a token
        ("X-Line", "a\r\nb"),  # a control character
        ("Accept", "t\u00e9xt"),  # latin-1 is fine
    ]
    kept = tunnel.carried_headers(headers)
    assert kept == [("Content-Type", "application/json"), ("Accept", "t\u00e9xt")]
    tunnel.head_frame(1, 200, kept)  # what it keeps, a frame carries
    with pytest.raises(tunnel.FrameError):
        tunnel.head_frame(1, 200, headers)
