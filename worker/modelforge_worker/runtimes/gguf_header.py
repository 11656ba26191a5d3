"""The one fact a split's main server needs from its GGUF: how many layers the model has.

GGUF (llama.cpp's ``gguf.md``): the magic ``GGUF``, a u32 version (2 or 3), u64 tensor and
key-value counts, then the key-value pairs, each a u64-length key, a u32 type and the value.
Only the header is read, and at most MAX_HEADER_BYTES of it: a value that would run past
that, an unknown type or a short file is a GgufError.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

MAX_HEADER_BYTES = 64 * 1024 * 1024  # tokenizer vocabularies make headers of tens of MB
MAX_KEYS = 1 << 16
# GGUF value types: their sizes, or None for a string (8) or an array (9).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: None, 9: None, 10: 8, 11: 8, 12: 8}
_UINTS = {0: "<B", 2: "<H", 4: "<I", 10: "<Q", 1: "<b", 3: "<h", 5: "<i", 11: "<q"}


class GgufError(Exception):
    """The file is not a GGUF whose header says how many layers it has."""


class _Reader:
    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.read_bytes = handle, 0

    def take(self, count: int) -> bytes:
        self.read_bytes += count
        if self.read_bytes > MAX_HEADER_BYTES:
            raise GgufError(f"the header is longer than {MAX_HEADER_BYTES} bytes")
        data = self.handle.read(count)
        if len(data) != count:
            raise GgufError("the file ends inside its header")
        return data

    def number(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.number("<Q"))

    def skip(self, kind: int) -> None:
        if kind == 8:
            self.string()
        elif kind == 9:
            inner, count = self.number("<I"), self.number("<Q")
            if inner not in _SIZES:
                raise GgufError(f"an array of unknown type {inner}")
            size = _SIZES[inner]
            if size is not None:
                self.take(size * count)
            else:
                for _ in range(count):
                    self.skip(inner)
        elif kind in _SIZES:
            self.take(_SIZES[kind] or 0)
        else:
            raise GgufError(f"a value of unknown type {kind}")


def layer_count(path: Path) -> int:
    """``<architecture>.block_count`` of the GGUF at ``path``."""
    with path.open("rb") as handle:
        reader = _Reader(handle)
        if reader.take(4) != b"GGUF":
            raise GgufError(f"{path.name} is not a GGUF file")
        if reader.number("<I") not in (2, 3):
            raise GgufError(f"{path.name} is a GGUF version this worker does not read")
        reader.number("<Q")  # tensors
        keys = reader.number("<Q")
        if keys > MAX_KEYS:
            raise GgufError(f"{path.name} says it has {keys} keys")
        for _ in range(keys):
            key, kind = reader.string(), reader.number("<I")
            if key.endswith(b".block_count") and kind in _UINTS:
                count = reader.number(_UINTS[kind])
                if count <= 0:
                    raise GgufError(f"{path.name} says it has {count} layers")
                return count
            reader.skip(kind)
    raise GgufError(f"{path.name} does not say how many layers it has")
