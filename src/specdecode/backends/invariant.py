"""Row-invariant projections for the native forward: how each weight shape computes a pass.

Apart from `native` (the forward and its cache) because choosing how a projection computes a
pass, so that a row gets the same bits in a pass of any size (see `native` for why), is a
study of the kernels of its own: the plans, what they cost, and the probes that test them.
Each weight shape is probed once, when the model's weights are arranged (`native_weights`).

Which kernel: on a CPU, oneDNN's product over a weight packed at load is tried first. BLAS's
(MKL's) float32 GEMM of a few rows sums in another order than its one-row GEMV, so a one-row
pass had to be padded to a GEMM's rows, at about three times the GEMV's cost; oneDNN's packed
product of 2 rows (a one-row pass is padded, see `_packed_plan`) costs what MKL's GEMV costs
one row and sums 2 to 128 rows in one order (in bfloat16, at half of BLAS's cost), and a verify
pass of 17 rows costs it a third of MKL's GEMM. The probes decide, as for BLAS: a shape whose
packed product is not invariant in any plan runs BLAS's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The dtypes whose passes are made row-invariant: every dtype the backend loads.
INVARIANT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32, torch.float64})
INVARIANT_ROWS = 128  # passes up to this many rows are row-invariant
# Row counts the probes try: every count of a default verify pass (up to 16 drafted tokens + 1),
# where kernels switch at counts that depend on K (MKL's float32 GEMM: after 1 row, then after
# 2, 4, 5, 10 or 15), then both sides of the powers of two.
PROBE_ROWS = (*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128)
SLICE_COUNTS = (2, 4, 8)
# When plans are compared: a product's fixed cost in rows (a float32 GEMM of a few rows costs
# about as much as 4-5 more rows on this project's CPU), and the pass sizes weighed: 1 to 17
# rows, the one-row pass (every pass of plain generation and of drafting) counted 16 times.
PRODUCT_COST_ROWS = 4
# oneDNN's packed product costs about the same for 1 to 4 rows: its fixed cost is about 8 rows.
PACKED_PRODUCT_COST_ROWS = 8
PACKED_DTYPES = frozenset({torch.float32, torch.bfloat16})
PACKED_MIN_ROWS = 2  # oneDNN's one-row kernel is never used (see `_packed_plan`)
COST_PASSES = (*[1] * 16, *range(2, 18))


@dataclass(frozen=True)
class Plan:
    """How a projection computes a pass of up to INVARIANT_ROWS rows: `slices` products over
    K-slices, summed in float32 at least (1: one product), each of min_rows to max_rows rows (a
    shorter pass is padded with zero rows, a longer one split), by BLAS or, `packed`, by oneDNN
    over the packed weight. Plan(max_rows=1): row by row."""

    slices: int = 1
    min_rows: int = 1
    max_rows: int = INVARIANT_ROWS
    packed: bool = False

    def cost(self) -> int:
        """What the COST_PASSES cost, in rows of the plan's kernel (see PRODUCT_COST_ROWS)."""
        fixed = PACKED_PRODUCT_COST_ROWS if self.packed else PRODUCT_COST_ROWS
        total = 0
        for rows in COST_PASSES:
            parts = [min(self.max_rows, rows - start) for start in range(0, rows, self.max_rows)]
            total += sum(max(part, self.min_rows) + self.slices * fixed for part in parts)
        return total


ONE_PRODUCT = Plan()
ROW_BY_ROW = Plan(max_rows=1)


class Projection:
    """x [T, K] -> x W^T + b [T, N], computed as `invariance_plan` decided."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan = ONE_PRODUCT) -> None:
        self.weight = weight
        self.bias = bias
        self.plan = plan
        self.pieces: list[tuple[slice, torch.Tensor]] | None = None
        self.packed: torch.Tensor | None = None
        if plan.slices > 1:
            step = weight.shape[1] // plan.slices
            parts = [slice(i, i + step) for i in range(0, weight.shape[1], step)]
            self.pieces = [
                (part, _pack(weight[:, part]) if plan.packed else weight[:, part].contiguous())
                for part in parts
            ]
        elif plan.packed:
            self.packed = _pack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, plan = x.shape[0], self.plan
        if rows > INVARIANT_ROWS or plan.min_rows <= rows <= plan.max_rows:
            return self.product(x)
        if rows < plan.min_rows:
            return self.product(F.pad(x, (0, 0, 0, plan.min_rows - rows)))[:rows]
        return torch.cat([self(part) for part in x.split(plan.max_rows)])

    def product(self, x: torch.Tensor) -> torch.Tensor:
        linear = _packed_linear if self.plan.packed else F.linear
        if self.pieces is None:
            return linear(x, self.weight if self.packed is None else self.packed, self.bias)
        wide = torch.promote_types(x.dtype, torch.float32)
        total = sum(linear(x[:, part], piece).to(wide) for part, piece in self.pieces)
        out = total.to(x.dtype)
        return out if self.bias is None else out + self.bias


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed layout of a weight [N, K], for `_packed_linear`; None where this torch,
    device or dtype has none."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in PACKED_DTYPES
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except (AttributeError, RuntimeError):
        return None


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x W^T + b by oneDNN over the packed weight (see `_pack`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def invariance_plan(weight: torch.Tensor, bias: torch.Tensor | None) -> Plan:
    """A plan that gives every row of `_order_probe` the same bits in passes of up to
    INVARIANT_ROWS rows as alone: oneDNN's packed product where it can (`_packed_plan`), else by
    BLAS one product (fewest slices first) where the kernels allow it, else the cheapest
    (`Plan.cost`) of the bands of row counts over which they agree, else row by row. The
    kernels' order of summation follows the shapes, not the values, so the probe stands in for
    the weight (and zeros for the bias)."""
    probe_weight, probe = _order_probe(weight)
    probe_bias = None if bias is None else torch.zeros_like(bias)
    slice_counts = [slices for slices in (1, *SLICE_COUNTS) if weight.shape[1] % slices == 0]
    packed = _packed_plan(probe_weight, probe_bias, probe, slice_counts)
    if packed is not None:
        return packed
    for slices in slice_counts:
        if _rows_match(Projection(probe_weight, probe_bias, Plan(slices)), probe):
            return Plan(slices)
    best = ROW_BY_ROW
    for slices in slice_counts:
        if Plan(slices).cost() >= best.cost():
            break  # one product per pass is the least a plan of this many slices costs
        product = Projection(probe_weight, probe_bias, Plan(slices)).product
        for plan in sorted((Plan(slices, low, high) for low, high in _bands(product, probe)), key=Plan.cost):
            if plan.cost() < best.cost() and _rows_match(Projection(probe_weight, probe_bias, plan), probe):
                best = plan
                break
    return best


def _packed_plan(
    probe_weight: torch.Tensor, probe_bias: torch.Tensor | None, probe: torch.Tensor, slice_counts: list[int]
) -> Plan | None:
    """The cheapest packed plan (one product or a band, of any slice count) that passes the
    probe; None where oneDNN cannot pack this weight or only row by row would pass. Unlike
    BLAS's, a packed product of a few rows costs what one row does, so one row is always padded
    to two: oneDNN's one-row kernel rounds some bfloat16 sums otherwise than its many-row kernel
    (about one output in 10^5 on random inputs: no change of order, which the probe would
    show), and a padded row is cheaper than slices."""
    try:
        if _pack(probe_weight) is None:
            return None
        best: Plan | None = None
        for slices in slice_counts:
            product = Projection(probe_weight, probe_bias, Plan(slices, packed=True)).product
            bands = [(max(low, PACKED_MIN_ROWS), high) for low, high in _bands(product, probe)]
            plans = [Plan(slices, low, high, packed=True) for low, high in bands if low <= high]
            for plan in sorted(plans, key=Plan.cost):
                if best is not None and plan.cost() >= best.cost():
                    break
                if _rows_match(Projection(probe_weight, probe_bias, plan), probe):
                    best = plan
                    break
        return best
    except RuntimeError:  # a oneDNN build that packs but cannot run this dtype
        return None


def _bands(product, probe: torch.Tensor) -> list[tuple[int, int]]:
    """Runs (first, last) of consecutive PROBE_ROWS counts whose passes give their common rows
    the same bits: the row counts over which the kernel sums in one order."""
    outs = [product(probe[:rows]) for rows in PROBE_ROWS]
    bands, first = [], 0
    for index in range(1, len(PROBE_ROWS) + 1):
        previous = PROBE_ROWS[index - 1]
        if index == len(PROBE_ROWS) or not torch.equal(outs[index][:previous], outs[index - 1]):
            bands.append((PROBE_ROWS[first], previous))
            first = index
    return bands


def _order_probe(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight of `weight`'s shape and INVARIANT_ROWS input rows whose products cancel
    exactly within every K-slice a plan may use, over terms spread across 2^12 in size: each
    output is the rounding error of its sum, so any change in the order of summation changes
    its bits. (On random inputs such a change shows in about one output in ten thousand: a
    random probe passes by luck, and verify passes then give rows other bits than one-row
    passes.)"""
    n, k = weight.shape
    like = {"dtype": weight.dtype, "device": weight.device}
    generator = torch.Generator(device=weight.device).manual_seed(0)
    blocks = max((s for s in (1, *SLICE_COUNTS) if k % (2 * s) == 0), default=1)
    block = k // blocks
    half = block // 2
    sizes = torch.randint(0, 12, (k,), generator=generator, device=weight.device)
    probe_weight = torch.randn((n, k), generator=generator, **like) * torch.pow(2.0, sizes).to(weight.dtype)
    probe = torch.randn((INVARIANT_ROWS, k), generator=generator, **like)
    for start in range(0, blocks * block, block):
        mirror = slice(start + half, start + 2 * half)
        probe_weight[:, mirror] = -probe_weight[:, start : start + half]
        probe[:, mirror] = probe[:, start : start + half]
    return probe_weight, probe


def _rows_match(product, x: torch.Tensor) -> bool:
    """Whether `product` gives the rows of x, taken together, the bits it gives each alone
    (rows alone computed as far as the row counts tried need them: a mismatch ends early)."""
    alone: list[torch.Tensor] = []
    for rows in PROBE_ROWS:
        alone += [product(row) for row in x[len(alone) : rows].split(1)]
        if not torch.equal(product(x[:rows]), torch.cat(alone)):
            return False
    return True
