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

Beside this module: llama-cpp-python's library (`specdecode.backends.llama_lib`), the loaded
model and its contexts (`specdecode.backends.llama_model`), the row-invariance probe and its
verdicts (`specdecode.backends.llama_probe`), GGUF files (`specdecode.backends.gguf_files`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.backends import VocabInfo, WholeChunks, check_cache_room
from specdecode.backends.batch import RowGroup
from specdecode.backends.hidden import HiddenRows
from specdecode.backends.llama_lib import layer_input_api, llama_cpp, require_library
from specdecode.backends.llama_model import MAX_SEQUENCES, LlamaContext, LlamaModel
from specdecode.backends.llama_probe import RowProbe
from specdecode.backends.options import LoadOptions
from specdecode.backends.tree import PendingTree, check_tree_room
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

VOCAB_KINDS = {1: "spm", 2: "bpe", 3: "wpm", 4: "ugm"}
SPARE_SEQUENCE = MAX_SEQUENCES - 1  # a one-row pass's second row (see LlamaCppBackend._decode)
# From this position on a one-row pass gets that second row: below it, the cache holds fewer
# than 256 cells (positions, tree nodes and the spare), and llama.cpp's attention reads 256.
PAD_FROM = 128


class LlamaCppBackend(RowProbe):
    """A GGUF model on llama.cpp's kernels (see `specdecode.backends.Backend`); the row-invariance
    probe's verdicts are `RowProbe`'s (`specdecode.backends.llama_probe`)."""

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

    def _probe_backend(self, n_ctx: int) -> LlamaCppBackend:
        """A backend over the same model in a context of its own of `n_ctx` cells, for the
        row-invariance probe (see `RowProbe.probe_invariance`)."""
        return LlamaCppBackend(
            self.model,
            n_ctx=n_ctx,
            n_batch=self.n_batch,
            threads=self.threads,
            name=self.name,
        )

    def draft_room(self) -> int | None:
        """The most draft tokens the next verify pass may carry within `row_cap` (None: no
        limit). A committed tree path is owed (see `commit`) and rides in that pass too."""
        cap = self.row_cap
        return None if cap is None else max(0, cap - 1 - len(self._owed))

    @classmethod
    def load(
        cls, path: str | Path, options: LoadOptions, progress: Callable[[str], None] | None = None
    ) -> LlamaCppBackend:
        """Load a GGUF file with the LoadOptions the other backends take (dtype is the file's).
        progress: told as a long step on the model begins (see `LlamaModel`)."""
        require_library()
        path = Path(path)
        if options.dtype != "auto":
            raise SpecdecodeError(
                f"{path.name}: llama.cpp computes in the file's own weight types; dtype {options.dtype!r} "
                '(--dtype) applies to the PyTorch backends (backend="native", --backend native)'
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
                "passes 'fixed' (--passes fixed) is the native backend's CUDA graphs; llama.cpp takes "
                "invariant (the default: drafts kept to passes whose rows are bit-identical) or bucketed "
                "(any pass size)"
            )
        return cls(
            LlamaModel(path, gpu_layers, options.repack, progress),
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
                f"layer ids {beyond} (the last layer's output): run this head on the native backend "
                '(backend="native", --backend native)'
            )
        api = layer_input_api()
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

    def output_embeddings(self) -> torch.Tensor:
        """The file's output head [V, hidden_size] (its token embeddings when tied), dequantized
        to float32 once per model."""
        if self.model.output is None:
            from specdecode.backends.gguf_files import dequantized_tensor

            try:
                self.model.output = dequantized_tensor(self.model.path, "output.weight")
            except SpecdecodeError:  # tied: the file holds no output.weight
                self.model.output = self.input_embeddings()
        return self.model.output

    def _record_hidden(self, rows: int) -> None:
        """Append the captured layers' rows of the first `rows` rows of the pass just decoded."""
        if self._hidden is None or rows == 0:
            return
        get = layer_input_api()["get"]
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
