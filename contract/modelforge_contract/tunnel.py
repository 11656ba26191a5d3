"""The relay tunnel's wire contract: frames, limits, paths and error codes (docs/architecture.md §12).

docs/tunnel-protocol.md says what each side does with each frame, exactly as the hub and
the agent do it (tests/appliance/test_tunnel_protocol.py holds it to both).

Each agent keeps one outbound connection to the control plane and carries many client
streams over it. The connection is a WebSocket (``GET /api/v1/agent/tunnel``, subprotocol
``modelforge.tunnel.v1``, compression off) with exactly one frame per binary message, or,
where WebSocket is blocked, the HTTP fallback: the control plane's frames come back to
back in the streamed answer of ``GET …/tunnel/down``, the agent's in the bodies of
``POST …/tunnel/up`` (both carry ``X-ModelForge-Tunnel-Session``, which the ``down``
answer hands out). ``decode`` reads one WebSocket message, ``FrameReader`` a byte stream.

Frame header (12 bytes, big-endian), then ``length`` bytes of payload::

    offset  size  field
    0       1     type       (FrameType)
    1       1     flags      (FLAG_END_STREAM is the only flag)
    2       2     reserved   must be 0
    4       4     stream id  0 for the tunnel itself (PING, PONG, RESUME, RESET of all)
    8       4     length     payload bytes, at most MAX_PAYLOAD (MAX_JSON_PAYLOAD for JSON)

Types, who sends them, and their payloads:

====== ========= ========================================================================
type   sender    payload
====== ========= ========================================================================
OPEN   control   JSON ``{server_id, method, path, headers: [[name, value], …]}``: a
       plane     client request for one server placed on this node.
HEAD   agent     JSON ``{status, headers}``: the runtime's status line and headers.
DATA   both      raw body bytes; the sender spends that much of the stream's credit.
WINDOW control   u32: credit returned to the agent, in body bytes, never 0 (a request's
       plane     body is sent whole and bounded, so the agent grants none).
END    both      none: this direction of the stream is over (like DATA + END_STREAM).
RESET  both      JSON ``{code, message}``: the stream is over in both directions. On
                 stream 0 the whole tunnel is being closed; the sender closes next
                 (going away, below).
PING   both      8 opaque bytes, answered by a PONG carrying the same 8 bytes.
PONG   both      8 bytes.
RESUME control   JSON ``{streams: [{stream_id, received, delivered, head}, …]}``: the
       plane     first frame of every tunnel; ``received`` counts the DATA payload bytes of
                 that stream that reached the control plane, ``delivered`` those its
                 client took, ``head`` whether the HEAD arrived. The agent sends on from
                 ``received``; a stream it cannot resume it RESETs (RESUME_FAILED).
LINK   both      JSON ``{server_id[, peer_server_id]}``: a byte link of a model split
                 across nodes (docs/deployments.md). From an agent, on a stream id it
                 chooses with LINK_STREAM_BIT set: its main server ``server_id`` dials
                 the helper ``peer_server_id``. From the control plane, to the helper's
                 agent on an id it chooses: connect to ``server_id``'s helper. Then DATA,
                 WINDOW (from every receiver: both directions are credit-bounded), END and
                 RESET as on any stream; the hub splices the two streams and keeps no
                 bytes. A link is never resumed: a tunnel that drops RESETs its links.
====== ========= ========================================================================

``FLAG_END_STREAM`` may be set on OPEN (no request body follows), HEAD (no response body)
and DATA (the last body bytes). Stream ids are chosen by the control plane, nonzero, and
never reused on one tunnel; a stream keeps its id across a reconnect.

Flow control: each direction of each stream starts with ``WINDOW_BYTES`` of credit; a
sender never sends more DATA payload than its credit, and the receiver returns credit
with WINDOW as its consumer takes the bytes (the control plane: as its client's socket
takes them). Returned credit is therefore also an acknowledgement: an agent needs to keep
at most one window of each stream's bytes for a replay after a reconnect.

Going away: an agent that stops (SIGTERM, or its credential refused) sends RESET on stream
0 with ``TUNNEL_CLOSING`` (``going_away_frame``) before it closes the connection, and starts no stream after it (an
OPEN that crosses it is answered RESET ``TUNNEL_CLOSING``); it resumes none of its streams.
The control plane, on receiving it, opens no more streams on that tunnel and ends each of
that node's streams at once, without waiting for a resume: one whose HEAD has not reached
its client may be sent to another server (``relay.FAILOVER_CODES``), one whose HEAD has ends
as a lost link (``NODE_LINK_LOST``). A tunnel that just drops instead (no RESET of stream 0)
keeps its streams waiting for the node's next tunnel and its RESUME.

What the receiver must do: a frame that fails ``decode``/``FrameReader`` or ``json_of``
(``FrameError``), a frame for a stream that does not exist or is not this node's, a frame
its stream's phase does not allow (``streams.Phase``: DATA or END before HEAD, a second
HEAD, DATA after the end), DATA beyond the credit, or more than ``MAX_STREAMS_PER_TUNNEL`` streams close the tunnel
(``TUNNEL_PROTOCOL_ERROR``, ``STREAM_LIMIT``) with the reason logged; no payload is logged.
What a tunnel may carry, the headers it drops and the error codes of RESET and of the client
API are in ``modelforge_contract.relay``.
"""

from __future__ import annotations

import enum
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from . import API_PREFIX
from .relay import TUNNEL_CLOSING

# -- paths, headers and media types ----------------------------------------------------

PATH_AGENT_TUNNEL = f"{API_PREFIX}/agent/tunnel"  # GET with Upgrade: websocket
# The HTTP fallback: a streamed GET of the control plane's frames, POSTs of the agent's.
PATH_AGENT_TUNNEL_DOWN = f"{PATH_AGENT_TUNNEL}/down"
PATH_AGENT_TUNNEL_UP = f"{PATH_AGENT_TUNNEL}/up"
HEADER_TUNNEL_SESSION = "X-ModelForge-Tunnel-Session"
TUNNEL_SUBPROTOCOL = "modelforge.tunnel.v1"
TUNNEL_MEDIA_TYPE = "application/vnd.modelforge.tunnel"

# -- limits ------------------------------------------------------------------------------

HEADER_SIZE = 12
MAX_PAYLOAD = 256 * 1024  # the most payload bytes of any frame (DATA)
MAX_JSON_PAYLOAD = 64 * 1024  # the most payload bytes of an OPEN, HEAD, RESET or RESUME
MAX_FRAME = HEADER_SIZE + MAX_PAYLOAD
WINDOW_BYTES = 1024 * 1024  # initial credit of each direction of each stream
MAX_STREAMS_PER_TUNNEL = 64  # the default cap on a tunnel's open streams
MAX_STREAM_ID = 2**32 - 1
# The ids an agent chooses for the links it opens (LINK): the control plane's never have it.
LINK_STREAM_BIT = 0x80000000
MAX_OFFSET = 2**63 - 1  # the most body bytes a resume_from or delivered may count
MAX_HEADERS = 128  # the most [name, value] pairs in an OPEN or HEAD
RESET_MESSAGE_MAX_CHARS = 1000  # reset_frame trims longer messages
PING_BYTES = 8
# -- frames ------------------------------------------------------------------------------


class FrameType(enum.IntEnum):
    OPEN = 1
    HEAD = 2
    DATA = 3
    WINDOW = 4
    END = 5
    RESET = 6
    PING = 7
    PONG = 8
    RESUME = 9
    LINK = 10


OPEN, HEAD, DATA, WINDOW, END, RESET, PING, PONG, RESUME, LINK = FrameType
FLAG_END_STREAM = 0x01

_HEADER = struct.Struct(">BBHII")
_JSON_TYPES = frozenset({OPEN, HEAD, RESET, RESUME, LINK})
_FLAGS = {OPEN: FLAG_END_STREAM, HEAD: FLAG_END_STREAM, DATA: FLAG_END_STREAM}
_TUNNEL_TYPES = frozenset({PING, PONG, RESUME})  # stream id 0 only
_STREAM_TYPES = frozenset({OPEN, HEAD, DATA, WINDOW, END, LINK})  # a nonzero stream id only
_FIXED_LENGTH = {WINDOW: 4, PING: PING_BYTES, PONG: PING_BYTES, END: 0}


class FrameError(Exception):
    """A frame breaks the tunnel contract; ``str()`` is a short reason fit for a log line.

    The tunnel it came on cannot be trusted to stay in step: close it.
    """


@dataclass(frozen=True)
class Frame:
    """One tunnel frame, well-formed at the framing level (JSON shapes: ``json_of``)."""

    type: FrameType
    stream_id: int
    payload: bytes = b""
    flags: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.payload, bytes):
            object.__setattr__(self, "payload", bytes(self.payload))
        frame_type = _check_header(self.type, self.flags, 0, self.stream_id, len(self.payload))
        object.__setattr__(self, "type", frame_type)
        if frame_type is WINDOW:
            _window_increment(self.payload)

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)


def _check_header(type_: int, flags: int, reserved: int, stream_id: int, length: int):
    try:
        frame_type = FrameType(type_)
    except ValueError:
        raise FrameError(f"unknown frame type {type_}") from None
    name = frame_type.name
    if reserved:
        raise FrameError(f"{name}: reserved bits set")
    if flags & ~_FLAGS.get(frame_type, 0):
        raise FrameError(f"{name}: unknown flags 0x{flags:02x}")
    if isinstance(stream_id, bool) or not 0 <= stream_id <= MAX_STREAM_ID:
        raise FrameError(f"{name}: stream id out of range")
    if stream_id == 0 and frame_type in _STREAM_TYPES:
        raise FrameError(f"{name}: stream id 0 where a stream is required")
    if stream_id != 0 and frame_type in _TUNNEL_TYPES:
        raise FrameError(f"{name}: a tunnel frame on stream {stream_id}")
    fixed = _FIXED_LENGTH.get(frame_type)
    if fixed is not None and length != fixed:
        raise FrameError(f"{name}: payload of {length} bytes, not {fixed}")
    bound = MAX_JSON_PAYLOAD if frame_type in _JSON_TYPES else MAX_PAYLOAD
    if length > bound:
        raise FrameError(f"{name}: payload of {length} bytes is over {bound}")
    return frame_type


def _window_increment(payload: bytes) -> int:
    (increment,) = struct.unpack(">I", payload)
    if increment == 0:
        raise FrameError("WINDOW: zero increment")
    return increment


def encode(frame: Frame) -> bytes:
    """The frame's bytes: its 12-byte header, then its payload."""
    header = _HEADER.pack(frame.type, frame.flags, 0, frame.stream_id, len(frame.payload))
    return header + frame.payload


def _frame_of(header: bytes | memoryview, payload: bytes) -> Frame:
    type_, flags, reserved, stream_id, _length = _HEADER.unpack(header)
    return Frame(FrameType(type_), stream_id, payload, flags)


def decode(data: bytes) -> Frame:
    """Exactly one frame from ``data`` (one WebSocket message); FrameError otherwise."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise FrameError(f"short frame: {len(view)} bytes")
    type_, flags, reserved, stream_id, length = _HEADER.unpack(view[:HEADER_SIZE])
    _check_header(type_, flags, reserved, stream_id, length)
    if len(view) != HEADER_SIZE + length:
        raise FrameError(f"frame of {len(view)} bytes, its header says {HEADER_SIZE + length}")
    return _frame_of(view[:HEADER_SIZE], bytes(view[HEADER_SIZE:]))


class FrameReader:
    """Frames from a byte stream (the HTTP fallback), however the bytes are chunked.

    It holds at most one incomplete frame (``buffered <= MAX_FRAME``): a header is checked
    as soon as its 12 bytes are in, so an oversized length fails before any payload is
    kept. After a FrameError every later ``feed`` raises it again.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need = HEADER_SIZE  # bytes the current frame has in all, once known
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held of the incomplete frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Every frame that ``data`` completes, in order."""
        if self._error is not None:
            raise self._error
        try:
            return self._feed(memoryview(data))
        except FrameError as error:
            self._error = error
            self._buffer = bytearray()
            raise

    def _feed(self, view: memoryview) -> list[Frame]:
        frames = []
        offset = 0
        while offset < len(view):
            buffer = self._buffer
            if not buffer and len(view) - offset >= HEADER_SIZE:
                # Fast path: whole frames straight from the caller's bytes.
                header = view[offset : offset + HEADER_SIZE]
                total = HEADER_SIZE + self._checked_length(header)
                if len(view) - offset >= total:
                    payload = bytes(view[offset + HEADER_SIZE : offset + total])
                    frames.append(_frame_of(header, payload))
                    offset += total
                    continue
            take = min(self._need - len(buffer), len(view) - offset)
            buffer += view[offset : offset + take]
            offset += take
            if len(buffer) == HEADER_SIZE and self._need == HEADER_SIZE:
                self._need = HEADER_SIZE + self._checked_length(buffer)
            if len(buffer) == self._need:
                frames.append(_frame_of(buffer[:HEADER_SIZE], bytes(buffer[HEADER_SIZE:])))
                self._buffer = bytearray()
                self._need = HEADER_SIZE
        return frames

    @staticmethod
    def _checked_length(header: bytes | bytearray | memoryview) -> int:
        type_, flags, reserved, stream_id, length = _HEADER.unpack(header)
        _check_header(type_, flags, reserved, stream_id, length)
        return length

    def close(self) -> None:
        """The stream ended: FrameError if it stopped inside a frame."""
        if self._error is None and self._buffer:
            self._error = FrameError(f"stream ended inside a frame ({len(self._buffer)} bytes)")
        if self._error is not None:
            raise self._error


# -- builders ----------------------------------------------------------------------------


def _json_payload(frame_type: FrameType, body: dict) -> bytes:
    _SHAPES[frame_type](body)
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(payload) > MAX_JSON_PAYLOAD:
        raise FrameError(
            f"{frame_type.name}: payload of {len(payload)} bytes is over {MAX_JSON_PAYLOAD}"
        )
    return payload


def open_frame(
    stream_id: int,
    server_id: str,
    method: str,
    path: str,
    headers: Iterable[tuple[str, str]],
    *,
    resume_from: int | None = None,
    end_stream: bool = False,
) -> Frame:
    """A client request for ``server_id``; ``end_stream``: no request body follows."""
    body: dict = {
        "server_id": server_id,
        "method": method,
        "path": path,
        "headers": [[name, value] for name, value in headers],
    }
    if resume_from is not None:
        body["resume_from"] = resume_from
    flags = FLAG_END_STREAM if end_stream else 0
    return Frame(OPEN, stream_id, _json_payload(OPEN, body), flags)


def head_frame(
    stream_id: int, status: int, headers: Iterable[tuple[str, str]], *, end_stream: bool = False
) -> Frame:
    """The runtime's status and headers; ``end_stream``: no body follows."""
    body = {"status": status, "headers": [[name, value] for name, value in headers]}
    flags = FLAG_END_STREAM if end_stream else 0
    return Frame(HEAD, stream_id, _json_payload(HEAD, body), flags)


def data_frame(stream_id: int, data: bytes, *, end_stream: bool = False) -> Frame:
    """Body bytes (at most MAX_PAYLOAD; ``data_frames`` splits longer ones)."""
    return Frame(DATA, stream_id, data, FLAG_END_STREAM if end_stream else 0)


def data_frames(stream_id: int, data: bytes, *, end_stream: bool = False) -> list[Frame]:
    """``data`` as DATA frames of at most MAX_PAYLOAD bytes; END_STREAM on the last."""
    view = memoryview(data)
    pieces = [view[i : i + MAX_PAYLOAD] for i in range(0, len(view), MAX_PAYLOAD)] or [view]
    last = len(pieces) - 1
    return [
        data_frame(stream_id, bytes(piece), end_stream=end_stream and i == last)
        for i, piece in enumerate(pieces)
    ]


def window_frame(stream_id: int, increment: int) -> Frame:
    """Return ``increment`` bytes of credit (1 … 2**32-1) on the stream."""
    if isinstance(increment, bool) or not 0 < increment <= MAX_STREAM_ID:
        raise FrameError("WINDOW: increment out of range")
    return Frame(WINDOW, stream_id, struct.pack(">I", increment))


def window_of(frame: Frame) -> int:
    """The credit a WINDOW frame returns."""
    if frame.type is not WINDOW:
        raise FrameError(f"{frame.type.name}: not a WINDOW frame")
    return _window_increment(frame.payload)


def end_frame(stream_id: int) -> Frame:
    """This direction of the stream is over."""
    return Frame(END, stream_id)


def reset_frame(stream_id: int, code: str, message: str) -> Frame:
    """End the stream both ways (stream 0: the tunnel); a long message is trimmed."""
    body = {"code": code, "message": message[:RESET_MESSAGE_MAX_CHARS]}
    return Frame(RESET, stream_id, _json_payload(RESET, body))


def going_away_frame(message: str = "the node agent is stopping") -> Frame:
    """RESET of stream 0 with TUNNEL_CLOSING: the sender stops and resumes nothing (going
    away, above); it closes the connection next."""
    return reset_frame(0, TUNNEL_CLOSING, message)


def ping_frame(opaque: bytes) -> Frame:
    return Frame(PING, 0, opaque)


def pong_frame(ping: Frame) -> Frame:
    """The answer to a PING: the same 8 bytes."""
    if ping.type is not PING:
        raise FrameError(f"{ping.type.name}: not a PING frame")
    return Frame(PONG, 0, ping.payload)


def resume_frame(delivered: dict[int, int]) -> Frame:
    """After a reconnect: ``{stream_id: body bytes delivered}`` for each open stream."""
    streams = [{"stream_id": sid, "delivered": n} for sid, n in sorted(delivered.items())]
    return Frame(RESUME, 0, _json_payload(RESUME, {"streams": streams}))


# -- JSON payloads -----------------------------------------------------------------------

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")
# A header value a WSGI server can write: latin-1, no control characters but tab.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]{0,8192}")
_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def carried_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs an OPEN or HEAD can carry (a token name, a value of at most 8,192
    characters of latin-1 without control characters but tab), in order. A sender leaves
    the others out: sent, they would make the receiver close the whole tunnel."""
    return [
        (name, value)
        for name, value in headers
        if isinstance(name, str)
        and isinstance(value, str)
        and _TOKEN.fullmatch(name)
        and _HEADER_VALUE.fullmatch(value)
    ]


_REQUEST_PATH = re.compile(r"/[\x21-\x7e]{0,8191}")


def json_of(frame: Frame) -> dict:
    """The JSON object of an OPEN, HEAD, RESET or RESUME, its shape checked.

    Unknown keys are kept (additive changes); a missing or mistyped key is a FrameError.
    """
    if frame.type not in _JSON_TYPES:
        raise FrameError(f"{frame.type.name}: no JSON payload")
    name = frame.type.name
    try:
        text = frame.payload.decode("utf-8")
        body = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise FrameError(f"{name}: payload is not JSON") from None
    if not isinstance(body, dict):
        raise FrameError(f"{name}: payload is not a JSON object")
    _SHAPES[frame.type](body)
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(name)


def _field(body: dict, frame_type: FrameType, key: str, kind: type, *, optional: bool = False):
    if key not in body:
        if optional:
            return None
        raise FrameError(f"{frame_type.name}: {key} missing")
    value = body[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FrameError(f"{frame_type.name}: {key} must be {kind.__name__}")
    return value


def _check_headers(body: dict, frame_type: FrameType) -> None:
    headers = _field(body, frame_type, "headers", list)
    if len(headers) > MAX_HEADERS:
        raise FrameError(f"{frame_type.name}: more than {MAX_HEADERS} headers")
    for pair in headers:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], str)
            and _TOKEN.fullmatch(pair[0])
            and _HEADER_VALUE.fullmatch(pair[1])
        ):
            raise FrameError(f"{frame_type.name}: headers must be [name, value] pairs")


def _check_open(body: dict) -> None:
    server_id = _field(body, OPEN, "server_id", str)
    if not 0 < len(server_id) <= 128:
        raise FrameError("OPEN: server_id out of range")
    if not _TOKEN.fullmatch(_field(body, OPEN, "method", str)):
        raise FrameError("OPEN: method is not a token")
    if not _REQUEST_PATH.fullmatch(_field(body, OPEN, "path", str)):
        raise FrameError("OPEN: path is not a request path")
    _check_headers(body, OPEN)
    resume_from = _field(body, OPEN, "resume_from", int, optional=True)
    if resume_from is not None and not 0 <= resume_from <= MAX_OFFSET:
        raise FrameError("OPEN: resume_from out of range")


def _check_head(body: dict) -> None:
    if not 100 <= _field(body, HEAD, "status", int) <= 599:
        raise FrameError("HEAD: status out of range")
    _check_headers(body, HEAD)


def _check_reset(body: dict) -> None:
    if not _CODE.fullmatch(_field(body, RESET, "code", str)):
        raise FrameError("RESET: code is not an error code")
    if len(_field(body, RESET, "message", str)) > RESET_MESSAGE_MAX_CHARS:
        raise FrameError("RESET: message too long")


def _check_resume(body: dict) -> None:
    seen = set()
    for entry in _field(body, RESUME, "streams", list):
        if not isinstance(entry, dict):
            raise FrameError("RESUME: streams must be objects")
        stream_id = _field(entry, RESUME, "stream_id", int)
        delivered = _field(entry, RESUME, "delivered", int)
        if not 0 < stream_id <= MAX_STREAM_ID or not 0 <= delivered <= MAX_OFFSET:
            raise FrameError("RESUME: stream_id or delivered out of range")
        if stream_id in seen:
            raise FrameError(f"RESUME: stream {stream_id} listed twice")
        seen.add(stream_id)


def _check_link(body: dict) -> None:
    for key in ("server_id", "peer_server_id"):
        value = _field(body, LINK, key, str, optional=key == "peer_server_id")
        if value is not None and not 0 < len(value) <= 128:
            raise FrameError(f"LINK: {key} out of range")


def link_frame(stream_id: int, server_id: str, peer_server_id: str | None = None) -> Frame:
    body = {"server_id": server_id}
    if peer_server_id is not None:
        body["peer_server_id"] = peer_server_id
    return Frame(LINK, stream_id, _json_payload(LINK, body))


def is_link_id(stream_id: int) -> bool:
    """Whether an agent chose this stream id (for a LINK it opened)."""
    return bool(stream_id & LINK_STREAM_BIT)


_SHAPES = {
    OPEN: _check_open,
    HEAD: _check_head,
    RESET: _check_reset,
    RESUME: _check_resume,
    LINK: _check_link,
}
