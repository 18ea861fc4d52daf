"""The native forward's padding of short passes: chosen by timing the model's own products at
load, applied only where a plan's band of row counts keeps the bits, and never changing them.

Timings here come from a clock that each product advances by a cost of its row count, so the
choice is checked without timing anything real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB_SIZE, cached_tokenizer

import specdecode.backends.native_weights as native_weights
from specdecode.backends.invariant import Plan, Projection, _pack
from specdecode.backends.native import NativeBackend
from specdecode.testing import make_llama

IDS = [(37 * i + 11) % (VOCAB_SIZE - 3) + 3 for i in range(40)]


def model(dtype: torch.dtype) -> torch.nn.Module:
    """A fresh model each call (weights are arranged once per model): same seed, same weights."""
    return make_llama(VOCAB_SIZE, hidden=64, layers=2, intermediate=256, init_std=0.5, seed=5).to(dtype)


def fake_clock(monkeypatch, cost: dict[int, float]) -> None:
    """perf_counter reads a clock that each product of R rows advances by cost[R]."""
    now = [0.0]
    product = Projection.product

    def timed_product(self: Projection, x: torch.Tensor) -> torch.Tensor:
        now[0] += cost[x.shape[0]]
        return product(self, x)

    monkeypatch.setattr(Projection, "product", timed_product)
    monkeypatch.setattr(native_weights, "time", SimpleNamespace(perf_counter=lambda: now[0]))


def projections(rows_bands: list[tuple[int, int]]) -> list[Projection]:
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    return [Projection(weight, None, Plan(min_rows=low, max_rows=high)) for low, high in rows_bands]


@pytest.mark.parametrize(
    ("cost", "chosen"),
    [
        ({1: 9.0, 2: 5.0, 3: 4.0, 4: 2.0, 6: 2.01, 8: 3.0}, 4),  # 6 is as fast: the fewer rows
        ({1: 1.0, 2: 1.02, 3: 1.5, 4: 2.0, 6: 2.0, 8: 3.0}, 1),  # padding is no faster: none
        ({1: 9.0, 2: 9.0, 3: 9.0, 4: 9.0, 6: 9.0, 8: 1.0}, 8),
    ],
)
def test_short_passes_pad_to_the_fastest_count_within_each_band(monkeypatch, cost, chosen):
    fake_clock(monkeypatch, cost)
    # a band from 1; a band from 2 (oneDNN's); a band of 1 to 6 rows; row by row
    arranged = projections([(1, 128), (2, 128), (1, 6), (1, 1)])
    assert native_weights._pad_fastest(arranged) == chosen
    plans = [projection.plan for projection in arranged]
    assert plans[0] == Plan(min_rows=chosen)
    assert plans[1] == Plan(min_rows=max(chosen, 2))
    assert plans[2] == Plan(min_rows=chosen if chosen <= 6 else 1, max_rows=6)
    assert plans[3] == Plan(max_rows=1)  # no band to pad within


def test_a_projection_outside_every_band_runs_as_its_plan_runs_one_row(monkeypatch):
    """Candidates are timed over the same products: a projection that cannot take a count is
    timed as it would run a one-row pass, so every candidate's time covers all of them."""
    seen: list[int] = []
    fake_clock(monkeypatch, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 6: 1.0, 8: 1.0})
    product = Projection.product
    monkeypatch.setattr(Projection, "product", lambda self, x: seen.append(x.shape[0]) or product(self, x))
    native_weights._pad_fastest(projections([(1, 1), (4, 128)]))
    rounds = native_weights.PAD_ROUNDS + 1
    # per round, candidates 4, 6 and 8 (no band holds 1 to 3): the first projection one row each
    assert seen == [1, 4, 1, 6, 1, 8] * rounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4, 8])
def test_padding_keeps_every_row_its_bits(monkeypatch, dtype, rows):
    """A model whose short passes pad to `rows` gives the logits, bit for bit, of the same
    model padding as the probes chose (one-row steps, a short verify pass, a longer one)."""
    backends = {}
    for pad in (1, rows):
        monkeypatch.setattr(native_weights, "PAD_ROWS", (pad,))
        backends[pad] = NativeBackend(model(dtype), cached_tokenizer())
    padded = backends[rows]
    if not any(p.plan.min_rows == rows for p in padded.weights.projections()):
        pytest.skip("no projection's plan takes this padding here")
    assert padded.weights.pad_rows == rows
    for backend in backends.values():
        backend.evaluate(IDS[:20])
    for chunk in ([IDS[20]], [IDS[21]], IDS[22:25], IDS[25:36]):
        assert torch.equal(backends[1].evaluate(chunk), padded.evaluate(chunk))


def test_packed_float32_steps_are_padded_by_the_timed_choice():
    """Where oneDNN packs the weights, every projection of a float32 model runs a one-row
    step padded to the count chosen at load (at least the probes' 2), and that count is one
    of PAD_ROWS."""
    backend = NativeBackend(model(torch.float32), cached_tokenizer())
    arranged = backend.weights.projections()
    if _pack(arranged[0].weight) is None:
        pytest.skip("this torch has no oneDNN packed product")
    assert backend.weights.pad_rows in native_weights.PAD_ROWS
    assert {p.plan.min_rows for p in arranged} == {max(backend.weights.pad_rows, 2)}
    assert len(arranged) == 2 * 4 + 1  # four products a layer, and the head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_row_step_runs_one_padded_product_per_fused_weight(monkeypatch, dtype):
    """A plain step is 4 products a layer (fused q/k/v, out, fused gate/up, down) and the head,
    each of as many rows as its plan pads a one-row pass to: the step the timing chose."""
    backend = NativeBackend(model(dtype), cached_tokenizer())
    backend.evaluate(IDS[:10])
    seen: list[tuple[int, int]] = []
    product = Projection.product
    monkeypatch.setattr(
        Projection,
        "product",
        lambda self, x: seen.append((x.shape[0], self.plan.min_rows)) or product(self, x),
    )
    backend.evaluate(IDS[10:11])
    assert len(seen) == 2 * 4 + 1
    assert all(rows == least for rows, least in seen)  # each padded as its plan says
    assert backend.weights.pad_rows == 1 or max(seen)[0] == max(backend.weights.pad_rows, 2)
