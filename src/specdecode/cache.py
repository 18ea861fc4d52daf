"""What the package keeps in the user's cache ($XDG_CACHE_HOME/specdecode, ~/.cache by default):
its kinds, what each holds and how big it is, the limit on what is written there, and clearing.

Most of what is kept is small (pass timings, tokenizers), but a GGUF copy of a Hugging Face
directory (`specdecode.backends.hf_gguf`) is as big as the model's weights, so nothing of that
size is written without room: `room_for` refuses a file that would take the whole cache past
SPECDECODE_CACHE_LIMIT (8 GiB unless set; 0 writes none) or leave less than FREE_MARGIN free on
its disk. `specdecode cache list|clear` shows and removes what is kept.

Standard library only: the command line's parsers read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecdecodeError, write_atomically
from specdecode.local import cache_dir

LIMIT_VARIABLE = "SPECDECODE_CACHE_LIMIT"
DEFAULT_LIMIT = 8 * 2**30
FREE_MARGIN = 2**30  # left free on the cache's disk after a write
UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)

# Each kind of thing kept: its folder under the cache, and what it is.
KINDS = {
    "gguf-models": "GGUF copies of Hugging Face directories, for llama.cpp's kernels (--backend auto)",
    "models": "the bundled models, decoded from their packed weights",
    "gguf-tokenizers": "tokenizers built from GGUF files' vocabularies",
    "pass-costs": "pass timings and llama.cpp's row-probe verdicts, per model and machine",
    "llama-kernels": "llama.cpp's CPU kernels built for this CPU (specdecode kernels --build)",
}


SOURCES = "sources.json"  # in gguf-models: each GGUF copy's name -> the directory it was written from
NOTES = {  # what a bookkeeping file in gguf-models is, by its ending
    "file-hashes.json": "SHA-256s of the copied directories' files (so unchanged ones are not read again)",
    SOURCES: "the directory each copy was written from",
    ".tokenizer-differs": "verdict: llama.cpp tokenizes this directory otherwise (it stays on PyTorch)",
    ".rows-differ": "verdict: llama.cpp rounds this target's rows by pass size (it stays on PyTorch)",
}


@dataclass(frozen=True)
class Entry:
    """One thing kept: a file or a folder directly under a kind's folder."""

    path: Path
    size: int  # bytes, a folder's files summed
    used: float  # when last read or written (seconds since the epoch): its newest access time


def root() -> Path:
    """$XDG_CACHE_HOME/specdecode, where every kind's folder lives."""
    return cache_dir("")


def entries(kind: str) -> list[Entry]:
    """What `kind`'s folder holds, largest first (empty where it does not exist)."""
    try:
        children = list(cache_dir(kind).iterdir())
    except OSError:
        return []
    found = [Entry(path, *_size_and_use(path)) for path in children]
    return sorted(found, key=lambda entry: (-entry.size, entry.path.name))


def describe(kind: str, path: Path) -> str:
    """What one thing kept is, where more can be said than its kind: the directory a GGUF copy
    was written from, which bundled model a decoded folder is, a bookkeeping file's purpose."""
    name = path.name
    if kind == "gguf-models":
        if name.endswith(".gguf"):
            source = _sources(path.parent).get(name)
            return f"copy of {source}" if source else "a GGUF copy (its directory unrecorded)"
        return next((what for ending, what in NOTES.items() if name.endswith(ending)), "")
    if kind == "models" and path.is_dir():
        role = name.split("-")[0]
        return f"the bundled {'EAGLE-3 head' if role == 'eagle3' else f'{role} model'}"
    return ""


def record_source(copy: Path, source: Path) -> None:
    """Remember which directory the GGUF copy `copy` was written from (for `describe`)."""
    index = copy.parent / SOURCES
    sources = _sources(copy.parent)
    sources[copy.name] = str(source.resolve())
    sources = {name: where for name, where in sources.items() if (copy.parent / name).exists()}
    text = json.dumps(sources, indent=1).encode()
    with contextlib.suppress(OSError, SpecdecodeError):
        write_atomically(index, "cache index", lambda file: file.write(text))


def _sources(folder: Path) -> dict[str, str]:
    try:
        sources = json.loads((folder / SOURCES).read_text())
    except (OSError, ValueError):
        return {}
    return sources if isinstance(sources, dict) else {}


def others() -> list[Path]:
    """Folders and files under the cache that no kind names (left by another version)."""
    try:
        return sorted(path for path in root().iterdir() if path.name not in KINDS)
    except OSError:
        return []


def total_size() -> int:
    """Bytes the whole cache holds, every kind and anything else under it."""
    try:
        return sum(_size_and_use(path)[0] for path in root().iterdir())
    except OSError:
        return 0


def clear(kind: str) -> int:
    """Remove `kind`'s folder and everything in it; the bytes it held. Another run using a file
    kept there keeps it open; the next run writes or decodes again what it needs."""
    size = sum(entry.size for entry in entries(kind))
    shutil.rmtree(cache_dir(kind), ignore_errors=True)
    return size


def limit() -> int:
    """The most bytes the cache may hold after a large write (SPECDECODE_CACHE_LIMIT)."""
    text = os.environ.get(LIMIT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_LIMIT
    try:
        return parse_size(text)
    except ValueError:
        raise SpecdecodeError(
            f"{LIMIT_VARIABLE}={text!r} is not a size: give bytes or a number with K, M, G or T "
            "(powers of 1024), e.g. 20G; 0 writes no model copy"
        ) from None


def parse_size(text: str) -> int:
    """Bytes from "12345", "500M", "8G", "8GiB", "1.5 GB" (units are powers of 1024)."""
    match = SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(text)
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def format_size(size: float) -> str:
    """1234567 -> "1.2 MiB": three significant digits at most, in the unit that fits."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    unit = units.pop(0)
    while size >= 1024 and units:
        size, unit = size / 1024, units.pop(0)
    return f"{size:.0f} {unit}" if unit == "B" or size >= 100 else f"{size:.3g} {unit}"


def room_for(size: int) -> str | None:
    """Why `size` more bytes may not be written into the cache, or None where they may: the
    whole cache past `limit()`, or less than FREE_MARGIN left free on its disk."""
    ceiling = limit()
    held = total_size()
    if held + size > ceiling:
        already = f", with {format_size(held)} already kept" if held else ""
        return (
            f"a {format_size(size)} copy would pass the cache limit of {format_size(ceiling)}{already} "
            f"({LIMIT_VARIABLE}; see `specdecode cache list`)"
        )
    where = root()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if size + FREE_MARGIN > free:
        return f"a {format_size(size)} copy does not fit on the disk ({format_size(free)} free at {where})"
    return None


def _size_and_use(path: Path) -> tuple[int, float]:
    """(bytes, newest access time) of a file, or of a folder's files (links not followed)."""
    try:
        if not path.is_dir() or path.is_symlink():
            stat = path.lstat()
            return stat.st_size, stat.st_atime
        size, used = 0, path.stat().st_atime
        for folder, _, files in os.walk(path):
            for name in files:
                stat = Path(folder, name).lstat()
                size, used = size + stat.st_size, max(used, stat.st_atime)
        return size, used
    except OSError:  # removed while read, by another run
        return 0, 0.0
