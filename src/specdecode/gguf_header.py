"""A GGUF file's metadata (its key-value header), read in a fraction of a second without the
`gguf` package, torch or any weights: what the command line checks before a model loads (a
chat template in `tokenizer.chat_template`), and what keys the cached tokenizer of a GGUF file
(`specdecode.backends.gguf_files.load_gguf_tokenizer`).

The `gguf` package's reader builds an array per item of every list field, which takes tens
of seconds for a vocabulary of 262,144 tokens (Gemma 3's); this walks the header once, keeping
each field's bytes and decoding only scalars and strings (lists keep their length only).

Layout (GGUF v2 and v3, either byte order): "GGUF", version (u32), tensor count (u64), field
count (u64), then each field: its name (u64 length, UTF-8 bytes), its type (u32), its value
(an array: item type u32, count u64, then the items).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecdecodeError

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# Fixed-size value types: GGUF's type number -> struct format
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class Field:
    """One metadata field: its bytes in the file (name, type and value, as stored), its value
    (a number, bool or text; None for a list) and how many items it holds (1 but for a list)."""

    name: str
    raw: bytes
    value: int | float | bool | str | None
    count: int = 1


def read_metadata(path: str | os.PathLike) -> dict[str, Field]:
    """The file's metadata fields by name; a SpecdecodeError for a file that is not GGUF or
    whose header is cut short or malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Walk(data).fields()
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise SpecdecodeError(f"cannot read the GGUF metadata of {path}: {exc}") from None


class _Walk:
    """A cursor over the header's bytes."""

    def __init__(self, data: mmap.mmap) -> None:
        if data[:4] != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.data = data
        version = struct.unpack_from("<I", data, 4)[0]
        self.order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads byte-swapped
        self.at = 8

    def take(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def text(self) -> str:
        length = int(self.take("Q"))
        end = self.at + length
        if end > len(self.data):
            raise ValueError("a text runs past the end of the file")
        value = self.data[self.at : end].decode("utf-8")
        self.at = end
        return value

    def fields(self) -> dict[str, Field]:
        self.take("Q")  # the tensor count: the tensors are not read
        count = int(self.take("Q"))
        fields: dict[str, Field] = {}
        for _ in range(count):
            start = self.at
            name = self.text()
            kind = int(self.take("I"))
            value, items = self.value(kind)
            if self.at > len(self.data):
                raise ValueError(f"the field {name} runs past the end of the file")
            fields[name] = Field(name, bytes(self.data[start : self.at]), value, items)
        return fields

    def value(self, kind: int) -> tuple[int | float | bool | str | None, int]:
        """A field's value and item count, the cursor moved past it; a list's items skipped."""
        if kind in SCALARS:
            return self.take(SCALARS[kind]), 1
        if kind == STRING:
            return self.text(), 1
        if kind != ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, items = int(self.take("I")), int(self.take("Q"))
        if item in SCALARS:
            self.at += items * struct.calcsize(SCALARS[item])
        elif item == STRING:  # the vocabulary: hundreds of thousands of texts, skipped by length
            length, data, at = struct.Struct(self.order + "Q").unpack_from, self.data, self.at
            for _ in range(items):
                at += 8 + length(data, at)[0]
            self.at = at
        elif item == ARRAY:  # lists of lists: none in llama.cpp's files, but valid GGUF
            for _ in range(items):
                self.value(ARRAY)
        else:
            raise ValueError(f"unknown value type {item}")
        return None, items


def chat_template(path: str | os.PathLike) -> str | None:
    """The GGUF file's chat template (`tokenizer.chat_template`), None where it has none."""
    field = read_metadata(path).get("tokenizer.chat_template")
    return field.value if field is not None and isinstance(field.value, str) and field.value else None
