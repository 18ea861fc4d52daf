"""Model backends: what the generation loop and the strategies need from a model, and no more.

A backend owns one model, its tokenizer and one KV cache. The cache holds `tokens` (the ids
evaluated so far, in order); `evaluate` appends new tokens after them and returns logits for
every new row, so a verify step scores [last, d0, ..., d(k-1)] in one forward pass.
Rolling back is `truncate(n)`: a length change, never a re-evaluation.

A pass may also score a token tree (`evaluate_tree`): each row is a node that sees the cached
prefix and its own ancestors, at position prefix + depth - 1 (see `specdecode.backends.tree`).
The nodes stay pending after the prefix, possibly over several passes, until `commit(path)`
keeps one root-to-node path as the next cached positions, without evaluating it again.

Some strategies (EAGLE-3) also read the target's hidden states. That is an optional
capability (`HiddenStates`): a backend that has it records the chosen layers' features for
every cached position once asked (`capture_hidden`), and costs nothing until then; a
backend without it is refused by `hidden_state_source` with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdecode.errors import SpecdecodeError


@dataclass(frozen=True)
class VocabInfo:
    """Facts about a vocabulary that speculation depends on (llama.cpp's compatibility inputs)."""

    size: int  # rows of the logits, V
    kind: str  # "bpe" (byte-level BPE), "spm" (BPE with byte fallback), "ugm", "wpm", "word"
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int] = field(default_factory=frozenset)  # ids that end generation


class Backend(Protocol):
    """A causal LM with a KV cache that can be rolled back to any length."""

    vocab: VocabInfo
    n_ctx: int  # positions the cache may hold

    @property
    def tokens(self) -> list[int]:
        """Ids currently in the KV cache (positions 0..n-1). Callers must not mutate it."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def detokenize(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of an id, as stored (no decoding); "" past the tokenizer's end."""
        ...

    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None) -> torch.Tensor:
        """Append `ids` at positions len(tokens)... and return logits [T, V] for the last
        `logits_rows` rows (all rows when None). Long inputs are processed in chunks."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions and forget the rest (pending tree nodes too)."""
        ...

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Score tree nodes after the cached tokens and return their logits [N, V]. parents[i]
        is -1 (the node follows the cached tokens) or the index of an earlier pending node,
        counting every node scored since the last commit. A node's row gets what a linear pass
        over its path would give it (bit for bit where the backend is row-invariant)."""
        ...

    def commit(self, path: Sequence[int]) -> None:
        """Append the pending nodes of `path` (a root-to-node path, [] for none) to the cached
        tokens, and forget every other pending node."""
        ...


class HiddenStates(Protocol):
    """A backend that can expose its model's residual stream (what EAGLE-3 heads read).

    Feature row p is the concatenation, in `layer_ids` order, of the residual-stream input
    to decoder layer l at position p (the final hidden state before the output norm when
    l == n_layers). Rows stay aligned with `tokens`: `truncate` trims them, and positions
    re-used from the cache keep the rows recorded when they were evaluated.
    """

    n_layers: int
    hidden_size: int

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """Record these layers from now on (an empty list stops recording). When the choice
        changes, the cache is emptied: earlier positions have no rows for the new layers."""
        ...

    def hidden_states(self, start: int, end: int) -> torch.Tensor:
        """Feature rows [end - start, len(layer_ids) * hidden_size] of cached positions start..end-1."""
        ...

    def input_embeddings(self) -> torch.Tensor:
        """The token embedding matrix [V, hidden_size] (shared with heads that carry none)."""
        ...

    def output_embeddings(self) -> torch.Tensor:
        """The output head's matrix [V, hidden_size] (a DFlash drafter reads out through it)."""
        ...


def hidden_state_source(backend: Backend, why: str) -> HiddenStates:
    """`backend` as a HiddenStates, or a clear error naming who needed it."""
    needed = ("capture_hidden", "hidden_states", "input_embeddings", "n_layers", "hidden_size")
    if not all(hasattr(backend, name) for name in needed):
        raise SpecdecodeError(
            f"{why} needs the target's hidden states, which {type(backend).__name__} cannot expose"
        )
    return backend  # type: ignore[return-value]


def check_cache_room(name: str, cached: int, new: int, n_ctx: int) -> None:
    """Refuse a pass that would append more tokens than the context holds (every backend's
    `evaluate`, before it changes anything)."""
    if cached + new > n_ctx:
        raise SpecdecodeError(f"{name}: context full ({cached} + {new} tokens > n_ctx {n_ctx})")


@dataclass
class WholeChunks:
    """The leading cached positions scored in whole `n_batch` chunks from position 0, as a
    fresh context scores a prompt. Where kernels round a row by its pass's shape, a new prompt
    gets a fresh run's bits only if it keeps such chunks of the cache and scores the rest in the
    chunks a fresh run scores it in (the transformers and llama.cpp backends' `reusable_prefix`)."""

    n_batch: int
    end: int = 0

    def scored(self, position: int, rows: int) -> None:
        """A pass scored `rows` cached positions from `position` on."""
        if position == self.end and rows == self.n_batch:
            self.end += rows

    def truncate(self, n: int) -> None:
        """Only the first n positions stay cached. A chunk cut short is a chunk no longer, and
        `end` stays a multiple of `n_batch`: a pass that then starts at the cut (a verify pass
        after a rollback) does not start where a fresh run's chunk does."""
        self.end = min(self.end, n // self.n_batch * self.n_batch)

    def reusable(self, cached: int) -> int:
        """How many of the first `cached` positions a new prompt may keep: whole chunks."""
        return min(cached, self.end) // self.n_batch * self.n_batch


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def uncached_tail(backend: Backend, ids: Sequence[int]) -> Sequence[int]:
    """Cut the cache to the longest prefix of `ids` it holds and return the rest, which the
    caller evaluates (at least the last id, whose logits the caller needs)."""
    assert len(ids) > 0, "need at least one token"
    keep = min(common_prefix(backend.tokens, ids), len(ids) - 1)
    backend.truncate(keep)
    return ids[keep:]


def evaluate_continuation(backend: Backend, ids: Sequence[int]) -> torch.Tensor:
    """Make the cache hold exactly `ids` and return the logits [V] after its last token.

    Reuses the longest cached prefix, so only tokens the backend has not seen are evaluated
    (the last one is re-evaluated when everything was cached, since its logits are needed).
    """
    return backend.evaluate(uncached_tail(backend, ids), logits_rows=1)[0]
