"""The tunnel core without I/O (modelforge_contract.streams): the phases a stream goes
through, the credit both ends keep, and a resume that neither loses nor repeats a byte,
whatever the order of production, consumption and dropped tunnels."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelforge_contract import tunnel as wire
from modelforge_contract.streams import Credit, Grants, Incoming, Outgoing, Phase

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

WINDOW = 1000  # small, so that credit runs out in a few steps


def deliver(incoming: Incoming, frames: list[wire.Frame]) -> None:
    """The receiving end's side of the frames, as the hub takes them."""
    for frame in frames:
        if frame.type == wire.HEAD:
            incoming.on_head(frame.payload)
        elif frame.type == wire.DATA:
            incoming.on_data(frame.payload)
        elif frame.type != wire.END:
            raise AssertionError(frame)
        if frame.type == wire.END or frame.end_stream:
            incoming.on_end()


def test_a_stream_goes_from_awaiting_its_head_through_its_body_to_its_end():
    out, into = Outgoing(WINDOW), Incoming(WINDOW)
    assert out.phase is into.phase is Phase.AWAITING_HEAD
    out.produce(b"early")  # the runtime's body before its head: nothing goes yet
    assert out.frames(7) == []
    out.set_head(b"{}")
    out.produce(b" and more")
    out.finish()
    frames = out.frames(7)
    assert [f.type for f in frames] == [wire.HEAD, wire.DATA]
    assert frames[-1].end_stream  # the end rides on the last frame
    assert out.phase is Phase.ENDED and out.all_sent
    deliver(into, frames)
    assert into.phase is Phase.ENDED
    assert into.take() == b"early and more"


def test_a_frame_the_phase_does_not_allow_breaks_the_contract():
    into = Incoming(WINDOW)
    with pytest.raises(wire.FrameError, match="DATA in phase awaiting head"):
        into.on_data(b"x")
    with pytest.raises(wire.FrameError, match="END in phase awaiting head"):
        into.on_end()
    into.on_head("head")
    with pytest.raises(wire.FrameError, match="HEAD in phase body"):
        into.on_head("again")
    into.on_end()
    into.on_end()  # a resumed sender ends again: nothing changes
    with pytest.raises(wire.FrameError, match="DATA in phase ended"):
        into.on_data(b"late")
    into.on_reset("RUNTIME_EXITED", "gone")
    assert into.phase is Phase.RESET


def test_data_beyond_the_credit_breaks_the_contract_and_grants_give_it_back():
    into = Incoming(WINDOW)
    into.on_head("head")
    into.on_data(b"a" * 600)
    into.on_data(b"b" * 400)  # the whole window
    with pytest.raises(wire.FrameError, match="beyond the stream's credit"):
        into.on_data(b"c")
    assert into.take() == b"a" * 600 + b"b" * 400
    # Taken but not yet granted still counts against the sender's credit.
    with pytest.raises(wire.FrameError, match="beyond the stream's credit"):
        into.on_data(b"c")
    assert into.grant(2000) == 0  # below the step: not yet
    assert into.grant(500) == 1000
    into.on_data(b"c" * 1000)


def test_the_sender_never_sends_past_its_credit_and_a_window_lets_it_go_on():
    out = Outgoing(WINDOW)
    out.set_head(b"{}")
    out.produce(b"x" * 2500)
    sent = sum(len(f.payload) for f in out.frames(1) if f.type == wire.DATA)
    assert sent == WINDOW and out.frames(1) == []
    out.on_window(400)
    assert [len(f.payload) for f in out.frames(1)] == [400]
    out.on_window(10**9)  # more than was sent counts as what was sent
    assert out.acked == out.sent == 1400
    assert len(out.replay) == 1100  # only what is not acknowledged is kept


def test_a_reset_sender_sends_nothing_more_and_keeps_nothing_for_a_replay():
    out = Outgoing(WINDOW)
    out.set_head(b"{}")
    out.produce(b"x" * 500)
    out.on_reset()
    assert out.phase is Phase.RESET and out.frames(1) == [] and out.replay == b""
    out.on_resume(0, 0, False)  # a new tunnel does not bring it back
    assert out.phase is Phase.RESET and out.frames(1) == []


def test_data_frames_are_cut_at_the_largest_payload():
    out = Outgoing(4 * wire.MAX_PAYLOAD)
    out.set_head(b"{}")
    out.produce(b"y" * (wire.MAX_PAYLOAD + 10))
    sizes = [len(f.payload) for f in out.frames(1) if f.type == wire.DATA]
    assert sizes == [wire.MAX_PAYLOAD, 10]


def test_a_link_spends_and_gets_back_its_credit_and_grants_in_steps():
    credit = Credit(WINDOW)
    credit.spend(WINDOW)
    with pytest.raises(wire.FrameError, match="beyond the link's credit"):
        credit.spend(1)
    credit.give(WINDOW)
    with pytest.raises(wire.FrameError, match="beyond what the link carried"):
        credit.give(1)
    grants = Grants(250)
    assert [grants.took(100), grants.took(100), grants.took(100), grants.took(10)] == [0, 0, 300, 0]


# Steps of a stream's life, in any order: the runtime produces, the client takes, the hub
# grants, the tunnel drops (frames in flight lost) and a new one resumes.
STEP = st.one_of(
    st.tuples(st.just("produce"), st.integers(1, 700)),
    st.tuples(st.just("send"), st.just(0)),
    st.tuples(st.just("take"), st.just(0)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(st.just("resume"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=60), st.booleans())
def test_a_resume_neither_loses_nor_repeats_a_byte(steps, head_first):
    out, into = Outgoing(WINDOW), Incoming(WINDOW)
    produced, taken = bytearray(), bytearray()
    in_flight: list[wire.Frame] = []  # sent on the current tunnel, not yet arrived
    down = False  # the tunnel dropped; the next one has not resumed yet
    counter = 0

    def produce(count: int) -> None:
        nonlocal counter
        data = bytes((counter + i) % 251 for i in range(count))
        counter += count
        produced.extend(data)
        out.produce(data)

    def arrive() -> None:
        deliver(into, in_flight)
        in_flight.clear()

    if head_first:
        out.set_head(b"{}")
    for kind, value in steps:
        if kind == "produce":
            if out.head is None:
                out.set_head(b"{}")
            produce(value)
        elif kind == "send":
            frames = out.frames(1)
            if not down:  # on a dropped tunnel they are lost: the RESUME says so
                in_flight.extend(frames)
        elif kind == "take":
            arrive()
            taken.extend(into.take())
            count = 0 if down else into.grant(1)  # no grant without a tunnel
            if count:
                out.on_window(count)
        elif kind == "drop" and not down:
            # The tunnel breaks: the last frames on it never arrive, the rest did.
            kept = len(in_flight) - min(value, len(in_flight))
            del in_flight[kept:]
            arrive()
            down = True
        elif kind == "resume":
            arrive()
            entry = into.resume_entry(1)
            out.on_resume(entry["received"], entry["delivered"], entry["head"])
            down = False
        # The sender keeps at most one window beyond what was acknowledged.
        assert out.sent - out.acked <= WINDOW
    if down:  # a new tunnel
        entry = into.resume_entry(1)
        out.on_resume(entry["received"], entry["delivered"], entry["head"])
    # At the end: the runtime finishes, the tunnel holds, the client reads it all.
    if out.head is None:
        out.set_head(b"{}")
    out.finish()
    for _ in range(len(produced) // WINDOW + 3):
        in_flight.extend(out.frames(1))
        arrive()
        taken.extend(into.take())
        count = into.grant(1)
        if count:
            out.on_window(count)
    assert into.phase is Phase.ENDED
    assert bytes(taken) == bytes(produced)
