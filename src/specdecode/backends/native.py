"""A lean PyTorch forward for Llama-family models, over the weights transformers loaded.

Why a second forward: for the small models that drafting uses, and for any model on a CPU, a
step through transformers' module stack spends much of its time outside the matrix products
(cache objects, mask building, per-layer Python). Here one function runs the whole pass over
a preallocated KV cache that rolls back by a length, with q/k/v and gate/up fused into one
product each (gpt-fast's recipe).

Why row-invariance: a verify pass scores k+1 rows at once where plain generation scores one
row per pass. The library's kernels may give a row different bits depending on how many rows
share the product (they pick other blockings, or another kernel altogether for one row), and a
sampled token whose draw falls near a boundary of its distribution, or a greedy near-tie, flips
on a one-ulp difference: speculative output would then drift from plain output. That is most
visible in bfloat16, but float32 and float64 kernels do it too (one row of a float32 product is
a GEMV, several a GEMM, summed in another order). So in every dtype, every pass of up to
INVARIANT_ROWS rows gives each row exactly the bits it gets alone. Attention runs one query row
at a time (the very call a one-row pass makes), and each projection shape is checked when the
model is loaded: rows alone against rows together, on a probe built so that any change in the
order of summation shows (see `invariant`). A projection runs as one product where that
passes; else as the cheapest `Plan` that passes: a sum of K-slices (in float32 at least),
products of a band of row counts whose kernels agree (a shorter pass padded with zero rows, a
longer one split), or, failing all, one row at a time.

The plans and their probes are in `invariant`, the arranged weights in `native_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.backends import check_cache_room
from specdecode.backends.batch import RowGroup
from specdecode.backends.hf import HFBackend
from specdecode.backends.hidden import HiddenRows
from specdecode.backends.invariant import INVARIANT_DTYPES, INVARIANT_ROWS
from specdecode.backends.native_weights import NativeWeights, native_unsupported, native_weights
from specdecode.backends.tree import check_tree_room
from specdecode.errors import SpecdecodeError


class KVCache:
    """Keys and values of every layer, [layers, kv_heads, capacity, head_dim], grown by doubling
    up to n_ctx, plus the rotary angles of each position (in the model's dtype)."""

    def __init__(self, weights: NativeWeights, n_ctx: int, dtype: torch.dtype, device: torch.device) -> None:
        self.weights = weights
        self.n_ctx = n_ctx
        self.dtype = dtype
        self.device = device
        self.capacity = 0
        shape = (len(weights.layers), weights.n_kv_heads, 0, weights.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.cos = self.sin = torch.empty(0, weights.head_dim, device=device)
        # Keys and values of pending tree nodes, by node (see NativeBackend).
        self.node_keys = torch.empty(shape, dtype=dtype, device=device)
        self.node_values = torch.empty(shape, dtype=dtype, device=device)

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        capacity = min(self.n_ctx, max(n, 2 * self.capacity, 64))
        keys = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
        values = torch.empty_like(keys)
        keys[:, :, : self.capacity] = self.keys
        values[:, :, : self.capacity] = self.values
        self.keys, self.values, self.capacity = keys, values, capacity
        positions = torch.arange(capacity, device=self.device)[None]
        probe = torch.empty(0, dtype=self.weights.embeddings.dtype, device=self.device)
        cos, sin = self.weights.rotary(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, head_dim]

    def reserve_nodes(self, n: int) -> None:
        have = self.node_keys.shape[2]
        if n <= have:
            return
        capacity = max(n, 2 * have, 16)
        keys = self.node_keys.new_empty(*self.node_keys.shape[:2], capacity, self.node_keys.shape[3])
        values = torch.empty_like(keys)
        keys[:, :, :have] = self.node_keys
        values[:, :, :have] = self.node_values
        self.node_keys, self.node_values = keys, values


# attend(layer index, q [H, T, D], k [KV, T, D], v [KV, T, D]): stores k and v where the pass
# keeps them and returns the attention output [H, T, D] of its rows.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Rows:
    """One sequence's rows, ready for a pass: their rotary angles, what they attend to, where
    their hidden-state rows go, and what the cache records once the pass has run."""

    ids: list[int]
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor
    attend: Attend
    recorder: HiddenRows | None
    done: Callable[[], None]

    def __len__(self) -> int:
        return len(self.ids)


class PassPart(Protocol):
    """One sequence's rows in a pass, as any native forward lays them out (`Rows`, or the
    graph passes' rows): how many, where their hidden-state rows go, what follows the pass."""

    recorder: HiddenRows | None
    done: Callable[[], None]

    def __len__(self) -> int: ...


def recorded_layers(parts: Sequence[PassPart]) -> list[int]:
    """The layers whose residual stream some part of the pass records."""
    return sorted({layer for part in parts if part.recorder is not None for layer in part.recorder.layer_ids})


def finish_parts(parts: Sequence[PassPart], captured: Mapping[int, torch.Tensor]) -> None:
    """After a pass: each part's hidden-state rows (captured: layer -> rows of the whole pass,
    parts in order) are recorded, then its cache updated."""
    start = 0
    for part in parts:
        end = start + len(part)
        if part.recorder is not None and part.recorder.layer_ids:
            part.recorder.extend(
                torch.cat([captured[layer][start:end] for layer in part.recorder.layer_ids], dim=-1)
            )
        part.done()
        start = end


class NativeBackend(HFBackend):
    """HFBackend's interface and loading, with the native forward (see the module docstring).

    Token trees (`evaluate_tree`): the nodes' rows take positions prefix + depth - 1. Each
    node's keys and values are kept by node, and a row attends exactly as a one-row pass over
    its own path would: the slots after the prefix are a window that holds the row's ancestors
    (refilled only where the previous row's path differs) and attention runs over prefix +
    window, the very call of a linear pass. With the row-invariant projections, a node gets the
    bits a linear pass over its path gives it. `commit` copies the kept path into the slots
    after the prefix: nothing is evaluated again.
    """

    half_precision_on_cpu = True
    max_pass_rows = INVARIANT_ROWS  # rows of several sequences share a pass up to this many
    row_invariant = True  # passes probed and run so that a row's bits never depend on the pass

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **options) -> None:
        """options: HFBackend's (n_ctx, n_batch, threads, name)."""
        reason = native_unsupported(model.config)
        if reason is not None:
            name = options.get("name", "model")
            raise SpecdecodeError(f"{name}: the native backend cannot run this model: {reason}")
        super().__init__(model, tokenizer, **options)
        self._use_threads()  # the probes must see the kernels the passes will use
        self.weights = native_weights(self.model, self.row_invariant)
        dtype = self.weights.embeddings.dtype
        # Attention runs in float32 at least: one query row at a time (row-invariance), where
        # torch's half-precision kernel is several times slower than its float32 one on CPUs.
        self._kv = KVCache(self.weights, self.n_ctx, torch.promote_types(dtype, torch.float32), self.device)
        self.invariant = dtype in INVARIANT_DTYPES
        # Per layer, which node's keys and values fill each slot after the prefix (tree passes).
        self._windows: list[list[int]] = [[] for _ in self.weights.layers]

    def reusable_prefix(self, cached: int, prompt_length: int | None = None) -> int:
        """Every cached position: rows are computed alike in passes of any shape."""
        return cached

    def truncate(self, n: int) -> None:
        n = max(0, n)
        self._drop_tree()
        del self._tokens[n:]
        if self._recorder is not None:
            self._recorder.truncate(n)

    def _new_recorder(self, layer_ids: Sequence[int]) -> HiddenRows:
        return HiddenRows(layer_ids, self.hidden_size)

    def _check_tree_support(self) -> None:
        """The native forward scores trees of any model it runs."""

    def _forward(self, chunk: Sequence[int], keep: int) -> torch.Tensor:
        return self._run([self._linear_rows(chunk)], keep)[None]

    @torch.inference_mode()
    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        check_tree_room(self.name, len(self._tokens), len(self._tree), len(ids), self.n_ctx)
        self._use_threads()
        logits = self._run([self._tree_rows_of(ids, parents)], len(ids))
        return logits if logits.dtype == torch.float64 else logits.float().cpu()

    @property
    def pass_key(self) -> object:
        """Forks of one model share a forward: their rows may share a pass."""
        return self.weights

    @torch.inference_mode()
    def evaluate_groups(self, groups: Sequence[RowGroup]) -> list[torch.Tensor]:
        """Several sequences' rows in one forward (see `specdecode.backends.batch`); each
        group's backend is a NativeBackend over these weights. Every group is checked before
        any cache changes, so a refused pass leaves every sequence as it was. Logits come to
        the host, but a group `on_device`'s stay where the pass ran."""
        for group in groups:
            backend = group.backend
            assert isinstance(backend, NativeBackend) and backend.weights is self.weights
            if group.parents is None:
                check_cache_room(backend.name, len(backend.tokens), len(group.ids), backend.n_ctx)
            else:
                check_tree_room(
                    backend.name, len(backend.tokens), len(backend._tree), len(group.ids), backend.n_ctx
                )
        self._use_threads()
        parts = []
        for group in groups:
            backend = group.backend
            if group.parents is None:
                backend._drop_tree()
                parts.append(backend._linear_rows(group.ids))
            else:
                parts.append(backend._tree_rows_of(group.ids, group.parents))
        wanted = [group.wanted for group in groups]
        total = sum(len(group) for group in groups)
        keep: int | torch.Tensor = total  # verify passes want every row: no gather of rows
        if sum(wanted) < total:
            rows, start = [], 0
            for group, count in zip(groups, wanted, strict=True):
                rows.extend(range(start + len(group) - count, start + len(group)))
                start += len(group)
            keep = torch.tensor(rows, device=self.device)
        logits = self._run(parts, keep)
        if logits.dtype != torch.float64:
            logits = logits.float()
        if not any(group.on_device for group in groups):
            return list(logits.cpu().split(wanted))
        if logits.device.type == "cuda":  # the pass ends here, as the copy to the host ended it
            torch.cuda.synchronize(logits.device)
        rows = logits.split(wanted)
        return [row if group.on_device else row.cpu() for group, row in zip(groups, rows, strict=True)]

    def _linear_rows(self, chunk: Sequence[int]) -> Rows:
        """Rows appended after the cached tokens, each seeing every position before it."""
        start = len(self._tokens)
        end = start + len(chunk)
        self._kv.reserve(end)
        ids = list(chunk)
        return Rows(
            ids,
            self._kv.cos[start:end],
            self._kv.sin[start:end],
            self._linear_attention(start, end),
            self._recorder,
            lambda: self._tokens.extend(ids),
        )

    def _tree_rows_of(self, ids: Sequence[int], parents: Sequence[int]) -> Rows:
        """Tree nodes after the cached prefix, each seeing the prefix and its own ancestors."""
        prefix = len(self._tokens)
        nodes = self._tree.add(ids, parents)
        self._kv.reserve(prefix + len(self._tree))
        self._kv.reserve_nodes(len(self._tree))
        positions = torch.tensor([prefix + self._tree.depths[node] - 1 for node in nodes], device=self.device)
        attend = self._tree_attention_by_row(prefix, nodes)
        return Rows(
            list(ids), self._kv.cos[positions], self._kv.sin[positions], attend, self._tree_rows, _nothing
        )

    def _run(self, parts: Sequence[Rows], keep: int | torch.Tensor) -> torch.Tensor:
        """One forward over every part's rows -> logits of the rows `keep` selects (see
        `_pass`); then each part's hidden-state rows are recorded and its cache updated."""
        if len(parts) == 1:
            part = parts[0]
            ids, cos, sin, attend = part.ids, part.cos, part.sin, part.attend
        else:
            ids = [token for part in parts for token in part.ids]
            cos = torch.cat([part.cos for part in parts])
            sin = torch.cat([part.sin for part in parts])
            attend = _attend_by_part(parts)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits, captured = self._pass(tokens, cos, sin, keep, attend, recorded_layers(parts))
        finish_parts(parts, captured)
        return logits

    @torch.inference_mode()
    def commit(self, path: Sequence[int]) -> None:
        path = self._tree.check_path(path)
        prefix, kv = len(self._tokens), self._kv
        if path:
            kept = slice(prefix, prefix + len(path))
            kv.keys[:, :, kept] = kv.node_keys[:, :, path]
            kv.values[:, :, kept] = kv.node_values[:, :, path]
        self._keep_path(path)
        self._windows = [[] for _ in self.weights.layers]

    def _drop_tree(self) -> None:
        if len(self._tree):
            self._keep_path([])
        self._windows = [[] for _ in self.weights.layers]

    def _pass(
        self,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: int | torch.Tensor,
        attend: Attend,
        recorded: Sequence[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Rows of `ids` with rotary angles cos/sin [T, D] -> logits of the last `keep` rows
        (or of the rows a tensor of indices names), and the residual stream [T, C] entering
        each `recorded` layer (the final hidden state for the layer count); `attend` decides
        what each row sees."""
        w, kv = self.weights, self._kv
        n = ids.shape[0]
        captured: dict[int, torch.Tensor] = {}
        x = F.embedding(ids, w.embeddings)  # [T, C]
        for index, layer in enumerate(w.layers):
            if index in recorded:
                captured[index] = x
            h = _rms_norm(x, layer.input_norm, w.eps)
            q, k, v = layer.qkv(h).split(
                [w.n_heads * w.head_dim, w.n_kv_heads * w.head_dim, w.n_kv_heads * w.head_dim], dim=-1
            )
            q = _rotate(q.view(n, w.n_heads, w.head_dim).transpose(0, 1), cos, sin)  # [H, T, D]
            k = _rotate(k.view(n, w.n_kv_heads, w.head_dim).transpose(0, 1), cos, sin)
            v = v.view(n, w.n_kv_heads, w.head_dim).transpose(0, 1)
            attended = attend(index, q.to(kv.dtype), k, v).to(x.dtype)
            x = x + layer.out(attended.transpose(0, 1).reshape(n, w.n_heads * w.head_dim))
            gate, up = layer.gate_up(_rms_norm(x, layer.post_norm, w.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if len(w.layers) in recorded:
            captured[len(w.layers)] = x
        kept = x[n - keep :] if isinstance(keep, int) else x[keep]
        return w.lm_head(_rms_norm(kept, w.final_norm, w.eps)), captured

    def _linear_attention(self, start: int, end: int) -> Attend:
        """Rows at positions start..end-1, each seeing every position before it."""
        kv = self._kv

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.keys[index, :, start:end] = k
            kv.values[index, :, start:end] = v
            return self._attend(q, kv.keys[index], kv.values[index], start)

        return attend

    def _tree_attention_by_row(self, prefix: int, nodes: range) -> Attend:
        """Tree rows one by one, each over prefix + its own path laid out in the window."""
        kv, tree = self._kv, self._tree

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.node_keys[index, :, nodes.start : nodes.stop] = k
            kv.node_values[index, :, nodes.start : nodes.stop] = v
            keys, values, window = kv.keys[index], kv.values[index], self._windows[index]
            rows = []
            for row, node in enumerate(nodes):
                path = tree.path(node)
                for slot, ancestor in enumerate(path):
                    if slot < len(window) and window[slot] == ancestor:
                        continue
                    keys[:, prefix + slot] = kv.node_keys[index, :, ancestor]
                    values[:, prefix + slot] = kv.node_values[index, :, ancestor]
                    if slot < len(window):
                        window[slot] = ancestor
                    else:
                        window.append(ancestor)
                rows.append(self._attend_row(q[:, row : row + 1], keys, values, prefix + len(path)))
            return torch.cat(rows, dim=1)

        return attend

    def _attend_row(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int
    ) -> torch.Tensor:
        """One query row [H, 1, D] over cached positions 0..end-1: the call a one-row pass makes."""
        return F.scaled_dot_product_attention(
            q[None],
            keys[None, :, :end],
            values[None, :, :end],
            enable_gqa=self.weights.n_kv_heads != self.weights.n_heads,
        )[0]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of queries [H, T, D] at positions start.. over the cached keys."""
        n = q.shape[1]
        if n == 1 or (self.invariant and n <= INVARIANT_ROWS):
            rows = [self._attend_row(q[:, i : i + 1], keys, values, start + i + 1) for i in range(n)]
            return rows[0] if n == 1 else torch.cat(rows, dim=1)
        visible = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
        return F.scaled_dot_product_attention(
            q[None],
            keys[None, :, : start + n],
            values[None, :, : start + n],
            attn_mask=visible,
            enable_gqa=self.weights.n_kv_heads != self.weights.n_heads,
        )[0]


def _attend_by_part(parts: Sequence[Rows]) -> Attend:
    """Attention of a pass over several sequences: each part's rows through its own attend."""
    bounds = []
    start = 0
    for part in parts:
        bounds.append((part, start, start + len(part.ids)))
        start += len(part.ids)

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [part.attend(index, q[:, a:b], k[:, a:b], v[:, a:b]) for part, a, b in bounds], dim=1
        )

    return attend


def _nothing() -> None:
    """A tree part's cache needs nothing after its pass: its nodes wait for commit."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in float32 (in float64 models too, so that the
    native forward computes what transformers' does), scale in the model dtype."""
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [heads, T, D] with angles [T, D] (the half-split layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
