"""Hugging Face directories on llama.cpp's kernels: the directory written once as a GGUF file by
our own writer (`export_gguf`, the directory's vocabulary kept) and kept in the cache.

On a CPU llama.cpp decodes a Llama-family model in 1.6-3.2x fewer CPU-seconds a token than
the PyTorch forwards (docs/gguf.md), so `--backend auto` runs a directory there when all of
these hold:

- llama-cpp-python and gguf are installed, the device is the CPU, and neither `--dtype` nor
  `--passes` asks for something of the PyTorch backends;
- the model is one the writer keeps exact: a Llama or Mistral decoder the native forward runs,
  a byte-level BPE tokenizer, weights stored in float32, bfloat16 or float16, written in that
  same type (llama.cpp has no float64 kernels: a float64 checkpoint stays on PyTorch);
- llama.cpp tokenizes a sample as the directory's tokenizer does (checked once, when written);
- a target (the model whose rows decide the output) only where llama.cpp gives a row the same
  bits in a pass of several rows as alone, as the backend's row probe finds
  (`LlamaCppBackend.invariant`): speculative output must equal plain output, and a plain run
  must print what a speculative run of the same target prints, so both run the target on the
  same backend. A draft model's rows decide nothing: it runs there wherever the rest allows;
- it is not the target of an EAGLE-3 head: a head may read the last layer's output, which
  llama.cpp does not hand out (`--backend llama.cpp` runs one that reads earlier layers).

Otherwise the directory runs on PyTorch, as it always did. `--backend llama.cpp` on a directory
takes the same file (an error where it cannot be written), `--backend native`/`hf` never do.

The file is `cache_dir("gguf-models")/<key>.<type>.gguf`, key a SHA-256 over the directory's
files (their contents, streamed) and the writer's format: a changed weight, config or tokenizer
file writes a new one. Each file's SHA-256 is remembered by its path, size and modification
time (`file-hashes.json`), so an unchanged directory is not read again.

A copy is as big as the weights, so it is written only where it will be used: the tokenizer
check and the row probe need the file, so a new one is written beside its place, checked
there, and moved into place only if llama.cpp runs it; otherwise it is deleted and the verdict
kept (`.tokenizer-differs`, `.rows-differ`), so that the next run writes nothing. Before
writing, the load's progress callback is told where and how big; a copy that would take the
cache past SPECDECODE_CACHE_LIMIT or fill its disk is not written (`specdecode.cache`): auto
runs the directory on PyTorch and says why, `--backend llama.cpp` is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from specdecode import cache
from specdecode.backends.options import LoadOptions
from specdecode.errors import SpecdecodeError, write_atomically
from specdecode.local import cache_dir, cpu_model, package_version

if TYPE_CHECKING:
    from specdecode.backends.hf import HFBackend
    from specdecode.backends.llama_cpp import LlamaCppBackend

# What a loaded model is for, which decides whether its rows must be invariant (see above):
# the output's target, a draft model, or the target of an EAGLE-3 head.
Use = Literal["target", "draft", "hidden"]
WRITER_FORMAT = 1  # of the cached files: a new format writes them again
STORED_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # checkpoint dtype -> GGUF type
TYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}  # a weight's bytes in each
GGUF_MODEL_TYPES = ("llama", "mistral")  # what `export_gguf` writes, as llama.cpp's "llama"
TOKENIZER_SAMPLE = (
    "def read_lines(path, encoding='utf-8'):\n    return [line.rstrip('\\n') for line in open(path)]\n"
    "  Ünïcödé — 日本語, 12345 + 6.7e-8;\t\tx != y  \n\n"
)
HASH_CHUNK = 1 << 20
ROWS_DIFFER = (
    "llama.cpp's multi-row passes would change its output here "
    "(--backend llama.cpp runs it anyway; see docs/gguf.md)"
)


def models_dir() -> Path:
    return cache_dir("gguf-models")


def load_directory(
    path: Path,
    options: LoadOptions,
    use: Use,
    pytorch: Callable[[Path, LoadOptions], HFBackend],
    say: Callable[[str], None] | None = None,
) -> HFBackend | LlamaCppBackend:
    """The directory on llama.cpp where `options` and the rules above allow, else `pytorch`'s
    backend; either says in `backend_note` which backend auto chose and why, where llama.cpp
    was a candidate. say: told where a GGUF copy is about to be written, and how big."""
    explicit = options.backend == "llama.cpp"
    if not explicit and not _candidate(options):
        return pytorch(path, options)
    from specdecode.backends import llama_lib  # loads llama.cpp's library

    if not llama_lib.available():
        if explicit:
            raise SpecdecodeError(f"the llama.cpp backend needs llama-cpp-python: {llama_lib.INSTALL_HINT}")
        return pytorch(path, options)
    from specdecode.backends.hf import check_model_directory, load_model_config

    directory = check_model_directory(path)
    config = load_model_config(directory)
    kind, reason = gguf_type(directory, config)
    if reason is not None:
        if explicit:
            raise SpecdecodeError(f"{directory}: the llama.cpp backend cannot run this directory: {reason}")
        return pytorch(path, options)
    if use == "hidden" and not explicit:
        return _on_pytorch(
            pytorch,
            path,
            options,
            "an EAGLE-3 head may read the last layer's output, which llama.cpp does not hand out "
            "(--backend llama.cpp: there, for a head reading earlier layers)",
        )
    try:
        exact_rows = use == "target" and not explicit
        backend = _from_gguf(directory, config, kind, options, exact_rows, say or _silent)
    except _Refused as refused:
        why = str(refused)  # the handler gone before PyTorch loads: llama.cpp's weights freed
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home directory for the cache
        why = f"cannot keep its GGUF copy in {models_dir()}: {exc}"
    else:
        return backend
    if explicit:
        raise SpecdecodeError(
            f"{directory}: {why}"
            + ("; `specdecode cache list` shows what the cache holds" if "cache limit" in why else "")
        )
    return _on_pytorch(pytorch, path, options, why)


class _Refused(Exception):
    """Why a directory does not run from its GGUF copy: auto's note, --backend llama.cpp's error."""


def _from_gguf(
    directory: Path, config, kind: str, options: LoadOptions, exact_rows: bool, say: Callable[[str], None]
) -> LlamaCppBackend:
    """The directory on llama.cpp from its GGUF copy, written where none is kept, or `_Refused`.

    exact_rows: whether the model must pass the row probe (auto's target). The probe needs the
    file, so a new copy is written beside its place, probed there and moved into place only
    where it is used; a copy refused is deleted and the verdict kept (`.rows-differ`, with what
    it depends on), so that the next run writes nothing. A copy is written only where the cache
    has room (`specdecode.cache.room_for`), said through `say` first: where and how big."""
    from specdecode.backends.llama_cpp import LlamaCppBackend

    out = models_dir() / f"{content_key(directory)[:40]}.{kind}.gguf"
    differs, rows_differ = out.with_suffix(".tokenizer-differs"), out.with_suffix(".rows-differ")
    if differs.is_file():
        raise _Refused(differs.read_text())
    facts = _row_facts(options) if exact_rows else None
    if exact_rows and _read_json(rows_differ).get("facts") == facts:
        raise _Refused(ROWS_DIFFER)
    if out.is_file():
        os.utime(out, ns=(time.time_ns(), out.stat().st_mtime_ns))  # used now (`cache list`), same file
        backend = LlamaCppBackend.load(out, options, say)
        backend.name = directory.name
        if exact_rows and not backend.invariant:
            del backend  # kept: written for another use (a draft), which it still serves
            _write_atomically(rows_differ, json.dumps({"facts": facts}))
            raise _Refused(ROWS_DIFFER)
        backend.backend_note = _note(directory, kind, "kept in", out)
        return backend
    size = estimated_size(directory, config, kind)
    if (full := cache.room_for(size)) is not None:
        raise _Refused(full)
    kept = " (kept only if llama.cpp runs it exactly)" if exact_rows else ""
    say(f"writing {directory.name} as a {cache.format_size(size)} {kind} GGUF file to {out}{kept}")
    from specdecode.backends.gguf_files import export_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.stem}.", dir=out.parent)) / out.name
    try:
        export_gguf(directory, staging, kind)
        why = _tokenizes_otherwise(directory, staging)
        if why is not None:
            differs.write_text(why)
            raise _Refused(why)
        backend = LlamaCppBackend.load(staging, options, say)
        backend.name = directory.name
        backend.model.path = out  # the probe's verdict and pass timings are kept for the file's place
        if exact_rows and not backend.invariant:
            del backend
            _write_atomically(rows_differ, json.dumps({"facts": facts}))
            raise _Refused(ROWS_DIFFER)
        os.replace(staging, out)
    finally:
        staging.unlink(missing_ok=True)
        staging.parent.rmdir()
    backend.keep_verdict()  # probed before the file was in place: kept under its place now
    cache.record_source(out, directory)
    backend.backend_note = _note(directory, kind, "written once to", out)
    return backend


def _note(directory: Path, kind: str, how: str, out: Path) -> str:
    return (
        f"{directory.name}: on llama.cpp's kernels (faster on a CPU), as a {kind} GGUF copy {how} {out} "
        "(--backend native: PyTorch)"
    )


def _row_facts(options: LoadOptions) -> dict[str, object]:
    """What the row probe's verdict on a file depends on besides the file (as its stored key,
    `RowProbe._probe_key`): a verdict remembered under the same facts holds without the file."""
    import torch

    from specdecode.backends.llama_lib import TILED_SWITCH, kernels
    from specdecode.backends.llama_probe import PROBE_FORMAT

    return {
        "probe": PROBE_FORMAT,
        "kernels": {**kernels(), "tiled": os.environ.get(TILED_SWITCH, "0")},  # as loading sets it
        "repack": options.repack,
        "gpu_layers": options.gpu_layers,
        "threads": options.threads or torch.get_num_threads(),
        "n_ctx": options.n_ctx,
        "cpu": cpu_model(),
        "version": package_version() or "unknown",
    }


def estimated_size(directory: Path, config, kind: str) -> int:
    """Bytes of the GGUF file `export_gguf` writes of `kind`: its matrices in that type, its
    vectors (norms) in float32, and its vocabulary (about as big as tokenizer.json)."""
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    per_layer = hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * int(config.intermediate_size)
    embeddings = int(config.vocab_size) * hidden * (1 if config.tie_word_embeddings else 2)
    vectors = hidden * (2 * layers + 1)
    tokenizer = (directory / "tokenizer.json").stat().st_size
    return (embeddings + layers * per_layer) * TYPE_BYTES[kind] + vectors * 4 + tokenizer


def _silent(line: str) -> None:
    """Where no one is told of a copy being written."""


def _read_json(path: Path) -> dict:
    """A small JSON object kept in the cache, or {} where there is none readable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _candidate(options: LoadOptions) -> bool:
    """Whether auto may consider llama.cpp at all: on the CPU, nothing asked of PyTorch, and
    llama-cpp-python and gguf installed (found without importing them)."""
    if options.device != "cpu" or options.dtype != "auto" or options.passes != "auto":
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


def _on_pytorch(
    pytorch: Callable[[Path, LoadOptions], HFBackend], path: Path, options: LoadOptions, why: str
) -> HFBackend:
    backend = pytorch(path, options)
    backend.backend_note = f"{backend.name}: runs on PyTorch, not llama.cpp: {why}"
    return backend


def gguf_type(directory: Path, config) -> tuple[str, None] | tuple[None, str]:
    """(the GGUF type that keeps the checkpoint's weights exact, None), or (None, why none does)."""
    from specdecode.backends.native_weights import native_unsupported

    if config.model_type not in GGUF_MODEL_TYPES:
        return None, f"model_type {config.model_type!r} (written: {', '.join(GGUF_MODEL_TYPES)})"
    reason = native_unsupported(config)
    if reason is not None:
        return None, reason
    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    stored = stored.removeprefix("torch.")
    if stored not in STORED_TYPES:
        return None, f"weights stored in {stored} (llama.cpp computes in {', '.join(STORED_TYPES)})"
    spec_file = directory / "tokenizer.json"
    if not spec_file.is_file():
        return None, "no tokenizer.json (the GGUF writer takes byte-level BPE tokenizers)"
    model = json.loads(spec_file.read_text()).get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None, "not a byte-level BPE tokenizer (the GGUF writer takes those only)"
    return STORED_TYPES[stored], None


def _tokenizes_otherwise(directory: Path, gguf_path: Path) -> str | None:
    """Why llama.cpp's tokenizer on the written file is not the directory's, or None."""
    from specdecode.backends.hf import load_tokenizer
    from specdecode.backends.llama_cpp import LlamaCppBackend

    tokenizer = load_tokenizer(directory)
    backend = LlamaCppBackend.load(gguf_path, LoadOptions(n_ctx=64))
    for special in (True, False):
        theirs = backend.tokenize(TOKENIZER_SAMPLE, add_special=special)
        ours = tokenizer(TOKENIZER_SAMPLE, add_special_tokens=special)["input_ids"]
        if theirs != ours:
            return "llama.cpp tokenizes a sample text otherwise than the directory's tokenizer"
    return None


def content_key(directory: Path) -> str:
    """SHA-256 over the writer's format and each file of `directory` (name and content)."""
    memo_path = models_dir() / "file-hashes.json"
    memo: dict[str, list] = {}
    with contextlib.suppress(OSError, ValueError):
        memo = json.loads(memo_path.read_text())
    digest = hashlib.sha256(f"{WRITER_FORMAT} gguf {importlib.metadata.version('gguf')}".encode())
    changed = False
    for file in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        stat = file.stat()
        where, stamp = str(file.resolve()), [stat.st_size, stat.st_mtime_ns]
        seen = memo.get(where)
        if not isinstance(seen, list) or seen[:2] != stamp:
            seen = memo[where] = [*stamp, file_sha256(file)]
            changed = True
        digest.update(f"{file.name}\0{seen[2]}\n".encode())
    if changed:
        _write_atomically(memo_path, json.dumps(memo))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` whole, so that concurrent runs read the old or the new, never a part."""
    with contextlib.suppress(OSError, SpecdecodeError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "cache file", lambda file: file.write(text.encode()))
