"""The native forward for GPUs: every row of a pass in one attention call per layer, over a
static KV cache, replayed from captured CUDA graphs.

Why another pass: `native`'s passes were built for CPU bit-invariance (attention one query
row at a time, projections split by probed plans). On a GPU each of those is a kernel launch
of microseconds' work, and the host's launch rate, not the GPU, sets the pace. Here a pass is
one fixed sequence of kernels over static buffers, the same for every kind of row:

- The rows of a pass (a chain after the cached tokens, tree nodes, several sequences) are laid
  out flat. Each row carries its token, its position, the slot its key and value go to, and
  what it sees: the slots [lo, hi) (its sequence's cached prefix, and its own chain) plus up
  to ANCESTOR_SLOTS single slots (its tree path). One boolean mask built on the device from
  those columns drives a single attention call per layer for every row.
- The KV store is shared by the forks of one model: a seat of S slots per sequence, grown by
  doubling (S) or by seats (P). Rejected drafts' entries simply stay in their slots, unseen.
  Attention reads only the seats of the sequences in the pass (one contiguous view), and each
  seat's last slot is a scratch slot where padding rows write.
- A pass of R rows over a span of seats replays the graph captured for those shapes
  (captured on first use; grown buffers drop the graphs).

Exactness. A GPU's matrix kernels are chosen by the shapes of a product, and their order of
summation with them: one row alone and the same row among k others may differ in the last bit,
and a greedy near-tie or a sampled draw at a boundary then flips. Two modes:

- fixed (the default on a GPU): every pass runs in chunks of exactly `fixed_rows` rows,
  padding a shorter one. Every pass then runs the very same kernels, a row's bits depend only
  on its own inputs and on what it sees, and a chain (alone or among other sequences' rows)
  gets the bits plain decoding gives it. Tree nodes see their ancestors at scattered slots,
  which the attention kernel sums in another order than a chain's contiguous slots: their
  logits match plain decoding's within rounding, not bit for bit.
- bucketed: rows padded to the next power of two only (1, 2, 4, ... MAX_GRAPH_ROWS; longer
  passes run without a graph). Fewer rows for plain decoding; rows of passes of different
  buckets may differ in the last bits, so output may differ from plain decoding where plain
  decoding's own choice was a near-tie within that rounding.

For bit-identity everywhere (trees included) on any device, `passes="invariant"` runs
`native`'s row-invariant design instead, at the cost of its many small kernels.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.backends.hidden import HiddenRows
from specdecode.backends.native import NativeBackend, _rms_norm, _rotate, finish_parts, recorded_layers
from specdecode.backends.native_weights import NativeWeights

FIRST_SLOTS = 2048  # a seat's first size: most requests never grow it (each growth recaptures)
FIXED_ROWS = 32  # rows of every pass in fixed mode: a default verify pass (17) and a batch of 32
MAX_GRAPH_ROWS = 128  # bucketed mode: the largest pass replayed from a graph
ANCESTOR_SLOTS = 32  # tree path slots a row names in a graph pass (deeper paths run eagerly)
# Seats are multiples of this many slots: the mask's alignment, and whole key blocks of the
# attention kernels, so a row's own seat is summed in the same blocks wherever it lies in a span.
SLOT_ALIGN = 128
# Columns of a pass's row table, then the ancestor slots.
ID, POSITION, SLOT, LO, HI = range(5)
FIRST_ANCESTOR = 5


@dataclass
class GraphRows:
    """One sequence's rows of a pass, as table rows, and what to do once the pass has run."""

    table: list[list[int]]  # [token, position, slot, lo, hi, *ancestor slots] per row
    recorder: HiddenRows | None
    done: Callable[[], None]

    def __len__(self) -> int:
        return len(self.table)


class _Graph:
    """One captured pass of `rows` rows: its static row table, logits and recorded states."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.captured: list[torch.Tensor] = []


class GraphPasses:
    """The KV store and the captured passes shared by the forks of one model (per context
    size and mode); each fork holds a seat."""

    def __init__(
        self, weights: NativeWeights, n_ctx: int, fixed_rows: int | None, device: torch.device
    ) -> None:
        self.weights = weights
        self.n_ctx = n_ctx
        self.fixed_rows = fixed_rows
        self.device = device
        self.use_graphs = device.type == "cuda"
        self.dtype = weights.embeddings.dtype
        self.max_slots = _align(n_ctx + 1)  # a seat's slots never exceed its context (+ scratch)
        self.seats = 0
        self.slots = 0
        self.free: list[int] = []
        self.keys = self.values = torch.empty(0)
        self.cos = self.sin = torch.empty(0)
        self.graphs: dict[tuple, _Graph] = {}
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self._resize(1, min(self.max_slots, _align(FIRST_SLOTS)))

    # --- seats and slots -------------------------------------------------------------------

    def acquire(self) -> int:
        if not self.free:
            self._resize(2 * self.seats, self.slots)
        return self.free.pop(0)

    def release(self, seat: int) -> None:
        self.free.append(seat)
        self.free.sort()

    def base(self, seat: int) -> int:
        return seat * self.slots

    def reserve(self, needed: int) -> None:
        """Room for `needed` slots in every seat (positions, pending tree nodes)."""
        if needed + 1 > self.slots:
            self._resize(self.seats, min(self.max_slots, _align(max(needed + 1, 2 * self.slots))))

    def _resize(self, seats: int, slots: int) -> None:
        """New buffers of `seats` x `slots`, keeping every seat's entries; graphs are recaptured."""
        w = self.weights
        shape = (len(w.layers), w.n_kv_heads, seats * slots, w.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        for seat in range(self.seats):
            old, new = seat * self.slots, seat * slots
            keep = min(self.slots, slots)
            keys[:, :, new : new + keep] = self.keys[:, :, old : old + keep]
            values[:, :, new : new + keep] = self.values[:, :, old : old + keep]
        self.free += list(range(self.seats, seats))
        self.keys, self.values, self.seats, self.slots = keys, values, seats, slots
        positions = torch.arange(slots, device=self.device)[None]
        cos, sin = w.rotary(torch.empty(0, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = cos[0], sin[0]  # [slots, head_dim]
        self.graphs.clear()

    def commit(self, seat: int, prefix: int, path: Sequence[int]) -> None:
        """Tree nodes `path` (pending at slots prefix + node) become positions prefix.. of the seat."""
        base = self.base(seat) + prefix
        source = torch.tensor([base + node for node in path], device=self.device)
        self.keys[:, :, base : base + len(path)] = self.keys[:, :, source]
        self.values[:, :, base : base + len(path)] = self.values[:, :, source]

    # --- passes ----------------------------------------------------------------------------

    def run(
        self, table: list[list[int]], keep: torch.Tensor | None, recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows of `table` -> logits of the rows `keep` names (None: all) and the residual
        stream entering each `recorded` layer, for every row."""
        rows = len(table)
        depth = max(len(row) for row in table) - FIRST_ANCESTOR
        seats = [row[SLOT] // self.slots for row in table]
        span = (min(seats), max(seats) + 1 - min(seats))
        if self.fixed_rows is not None:
            chunk = self.fixed_rows
        elif rows <= MAX_GRAPH_ROWS:
            chunk = 1 << (rows - 1).bit_length()
        else:
            chunk = rows
        pieces = [
            self._run_chunk(table[start : start + chunk], chunk, depth, span, recorded)
            for start in range(0, rows, chunk)
        ]
        logits = torch.cat([piece[0] for piece in pieces])[:rows]
        captured = [torch.cat([piece[1][i] for piece in pieces])[:rows] for i in range(len(recorded))]
        return (logits if keep is None else logits[keep]), captured

    def _run_chunk(
        self, table: list[list[int]], rows: int, depth: int, span: tuple[int, int], recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass of exactly `rows` rows over the seats of `span` (first, count): the table
        padded with rows that write and see only the span's scratch slot."""
        width = FIRST_ANCESTOR + max(depth, ANCESTOR_SLOTS if self.use_graphs else depth, 1)
        padded = [_pad(row, width) for row in table]
        scratch = self._scratch(span)
        padded += [[0, 0, scratch, 0, 0] + [scratch] * (width - FIRST_ANCESTOR)] * (rows - len(table))
        host = torch.tensor(padded, dtype=torch.long)
        start = self._begin_timing()
        if not self.use_graphs or width > FIRST_ANCESTOR + ANCESTOR_SLOTS or rows > MAX_GRAPH_ROWS:
            logits, captured = self._compute(host.to(self.device), span, recorded)
        else:
            graph = self._graph(rows, width, span, recorded)
            graph.table.copy_(host, non_blocking=False)
            graph.graph.replay()
            assert graph.logits is not None
            logits, captured = graph.logits.clone(), [state.clone() for state in graph.captured]
        self._end_timing(start)
        return logits[: len(table)], [state[: len(table)] for state in captured]

    def _scratch(self, span: tuple[int, int]) -> int:
        """The span's last slot: past every context of its seats (see `reserve`), never seen."""
        return (span[0] + span[1]) * self.slots - 1

    def _graph(self, rows: int, width: int, span: tuple[int, int], recorded: tuple[int, ...]) -> _Graph:
        """The captured pass for these shapes (the span is part of them: attention reads its
        seats' slots as one view). Each graph has its own memory pool."""
        key = (rows, width, span, recorded)
        if key not in self.graphs:
            graph = _Graph(rows, width, self.device)
            graph.table[:, SLOT] = self._scratch(span)  # warm-up and capture touch only scratch
            graph.table[:, FIRST_ANCESTOR:] = self._scratch(span)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._compute(graph.table, span, recorded)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph.graph):
                graph.logits, graph.captured = self._compute(graph.table, span, recorded)
            self.graphs[key] = graph
        return self.graphs[key]

    def _compute(
        self, table: torch.Tensor, span: tuple[int, int], recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward of a row table on the device: static shapes, no host synchronisation.
        Attention reads the slots of the span's seats alone."""
        w = self.weights
        n = table.shape[0]
        group = w.n_heads // w.n_kv_heads
        slots = table[:, SLOT]
        first, last = span[0] * self.slots, (span[0] + span[1]) * self.slots
        columns = torch.arange(first, last, device=self.device)
        visible = (columns >= table[:, LO, None]) & (columns < table[:, HI, None])
        visible.scatter_(1, table[:, FIRST_ANCESTOR:] - first, True)
        # Query heads that share a key head are folded into rows: [KV, group * n, D] against
        # [KV, slots, D], so grouped-query attention needs no copies of the keys.
        # Additive, made once per pass (a boolean mask would be converted in every layer's call).
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill_(~visible, float("-inf")).repeat(group, 1)[None, None]
        cos, sin = self.cos[table[:, POSITION]], self.sin[table[:, POSITION]]
        captured: list[torch.Tensor] = []
        x = F.embedding(table[:, ID], w.embeddings)
        for index, layer in enumerate(w.layers):
            if index in recorded:
                captured.append(x)
            h = _rms_norm(x, layer.input_norm, w.eps)
            q, k, v = layer.qkv(h).split(
                [w.n_heads * w.head_dim, w.n_kv_heads * w.head_dim, w.n_kv_heads * w.head_dim], dim=-1
            )
            q = _rotate(q.view(n, w.n_heads, w.head_dim).transpose(0, 1), cos, sin)  # [H, n, D]
            k = _rotate(k.view(n, w.n_kv_heads, w.head_dim).transpose(0, 1), cos, sin)
            self.keys[index].index_copy_(1, slots, k.to(self.dtype))
            self.values[index].index_copy_(1, slots, v.view(n, w.n_kv_heads, w.head_dim).transpose(0, 1))
            attended = F.scaled_dot_product_attention(
                q.reshape(w.n_kv_heads, group * n, w.head_dim)[None],
                self.keys[index, :, first:last][None],
                self.values[index, :, first:last][None],
                attn_mask=mask,
            )[0]
            attended = attended.reshape(w.n_heads, n, w.head_dim).transpose(0, 1).reshape(n, -1)
            x = x + layer.out(attended.to(x.dtype))
            gate, up = layer.gate_up(_rms_norm(x, layer.post_norm, w.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if len(w.layers) in recorded:
            captured.append(x)
        return w.lm_head(_rms_norm(x, w.final_norm, w.eps)), captured

    # --- GPU busy time ---------------------------------------------------------------------

    def _begin_timing(self) -> torch.cuda.Event | None:
        if self.timing is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _end_timing(self, start: torch.cuda.Event | None) -> None:
        if start is not None and self.timing is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timing.append((start, end))


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def _pad(row: list[int], width: int) -> list[int]:
    """A table row widened with copies of its own slot (which it sees anyway)."""
    return row + [row[SLOT]] * (width - len(row))


_ENGINES: weakref.WeakKeyDictionary[NativeWeights, dict[tuple, GraphPasses]] = weakref.WeakKeyDictionary()


def shared_passes(
    weights: NativeWeights, n_ctx: int, fixed_rows: int | None, device: torch.device
) -> GraphPasses:
    """The passes engine of these weights for this context size and mode, made once."""
    engines = _ENGINES.setdefault(weights, {})
    key = (n_ctx, fixed_rows)
    if key not in engines:
        engines[key] = GraphPasses(weights, n_ctx, fixed_rows, device)
    return engines[key]


class GraphBackend(NativeBackend):
    """NativeBackend's interface (chains, trees, shared passes of several sequences) on the
    graph passes (see the module docstring). fixed_rows: the row count of every pass (fixed
    mode), or None for power-of-two buckets."""

    row_invariant = False

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        fixed_rows: int | None = FIXED_ROWS,
        **options,
    ) -> None:
        super().__init__(model, tokenizer, **options)
        if fixed_rows is not None and fixed_rows < 1:
            raise ValueError(f"fixed_rows must be >= 1, not {fixed_rows}")
        self.passes = shared_passes(self.weights, self.n_ctx, fixed_rows, self.device)
        self.seat = self.passes.acquire()
        weakref.finalize(self, self.passes.release, self.seat)

    @classmethod
    def pass_options(cls, options) -> dict:
        return {"fixed_rows": None if options.passes == "bucketed" else FIXED_ROWS}

    def _options(self) -> dict:
        return {**super()._options(), "fixed_rows": self.passes.fixed_rows}

    def row_variance_warning(self, trees: bool) -> str | None:
        """What a speculative run should be told where its output may leave plain output's
        (see the module docstring): any bucketed run; a fixed run that may draft trees."""
        if self.passes.fixed_rows is None:
            return (
                f"{self.name} runs passes of power-of-two sizes (--passes bucketed): output can differ from "
                "plain output where two tokens almost tie (exact: --passes fixed, or invariant for trees)"
            )
        if trees:
            return (
                f"{self.name} adds up tree drafts in another order than chains: output can differ from "
                "plain output where two tokens almost tie (exact: --passes invariant, at its cost)"
            )
        return None

    @property
    def pass_key(self) -> object:
        """Forks on one engine share its passes."""
        return self.passes

    def busy_seconds(self) -> float:
        """GPU time of this engine's passes since `reset_busy` (0.0 off a GPU or before it)."""
        timing = self.passes.timing or []
        if timing:
            torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in timing) / 1000.0

    def reset_busy(self) -> None:
        """Start timing this engine's passes on the GPU (a pair of events per pass)."""
        self.passes.timing = [] if self.passes.use_graphs else None

    def _linear_rows(self, chunk: Sequence[int]) -> GraphRows:  # type: ignore[override]
        start = len(self._tokens)
        self.passes.reserve(start + len(chunk))
        base = self.passes.base(self.seat)
        ids = list(chunk)
        table = [
            [token, start + i, base + start + i, base, base + start + i + 1] for i, token in enumerate(ids)
        ]
        return GraphRows(table, self._recorder, lambda: self._tokens.extend(ids))

    def _tree_rows_of(self, ids: Sequence[int], parents: Sequence[int]) -> GraphRows:  # type: ignore[override]
        prefix = len(self._tokens)
        nodes = self._tree.add(ids, parents)
        self.passes.reserve(prefix + len(self._tree))
        base = self.passes.base(self.seat)
        after = base + prefix
        table = [
            [token, prefix + self._tree.depths[node] - 1, after + node, base, after]
            + [after + ancestor for ancestor in self._tree.path(node)]
            for token, node in zip(ids, nodes, strict=True)
        ]
        return GraphRows(table, self._tree_rows, _nothing)

    def _run(self, parts: Sequence[GraphRows], keep: int | torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        table = [row for part in parts for row in part.table]
        layers = tuple(recorded_layers(parts))
        chosen = torch.arange(len(table) - keep, len(table)) if isinstance(keep, int) else keep
        logits, captured = self.passes.run(table, chosen.to(self.device), layers)
        finish_parts(parts, dict(zip(layers, captured, strict=True)))
        return logits

    @torch.inference_mode()
    def commit(self, path: Sequence[int]) -> None:
        path = self._tree.check_path(path)
        if path:
            self.passes.commit(self.seat, len(self._tokens), path)
        self._keep_path(path)

    def _drop_tree(self) -> None:
        if len(self._tree):
            self._keep_path([])


def _nothing() -> None:
    """A tree part's cache needs nothing after its pass: its nodes wait for commit."""
