"""A lossless, compact container for safetensors files of bf16 weights, and the directories holding them.

Why: the repository, bundled models included, must travel to machines that take at most 64 MiB,
and general-purpose compressors do not take raw bf16 far enough (the 68.2 MB target: xz 48.1 MB,
zlib 54.2 MB). Each bf16 value is split into two byte planes: its 8 exponent bits, few of them
in use, which a Huffman code (deflate without matching) takes to about 2.6 bits; and its sign
and 7 mantissa bits, which are noise and are kept as they are (unless a code finds otherwise).
That packs the target in 45.2 MB, a few percent above the exponents' entropy, and decodes it
in about half a second. Other tensors, gaps and the header are stored whole; every chunk takes
whichever of raw, deflate and xz is smallest.

A container is `MAGIC`, the length of a JSON index (8 bytes, little-endian), the index and the
chunks it lists. The index holds the original file's size and SHA-256, and decoding checks
both: a container that does not decode to exactly the file it was made from is an error, never
a silently different model.

Nothing but the standard library and numpy is needed to decode, so installations need no
extra package; `materialize` gives loaders an ordinary Hugging Face directory in the user's
cache, decoded once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import lzma
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from specdecode.errors import SpecdecodeError
from specdecode.local import cache_dir

MAGIC = b"SDPACK1\n"
SUFFIX = ".packed"  # model.safetensors.packed decodes to model.safetensors

Chunk = dict  # an index entry: {"codec": name, "length": bytes stored, "size": bytes decoded}


def _encodings(data: bytes) -> Iterator[tuple[str, bytes]]:
    yield "raw", data
    huffman = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_HUFFMAN_ONLY)
    yield "zlib", huffman.compress(data) + huffman.flush()
    yield "zlib", zlib.compress(data, 9)
    yield "xz", lzma.compress(data)


def _encode(data: bytes) -> tuple[Chunk, bytes]:
    """The smallest encoding of one chunk, and its index entry."""
    codec, stored = min(_encodings(data), key=lambda pair: len(pair[1]))
    return {"codec": codec, "length": len(stored), "size": len(data)}, stored


def _decode(chunk: Chunk, stored: bytes) -> bytes:
    codec = chunk["codec"]
    try:
        if codec == "raw":
            data = stored
        elif codec == "zlib":
            data = zlib.decompress(stored)
        elif codec == "xz":
            data = lzma.decompress(stored, format=lzma.FORMAT_XZ)
        else:
            raise SpecdecodeError(f"unknown codec {codec!r}")
    except (zlib.error, lzma.LZMAError) as exc:
        raise SpecdecodeError(f"a {codec} chunk does not decode: {exc}") from None
    if len(data) != chunk["size"]:
        raise SpecdecodeError(f"a {codec} chunk decodes to {len(data)} bytes, not {chunk['size']}")
    return data


def _segments(data: bytes) -> Iterator[tuple[bool, int, int]]:
    """(is bf16, start, end) spans covering a safetensors file in order: the header, then each
    tensor and any gap; bf16 tensors are the ones split into planes."""
    try:
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + n])
        tensors = sorted(
            (8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1], info["dtype"])
            for name, info in header.items()
            if name != "__metadata__"
        )
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise SpecdecodeError(f"not a safetensors file: {exc}") from None
    cursor = 8 + n
    yield False, 0, cursor
    for start, end, dtype in tensors:
        if start < cursor or end > len(data) or end < start:
            raise SpecdecodeError("not a safetensors file: its tensors overlap or run past its end")
        if start > cursor:
            yield False, cursor, start
        yield dtype == "BF16" and (end - start) % 2 == 0, start, end
        cursor = end
    if cursor < len(data):
        yield False, cursor, len(data)


def pack(source: Path, destination: Path) -> None:
    """Write the container of the safetensors file `source` to `destination`."""
    data = source.read_bytes()
    segments, payload = [], []
    for bf16, start, end in _segments(data):
        if bf16:
            values = np.frombuffer(data, dtype="<u2", count=(end - start) // 2, offset=start)
            exponent = (values >> 7).astype(np.uint8)  # the sign is shifted out by the cast
            sign_mantissa = ((values >> 8) & 0x80 | values & 0x7F).astype(np.uint8)
            planes = [exponent.tobytes(), sign_mantissa.tobytes()]
        else:
            planes = [data[start:end]]
        chunks = []
        for plane in planes:
            chunk, stored = _encode(plane)
            chunks.append(chunk)
            payload.append(stored)
        segments.append({"bf16": bf16, "chunks": chunks})
    index = json.dumps(
        {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "segments": segments}
    ).encode()
    destination.write_bytes(b"".join([MAGIC, struct.pack("<Q", len(index)), index, *payload]))


def read_index(container: Path, data: bytes | None = None) -> tuple[dict, int]:
    """A container's index and where its chunks start; reads only the head unless given the data."""
    if data is None:
        with open(container, "rb") as file:
            head = file.read(len(MAGIC) + 8)
            n = struct.unpack_from("<Q", head, len(MAGIC))[0] if len(head) == len(MAGIC) + 8 else 0
            data = head + file.read(n)
    start = len(MAGIC) + 8
    if data[: len(MAGIC)] != MAGIC or len(data) < start:
        raise SpecdecodeError(f"{container} is not a packed safetensors file")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    try:
        index = json.loads(data[start : start + n])
        if not isinstance(index["size"], int) or not isinstance(index["sha256"], str):
            raise TypeError("size or sha256 of the wrong type")
    except (ValueError, TypeError, KeyError) as exc:
        raise SpecdecodeError(f"{container}: the index of the packed file is damaged ({exc})") from None
    return index, start + n


def unpack(container: Path, destination: Path) -> None:
    """Decode a container into `destination`, checking the result against the original's SHA-256."""
    data = container.read_bytes()
    index, offset = read_index(container, data)
    pieces = []
    try:
        for segment in index["segments"]:
            planes = []
            for chunk in segment["chunks"]:
                stored = data[offset : offset + chunk["length"]]
                if len(stored) != chunk["length"]:
                    raise SpecdecodeError("the file is truncated")
                planes.append(np.frombuffer(_decode(chunk, stored), dtype=np.uint8))
                offset += chunk["length"]
            if segment["bf16"]:
                exponent, sign_mantissa = planes
                values = sign_mantissa.astype("<u2")
                pieces.append(
                    ((values & 0x80) << 8 | exponent.astype("<u2") << 7 | values & 0x7F).view(np.uint8)
                )
            else:
                (plane,) = planes
                pieces.append(plane)
    except SpecdecodeError as exc:
        raise SpecdecodeError(f"{container} is damaged: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdecodeError(f"{container} is damaged: its index does not describe it ({exc})") from None
    out = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)
    if out.size != index["size"] or offset != len(data):
        raise SpecdecodeError(f"{container} is damaged: its chunks do not add up to the original file")
    if hashlib.sha256(out).hexdigest() != index["sha256"]:
        raise SpecdecodeError(f"{container} does not decode to the file it was made from (SHA-256 differs)")
    out.tofile(destination)


def cache_root() -> Path:
    """Where decoded directories are kept: $XDG_CACHE_HOME/specdecode/models, ~/.cache by default."""
    return cache_dir("models")


def _sources(directory: Path, extra: Mapping[str, Path]) -> dict[str, Path]:
    """Each file of the decoded directory -> the file it comes from (a container or a copy)."""
    files = {p.name.removesuffix(SUFFIX): p for p in sorted(directory.iterdir()) if p.is_file()}
    return {**files, **extra}


def _key(sources: Mapping[str, Path]) -> str:
    """A digest of what the decoded directory holds: a container counts by its original's SHA-256
    (in its index), every other file by its bytes."""
    digest = hashlib.sha256(MAGIC)
    for name, path in sorted(sources.items()):
        content = read_index(path)[0]["sha256"].encode() if path.name.endswith(SUFFIX) else path.read_bytes()
        digest.update(f"{name}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()


def _sizes(sources: Mapping[str, Path]) -> dict[str, int]:
    return {
        name: read_index(path)[0]["size"] if path.name.endswith(SUFFIX) else path.stat().st_size
        for name, path in sources.items()
    }


def _complete(directory: Path, sizes: Mapping[str, int]) -> bool:
    try:
        return all((directory / name).stat().st_size == size for name, size in sizes.items())
    except OSError:
        return False


def _build(root: Path, final: Path, sources: Mapping[str, Path], sizes: Mapping[str, int]) -> Path:
    """Decode into a fresh directory beside `final`, then rename it into place: a directory at
    `final` is always whole, whoever else is building it at the same time."""
    if _complete(final, sizes):
        return final
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        for name, path in sources.items():
            if path.name.endswith(SUFFIX):
                unpack(path, building / name)
            else:
                shutil.copyfile(path, building / name)
        if final.exists() and not _complete(final, sizes):  # damaged: moved aside, then replaced
            aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.rename(final, aside / "damaged")
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(building, final)
        except OSError:
            if not _complete(final, sizes):  # else another process's build came first: ours goes
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)  # gone once renamed
    return final


def materialize(directory: Path, extra: Mapping[str, Path] | None = None) -> Path:
    """An ordinary Hugging Face directory with `directory`'s files, each container decoded, plus
    the `extra` files (name -> a file stored elsewhere), or `directory` itself when it has neither.

    Decoded once into the user's cache, in a directory named by the digest of its contents, so
    an updated model is decoded again; where the cache cannot be written, into a temporary one."""
    sources = _sources(directory, extra or {})
    if not extra and not any(path.name.endswith(SUFFIX) for path in sources.values()):
        return directory
    sizes, name = _sizes(sources), f"{directory.name}-{_key(sources)[:24]}"
    try:
        root = cache_root()
        return _build(root, root / name, sources, sizes)
    except (OSError, RuntimeError):  # RuntimeError: no home directory to find the cache in
        owner = os.getuid() if hasattr(os, "getuid") else "user"
        fallback = Path(tempfile.gettempdir()) / f"specdecode-{owner}" / "models"
        try:
            return _build(fallback, fallback / name, sources, sizes)
        except OSError as exc:
            raise SpecdecodeError(f"cannot decode {directory} into the cache or {fallback}: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    """python -m specdecode.backends.packed_weights SRC DST: pack a safetensors file (and check it)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("source", type=Path, help="a safetensors file")
    parser.add_argument("destination", type=Path, help=f"the container to write (name it ...{SUFFIX})")
    args = parser.parse_args(argv)
    pack(args.source, args.destination)
    with tempfile.TemporaryDirectory() as scratch:
        unpack(args.destination, Path(scratch) / args.source.name)
    print(
        f"{args.source} ({args.source.stat().st_size} bytes) -> {args.destination} "
        f"({args.destination.stat().st_size} bytes)"
    )


if __name__ == "__main__":
    main()
