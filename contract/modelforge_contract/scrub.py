"""Scrub a node's filesystem paths out of relayed bodies (docs/architecture.md §12).

Every path the caller names (the artifact root, the model directory, the model file, the
worker's own paths) is replaced by the deployment's name wherever it occurs in a body, so
a client learns nothing of the node's layout. Both sides may scrub: the guarantees do not
depend on how the bytes were chunked on the way.

What is matched: each path as bytes, longest first (a model directory inside the artifact
root becomes one name, not the name plus the rest), in any spelling a JSON string may give
it, chosen freely per character: the raw UTF-8, ``\\/`` for ``/`` (and ``\\"``, ``\\\\``),
or ``\\uXXXX`` with either case of hex (a surrogate pair beyond the BMP) — what Python's
``json.dumps`` (non-ASCII escaped), PHP (slashes escaped), Go (``<>&`` escaped) and the
raw-UTF-8 encoders of llama.cpp and vLLM emit. Matching is on substrings, not on path
components: with only ``/srv/models`` named, ``/srv/models/x.gguf`` becomes ``name/x.gguf``
(name the deeper paths too). Not matched: percent-encoding, a path escaped twice (JSON in
a JSON string), or a path spelled other than it was given (name its ``realpath`` too).

After one pass replaces what it found, passes repeat until none finds anything, so text a
replacement forms with its neighbours is caught too. The replacement is printable ASCII
without ``/``, ``\\`` or ``"``: it cannot start a match, keeps a JSON string valid and an
SSE event whole, and so the passes end.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

MAX_HELD_BYTES = 1024 * 1024  # the default bound on an incomplete SSE event held

_REPLACEMENT = re.compile(r"[\x20-\x7e]+")
_SHORT_ESCAPES = {"/": b"\\/", '"': b'\\"', "\\": b"\\\\"}


def _hex_units(code_point: int) -> list[int]:
    if code_point <= 0xFFFF:
        return [code_point]
    code_point -= 0x10000
    return [0xD800 + (code_point >> 10), 0xDC00 + (code_point & 0x3FF)]


def _escape_pattern(unit: int) -> bytes:
    digits = b"".join(
        b"[%s%s]" % (d.encode(), d.upper().encode()) if d.isalpha() else d.encode()
        for d in f"{unit:04x}"
    )
    return rb"\\u" + digits


def _char_spellings(char: str) -> tuple[bytes, int]:
    """A regex for every spelling of one character, and the longest spelling's length."""
    raw = char.encode("utf-8", "surrogateescape")
    spellings = [re.escape(raw)]
    longest = len(raw)
    if char in _SHORT_ESCAPES:
        spellings.append(re.escape(_SHORT_ESCAPES[char]))
        longest = max(longest, 2)
    units = _hex_units(ord(char))
    spellings.append(b"".join(_escape_pattern(unit) for unit in units))
    longest = max(longest, 6 * len(units))
    return b"(?:" + b"|".join(spellings) + b")", longest


def _normalised(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"not an absolute path: {path!r}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ValueError("a path with a control character")
    try:
        path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ValueError("a path that is not UTF-8 or surrogate-escaped bytes") from None
    stripped = path.rstrip("/")
    if len(stripped) < 2:
        raise ValueError("the root path would scrub every slash")
    return stripped


def _longest_spelling(path: str) -> int:
    return sum(_char_spellings(c)[1] for c in path)


def _trie_pattern(paths: Iterable[str]) -> bytes:
    """One regex for all paths, sharing their common prefixes (they all start with ``/``,
    which lets the regex engine skip to the next ``/`` or ``\\`` between tries).

    At each branch the deeper paths are tried first and the end of a shorter path last,
    so the longest path that matches at a position wins.
    """
    root = _Node()
    for path in paths:
        node = root
        for index, char in enumerate(path):
            node.deepest = max(node.deepest, len(path) - index)
            node = node.children.setdefault(char, _Node())
        node.ends = True
    return root.pattern()


class _Node:
    __slots__ = ("children", "deepest", "ends")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.deepest = 0  # the most characters of a path below this node
        self.ends = False

    def pattern(self) -> bytes:
        # A chain without branches is written in a loop: paths are up to PATH_MAX long.
        node, parts = self, []
        while len(node.children) == 1 and not node.ends:
            ((char, node),) = node.children.items()
            parts.append(_char_spellings(char)[0])
        branches = sorted(node.children.items(), key=lambda item: -item[1].deepest)
        alternatives = [_char_spellings(char)[0] + child.pattern() for char, child in branches]
        if node.ends:
            alternatives.append(b"")
        if len(alternatives) == 1:
            parts.append(alternatives[0])
        elif alternatives:
            parts.append(b"(?:" + b"|".join(alternatives) + b")")
        return b"".join(parts)


class _Matcher:
    """The compiled paths and replacement, shared by every scrubber of the same pair."""

    def __init__(self, paths: tuple[str, ...], replacement: str) -> None:
        if not isinstance(replacement, str) or not _REPLACEMENT.fullmatch(replacement):
            raise ValueError("the replacement must be printable ASCII")
        if any(c in replacement for c in '/\\"'):
            raise ValueError('the replacement may not hold "/", "\\" or \'"\'')
        self.replacement = replacement.encode("ascii")
        unique = {_normalised(p) for p in paths}
        self.longest = max((_longest_spelling(p) for p in unique), default=0)
        self.pattern = re.compile(_trie_pattern(unique)) if unique else None
        # The raw spellings, longest first, and the escapes that begin every other spelling
        # of a character these paths hold: data without any of those escapes can only hold
        # raw spellings, found by bytes.find (memmem) far faster than the regex scans.
        self.raw = sorted((p.encode("utf-8", "surrogateescape") for p in unique), key=len)[::-1]
        chars = set("".join(unique))
        self.escapes = [b"\\u", b"\\/"] + [_SHORT_ESCAPES[c] for c in '"\\' if c in chars]

    def _raw_only(self, data: bytes | bytearray) -> bool:
        return b"\\" not in data or not any(escape in data for escape in self.escapes)

    def _spans(self, data: bytes | bytearray) -> list[tuple[int, int]]:
        """Where the regex's left-to-right scan matches in ``data``: (start, end) pairs,
        leftmost first, the longest path at each start, none overlapping."""
        if self.pattern is None:
            return []
        if not self._raw_only(data):
            return [match.span() for match in self.pattern.finditer(data)]
        if b"/" not in data:  # every path starts with one
            return []
        starts: dict[int, int] = {}
        for raw in self.raw:  # longest first: the first path found at a start wins
            at = data.find(raw)
            while at >= 0:
                starts.setdefault(at, at + len(raw))
                at = data.find(raw, at + 1)
        spans, position = [], 0
        for start in sorted(starts):
            if start >= position:
                spans.append((start, starts[start]))
                position = starts[start]
        return spans

    def _replace(self, data: bytes | bytearray, spans: list[tuple[int, int]], end: int) -> bytes:
        parts, position = [], 0
        for start, stop in spans:
            parts += (data[position:start], self.replacement)
            position = stop
        parts.append(data[position:end])
        return b"".join(parts)

    def clean(self, data: bytes | bytearray) -> bytes:
        """``data`` with every spelling of every path replaced, until none is left."""
        data = bytes(data)
        while True:
            spans = self._spans(data)
            if not spans:
                return data
            data = self._replace(data, spans, len(data))

    def piece(self, data: bytes | bytearray) -> tuple[bytes, int]:
        """Scrub the front of an unfinished stream: (scrubbed bytes, how many input bytes).

        Keeps back ``longest - 1`` bytes, or fewer where a match runs past them: a match
        starting before that point lies whole in ``data``, so it is the match the whole
        stream's scan would make there, and nothing after the point is needed to decide it.
        """
        if self.pattern is None:
            return bytes(data), len(data)
        cut = len(data) - (self.longest - 1)
        spans = [span for span in self._spans(data) if span[0] < cut]
        end = max(cut, spans[-1][1]) if spans else cut
        out = self._replace(data, spans, end)
        return (self.clean(out) if spans else out), end


@functools.lru_cache(maxsize=128)
def _matcher(paths: tuple[str, ...], replacement: str) -> _Matcher:
    return _Matcher(paths, replacement)


def scrub_body(body: bytes, paths: Iterable[str], replacement: str) -> bytes:
    """A whole body (JSON or anything) with every path replaced; the caller fixes its
    Content-Length."""
    return _matcher(tuple(paths), replacement).clean(body)


def _last_event_end(buffer: bytearray, old: int) -> int:
    """Where the last complete SSE event in ``buffer`` ends, looking only at blank lines
    that end after ``old`` (the part before held none); 0 if none does.

    A blank line is two line endings in a row (CRLF, LF or CR), so an event ends after any
    run of two or more CR/LF bytes except a lone CRLF: ``\\n\\n``, ``\\r\\n\\r\\n`` and
    ``\\r\\r`` are the common ones. A run at the very end counts at once (a CR may be a
    line ending alone), so an event is never held back for the byte after it; a LF that
    then completes the CRLF goes out at once too (``SseScrubber.feed``).
    """
    low, high = max(0, old - 1), len(buffer)
    while high > low:
        last = max(buffer.rfind(b"\n", low, high), buffer.rfind(b"\r", low, high))
        if last < 0:
            return 0
        first = last
        while first > 0 and buffer[first - 1] in b"\r\n":
            first -= 1
        if last - first >= 1 and buffer[first : last + 1] != b"\r\n":
            return last + 1
        high = first
    return 0


class SseScrubber:
    """Scrub a server-sent event stream as it arrives, one complete event at a time.

    ``feed`` returns the scrubbed bytes of every event completed so far (the bytes up to
    the last blank line) and holds the incomplete rest; ``flush`` returns the rest at the
    end. No path has a CR or LF, so no spelling of one spans a blank line: scrubbing whole
    events catches every path however the chunks split it, and the output is the input
    with each event scrubbed on its own, whatever the chunking.

    The held event is bounded: once more than ``max_held`` bytes are held, everything but
    the last ``longest spelling - 1`` bytes goes out scrubbed (``at_event_boundary`` is
    then False until the event completes). Every path is still caught: the matches made
    are exactly those of a scan of the whole event, with the repeated passes confined to
    each piece. After every ``feed``, at most ``max_held`` bytes are held.
    """

    def __init__(
        self, paths: Iterable[str], replacement: str, *, max_held: int = MAX_HELD_BYTES
    ) -> None:
        self._matcher = _matcher(tuple(paths), replacement)
        if max_held < self._matcher.longest:
            raise ValueError(f"max_held must be at least {self._matcher.longest} bytes")
        self._max_held = max_held
        self._held = bytearray()
        self._consumed = 0
        self._at_boundary = True
        self._after_cr = False  # the last event went out ending in a CR

    @property
    def held(self) -> int:
        """Input bytes held back (of one incomplete event)."""
        return len(self._held)

    @property
    def consumed(self) -> int:
        """Input bytes whose scrubbed form has been returned (for resuming a stream)."""
        return self._consumed

    @property
    def at_event_boundary(self) -> bool:
        """True when the bytes returned so far end with a complete event (or are none):
        a keepalive comment may go out now."""
        return self._at_boundary

    def feed(self, chunk: bytes) -> bytes:
        """The scrubbed bytes of the events that ``chunk`` completes (often ``b""``)."""
        out = b""
        if self._after_cr and not self._held and chunk[:1] == b"\n":
            # The LF of a CRLF whose CR ended the last event: it goes out with that event.
            out, chunk = b"\n", chunk[1:]
            self._consumed += 1
        self._after_cr = False
        old = len(self._held)
        self._held += chunk
        end = _last_event_end(self._held, old)
        if end:
            out += self._matcher.clean(bytes(self._held[:end]))
            del self._held[:end]
            self._consumed += end
            self._at_boundary = True
            self._after_cr = out.endswith(b"\r") and not self._held
        if len(self._held) > self._max_held:
            piece, taken = self._matcher.piece(self._held)
            del self._held[:taken]
            self._consumed += taken
            self._at_boundary = self._after_cr = False
            out += piece
        return out

    def flush(self) -> bytes:
        """The scrubbed rest at the end of the stream."""
        out = self._matcher.clean(bytes(self._held))
        self._consumed += len(self._held)
        self._held = bytearray()
        self._at_boundary = True
        return out
