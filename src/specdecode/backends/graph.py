"""The native forward for GPUs: every row of a pass in one attention call per layer, over a
static KV cache, replayed from captured CUDA graphs.

Why another pass: `native`'s passes were built for CPU bit-invariance (attention one query
row at a time, projections split by probed plans). On a GPU each of those is a kernel launch
of microseconds' work, and the host's launch rate, not the GPU, sets the pace. Here a pass is
one fixed sequence of kernels over static buffers, the same for every kind of row:

- The rows of a pass (a chain after the cached tokens, tree nodes, several sequences) are laid
  out flat. Each row carries its token, its position, the slot its key and value go to, and
  what it sees: the slots [lo, hi) (its sequence's cached prefix, and its own chain) plus up
  to ANCESTOR_SLOTS single slots (its tree path).
- Attention is per seat (`graph_attention`): the rows of each sequence are laid out as one
  batch element against that sequence's own slots (a view of the store), under a mask built
  on the device from those columns. A row reads its own seat's cache only, and chains, trees
  and batches are one code path.
- The KV store is shared by the forks of one model: a seat of S slots per sequence, grown by
  doubling (S) or by seats (P). Rejected drafts' entries simply stay in their slots, unseen.
  Each seat's last slot is a scratch slot where padding rows write.
- A pass replays the graph captured for its shapes (rows, seats, rows per seat; captured on
  first use, all graphs in one memory pool; grown buffers drop the graphs). Its row table goes
  to the device from a pinned buffer without blocking the host.
- A prompt chunk (a chain of one sequence, of more than one row, that wants at most its last
  row's logits: the prompt in chunks of n_batch rows, a context shift's re-read) runs as one eager pass of all
  its rows, attending over its own seat up to its last row, with the LM head on its last row
  only. Plain and speculative runs prefill a prompt in the same chunks, so their caches hold
  the same bits; a new prompt keeps only whole chunks of the cache (`reusable_prefix`), so a
  cached prompt gets a fresh run's bits.

Exactness. A GPU's matrix kernels are chosen by the shapes of a product, and their order of
summation with them: one row alone and the same row among k others may differ in the last bit,
and a greedy near-tie or a sampled draw at a boundary then flips. Two modes:

- fixed (the default on a GPU): every pass after the prompt runs in chunks of exactly
  `fixed_rows` rows, padding a shorter one, with the LM head on all of them. Every pass then
  runs the very same projection kernels, and attention sums each row over its own seat's
  slots, in the same key blocks whatever else the pass holds: a row's bits depend only on its
  own inputs and on what it sees, and a chain (alone or among other sequences' rows) gets the
  bits plain decoding gives it. Tree nodes see their ancestors at scattered slots,
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
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.backends import WholeChunks, check_cache_room
from specdecode.backends.fused import LayerOps
from specdecode.backends.graph_attention import (
    FIRST_ANCESTOR,
    ID,
    LO,
    NO_CUDNN,
    POSITION,
    SLOT,
    Heads,
    Layout,
    OwnAttention,
    SeatAttention,
    StaticInputs,
    capture,
)
from specdecode.backends.graph_draft import CapturedSteps, greedy_steps
from specdecode.backends.hidden import HiddenRows
from specdecode.backends.native import Attend, NativeBackend, finish_parts, recorded_layers
from specdecode.backends.native_weights import NativeWeights

FIRST_SLOTS = 2048  # a seat's first size: most requests never grow it (each growth recaptures)
FIXED_ROWS = 32  # rows of every pass in fixed mode: a default verify pass (17) and a batch of 32
MAX_GRAPH_ROWS = 128  # bucketed mode: the largest pass replayed from a graph
ANCESTOR_SLOTS = 32  # tree path slots a row names in a graph pass (deeper paths run eagerly)
# Seats are multiples of this many slots: every seat's view starts aligned, on whole key blocks
# of the attention kernels, so a row's own seat is summed alike whichever seat it is.
SLOT_ALIGN = 128


@dataclass
class GraphRows:
    """One sequence's rows of a pass, as table rows, and what to do once the pass has run."""

    table: list[list[int]]  # [token, position, slot, lo, hi, *ancestor slots] per row
    recorder: HiddenRows | None
    done: Callable[[], None]
    linear: bool = False  # a chain after the cached tokens (a prompt chunk may run as a prefill)

    def __len__(self) -> int:
        return len(self.table)


@dataclass
class _Graph:
    """One captured pass: its static inputs, its logits and recorded states."""

    inputs: StaticInputs
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    captured: list[torch.Tensor]


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
        self.heads = Heads(weights.n_heads, weights.n_kv_heads, weights.head_dim)
        # The layers' element-wise parts, one kernel each (`fused`): compiled on a GPU for the
        # chunks, whose row counts are few; eager for prefills, whose row counts follow the prompt.
        self.ops = LayerOps(weights.n_heads, weights.n_kv_heads, weights.eps, device)
        self.eager_ops = LayerOps(weights.n_heads, weights.n_kv_heads, weights.eps, device, compiled=False)
        self.max_slots = _align(n_ctx + 1)  # a seat's slots never exceed its context (+ scratch)
        self.seats = 0
        self.slots = 0
        self.free: list[int] = []
        self.keys = self.values = torch.empty(0)
        self.cos = self.sin = torch.empty(0)
        self.graphs: dict[tuple, _Graph] = {}
        self.draft_graphs: dict[tuple, CapturedSteps] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
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
        self.draft_graphs.clear()

    def commit(self, seat: int, prefix: int, path: Sequence[int]) -> None:
        """Tree nodes `path` (pending at slots prefix + node) become positions prefix.. of the seat."""
        base = self.base(seat) + prefix
        source = torch.tensor([base + node for node in path], device=self.device)
        self.keys[:, :, base : base + len(path)] = self.keys[:, :, source]
        self.values[:, :, base : base + len(path)] = self.values[:, :, source]

    # --- passes ----------------------------------------------------------------------------

    def prefill(
        self, table: list[list[int]], keep: int, recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A chain of one seat (a prompt chunk: `table` from `GraphBackend._linear_rows`) in one
        eager pass of all its rows, attending over its own seat's slots alone, with the LM head
        on its last `keep` rows only; and the residual stream entering each `recorded` layer.
        Its rows' bits depend on the chunk's start and length alone: a prompt is prefilled in
        the same chunks by plain and speculative runs (and by a fresh run, see
        `GraphBackend.reusable_prefix`)."""
        n, base, start = len(table), table[0][LO], table[0][POSITION]
        ids = self._to_device(torch.tensor([row[ID] for row in table], dtype=torch.long))
        began = self._begin_timing()
        with sdpa_kernel(NO_CUDNN):
            h, captured = self._layers(
                ids,
                self.cos[start : start + n],
                self.sin[start : start + n],
                OwnAttention((self.keys, self.values), base, start, n, self.heads),
                recorded,
                self.eager_ops,
            )
            logits = self.weights.lm_head(h[n - keep :])
        self._end_timing(began)
        return logits, captured

    def run(
        self, table: list[list[int]], keep: torch.Tensor | None, recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows of `table` (any seats, chains and tree nodes) -> logits of the rows `keep` names
        (None: all) and the residual stream entering each `recorded` layer, for every row. The
        rows run in chunks of the mode's row count, each with the LM head on all its rows."""
        rows = len(table)
        width = self._width(max(len(row) for row in table) - FIRST_ANCESTOR)
        if self.fixed_rows is not None:
            chunk = self.fixed_rows
        elif rows <= MAX_GRAPH_ROWS:
            chunk = 1 << (rows - 1).bit_length()
        else:
            chunk = rows
        pieces = [
            self._run_chunk(table[start : start + chunk], chunk, width, recorded)
            for start in range(0, rows, chunk)
        ]
        logits = torch.cat([piece[0] for piece in pieces])[:rows]
        captured = [torch.cat([piece[1][i] for piece in pieces])[:rows] for i in range(len(recorded))]
        return (logits if keep is None else logits[keep]), captured

    def draft(
        self, logits: torch.Tensor, table: list[list[int]], steps: int, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy draft steps of one seat on the device (`graph_draft`): `steps` tokens after
        the row of `logits` [V], the first len(table) of them evaluated as one-row passes (their
        table rows, tokens filled on the device); one replay on a GPU. Returns the tokens, their
        top-1 confidences over the `top_k` largest logits, and the logits after the last
        evaluated token."""
        if not table:  # the token after `logits` alone: no pass
            return greedy_steps(logits, torch.empty(0, 1, dtype=torch.long), steps, None, top_k)
        layout, place = self._layout(table[:1], self.fixed_rows or 1, self._width(0))
        inputs = torch.stack([self._inputs([row], layout, place) for row in table])

        def forward(pass_inputs: torch.Tensor) -> torch.Tensor:
            return self._compute(pass_inputs, layout, ())[0][0]

        began = self._begin_timing()
        if self.use_graphs:
            key = (layout, steps, len(table), top_k)
            if key not in self.draft_graphs:
                scratch = torch.stack([self._inputs([], layout, [])] * len(table)).to(self.device)
                kernels = partial(sdpa_kernel, NO_CUDNN)
                steps_graph = CapturedSteps(logits, scratch, steps, forward, top_k, self.pool, kernels)
                self.draft_graphs[key] = steps_graph
            out = self.draft_graphs[key](logits, inputs)
        else:
            with sdpa_kernel(NO_CUDNN):
                out = greedy_steps(logits, self._to_device(inputs), steps, forward, top_k)
        self._end_timing(began)
        return out

    def _width(self, depth: int) -> int:
        """Row table columns for tree paths of up to `depth` ancestors: in graphs every pass
        has room for ANCESTOR_SLOTS (one graph for chains and shallow trees)."""
        return FIRST_ANCESTOR + max(depth, ANCESTOR_SLOTS if self.use_graphs else depth, 1)

    def _run_chunk(
        self, table: list[list[int]], rows: int, width: int, recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass of exactly `rows` rows (the table padded with rows that write and see only
        a scratch slot), attending per seat over the seats its rows come from."""
        layout, place = self._layout(table, rows, width)
        inputs = self._inputs(table, layout, place)
        began = self._begin_timing()
        if not self.use_graphs or width > FIRST_ANCESTOR + ANCESTOR_SLOTS or rows > MAX_GRAPH_ROWS:
            with sdpa_kernel(NO_CUDNN):
                logits, captured = self._compute(self._to_device(inputs), layout, recorded)
        else:
            graph = self._graph(layout, recorded)
            graph.inputs.load(inputs)
            graph.graph.replay()
            # the outputs live in the shared pool, which the next replay of any graph may reuse
            logits, captured = graph.logits.clone(), [state.clone() for state in graph.captured]
        self._end_timing(began)
        return logits[: len(table)], [state[: len(table)] for state in captured]

    def _layout(self, table: list[list[int]], rows: int, width: int) -> tuple[Layout, list[int]]:
        """The chunk's layout and each row's cell: seat s's j-th row is cell s * per_seat + j.
        Cells per seat are a power of two up to MAX_GRAPH_ROWS rows (few graph shapes)."""
        seats = [row[SLOT] // self.slots for row in table]
        first = min(seats)
        filled = [0] * (max(seats) + 1 - first)
        order = []
        for seat in seats:
            order.append((seat - first, filled[seat - first]))
            filled[seat - first] += 1
        most = max(filled)
        per_seat = most if rows > MAX_GRAPH_ROWS else 1 << (most - 1).bit_length()
        layout = Layout(rows, width, first, len(filled), per_seat)
        return layout, [seat * per_seat + j for seat, j in order]

    def _inputs(self, table: list[list[int]], layout: Layout, place: list[int]) -> torch.Tensor:
        """A chunk's inputs on the host (see `Layout.size`); padding rows write the first seat's
        scratch slot and sit in cell 0, padding cells see only their seat's scratch slot."""
        scratch = (layout.first + 1) * self.slots - 1
        padding = [0, 0, scratch, 0, 0] + [scratch] * (layout.width - FIRST_ANCESTOR)
        source = [-1] * layout.cells
        for row, cell in enumerate(place):
            source[cell] = row
        flat = [value for row in table for value in _pad(row, layout.width)]
        flat += padding * (layout.rows - len(table))
        return torch.tensor(flat + place + [0] * (layout.rows - len(table)) + source, dtype=torch.long)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device; on a GPU from pinned memory, without blocking the host
        (the pinned allocator keeps the block until the copy is done)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _graph(self, layout: Layout, recorded: tuple[int, ...]) -> _Graph:
        """The captured pass for this layout (its seats are part of it: attention reads them as
        one view), in the pool all graphs share: outputs are copied out after each replay."""
        key = (layout, recorded)
        if key not in self.graphs:
            # warm-up and capture touch only scratch slots
            inputs = self._inputs([], layout, []).to(self.device)
            kernels = partial(sdpa_kernel, NO_CUDNN)
            graph, (logits, captured) = capture(
                partial(self._compute, inputs, layout, recorded), self.pool, kernels
            )
            self.graphs[key] = _Graph(StaticInputs(inputs), graph, logits, captured)
        return self.graphs[key]

    # --- the forward -----------------------------------------------------------------------

    def _compute(
        self, inputs: torch.Tensor, layout: Layout, recorded: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward of a chunk's inputs on the device: static shapes, no host
        synchronisation; the LM head on every row."""
        table = layout.table(inputs)
        positions = table[:, POSITION]
        ops = self.ops if layout.rows <= MAX_GRAPH_ROWS else self.eager_ops
        h, captured = self._layers(
            table[:, ID],
            self.cos[positions],
            self.sin[positions],
            SeatAttention(inputs, layout, (self.keys, self.values), self.slots, self.heads),
            recorded,
            ops,
        )
        return self.weights.lm_head(h), captured

    def _layers(
        self,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        recorded: tuple[int, ...],
        ops: LayerOps,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over the rows `ids` -> the final norm of the residual stream (the LM
        head's input) and the stream entering each `recorded` layer. `attend` stores each
        layer's keys and values and attends (per seat, or over a prefill's own seat); each
        residual add is fused with the norm after it."""
        w = self.weights
        captured: list[torch.Tensor] = []
        x = F.embedding(ids, w.embeddings)
        h = ops.rms_norm(x, w.layers[0].input_norm)
        for index, layer in enumerate(w.layers):
            if index in recorded:
                captured.append(x)
            following = w.layers[index + 1].input_norm if index + 1 < len(w.layers) else w.final_norm
            q, k, v = ops.rotary(layer.qkv(h), cos, sin)  # [H, n, D], [KV, n, D], [KV, n, D]
            x, h = ops.add_norm(x, layer.out(attend(index, q, k, v).to(x.dtype)), layer.post_norm)
            x, h = ops.add_norm(x, layer.down(ops.silu_mul(layer.gate_up(h))), following)
        if len(w.layers) in recorded:
            captured.append(x)
        return h, captured

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
    logits_on_device = True  # a RowGroup may keep its logits here: verification reduces them here

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
        self._prefill_chunks = WholeChunks(self.n_batch)

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

    def reusable_prefix(self, cached: int, prompt_length: int | None = None) -> int:
        """Whole prefill chunks only: a prompt chunk's rows run in a pass of its own shape (see
        `GraphPasses.prefill`), so a new prompt gets a fresh run's bits only if it keeps the
        chunks a fresh run would have prefilled and prefills the rest as a fresh run does."""
        return self._prefill_chunks.reusable(cached)

    def truncate(self, n: int) -> None:
        self._prefill_chunks.truncate(max(0, n))
        super().truncate(n)

    def _linear_rows(self, chunk: Sequence[int]) -> GraphRows:  # type: ignore[override]
        start = len(self._tokens)
        self.passes.reserve(start + len(chunk))
        base = self.passes.base(self.seat)
        ids = list(chunk)
        table = [
            [token, start + i, base + start + i, base, base + start + i + 1] for i, token in enumerate(ids)
        ]
        return GraphRows(table, self._recorder, lambda: self._tokens.extend(ids), linear=True)

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
        """A prompt chunk (or a context shift's re-read: one sequence's chain of more than one
        row that wants at most its last row's logits; a single group's kept rows are its last)
        runs as a prefill, any other pass in the mode's chunks."""
        table = [row for part in parts for row in part.table]
        layers = tuple(recorded_layers(parts))
        kept = keep if isinstance(keep, int) else keep.numel()
        if len(parts) == 1 and parts[0].linear and kept <= 1 < len(table):
            logits, captured = self.passes.prefill(table, kept, layers)
            self._prefill_chunks.scored(table[0][POSITION], len(table))
        else:
            chosen = torch.arange(len(table) - keep, len(table)) if isinstance(keep, int) else keep
            logits, captured = self.passes.run(table, chosen.to(self.device), layers)
        finish_parts(parts, dict(zip(layers, captured, strict=True)))
        return logits

    @property
    def drafts_on_device(self) -> bool:
        """Whether `draft_greedy` can run: not while hidden states are recorded (its passes
        record none)."""
        return self._recorder is None

    @torch.inference_mode()
    def draft_greedy(
        self, logits: torch.Tensor, steps: int, evaluate_last: bool, top_k: int
    ) -> tuple[list[int], list[float], torch.Tensor]:
        """`steps` greedy draft tokens after the cached ones, the row of `logits` [V] (on the
        device) giving the first, each the argmax of the row before it, with their top-1
        confidences over the `top_k` largest logits (see `graph_draft`). Every token but the
        last is evaluated into the cache, the last too if `evaluate_last`; the logits after the
        last evaluated one stay on the device for the next call."""
        evaluated = steps if evaluate_last else steps - 1
        check_cache_room(self.name, len(self._tokens), evaluated, self.n_ctx)
        self._use_threads()
        self._drop_tree()
        table = self._linear_rows([0] * evaluated).table  # the tokens are filled on the device
        tokens, confidences, last = self.passes.draft(logits, table, steps, top_k)
        host = torch.cat([tokens.to(torch.float64), confidences]).cpu()  # one copy back
        ids = [int(token) for token in host[:steps]]
        self._tokens.extend(ids[:evaluated])
        return ids, host[steps:].tolist(), last

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
