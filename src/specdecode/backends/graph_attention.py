"""Attention of the graph passes (`specdecode.backends.graph`): each row reads only the slots
it may see.

- A chunk pass (verify rows, tree nodes, a batch of sequences) attends per seat: its rows are
  laid out as [seats, KV heads, group * rows per seat, D] (query heads that share a key head
  folded into rows) against each seat's own slots, a view of the store, with a mask built on
  the device from the row table. A seat's rows read its cache once per key head, never
  another seat's.
- A prefill (a prompt chunk of one sequence) attends over its own seat up to its last row,
  laid out [KV heads, group, rows, D] against the keys expanded over the group (a view), with
  a causal mask of [rows, slots] or none.

A pass's inputs (its row table and the rows' places, `Layout`) reach a captured graph through
`StaticInputs`; `capture` captures one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

# Columns of a pass's row table, then the ancestor slots.
ID, POSITION, SLOT, LO, HI = range(5)
FIRST_ANCESTOR = 5
# Attention under a mask goes to cuDNN first, which plans anew for every new shape.
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

T = TypeVar("T")


@dataclass(frozen=True)
class Heads:
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class Layout:
    """The shapes of one chunk pass: `rows` table rows of `width` columns, attending per seat
    over the `count` seats from `first` on, each seat's rows in `per_seat` query cells (seat
    s's j-th row in cell s * per_seat + j)."""

    rows: int
    width: int
    first: int
    count: int
    per_seat: int

    @property
    def cells(self) -> int:
        return self.count * self.per_seat

    @property
    def size(self) -> int:
        """Longs of the pass's inputs: the table, each row's cell, each cell's row (-1: none)."""
        return self.rows * self.width + self.rows + self.cells

    def table(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs[: self.rows * self.width].view(self.rows, self.width)


class StaticInputs:
    """A captured graph's inputs on the device, filled from a pinned host buffer without
    blocking the host; the buffer is refilled only once its previous copy has finished."""

    def __init__(self, device_tensor: torch.Tensor) -> None:
        self.tensor = device_tensor
        self.staging = torch.empty(device_tensor.shape, dtype=device_tensor.dtype, pin_memory=True)
        self.copied = torch.cuda.Event()

    def load(self, host: torch.Tensor) -> None:
        self.copied.synchronize()
        self.staging.copy_(host)
        self.tensor.copy_(self.staging, non_blocking=True)
        self.copied.record()


def capture(
    run: Callable[[], T], pool: tuple[int, int] | None, kernels: Callable[[], AbstractContextManager]
) -> tuple[torch.cuda.CUDAGraph, T]:
    """run() captured as one CUDA graph in the memory pool `pool`, with its outputs, under the
    attention kernels' context `kernels()`: warmed up twice on a side stream first (kernels
    compiled, workspaces allocated), as capture requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), kernels():
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), kernels():
        outputs = run()
    return graph, outputs


class SeatAttention:
    """A chunk pass's attention (see the module docstring), made once per pass: the mask and
    the rows' places, then one call per layer."""

    def __init__(
        self,
        inputs: torch.Tensor,
        layout: Layout,
        store: tuple[torch.Tensor, torch.Tensor],
        slots: int,
        heads: Heads,
    ) -> None:
        self.layout, self.keys, self.values, self.slots, self.heads = layout, *store, slots, heads
        device, end = inputs.device, layout.rows * layout.width
        table = layout.table(inputs)
        self.row_slots = table[:, SLOT]
        self.place = inputs[end : end + layout.rows]
        source = inputs[end + layout.rows :]
        real = source >= 0
        self.source = source.clamp(min=0)
        cell_rows = table[self.source]
        # Slots relative to each cell's seat; a padding cell sees its seat's scratch slot only.
        base = (layout.first + torch.arange(layout.cells, device=device) // layout.per_seat) * slots
        scratch = slots - 1
        lo = torch.where(real, cell_rows[:, LO] - base, scratch)
        hi = torch.where(real, cell_rows[:, HI] - base, slots)
        ancestors = torch.where(real[:, None], cell_rows[:, FIRST_ANCESTOR:] - base[:, None], scratch)
        columns = torch.arange(slots, device=device)
        visible = (columns >= lo[:, None]) & (columns < hi[:, None])
        visible.scatter_(1, ancestors, True)
        # Additive, made once per pass (a boolean mask would be converted in every layer's call).
        mask = torch.zeros(visible.shape, dtype=self.keys.dtype, device=device)
        mask = mask.masked_fill_(~visible, float("-inf")).view(layout.count, 1, layout.per_seat, slots)
        group_rows = heads.group * layout.per_seat
        self.mask = mask.expand(-1, heads.group, -1, -1).reshape(layout.count, 1, group_rows, slots)

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer `index`: keys and values k, v [KV, rows, D] stored at the rows' slots, queries
        q [H, rows, D] attended -> [rows, H * D]."""
        layout, heads = self.layout, self.heads
        self.keys[index].index_copy_(1, self.row_slots, k)
        self.values[index].index_copy_(1, self.row_slots, v)
        query = q.transpose(0, 1)[self.source]  # [cells, H, D]
        query = query.view(layout.count, layout.per_seat, heads.n_kv_heads, heads.group, heads.head_dim)
        attended = F.scaled_dot_product_attention(
            query.permute(0, 2, 3, 1, 4).reshape(
                layout.count, heads.n_kv_heads, heads.group * layout.per_seat, heads.head_dim
            ),
            self._per_seat(self.keys[index]),
            self._per_seat(self.values[index]),
            attn_mask=self.mask,
        )
        attended = attended.view(layout.count, heads.n_kv_heads, heads.group, layout.per_seat, heads.head_dim)
        return attended.permute(0, 3, 1, 2, 4).reshape(layout.cells, -1)[self.place]

    def _per_seat(self, store: torch.Tensor) -> torch.Tensor:
        """One layer's keys or values [KV, seats * slots, D] as [count, KV, slots, D] over the
        layout's seats: a view."""
        heads, first = self.heads, self.layout.first
        by_seat = store.view(heads.n_kv_heads, store.shape[1] // self.slots, self.slots, heads.head_dim)
        return by_seat[:, first : first + self.layout.count].transpose(0, 1)


class OwnAttention:
    """A prefill's attention: its `rows` rows are positions start.. of the seat whose first
    slot is `base`, and each sees its seat's slots up to itself."""

    def __init__(
        self, store: tuple[torch.Tensor, torch.Tensor], base: int, start: int, rows: int, heads: Heads
    ) -> None:
        self.keys, self.values = store
        self.base, self.start, self.heads = base, start, heads
        self.mask = None  # from position 0 the keys are the chunk's own rows: plain causal attention
        if start > 0:
            self.mask = torch.ones(rows, start + rows, dtype=torch.bool, device=self.keys.device).tril(start)

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer `index`: keys and values k, v [KV, rows, D] stored after the seat's cached ones,
        queries q [H, rows, D] attended -> [rows, H * D]."""
        heads, n = self.heads, q.shape[1]
        end = self.base + self.start + n
        self.keys[index, :, end - n : end] = k
        self.values[index, :, end - n : end] = v
        shape = (heads.n_kv_heads, heads.group, end - self.base, heads.head_dim)
        attended = F.scaled_dot_product_attention(
            q.view(heads.n_kv_heads, heads.group, n, heads.head_dim),
            self.keys[index, :, None, self.base : end].expand(shape),
            self.values[index, :, None, self.base : end].expand(shape),
            attn_mask=self.mask,
            is_causal=self.mask is None,
        )
        return attended.view(heads.n_heads, n, heads.head_dim).transpose(0, 1).reshape(n, -1)
