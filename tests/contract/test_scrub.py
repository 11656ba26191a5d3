"""Path scrubbing: every spelling of a node path becomes the deployment's name, per complete
SSE event or over a whole body, however the chunks split it, with nothing else changed."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from modelforge_contract.scrub import MAX_HELD_BYTES, SseScrubber, scrub_body

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython

ROOT = "/var/lib/modelforge-artifacts"
MODEL_DIR = f"{ROOT}/models/0a1b2c3d"
MODEL_FILE = f"{MODEL_DIR}/tiny-llama.Q4_K_M.gguf"
WORKER = "/opt/modelforge/worker"
PATHS = [ROOT, MODEL_DIR, MODEL_FILE, WORKER]
NAME = "tiny"
TERMINATORS = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n"]


def spellings(path: str) -> list[bytes]:
    """What runtimes emit for the path: raw, JSON with escaped slashes, JSON \\u escapes."""
    raw = path.encode()
    ascii_json = json.dumps(path)[1:-1].encode()  # non-ASCII as \\u (lowercase hex)
    return [
        raw,
        raw.replace(b"/", b"\\/"),
        ascii_json,
        ascii_json.replace(b"/", b"\\/").replace(b"\\u00e8", b"\\u00E8"),
        raw.replace(b"/", b"\\u002f", 1).replace(b"/", b"\\u002F"),
    ]


def leaks(out: bytes, paths: list[str]) -> list[bytes]:
    return [s for p in paths for s in spellings(p) if s in out]


def event(text: str, terminator: bytes = b"\r\n\r\n") -> bytes:
    return b"data: " + json.dumps({"content": text}).encode() + terminator


# -- whole bodies ------------------------------------------------------------------------


def test_a_json_body_keeps_its_shape_and_names_the_deployment_instead_of_each_path():
    body = json.dumps(
        {
            "model": MODEL_FILE,
            "owned_by": "llamacpp",
            "meta": {"dir": MODEL_DIR, "root": ROOT, "worker": f"{WORKER}/run.sock"},
            "error": f"failed to open {MODEL_FILE}: no such file",
        }
    ).encode()
    out = scrub_body(body, PATHS, NAME)
    assert json.loads(out) == {
        "model": NAME,
        "owned_by": "llamacpp",
        "meta": {"dir": NAME, "root": NAME, "worker": f"{NAME}/run.sock"},
        "error": f"failed to open {NAME}: no such file",
    }
    assert leaks(out, PATHS) == []


def test_the_longest_path_wins_where_one_lies_inside_another():
    # The model directory lies inside the artifact root: one name, not "name/models/…".
    assert scrub_body(MODEL_DIR.encode(), [ROOT, MODEL_DIR], NAME) == NAME.encode()
    assert scrub_body(MODEL_DIR.encode(), [MODEL_DIR, ROOT], NAME) == NAME.encode()
    assert scrub_body(f"{MODEL_DIR}/x".encode(), [ROOT, MODEL_DIR], NAME) == b"tiny/x"
    # Only the root named: the rest of a deeper path stays (documented: name them all).
    assert scrub_body(MODEL_FILE.encode(), [ROOT], NAME) == b"tiny/models/0a1b2c3d/" + (
        b"tiny-llama.Q4_K_M.gguf"
    )
    assert scrub_body(f"{ROOT}2".encode(), [ROOT], NAME) == b"tiny2"  # substrings


@pytest.mark.parametrize("index", range(5))
def test_every_json_spelling_of_a_path_is_caught(index):
    path = "/srv/modèles/🦙 q4"
    spelled = spellings(path)[index]
    body = b'{"path": "' + spelled + b'", "n": 1}'
    out = scrub_body(body, [path], NAME)
    assert out == b'{"path": "tiny", "n": 1}'


def test_escapes_chosen_character_by_character_and_other_escapes_are_caught():
    path = '/srv/a"b\\c&d'
    for spelled in [
        b'/srv/a\\"b\\\\c&d',  # JSON's mandatory escapes of " and \
        b"\\/srv\\/a\\u0022b\\u005cc\\u0026d",  # every one a \\u escape (Go's \\u0026)
        b'/\\u0073rv/a\\"b\\\\c\\u0026d',
        b'/srv/a"b\\c&d',  # raw
    ]:
        assert scrub_body(b"<" + spelled + b">", [path], NAME) == b"<tiny>", spelled


def test_a_path_is_given_with_or_without_its_trailing_slash():
    assert scrub_body(b"/srv/models/x", ["/srv/models/"], NAME) == b"tiny/x"


def test_a_replacement_never_leaves_a_path_behind():
    # One pass turns "/x//y" into "/x/name", itself a path: the passes repeat.
    assert scrub_body(b"a /x//y b", ["/x/name", "/y"], "name") == b"a name b"
    scrubber = SseScrubber(["/x/name", "/y"], "name")
    assert scrubber.feed(b"data: /x//y\n\n") == b"data: name\n\n"


def test_bad_paths_and_replacements_are_refused():
    for paths, replacement in [
        (["relative/path"], NAME),
        (["/"], NAME),
        (["//"], NAME),
        (["/a\nb"], NAME),
        ([ROOT], "a/b"),
        ([ROOT], "a\\b"),
        ([ROOT], 'a"b'),
        ([ROOT], "a\nb"),
        ([ROOT], ""),
        ([ROOT], "modèle"),
    ]:
        with pytest.raises(ValueError):
            scrub_body(b"x", paths, replacement)


def test_no_paths_changes_nothing():
    assert scrub_body(b"/var/lib/x", [], NAME) == b"/var/lib/x"
    assert SseScrubber([], NAME).feed(b"data: /a\n\n") == b"data: /a\n\n"


def test_a_path_as_long_as_path_max():
    path = "/a" + "/bcdefgh" * 511
    assert len(path) > 4000
    assert scrub_body(b"[" + path.encode() + b"]", [path, "/a/bcdefgh"], NAME) == b"[tiny]"


# -- SSE streams -------------------------------------------------------------------------


@pytest.mark.parametrize("terminator", TERMINATORS, ids=repr)
def test_each_event_is_returned_as_soon_as_it_completes(terminator):
    scrubber = SseScrubber(PATHS, NAME)
    first = event(f"loaded {MODEL_FILE}", terminator)
    second = event("hello", terminator)
    assert scrubber.feed(first + second[:10]) == event("loaded tiny", terminator)
    assert scrubber.held == 10 and scrubber.at_event_boundary
    assert scrubber.feed(second[10:]) == second
    assert scrubber.held == 0
    assert scrubber.flush() == b""


def test_an_event_is_held_until_its_blank_line_arrives_and_no_longer():
    scrubber = SseScrubber(PATHS, NAME)
    assert scrubber.feed(b"data: a\r\n") == b""  # one line ending is no blank line
    assert scrubber.feed(b"data: b\r\n\r") == b"data: a\r\ndata: b\r\n\r"  # CR ends it
    assert scrubber.feed(b"\n") == b"\n"  # the LF that completes the CRLF, at once
    assert scrubber.feed(b"data: c\r\n\r\n") == b"data: c\r\n\r\n"
    assert scrubber.feed(b": comment\n\ndata: d\n") == b": comment\n\n"
    assert scrubber.feed(b"\r\n\r") == b"data: d\n\r\n\r"
    assert scrubber.feed(b"\ndata: e\n\n") == b"\ndata: e\n\n"  # the LF and what follows
    assert scrubber.feed(b"\n") == b""  # after that, a LF is the next event's again
    assert scrubber.flush() == b"\n"


@pytest.mark.parametrize("terminator", TERMINATORS, ids=repr)
@pytest.mark.parametrize("spelling", range(5))
def test_a_path_split_at_every_byte_across_two_chunks_is_caught(terminator, spelling):
    spelled = spellings(MODEL_FILE)[spelling]
    stream = b'data: {"model": "' + spelled + b'"}' + terminator
    expected = b'data: {"model": "tiny"}' + terminator
    for cut in range(len(stream) + 1):
        scrubber = SseScrubber(PATHS, NAME)
        out = scrubber.feed(stream[:cut])
        out += scrubber.feed(stream[cut:])
        assert out == expected, cut  # complete without a flush
        assert scrubber.flush() == b""


def test_a_stream_of_events_cut_anywhere_into_two_chunks():
    stream = b"".join(event(f"at {MODEL_DIR}", t) for t in TERMINATORS * 2)
    expected = scrub_body(stream, PATHS, NAME)
    for cut in range(len(stream) + 1):
        scrubber = SseScrubber(PATHS, NAME)
        first = scrubber.feed(stream[:cut])
        assert first == expected[: len(first)], cut
        assert first + scrubber.feed(stream[cut:]) == expected, cut  # no flush needed
        assert scrubber.held == 0


def test_a_stream_fed_one_byte_at_a_time():
    stream = b"".join(event(f"{p} and {p}", t) for p in PATHS for t in TERMINATORS)
    scrubber = SseScrubber(PATHS, NAME)
    out = b"".join(scrubber.feed(stream[i : i + 1]) for i in range(len(stream)))
    assert out + scrubber.flush() == scrub_body(stream, PATHS, NAME)
    assert leaks(out, PATHS) == []
    assert scrubber.consumed == len(stream)


def test_what_was_consumed_and_whether_a_keepalive_may_go_out():
    scrubber = SseScrubber(PATHS, NAME)
    first = event(ROOT, b"\n\n")
    scrubber.feed(first + b"data: x")
    assert scrubber.consumed == len(first) and scrubber.held == 7
    assert scrubber.at_event_boundary
    scrubber.flush()
    assert scrubber.consumed == len(first) + 7


def test_a_long_event_is_not_held_past_the_bound_and_its_paths_are_still_caught():
    longest = max(len(s) for s in spellings(MODEL_FILE))
    bound = 4096
    body = b"".join(b"x" * (i % 97) + spellings(MODEL_FILE)[i % 5] for i in range(400))
    stream = b"data: " + body + b"\n\n"
    scrubber = SseScrubber(PATHS, NAME, max_held=bound)
    out = b""
    for i in range(0, len(stream), 1000):
        out += scrubber.feed(stream[i : i + 1000])
        assert scrubber.held <= bound
        if out and i + 1000 < len(stream):
            assert not scrubber.at_event_boundary  # mid-event: no keepalive now
    assert scrubber.at_event_boundary and scrubber.held == 0
    assert out == scrub_body(stream, PATHS, NAME)
    assert leaks(out, PATHS) == [] and out.count(b"tiny") == 400
    assert len(stream) > 10 * bound and longest < bound


def test_the_default_bound_is_a_mebibyte_and_must_hold_the_longest_spelling():
    assert MAX_HELD_BYTES == 1024 * 1024
    scrubber = SseScrubber(PATHS, NAME)
    scrubber.feed(b"data: " + b"y" * (2 * MAX_HELD_BYTES))
    assert scrubber.held <= MAX_HELD_BYTES
    with pytest.raises(ValueError, match="max_held"):
        SseScrubber(PATHS, NAME, max_held=10)


# -- properties --------------------------------------------------------------------------

_texts = st.sampled_from(
    ["hello", "a/b", " /var/lib", "/opt/modelforge/", "é", "\\/", "\\u002f", "{", '"', ":"]
)
_pieces = st.one_of(
    _texts.map(str.encode),
    st.sampled_from([s for p in PATHS for s in spellings(p)]),
    st.sampled_from(TERMINATORS + [b"\r\n", b"\n", b"\r"]),
    st.binary(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_pieces, max_size=40),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    bound=st.sampled_from([None, 512, 2048]),
)
def test_any_chunking_gives_the_whole_body_scrub_and_leaks_nothing(pieces, cuts, bound):
    stream = b"".join(pieces)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    kwargs = {} if bound is None else {"max_held": bound}
    scrubber = SseScrubber(PATHS, "DEPLOY", **kwargs)
    out = b""
    for start, end in zip(points, points[1:], strict=False):
        out += scrubber.feed(stream[start:end])
        assert scrubber.held <= (bound or MAX_HELD_BYTES)
    out += scrubber.flush()
    assert out == scrub_body(stream, PATHS, "DEPLOY")
    assert leaks(out, PATHS) == []


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.binary(max_size=300),
        st.lists(
            st.one_of(
                st.sampled_from(
                    [s[:-1] for p in (ROOT, WORKER) for s in spellings(p)]
                ),  # near misses
                st.binary(max_size=10),
            ),
            max_size=20,
        ).map(b"".join),
    ),
    cut=st.integers(0, 400),
)
def test_text_without_any_path_is_unchanged(text, cut):
    assume(not any(p.encode() in text for p in PATHS))
    assume(leaks(text, PATHS) == [])
    assert scrub_body(text, PATHS, NAME) == text
    scrubber = SseScrubber(PATHS, NAME, max_held=1024)
    assert scrubber.feed(text[:cut]) + scrubber.feed(text[cut:]) + scrubber.flush() == text


def _regex_only(body: bytes, paths: list[str], replacement: str) -> bytes:
    """The reference: the regex alone, pass after pass (what the fast path must equal)."""
    from modelforge_contract.scrub import _matcher

    pattern = _matcher(tuple(paths), replacement).pattern
    while True:
        body, found = pattern.subn(replacement.encode(), body)
        if not found:
            return body


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.sampled_from([p.encode() for p in PATHS] + [b"/", b"\\n", b"\\", b"x/"]),
            st.sampled_from([s for p in PATHS for s in spellings(p)]),
            st.binary(max_size=6),
        ),
        max_size=30,
    ),
    paths=st.sampled_from([PATHS, [ROOT], [WORKER, "/opt/modelforge"], ['/a"b', "/c\\d"]]),
)
def test_the_fast_search_for_raw_paths_finds_exactly_what_the_regex_finds(pieces, paths):
    # Data with no escape that could begin a spelled character is searched with bytes.find;
    # data with one goes to the regex. Either way the answer is the regex's.
    body = b"".join(pieces)
    assert scrub_body(body, paths, NAME) == _regex_only(body, paths, NAME)
