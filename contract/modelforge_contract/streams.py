"""One stream of the tunnel without I/O: the bookkeeping both ends drive
(docs/tunnel-protocol.md).

The hub and the node agent each keep their own sockets, threads or loop, and locks; what a
stream *is* between frames is written once, here, and driven by both:

- ``Incoming``: the answer as its receiver keeps it (the control plane's side of a relayed
  request): the HEAD, the body bytes buffered within the credit, how many arrived and how
  many the consumer took (what a RESUME reports), and the credit to grant back.
- ``Outgoing``: the answer as its sender keeps it (the agent's side): the HEAD, the body
  bytes produced, those sent within the credit, and, until acknowledged, the bytes a resume
  may have to send again. ``frames`` says what may go now.
- ``Credit`` and ``Grants``: one direction's credit alone, for a link of a model split
  across nodes (never resumed, so nothing is kept for a replay).

Each stream direction is in one named ``Phase``; a frame its phase does not allow is a
``FrameError`` (the tunnel that sent it is closed), never a guess.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any

from .tunnel import (
    DATA,
    END,
    FLAG_END_STREAM,
    HEAD,
    MAX_PAYLOAD,
    WINDOW_BYTES,
    Frame,
    FrameError,
)


class Phase(enum.Enum):
    """Where one direction of a stream is (the answer's, for a relayed request)."""

    AWAITING_HEAD = "awaiting head"  # opened; the HEAD has not come (or gone) yet
    BODY = "body"  # the HEAD is through; body bytes flow within the credit
    ENDED = "ended"  # the last body byte is through (END, or END_STREAM on a frame)
    RESET = "reset"  # RESET either way: over in both directions


class Incoming:
    """The receiving end of a stream: what arrived, what the consumer took, what to grant.

    ``on_head``, ``on_data``, ``on_end`` and ``on_reset`` take the sender's frames (a frame
    the phase does not allow, or DATA beyond the credit, is a FrameError); ``take`` hands
    the consumer what is buffered; ``grant`` says how much credit to return; ``resume_entry``
    is this stream's line of a RESUME.
    """

    def __init__(self, window: int = WINDOW_BYTES) -> None:
        self.window = window
        self.head: Any = None
        self.ended = False
        self.reset: tuple[str, str] | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0  # arrived, not yet taken
        self.received = 0  # body bytes that arrived
        self.delivered = 0  # body bytes the consumer took
        self.ungranted = 0  # of those, not yet granted back

    @property
    def phase(self) -> Phase:
        if self.reset is not None:
            return Phase.RESET
        if self.ended:
            return Phase.ENDED
        return Phase.AWAITING_HEAD if self.head is None else Phase.BODY

    def on_head(self, head: Any) -> None:
        if self.phase is not Phase.AWAITING_HEAD:
            raise FrameError(f"HEAD in phase {self.phase.value}")
        self.head = head

    def on_data(self, payload: bytes) -> None:
        if self.phase is not Phase.BODY:
            raise FrameError(f"DATA in phase {self.phase.value}")
        if self.buffered + self.ungranted + len(payload) > self.window:
            raise FrameError("DATA beyond the stream's credit")
        if payload:
            self.chunks.append(payload)
            self.buffered += len(payload)
            self.received += len(payload)

    def on_end(self) -> None:
        """The body is over. Said again after a resume (the RESUME does not say whether
        the end arrived, so a resumed sender ends again), it changes nothing."""
        if self.phase not in (Phase.BODY, Phase.ENDED):
            raise FrameError(f"END in phase {self.phase.value}")
        self.ended = True

    def on_reset(self, code: str, message: str) -> None:
        self.reset = (code, message)

    def take(self) -> bytes:
        """Everything buffered, in one piece (b"" when nothing is); the consumer took it."""
        if not self.chunks:
            return b""
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered -= len(data)
        self.delivered += len(data)
        self.ungranted += len(data)
        return data

    def grant(self, at_least: int) -> int:
        """The credit to give back now: what the consumer took since the last grant, once
        that is ``at_least`` bytes; 0 otherwise, and once the body ended (nothing more may
        come). The sender never waits on it: while it waits for credit, buffered plus
        ungranted is a whole window, so the consumer takes what is buffered and the grant
        follows."""
        if self.ungranted < at_least or self.phase is not Phase.BODY:
            return 0
        count, self.ungranted = self.ungranted, 0
        return count

    def resume_entry(self, stream_id: int) -> dict[str, Any]:
        """This stream's line of a RESUME. The sender's credit starts again from what the
        consumer took, so nothing taken before it is granted again."""
        self.ungranted = 0
        return {
            "stream_id": stream_id,
            "received": self.received,
            "delivered": self.delivered,
            "head": self.head is not None,
        }


class Outgoing:
    """The sending end of a stream: the HEAD and body as produced, what went out within the
    credit, and what a resume may have to send again (from the last acknowledged byte: the
    receiver's grants acknowledge, so at most one window is kept).

    ``set_head``, ``produce`` and ``finish`` take what the producer made; ``on_window`` and
    ``on_resume`` take the receiver's word; ``on_reset`` ends it both ways; ``frames`` hands
    out what may be sent now.
    """

    def __init__(self, window: int = WINDOW_BYTES) -> None:
        self.window = window
        self.head: bytes | None = None  # the HEAD's payload, kept for a resume before it
        self.head_sent = False
        self.finished = False  # every byte produced: END goes once all are sent
        self.end_sent = False
        self.reset = False  # RESET either way (the receiver's, or the sender stops)
        self.acked = 0  # body bytes the receiver says its consumer took
        self.sent = 0  # body bytes sent
        self.total = 0  # body bytes produced
        self.replay = bytearray()  # the bytes from ``acked`` to ``total``

    @property
    def phase(self) -> Phase:
        if self.reset:
            return Phase.RESET
        if self.end_sent:
            return Phase.ENDED
        return Phase.BODY if self.head_sent else Phase.AWAITING_HEAD

    @property
    def all_sent(self) -> bool:
        """Everything produced so far went out (the END too, once finished)."""
        return self.sent == self.total and (not self.finished or self.end_sent)

    def set_head(self, payload: bytes) -> None:
        self.head = payload

    def produce(self, data: bytes) -> None:
        if data:
            self.replay += data
            self.total += len(data)

    def finish(self) -> None:
        self.finished = True

    def on_reset(self) -> None:
        """Over both ways: nothing more is sent, and the bytes kept for a replay go."""
        self.reset = True
        self.replay.clear()

    def on_window(self, count: int) -> None:
        """Credit back: the receiver's consumer took ``count`` more bytes (more than were
        sent counts as what was sent)."""
        count = min(count, self.sent - self.acked)
        if count > 0:
            del self.replay[:count]
            self.acked += count

    def on_resume(self, received: int, delivered: int, head: bool) -> None:
        """A new tunnel's RESUME: ``received`` bytes arrived, the consumer took
        ``delivered``, and whether the HEAD arrived. Sending goes on from ``received``
        (clamped to what this side holds), and the END goes again."""
        received = max(self.acked, min(received, self.total))
        delivered = max(self.acked, min(delivered, received))
        del self.replay[: delivered - self.acked]
        self.acked = delivered
        self.sent = received
        self.head_sent = head and self.head is not None
        self.end_sent = False

    def frames(self, stream_id: int) -> list[Frame]:
        """What may be sent now, in order: the HEAD if it has not gone, DATA within the
        credit, and the end (on the last frame, or an END of its own) once everything
        produced is out."""
        frames: list[Frame] = []
        if self.reset:
            return frames
        if self.head is not None and not self.head_sent:
            frames.append(Frame(HEAD, stream_id, self.head))
            self.head_sent = True
        if not self.head_sent:  # no body before the HEAD
            return frames
        room = self.acked + self.window - self.sent
        waiting = self.total - self.sent
        while waiting > 0 and room > 0:
            size = min(waiting, room, MAX_PAYLOAD)
            start = self.sent - self.acked
            frames.append(Frame(DATA, stream_id, bytes(self.replay[start : start + size])))
            self.sent += size
            waiting, room = waiting - size, room - size
        if self.finished and self.sent == self.total and not self.end_sent:
            if frames:  # a HEAD or DATA: the end rides on it, one message fewer
                frames[-1] = dataclasses.replace(frames[-1], flags=FLAG_END_STREAM)
            else:
                frames.append(Frame(END, stream_id, b""))
            self.end_sent = True
        return frames


class Credit:
    """What a sender may still send in one direction of a link: ``spend`` as DATA goes,
    ``give`` as WINDOW comes back. Either past its bound is a FrameError."""

    def __init__(self, window: int = WINDOW_BYTES) -> None:
        self.window = window
        self.left = window

    def spend(self, count: int) -> None:
        if count > self.left:
            raise FrameError("DATA beyond the link's credit")
        self.left -= count

    def give(self, count: int) -> None:
        if self.left + count > self.window:
            raise FrameError("WINDOW beyond what the link carried")
        self.left += count


class Grants:
    """The credit a receiver owes back in one direction of a link, returned in ``step``
    sized pieces (a WINDOW per small message would double the frames of a round trip)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.owed = 0

    def took(self, count: int) -> int:
        """The consumer took ``count`` bytes: the credit to send back now (0: not yet)."""
        self.owed += count
        if self.owed < self.step:
            return 0
        count, self.owed = self.owed, 0
        return count
