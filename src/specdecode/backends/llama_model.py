"""A loaded GGUF model and the llama.cpp contexts over it: the weights and vocabulary that forks
share, and each context's KV cache, compute buffers and batch.

Apart from the backend (`specdecode.backends.llama_cpp`) because they own llama.cpp's memory
(freed with their last holder) and know nothing of passes, trees or the probe's verdicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.backends.llama_lib import TILED_SWITCH, kernels, llama_cpp, require_library, silence_logs
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specdecode.backends.llama_probe import RowAgreement

MAX_SEQUENCES = 64  # the committed sequence, up to 62 pending tree nodes and the spare one


class LlamaModel:
    """A loaded GGUF model (weights and vocabulary), shared by the contexts forked from it.

    repack: whether llama.cpp may repack weights into its interleaved CPU layouts (its
    `use_extra_bufts`, llama.cpp's `--repack`/`--no-repack`). Those layouts have their own
    batched kernels, which round a row differently from the one-row path.

    ggml's tiled K-quant product is switched off (TILED_SWITCH) unless the environment already
    says otherwise: with it, a K-quant file's rows agree with one-row passes only in passes of
    up to 7 rows; without it, in passes of every probed size (it serves passes of 8 rows and
    more, a long prompt's chunks among them)."""

    # Class defaults, so that a model whose loading failed is finalized without them.
    contexts = 0  # live contexts made from it: the model is freed after the last
    unused = False  # nothing holds it but its contexts (its __del__ has run)

    def __init__(
        self, path: Path, gpu_layers: int, repack: bool = True, progress: Callable[[str], None] | None = None
    ) -> None:
        """progress: told as a long step on this model begins (its tokenizer built, the row
        probe), for a command to show; the model's contexts and forks share it."""
        require_library()
        os.environ.setdefault(TILED_SWITCH, "0")
        silence_logs()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        params.use_extra_bufts = repack
        self.repack = repack
        self.embeddings: torch.Tensor | None = None  # token embeddings, read on first use (EAGLE-3)
        self.output: torch.Tensor | None = None  # output head, read on first use (DFlash)
        self.kernels = kernels()
        self.pointer = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.pointer:
            raise SpecdecodeError(f"llama.cpp cannot load {path} (not a model file it knows)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.pointer)
        self.path = path
        self.progress = progress
        self._tokenizer = None
        self.probe: RowAgreement | None = None  # see RowProbe.invariant
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
            if self.progress is not None:  # transformers' imports alone take seconds
                self.progress(f"reading {self.path.name}'s tokenizer with transformers")
            from specdecode.backends.gguf_files import load_gguf_tokenizer

            self._tokenizer = load_gguf_tokenizer(self.path, self.progress)
        return self._tokenizer

    def __del__(self) -> None:
        self.unused = True
        self.free_if_unused()

    def free_if_unused(self) -> None:
        """Free the weights once the model is unused and its last context is freed: a context
        freed after its model reads freed memory, and garbage in a reference cycle is finalized
        in no set order (a context's reference to its model does not order them)."""
        if self.unused and not self.contexts and getattr(self, "pointer", None) and llama_cpp is not None:
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
        self.model = model
        model.contexts += 1
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
            self.model.contexts -= 1
            self.model.free_if_unused()
