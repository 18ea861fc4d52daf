"""llama.cpp's kernels for a GGUF model, through llama-cpp-python's low-level (C) API.

The chain, strategies and verification stay ours; a pass is one `llama_decode` of a batch, and
its logits cross into Python as one view of llama.cpp's output buffer (one bulk copy per pass,
never one per row). The KV cache is llama.cpp's, addressed by sequence: the committed tokens
are sequence 0 (in a context of its own), and rolling back is removing positions from it
(`llama_memory_seq_rm`).

Token trees use sequences the way llama.cpp's own speculative example does. Pending node i has
sequence i + 1, and a cell belongs to every sequence that may see it: a node is decoded in the
sequences of itself and its descendants in the same pass, and a node whose parent came in an
earlier pass first joins its parent's sequence (`llama_memory_seq_cp`), which holds the prefix
and every ancestor. `commit(path)` drops the tree's cells and owes the path: its tokens are
scored again as the first rows of the next pass, so that the cache holds every position in
position order, as plain generation leaves it (see `commit`).

A prompt found in the cache must give the bits it gives a fresh context, and llama.cpp rounds
a row by the shape of its pass (its CPU flash attention takes tiles of 64 query rows from passes
of 64 rows on: a prompt's last row scored in a pass of 100 rows differs from the same row
scored alone even on a Q8_0 file whose shorter passes agree). So a prompt keeps only the
cached prefix that a fresh run would have built the same way, whole `n_batch` chunks from
position 0, and scores the rest in the chunks a fresh run scores it in (see `reusable_prefix`).

An EAGLE-3 head reads the target's hidden states: the inputs of the layers it names, which
llama.cpp captures for every row of a pass (`capture_hidden`), one row per cached position.

Forks for a batch may share one context instead (`LlamaCppBackend.forks`), the committed tokens
of each being a sequence of its own in a KV stream of its own, so that one `llama_decode`
scores every sequence's rows, as llama-server decodes its slots (`SharedLlamaCppBackend`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.backends import VocabInfo, WholeChunks, check_cache_room, pass_cache
from specdecode.backends.batch import RowGroup
from specdecode.backends.hidden import HiddenRows
from specdecode.backends.options import LoadOptions
from specdecode.backends.tree import PendingTree, check_tree_room
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

try:
    import llama_cpp
except ImportError:  # the optional extra
    llama_cpp = None

INSTALL_HINT = "pip install 'specdecode[llama-cpp]'"
VOCAB_KINDS = {1: "spm", 2: "bpe", 3: "wpm", 4: "ugm"}
MAX_SEQUENCES = 64  # the committed sequence, up to 62 pending tree nodes and the spare one
SPARE_SEQUENCE = MAX_SEQUENCES - 1  # a one-row pass's second row (see LlamaCppBackend._decode)
# From this position on a one-row pass gets that second row: below it, the cache holds fewer
# than 256 cells (positions, tree nodes and the spare), and llama.cpp's attention reads 256.
PAD_FROM = 128
# The row-invariance probe: after PROBE_CONTEXT tokens of this text, one pass of each row count
# in PROBE_PASSES (verify passes of drafts up to 16 long; kernels switch paths at multiples of
# 2, 4 and 8 rows), each over the next tokens, against the same rows one at a time. Then, at
# cache lengths from PROBE_CONTEXT up to the context (`probe_lengths`), passes of every size in
# WIDE_PASSES against PROBE_ROWS rows scored one at a time: llama.cpp's kernels also switch
# with the cached cells (its CPU flash attention splits a one-row pass over 512 cells or more
# among its threads) and past 63 rows (flash attention's tiles of 64 query rows), so passes are
# vouched for only at the lengths and sizes seen to agree (ngram-mod verifies up to 65 rows).
PROBE_TEXT = (
    "import os\n\n\ndef read_lines(path, encoding='utf-8'):\n"
    '    """Return the lines of a text file, without their line ends."""\n'
    "    with open(path, encoding=encoding) as handle:\n"
    "        return [line.rstrip('\\n') for line in handle]\n\n\n"
    "def count_words(lines):\n    total = 0\n    for line in lines:\n"
    "        total += len(line.split())\n    return total\n"
)
PROBE_CONTEXT = 8
PROBE_PASSES = (2, 3, 4, 5, 7, 8, 9, 16, 17)
WIDE_PASSES = (*PROBE_PASSES, 33, 63, 64, 65)
PROBE_ROWS = 17  # rows scored one at a time at each probed length
CLASS_PASS = 130  # beside the wide passes: do all passes past the vouched size round alike?
PROBE_FIRST_LENGTH = 320  # past 256 cells: llama.cpp pads the cells a pass reads to 256
PROBE_LONGEST = 4096  # the probe's fill costs a prompt this long at most
PROBE_FORMAT = 2  # of the probe's stored verdicts (see LlamaCppBackend.invariant)
# ggml's switch for its tiled K-quant (Q2_K..Q6_K, IQ*) matrix product, which it takes for
# passes of 8 rows and more of weights kept in the file's layout: its sums round a row
# otherwise than the one-row dot product. ggml reads it once per process, at the first product.
TILED_SWITCH = "GGML_CPU_TILED_MM"
_quiet_log = None  # the logging callback, kept alive while llama.cpp may call it


def available() -> bool:
    return llama_cpp is not None


def _require() -> None:
    if llama_cpp is None:
        raise SpecdecodeError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}")


def _kernels() -> dict[str, object]:
    """What decides which kernels llama.cpp runs besides the model and its options: the
    libraries loaded (their names, sizes and modification times: LLAMA_CPP_LIB_PATH picks
    another build) and ggml's tiled-product switch. Part of the keys of what is measured once
    and kept (the probe's verdict, pass timings)."""
    library = Path(llama_cpp.llama_cpp._lib._name).resolve().parent
    files = sorted(library.glob("lib*.so*")) + sorted(library.glob("*.dylib")) + sorted(library.glob("*.dll"))
    return {
        "library": str(library),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "tiled": os.environ.get(TILED_SWITCH),
    }


# llama.cpp's staging API (src/llama-ext.h) for the inputs of a model's layers, which its own
# EAGLE-3 drafting reads: declared without C linkage, so exported under C++ (Itanium) names,
# and not bound by llama-cpp-python. Resolved on first use; a build without them refuses heads.
LAYER_INPUT_SYMBOLS = {
    "set": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "get": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
}
_layer_inputs: dict[str, ctypes._CFuncPtr] = {}


def _layer_input_api() -> dict[str, ctypes._CFuncPtr]:
    """(set, get) of llama.cpp's layer-input capture, or a clear error where the build lacks them."""
    if not _layer_inputs:
        library = llama_cpp.llama_cpp._lib
        try:
            setter, getter = (library[LAYER_INPUT_SYMBOLS[name]] for name in ("set", "get"))
        except AttributeError:
            raise SpecdecodeError(
                "this llama.cpp build does not export llama_set/get_embeddings_layer_inp, which an "
                "EAGLE-3 head needs to read the target's hidden states (--backend native runs it)"
            ) from None
        setter.argtypes, setter.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
        getter.argtypes, getter.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
        _layer_inputs.update(set=setter, get=getter)
    return _layer_inputs


def silence_logs() -> None:
    """Route llama.cpp's log lines nowhere (load messages on every model otherwise)."""
    global _quiet_log
    if _quiet_log is None:
        _quiet_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))


def quantize(source: Path, out: Path, fmt: str) -> None:
    """Requantize a GGUF file with llama.cpp's own quantizer (k-quants need it)."""
    if llama_cpp is None:
        raise SpecdecodeError(f"GGUF type {fmt} needs llama.cpp's quantizer: {INSTALL_HINT}")
    silence_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    ftypes = {"q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K}
    params.ftype = ftypes[fmt]
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SpecdecodeError(f"llama.cpp could not quantize {source} to {fmt}")


@dataclass(frozen=True)
class RowAgreement:
    """How the rows of multi-row passes compare with the same rows scored one at a time."""

    rows: int
    identical: int  # rows whose logits are bit-identical
    same_argmax: int  # rows with the same greedy choice

    @property
    def invariant(self) -> bool:
        return self.identical == self.rows

    def __add__(self, other: RowAgreement) -> RowAgreement:
        return RowAgreement(
            self.rows + other.rows, self.identical + other.identical, self.same_argmax + other.same_argmax
        )

    @classmethod
    def of(cls, together: torch.Tensor, alone: torch.Tensor) -> RowAgreement:
        return cls(
            len(together),
            int((together == alone).all(-1).sum()),
            int((together.argmax(-1) == alone.argmax(-1)).sum()),
        )


def probe_lengths(n_ctx: int) -> list[int]:
    """The cache lengths the row-invariance probe passes at in a context of n_ctx cells: the
    short PROBE_CONTEXT, then from PROBE_FIRST_LENGTH doubling, and the last length whose
    widest pass still fits the context (or PROBE_LONGEST, past which it costs too much)."""
    room = min(n_ctx, PROBE_LONGEST) - max(WIDE_PASSES)
    lengths, length = [PROBE_CONTEXT], PROBE_FIRST_LENGTH
    while length < room:
        lengths.append(length)
        length *= 2
    if room > lengths[-1]:
        lengths.append(room)
    return lengths


class LlamaModel:
    """A loaded GGUF model (weights and vocabulary), shared by the contexts forked from it.

    repack: whether llama.cpp may repack weights into its interleaved CPU layouts (its
    `use_extra_bufts`, llama.cpp's `--repack`/`--no-repack`). Those layouts have their own
    batched kernels, which round a row differently from the one-row path.

    ggml's tiled K-quant product is switched off (TILED_SWITCH) unless the environment already
    says otherwise: with it, a K-quant file's rows agree with one-row passes only in passes of
    up to 7 rows; without it, in passes of every probed size (it serves passes of 8 rows and
    more, a long prompt's chunks among them)."""

    def __init__(self, path: Path, gpu_layers: int, repack: bool = True) -> None:
        _require()
        os.environ.setdefault(TILED_SWITCH, "0")
        silence_logs()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        params.use_extra_bufts = repack
        self.repack = repack
        self.embeddings: torch.Tensor | None = None  # token embeddings, read on first use (EAGLE-3)
        self.kernels = _kernels()
        self.pointer = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.pointer:
            raise SpecdecodeError(f"llama.cpp cannot load {path} (not a model file it knows)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.pointer)
        self.path = path
        self._tokenizer = None
        self.probe: RowAgreement | None = None  # see LlamaCppBackend.invariant
        self.invariant_rows = 0  # the probed passes of up to this many rows were all bit-identical
        # whether the probed passes of more rows than that agreed among themselves (see
        # LlamaCppBackend.reusable_prefix)
        self.wide_rows_agree = False

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The file's vocabulary as a transformers tokenizer, built on first use: what the
        server's chat templates and text routes work with (the same ids as llama.cpp's on
        files `specdecode export` writes)."""
        if self._tokenizer is None:
            from specdecode.backends.gguf_files import load_gguf_tokenizer  # transformers: seconds of imports

            self._tokenizer = load_gguf_tokenizer(self.path)
        return self._tokenizer

    def __del__(self) -> None:
        if getattr(self, "pointer", None) and llama_cpp is not None:
            llama_cpp.llama_model_free(self.pointer)
            self.pointer = None


class LlamaContext:
    """A llama_context (KV cache and compute buffers) with a batch to fill, freed when the last
    backend holding it goes.

    sequences, unified: how many sequence ids it takes, and whether they share one KV stream
    (a backend of its own: the tree nodes' sequences share the prefix's cells) or each has
    one of n_ctx cells (forks sharing a context: see `LlamaCppBackend.forks`)."""

    def __init__(
        self,
        model: LlamaModel,
        name: str,
        n_ctx: int,
        n_batch: int,
        threads: int | None,
        sequences: int = MAX_SEQUENCES,
        unified: bool = True,
    ) -> None:
        params = llama_cpp.llama_context_default_params()
        # With a stream per sequence, llama.cpp splits n_ctx among them. One KV stream gets a
        # cell more than n_ctx, for the second row a one-row pass is given even when the
        # context is full (see `LlamaCppBackend._decode`).
        spare = 1 if unified else 0
        params.n_ctx = n_ctx + spare if unified else n_ctx * sequences
        params.n_batch = params.n_ubatch = max(n_batch, MAX_SEQUENCES)
        params.n_seq_max = sequences
        params.kv_unified = unified
        if threads:
            params.n_threads = params.n_threads_batch = threads
        self.pointer = llama_cpp.llama_init_from_model(model.pointer, params)
        if not self.pointer:
            raise SpecdecodeError(f"{name}: llama.cpp could not create a context of {params.n_ctx} tokens")
        self.memory = llama_cpp.llama_get_memory(self.pointer)
        # what the user may fill: llama.cpp rounds the cells up (to a multiple of 256)
        self.n_ctx_seq = min(int(llama_cpp.llama_n_ctx_seq(self.pointer)) - spare, n_ctx)
        self.batch_rows = int(params.n_batch)
        self.batch = llama_cpp.llama_batch_init(self.batch_rows, 0, MAX_SEQUENCES)

    def __del__(self) -> None:
        if getattr(self, "pointer", None) and llama_cpp is not None:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.pointer)
            self.pointer = None


class LlamaCppBackend:
    """A GGUF model on llama.cpp's kernels (see `specdecode.backends.Backend`)."""

    # Set where `--backend auto` ran a Hugging Face directory here (see `specdecode.backends.hf_gguf`).
    backend_note: str | None = None
    pads_one_row_passes = True  # see _decode

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int = 0,
        n_batch: int = 512,
        threads: int | None = None,
        name: str = "model",
        exact: bool = True,
        context: LlamaContext | None = None,
        sequence: int = 0,
    ) -> None:
        """context: one shared with other backends over this model, this one's rows being
        sequence `sequence` of it (see `forks`); None: a context of its own."""
        self.model = model
        self.name = name
        # Whether drafts are kept to the passes whose rows the probe found bit-identical (see
        # `draft_room`); False (--passes bucketed) lets every pass take any size
        self.exact = exact
        self.device = torch.device("cpu")  # where logits arrive (llama.cpp places its layers itself)
        self.n_batch = n_batch
        self.threads = threads
        if context is None:
            trained = llama_cpp.llama_model_n_ctx_train(model.pointer)
            context = LlamaContext(model, name, n_ctx if n_ctx > 0 else trained, n_batch, threads)
        self._shared = context  # freed with the last backend that holds it
        self._sequence = sequence  # this backend's sequence id in the context
        self._context, self._memory, self._batch = context.pointer, context.memory, context.batch
        self._batch_rows = context.batch_rows
        self.n_ctx = context.n_ctx_seq
        self._size = int(llama_cpp.llama_vocab_n_tokens(model.vocab))
        self._tokens: list[int] = []  # ids of the cached positions, then the owed ones
        self._owed: list[int] = []  # committed tree tokens not in the cache yet (see commit)
        self._fresh = WholeChunks(n_batch)
        self._pass_rows: list[int] = []  # per scored position: the rows of the pass that scored it
        self._tree = PendingTree()
        self._texts: list[str] | None = None
        self.vocab = self._vocab_info()
        self.n_layers = int(llama_cpp.llama_model_n_layer(model.pointer))
        self.hidden_size = int(llama_cpp.llama_model_n_embd(model.pointer))
        self._hidden: HiddenRows | None = None  # rows of the captured layers (see capture_hidden)

    @property
    def invariant(self) -> bool:
        """Whether llama.cpp gives a row the same bits in passes of up to max(PROBE_PASSES) rows
        (a default draft's verify pass) as alone, at every cache length the probe passed at
        (see `probe_invariance`, run once per loaded model on first use): what makes
        speculative output equal plain output bit for bit rather than up to a near-tie. Only
        the target's rows decide the output. Longer passes may still be capped (`row_cap`)."""
        return self._probed_rows() >= max(PROBE_PASSES)

    def _probed_rows(self) -> int:
        """The probe's `invariant_rows`, probing on first use. The verdict is kept with the pass
        timings (see `specdecode.backends.pass_cache`), keyed by the file, the repacking, the threads, the
        context, the machine and llama.cpp's libraries and switches, so that the probe runs
        once per such key rather than at every start."""
        if self.model.probe is None:
            key = self._probe_key()
            stored = pass_cache.read_value(key, "probe") if key is not None else None
            try:
                probe, rows, wide = RowAgreement(*stored[:3]), int(stored[3]), bool(stored[4])
            except (TypeError, ValueError, IndexError):  # nothing stored, or not a verdict
                probe = self.probe_invariance()
                rows, wide = self.model.invariant_rows, self.model.wide_rows_agree
                verdict = [probe.rows, probe.identical, probe.same_argmax, rows, wide]
                if key is not None:
                    pass_cache.write_value(key, "probe", verdict)
            self.model.probe, self.model.invariant_rows, self.model.wide_rows_agree = probe, rows, wide
        return self.model.invariant_rows

    def _probe_key(self) -> dict[str, object] | None:
        key = pass_cache.cache_key(self, WIDE_PASSES) if pass_cache.enabled() else None
        if key is None:
            return None
        return {**key, "n_ctx": probe_lengths(self.n_ctx), "probe": PROBE_FORMAT, "text": PROBE_TEXT}

    @property
    def row_cap(self) -> int | None:
        """The most rows a pass after the prompt may hold for its rows to get the bits plain
        generation gives them, where exactness is asked for and the probe found the rows
        invariant only up to some pass size (at least 1: then nothing is drafted); None where
        passes of any probed size agree, or speed was asked for over exactness."""
        if not self.exact:
            return None
        rows = self._probed_rows()
        return None if rows >= max(WIDE_PASSES) else max(1, rows)

    @property
    def vouched_rows(self) -> int | None:
        """The most rows of a pass whose rows get the bits they get in any other pass, where
        exactness is asked for: the row cap, or where every probed pass agreed the largest pass
        the probe tried (rows of far larger passes have differed on files whose probed passes
        agreed, see the module's docstring); None where speed was asked for over exactness."""
        if not self.exact:
            return None
        cap = self.row_cap
        return max(WIDE_PASSES) if cap is None else cap

    def draft_room(self) -> int | None:
        """The most draft tokens the next verify pass may carry within `row_cap` (None: no
        limit). A committed tree path is owed (see `commit`) and rides in that pass too."""
        cap = self.row_cap
        return None if cap is None else max(0, cap - 1 - len(self._owed))

    def row_cap_note(self) -> str | None:
        """The line a speculative run on this model is told when its drafts are capped below a
        default draft's length (a cap on longer drafts only, such as ngram-mod's, goes unsaid)."""
        cap = self.row_cap
        if cap is None or cap >= max(PROBE_PASSES):
            return None
        where = f"in passes of up to {cap} rows" if cap > 1 else "in one-row passes"
        kept = f"drafts are capped at {cap - 1} tokens a step" if cap > 1 else "nothing is drafted"
        return (
            f"llama.cpp gives {self.name}'s rows their one-row bits only {where} (probed): {kept} so "
            "that output equals plain output (--passes bucketed lifts the cap, at near-ties' risk; "
            "-nr/--no-repack or llama.cpp's row-invariant build may raise it; see docs/gguf.md)"
        )

    def row_variance_warning(self, trees: bool) -> str | None:
        """What a speculative run on this model should be told when its rows are not invariant
        and exactness was given up (--passes bucketed; `trees`, whether it may draft trees,
        changes nothing: any multi-row pass may vary)."""
        if self.exact or self._probed_rows() >= max(WIDE_PASSES):
            return None
        probe, agreed = self.model.probe, self.model.invariant_rows
        return (
            f"llama.cpp rounds {probe.rows - probe.identical} of {probe.rows} probed rows of {self.name} "
            "differently in multi-row passes than alone"
            + (f" (passes of up to {agreed} rows agreed)" if agreed else "")
            + ": with --passes bucketed, greedy speculative output equals plain output up to near-ties "
            "only (bit for bit: the default --passes, see docs/gguf.md)"
        )

    def probe_invariance(self) -> RowAgreement:
        """Passes of the row counts in PROBE_PASSES, each over the next positions of a greedy
        continuation, against the rows plain generation scored for it one at a time, bit for
        bit; then passes of every size in WIDE_PASSES at each cache length of `probe_lengths`
        (up to this backend's context), against PROBE_ROWS rows scored one at a time there.
        Which kernel llama.cpp runs depends on the build, the weight types, the repacking, the
        threads, the row count and the cells cached, and some round differently only for some
        inputs: hence new rows for every short pass, from the model's own text. A pass size is
        vouched for (`invariant_rows`) where it and every smaller probed size agreed at every
        length. In a context of its own: this backend's cache is untouched."""
        ids = self.tokenize(PROBE_TEXT)[:PROBE_CONTEXT]
        context, needed = len(ids), len(ids) + sum(PROBE_PASSES)
        lengths = probe_lengths(self.n_ctx)
        probe = LlamaCppBackend(
            self.model,
            n_ctx=max(needed, lengths[-1] + CLASS_PASS),
            n_batch=self.n_batch,
            threads=self.threads,
            name=self.name,
        )
        rows = [probe.evaluate(ids)[-1]]
        while len(ids) < needed:
            ids.append(int(rows[-1].argmax()))
            rows.append(probe.evaluate(ids[-1:])[-1])
        alone = torch.stack(rows[1:])  # position context + i
        agreement, start, agreed = RowAgreement(0, 0, 0), context, dict.fromkeys(WIDE_PASSES, True)
        for k in PROBE_PASSES:
            probe.truncate(start)
            this_pass = RowAgreement.of(probe.evaluate(ids[start : start + k]), alone[start - context :][:k])
            agreed[k] &= this_pass.invariant
            agreement += this_pass
            start += k
        text = self.tokenize(PROBE_TEXT)
        filler = [text[i % len(text)] for i in range(lengths[-1] + CLASS_PASS)]
        probe.truncate(0)
        firsts: list[dict[int, torch.Tensor]] = []  # per length: each pass's first rows
        for length in lengths:
            probe.truncate(length)
            if len(probe.tokens) < length:
                probe.evaluate(filler[len(probe.tokens) : length])
            alone = torch.cat([probe.evaluate([token]) for token in filler[length : length + PROBE_ROWS]])
            firsts.append({})
            for k in (*WIDE_PASSES, CLASS_PASS):
                probe.truncate(length)
                together = probe.evaluate(filler[length : length + k])[:PROBE_ROWS]
                firsts[-1][k] = together
                if k in agreed:
                    this_pass = RowAgreement.of(together, alone[: len(together)])
                    agreed[k] &= this_pass.invariant
                    agreement += this_pass
        self.model.invariant_rows = 0
        for k in sorted(agreed):
            if not agreed[k]:
                break
            self.model.invariant_rows = k
        wide = [k for k in (*WIDE_PASSES, CLASS_PASS) if k > self.model.invariant_rows]
        common = min(PROBE_ROWS, wide[0])
        self.model.wide_rows_agree = all(
            torch.equal(rows[k][:common], rows[wide[0]][:common]) for rows in firsts for k in wide
        )
        return agreement

    @classmethod
    def load(cls, path: str | Path, options: LoadOptions) -> LlamaCppBackend:
        """Load a GGUF file with the LoadOptions the other backends take (dtype is the file's)."""
        _require()
        path = Path(path)
        if options.dtype != "auto":
            raise SpecdecodeError(
                f"{path.name}: llama.cpp computes in the file's own weight types; --dtype {options.dtype} "
                "applies to the PyTorch backends (--backend native)"
            )
        if options.device != "cpu" and not llama_cpp.llama_supports_gpu_offload():
            raise SpecdecodeError(f"device {options.device} asked for, but this llama.cpp build has no GPU")
        gpu_layers = options.gpu_layers
        if gpu_layers is None:
            gpu_layers = 999 if options.device != "cpu" else 0  # every layer on a GPU device
        if gpu_layers and not llama_cpp.llama_supports_gpu_offload():
            raise SpecdecodeError("GPU layers (-ngl) asked for, but this llama.cpp build has no GPU")
        if options.passes == "fixed":
            raise SpecdecodeError(
                "--passes fixed is the native backend's CUDA graphs; llama.cpp takes invariant (the "
                "default: drafts kept to passes whose rows are bit-identical) or bucketed (any pass size)"
            )
        return cls(
            LlamaModel(path, gpu_layers, options.repack),
            n_ctx=options.n_ctx,
            n_batch=options.n_batch,
            threads=options.threads,
            name=path.stem,
            exact=options.passes != "bucketed",
        )

    def fork(self) -> LlamaCppBackend:
        """A backend over the same loaded weights with its own context (KV cache)."""
        return LlamaCppBackend(
            self.model,
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            threads=self.threads,
            name=self.name,
            exact=self.exact,
        )

    def forks(self, count: int) -> list[LlamaCppBackend]:
        """`count` backends over the same weights that share ONE new context, each its own
        sequence of it, so that a batch scores all of their rows in one `llama_decode`
        (`SharedLlamaCppBackend`), as llama-server does with its slots. One: a plain fork.

        With more than one thread, where exactness is asked for, plain forks too: a lone row
        of a shared pass would have its attention split among the threads, which only a
        context of one's own can prevent (by the second row of `_decode`), so sharing would
        give rows other bits than plain generation's past 256 cached tokens."""
        if count < 2 or (self.exact and self.threads != 1):
            return [self.fork() for _ in range(count)]
        context = LlamaContext(
            self.model, self.name, self.n_ctx, self.n_batch, self.threads, sequences=count, unified=False
        )
        return [
            SharedLlamaCppBackend(
                self.model,
                n_batch=self.n_batch,
                threads=self.threads,
                name=self.name,
                exact=self.exact,
                context=context,
                sequence=sequence,
            )
            for sequence in range(count)
        ]

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.model.tokenizer

    # Vocabulary: the GGUF's own, through llama.cpp's tokenizer.

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode()
        room = len(data) + 8
        buffer = (llama_cpp.llama_token * room)()
        count = llama_cpp.llama_tokenize(self.model.vocab, data, len(data), buffer, room, add_special, True)
        if count < 0:  # more tokens than bytes + 8: only with many added specials
            room = -count
            buffer = (llama_cpp.llama_token * room)()
            count = llama_cpp.llama_tokenize(
                self.model.vocab, data, len(data), buffer, room, add_special, True
            )
        return list(buffer[:count])

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str:
        if not ids:
            return ""
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        room = 16 * len(ids) + 64
        for _ in range(2):
            buffer = ctypes.create_string_buffer(room)
            count = llama_cpp.llama_detokenize(
                self.model.vocab, tokens, len(ids), buffer, room, False, not skip_special
            )
            if count >= 0:
                return buffer.raw[:count].decode("utf-8", errors="replace")
            room = -count
        raise SpecdecodeError(f"{self.name}: llama.cpp could not detokenize {len(ids)} tokens")

    def token_text(self, token_id: int) -> str:
        if self._texts is None:
            self._texts = [
                llama_cpp.llama_vocab_get_text(self.model.vocab, i).decode("utf-8", errors="replace")
                for i in range(self._size)
            ]
        return self._texts[token_id] if 0 <= token_id < len(self._texts) else ""

    def _vocab_info(self) -> VocabInfo:
        vocab = self.model.vocab

        def token(value: int) -> int | None:
            return None if value < 0 else int(value)

        return VocabInfo(
            size=self._size,
            kind=VOCAB_KINDS.get(int(llama_cpp.llama_vocab_type(vocab)), "unknown"),
            bos_id=token(llama_cpp.llama_vocab_bos(vocab)),
            eos_id=token(llama_cpp.llama_vocab_eos(vocab)),
            add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            add_eos=bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
            eog_ids=frozenset(i for i in range(self._size) if llama_cpp.llama_vocab_is_eog(vocab, i)),
        )

    # Passes.

    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None) -> torch.Tensor:
        total = len(ids)
        assert total > 0, "evaluate needs at least one token"
        check_cache_room(self.name, len(self._tokens), total, self.n_ctx)
        self._drop_tree()
        wanted = total if logits_rows is None else min(logits_rows, total)
        owed = len(self._owed)
        rows_in = [*self._owed, *(int(token) for token in ids)]
        first_wanted = owed + total - wanted
        self._owed.clear()
        out: list[torch.Tensor] = []
        position = len(self._tokens) - owed
        step = min(self.n_batch, self._batch_rows)
        for start in range(0, len(rows_in), step):
            chunk = rows_in[start : start + step]
            for row, token in enumerate(chunk):
                self._set_row(
                    row, token, position + start + row, (self._sequence,), start + row >= first_wanted
                )
            outputs = self._decode(len(chunk))
            self._record_hidden(len(chunk))
            self._fresh.scored(position + start, len(chunk))
            self._pass_rows.extend([len(chunk)] * len(chunk))
            if len(outputs):
                out.append(outputs)
        self._tokens.extend(rows_in[owed:])
        if not out:
            return torch.empty(0, self._size)
        return torch.cat(out) if len(out) > 1 else out[0]

    def truncate(self, n: int) -> None:
        n = max(0, n)
        self._drop_tree()
        if n >= len(self._tokens):
            return
        cached = len(self._tokens) - len(self._owed)
        if n >= cached:
            del self._owed[n - cached :]
        else:
            if not llama_cpp.llama_memory_seq_rm(self._memory, self._sequence, n, -1):
                raise SpecdecodeError(f"{self.name}: llama.cpp cannot roll this model's cache back")
            self._owed.clear()
        del self._tokens[n:]
        del self._pass_rows[n:]
        self._fresh.truncate(n)
        if self._hidden is not None:
            self._hidden.truncate(n)

    def reusable_prefix(self, cached: int, prompt_length: int | None = None) -> int:
        """How many of the first `cached` positions (which hold a new prompt's tokens) the
        prompt of `prompt_length` tokens may keep so that every row gets the bits a fresh
        context gives it: in any build, the longest run of whole chunks a fresh context would
        have scored in the same passes (the prompt's remaining chunks then start where a fresh
        run's do, so every pass has the shape it has in a fresh run, on the same cached bits).

        More where the probe found two classes of passes, each giving a row the same bits
        whatever its size (`LlamaModel.wide_rows_agree`): those of up to `vouched_rows` rows,
        and the wider ones (llama.cpp's CPU flash attention, one thread: below and from 64
        query rows). Then a cached position is as good as a fresh run's where the pass that
        scored it and every position before it was of the class of the fresh run's chunk, and
        the rest of the prompt is scored in passes of the fresh run's classes: from a chunk
        boundary, or inside the fresh run's last chunk as one pass of its class (a wide last
        chunk leaves at least `vouched_rows` + 1 rows to score). A prompt scored before
        mostly keeps all but its last few dozen tokens, where whole chunks kept none of a
        prompt shorter than `n_batch`."""
        whole = self._fresh.reusable(cached)
        if whole == cached or prompt_length is None:
            return whole
        small = self.vouched_rows
        if small is None or not self.model.wide_rows_agree:
            return whole
        n_batch, last_start = self.n_batch, (prompt_length - 1) // self.n_batch * self.n_batch

        def fresh_small(position: int) -> bool:
            return min(n_batch, prompt_length - position // n_batch * n_batch) <= small

        keep = 0
        limit = min(cached, len(self._pass_rows))
        while keep < limit and (self._pass_rows[keep] <= small) == fresh_small(keep):
            keep += 1
        if keep > last_start and not fresh_small(last_start):
            keep = min(keep, prompt_length - small - 1)
        if keep <= last_start:
            keep = keep // n_batch * n_batch
        return max(keep, whole)

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """See `specdecode.backends.Backend.evaluate_tree` and the module's docstring."""
        prefix = len(self._tokens)
        check_tree_room(self.name, prefix, len(self._tree), len(ids), self.n_ctx)
        if len(self._tree) + len(ids) >= SPARE_SEQUENCE:
            raise SpecdecodeError(
                f"{self.name}: a token tree of more than {SPARE_SEQUENCE - 1} nodes does not fit "
                "llama.cpp's sequences here (use fewer draft tokens)"
            )
        if len(self._owed) + len(ids) > self._batch_rows:
            raise SpecdecodeError(f"{self.name}: {len(ids)} tree nodes exceed the batch size")
        nodes = self._tree.add(ids, parents)
        first = nodes.start
        members: dict[int, list[int]] = {node: [node + 1] for node in nodes}
        for node in nodes:
            for ancestor in self._tree.path(node)[:-1]:
                if ancestor >= first:
                    members[ancestor].append(node + 1)
        for node in nodes:
            # The nearest ancestor from an earlier pass holds the prefix and every ancestor before it.
            earlier = [ancestor for ancestor in self._tree.path(node) if ancestor < first]
            source = earlier[-1] + 1 if earlier else 0
            llama_cpp.llama_memory_seq_cp(self._memory, source, node + 1, -1, -1)
        # Owed path tokens (see commit) come first, seen by the committed sequence and every node.
        owed, everyone = len(self._owed), [0, *(node + 1 for node in nodes)]
        for row, token in enumerate(self._owed):
            self._set_row(row, token, prefix - owed + row, everyone, False)
        self._owed.clear()
        for row, node in enumerate(nodes, start=owed):
            position = prefix + self._tree.depths[node] - 1
            self._set_row(row, self._tree.tokens[node], position, members[node], True)
        logits = self._decode(owed + len(ids))
        self._record_hidden(owed)  # the owed path's rows; tree nodes are not cached positions
        self._pass_rows.extend([owed + len(ids)] * owed)
        return logits

    def commit(self, path: Sequence[int]) -> None:
        """The path joins the cached tokens, but its cache entries are dropped with the rest of
        the tree and its tokens are owed: evaluated again as the first rows of the next pass.
        Kept in place, the path's entries would sit in the cells the tree gave them, out of
        position order, and llama.cpp's attention sums over cells in cell order: every later
        row would round differently from plain generation's."""
        path = self._tree.check_path(path)
        tokens = [self._tree.tokens[node] for node in path]
        self._drop_tree()
        self._tokens.extend(tokens)
        self._owed.extend(tokens)

    # Hidden states (EAGLE-3): the inputs of the target's layers, as llama.cpp's own drafting reads them.

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """See `specdecode.backends.HiddenStates`. llama.cpp hands out the input of each layer
        for every row of a pass, not the last layer's output (its graph keeps only the output
        rows there): ids up to n_layers - 1."""
        layer_ids = list(layer_ids)
        if self._hidden is not None and self._hidden.layer_ids == layer_ids:
            return
        beyond = [layer for layer in layer_ids if not 0 <= layer < self.n_layers]
        if beyond:
            raise SpecdecodeError(
                f"{self.name}: llama.cpp exposes the inputs of layers 0..{self.n_layers - 1}, not "
                f"layer ids {beyond} (the last layer's output): run this head with --backend native"
            )
        api = _layer_input_api()
        for layer in range(self.n_layers):
            api["set"](self._context, layer, layer in layer_ids)
        self._hidden = HiddenRows(layer_ids, self.hidden_size) if layer_ids else None
        self.truncate(0)  # earlier positions have no rows for these layers

    def hidden_states(self, start: int, end: int) -> torch.Tensor:
        assert self._hidden is not None, "capture_hidden first"
        if end > len(self._hidden) and self._owed:
            self._settle()
        return self._hidden.rows(start, end)

    def input_embeddings(self) -> torch.Tensor:
        """The file's token embeddings [V, hidden_size], dequantized to float32 once per model."""
        if self.model.embeddings is None:
            from specdecode.backends.gguf_files import dequantized_tensor

            self.model.embeddings = dequantized_tensor(self.model.path, "token_embd.weight")
        return self.model.embeddings

    def _record_hidden(self, rows: int) -> None:
        """Append the captured layers' rows of the first `rows` rows of the pass just decoded."""
        if self._hidden is None or rows == 0:
            return
        get = _layer_input_api()["get"]
        layers = [
            np.ctypeslib.as_array(get(self._context, layer), shape=(rows, self.hidden_size))
            for layer in self._hidden.layer_ids
        ]
        self._hidden.extend(torch.from_numpy(np.concatenate(layers, axis=1)))

    def _settle(self) -> None:
        """Score the owed path tokens (see `commit`) in a pass of their own, for their rows."""
        owed, position = self._owed, len(self._tokens) - len(self._owed)
        for row, token in enumerate(owed):
            self._set_row(row, token, position + row, (self._sequence,), False)
        self._decode(len(owed))
        self._record_hidden(len(owed))
        self._pass_rows.extend([len(owed)] * len(owed))
        self._owed = []

    def _drop_tree(self) -> None:
        if len(self._tree):
            llama_cpp.llama_memory_seq_keep(self._memory, 0)
            self._tree.clear()

    def _set_row(self, row: int, token: int, position: int, sequences: Sequence[int], output: bool) -> None:
        batch = self._batch
        batch.token[row] = token
        batch.pos[row] = position
        batch.n_seq_id[row] = len(sequences)
        for i, sequence in enumerate(sequences):
            batch.seq_id[row][i] = sequence
        batch.logits[row] = output

    def _decode(self, rows: int) -> torch.Tensor:
        """Run the batch's first `rows` rows; the logits of its output rows, in row order.

        With several threads, llama.cpp's CPU flash attention splits a one-row pass over 512
        cells or more among them and adds their parts, which rounds a row otherwise than a pass
        of several rows: so a one-row pass gets a second row, the same token at the same
        position in the spare sequence, which sees only itself and is removed after the pass
        (from PAD_FROM on: it costs a one-row pass of the bundled target about a third more).
        With one thread the split is one part, the same bits, and nothing is added. The probe
        checks the outcome at every length."""
        padded = (
            rows == 1 and self.threads != 1 and self.pads_one_row_passes and self._batch.pos[0] >= PAD_FROM
        )
        if padded:
            self._set_row(1, self._batch.token[0], self._batch.pos[0], (SPARE_SEQUENCE,), False)
        self._batch.n_tokens = rows + padded
        outputs = sum(1 for row in range(rows) if self._batch.logits[row])
        status = llama_cpp.llama_decode(self._context, self._batch)
        if padded:
            llama_cpp.llama_memory_seq_rm(self._memory, SPARE_SEQUENCE, -1, -1)
        if status != 0:
            raise SpecdecodeError(f"{self.name}: llama_decode failed (status {status})")
        if not outputs:
            return torch.empty(0, self._size)
        logits = torch.empty(outputs, self._size, dtype=torch.float32)
        # One copy of the whole block: the buffer is overwritten by the next pass.
        ctypes.memmove(logits.data_ptr(), llama_cpp.llama_get_logits(self._context), logits.nbytes)
        return logits


class SharedLlamaCppBackend(LlamaCppBackend):
    """A fork that shares one llama.cpp context with its siblings (see `LlamaCppBackend.forks`),
    the sequence of its own id: a batch scores every sibling's rows in one `llama_decode`
    (`SharedPasses`, see `specdecode.backends.batch`).

    Each sequence has a KV stream of its own (the context is not unified): its cells sit
    exactly where a context of its own puts them, whatever the others cache or roll back, and
    attention sums over them in the same order. A unified cache would let a rollback of one
    sequence free cells that another's later positions then take, out of position order. The
    weight products still round a row by its pass's size: a shared pass holds at most
    `max_pass_rows` rows, the backend's `row_cap` where exactness is asked for.

    Trees need sequence ids that see the prefix's cells, which another stream's are not (a
    copy across streams copies a whole stream): these forks take chains only (`takes_trees`),
    and the generation loop verifies a tree's preferred path. Nor do they capture hidden
    states (EAGLE-3): a head's target keeps contexts of its own."""

    takes_trees = False
    pads_one_row_passes = False  # no spare sequence: each sequence has a KV stream of its own

    @property
    def pass_key(self) -> object:
        """Siblings share a forward: their rows may share a pass."""
        return self._shared

    @property
    def max_pass_rows(self) -> int:
        """The most rows of a shared pass: those the probe vouches for (`vouched_rows`; 1:
        every sequence alone), or the batch's where exactness was given up."""
        vouched = self.vouched_rows
        return self._batch_rows if vouched is None else min(vouched, self._batch_rows)

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        raise SpecdecodeError(
            f"{self.name}: forks sharing one llama.cpp context score chains only, not token trees"
        )

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        raise SpecdecodeError(
            f"{self.name}: forks sharing one llama.cpp context do not capture hidden states "
            "(an EAGLE-3 head's target forks contexts of its own)"
        )

    def evaluate_groups(self, groups: Sequence[RowGroup]) -> list[torch.Tensor]:
        """Every group's chain in one `llama_decode` (see `specdecode.backends.batch`); each
        group's backend is a sibling of this one. Every group is checked before any cache
        changes, so a refused pass leaves every sequence as it was."""
        sequences = set()
        for group in groups:
            backend = group.backend
            assert isinstance(backend, SharedLlamaCppBackend) and backend._shared is self._shared
            assert backend._sequence not in sequences, "one group per sequence"
            sequences.add(backend._sequence)
            if group.parents is not None:
                backend.evaluate_tree(group.ids, group.parents)  # refused
            check_cache_room(backend.name, len(backend.tokens), len(group.ids), backend.n_ctx)
        rows = sum(len(group.backend._owed) + len(group) for group in groups)
        if rows > self._batch_rows:
            raise SpecdecodeError(f"{self.name}: {rows} rows exceed the batch size {self._batch_rows}")
        # llama.cpp splits a pass over streams into parts of consecutive sequence ids, each
        # taking as many rows of every sequence in it: rows in sequence order split least.
        order = sorted(range(len(groups)), key=lambda index: groups[index].backend._sequence)
        row = 0
        for index in order:
            group, backend = groups[index], groups[index].backend
            rows_in = [*backend._owed, *group.ids]
            first_wanted = len(rows_in) - group.wanted
            position = len(backend._tokens) - len(backend._owed)
            for offset, token in enumerate(rows_in):
                self._set_row(row, token, position + offset, (backend._sequence,), offset >= first_wanted)
                row += 1
        logits = self._decode(row)
        out: list[torch.Tensor] = [torch.empty(0)] * len(groups)
        start = 0
        for index in order:
            group, backend = groups[index], groups[index].backend
            backend._pass_rows.extend([row] * (len(backend._owed) + len(group.ids)))
            backend._tokens.extend(group.ids)
            backend._owed.clear()
            out[index] = logits[start : start + group.wanted]
            start += group.wanted
        return out
