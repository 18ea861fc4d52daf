"""The fused layer parts: eager ones compute exactly what the graph passes' layer computes,
compiled ones agree with them to rounding, give a row the same bits whatever the other rows,
and a compiler that fails leaves eager parts and a warning, not an error."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from specdecode.backends.fused import LayerOps
from specdecode.backends.native import _rms_norm, _rotate

CPU = torch.device("cpu")
EPS = 1e-5
HIDDEN, INTERMEDIATE = 64, 96
# Compiled against eager: float32 within a few ulps (the norm's sum runs in another order);
# bfloat16 within two ulps of its 8-bit significand.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-6, "atol": 1e-5}}


def inputs(dtype: torch.dtype, rows: int, head_dim: int, heads: int, kv_heads: int, seed: int = 0) -> dict:
    """What a layer of the graph passes feeds its element-wise parts, at a small hidden size."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    angles = torch.rand(rows, head_dim // 2, generator=g) * 100
    angles = torch.cat([angles, angles], dim=-1)
    return {
        "x": randn(rows, HIDDEN),
        "delta": randn(rows, HIDDEN),
        "weight": 1 + randn(HIDDEN) / 4,
        "qkv": randn(rows, (heads + 2 * kv_heads) * head_dim),
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "gate_up": randn(rows, 2 * INTERMEDIATE),
    }


@torch.inference_mode()
def run_all(ops: LayerOps, t: dict) -> dict[str, torch.Tensor]:
    q, k, v = ops.rotary(t["qkv"], t["cos"], t["sin"])
    summed, normed = ops.add_norm(t["x"], t["delta"], t["weight"])
    return {
        "rms_norm": ops.rms_norm(t["x"], t["weight"]),
        "sum": summed,
        "sum_norm": normed,
        "q": q,
        "k": k,
        "v": v,
        "silu_mul": ops.silu_mul(t["gate_up"]),
    }


@torch.inference_mode()
def graph_layer_parts(t: dict, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """The same parts as the graph passes' layer computes them, op by op."""
    n, dim = t["cos"].shape
    q, k, v = t["qkv"].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    gate, up = t["gate_up"].chunk(2, dim=-1)
    summed = t["x"] + t["delta"]
    return {
        "rms_norm": _rms_norm(t["x"], t["weight"], EPS),
        "sum": summed,
        "sum_norm": _rms_norm(summed, t["weight"], EPS),
        "q": _rotate(q.view(n, heads, dim).transpose(0, 1), t["cos"], t["sin"]),
        "k": _rotate(k.view(n, kv_heads, dim).transpose(0, 1), t["cos"], t["sin"]),
        "v": v.view(n, kv_heads, dim).transpose(0, 1),
        "silu_mul": F.silu(gate) * up,
    }


# (dtype, rows, head_dim, heads, kv_heads): the two unmarked ones cover rows 1 and 32, head_dim
# 64 and 128, grouped queries and both dtypes; the rest of the cross product is slow.
FAST = [(torch.float32, 1, 64, 4, 2), (torch.bfloat16, 32, 128, 4, 1)]
CONFIGS = FAST + [
    (dtype, rows, dim, 4, 2)
    for dtype in (torch.float32, torch.bfloat16)
    for rows in (1, 32)
    for dim in (64, 128)
    if (dtype, rows, dim) not in {c[:3] for c in FAST}
]
PARAMS = [
    pytest.param(
        *c, marks=[] if c in FAST else [pytest.mark.slow], id=f"{str(c[0])[6:]}-rows{c[1]}-dim{c[2]}"
    )
    for c in CONFIGS
]


@functools.cache
def compiled_ops(heads: int, kv_heads: int, dtype: torch.dtype) -> LayerOps:
    """One compiled LayerOps per head layout and dtype, shared by the tests: compiling takes
    seconds per shape."""
    return LayerOps(heads, kv_heads, EPS, CPU, compiled=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_parts_are_the_graph_layers_ops(dtype):
    t = inputs(dtype, 3, 64, 4, 2)
    got = run_all(LayerOps(4, 2, EPS, CPU), t)
    expected = graph_layer_parts(t, 4, 2)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].dtype == dtype
    assert got["q"].is_contiguous() and got["k"].is_contiguous()  # attention's reshape is a view


@pytest.mark.parametrize(("dtype", "rows", "head_dim", "heads", "kv_heads"), PARAMS)
def test_compiled_parts_match_eager_to_rounding(dtype, rows, head_dim, heads, kv_heads):
    t = inputs(dtype, rows, head_dim, heads, kv_heads)
    ops = compiled_ops(heads, kv_heads, dtype)
    got = run_all(ops, t)
    assert ops.compiled  # built, not fallen back
    expected = run_all(LayerOps(heads, kv_heads, EPS, CPU), t)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape and got[name].dtype == tensor.dtype, name
        torch.testing.assert_close(got[name], tensor, **TOLERANCE[dtype], msg=name)
    assert torch.equal(got["sum"], t["x"] + t["delta"])  # the residual stream itself is exact
    assert got["q"].is_contiguous() and got["k"].is_contiguous()


def test_compiled_rows_do_not_depend_on_the_other_rows():
    """Row 5 of a 32-row call, beside two different sets of other rows: the same bits."""
    dtype, rows, head_dim, heads, kv_heads = FAST[1]
    ops = compiled_ops(heads, kv_heads, dtype)
    first = inputs(dtype, rows, head_dim, heads, kv_heads, seed=1)
    second = inputs(dtype, rows, head_dim, heads, kv_heads, seed=2)
    for name in first:
        if name != "weight":
            second[name][5] = first[name][5]
    second["weight"] = first["weight"]
    a, b = run_all(ops, first), run_all(ops, second)
    assert ops.compiled
    for name in a:
        row_a, row_b = (a[name][:, 5], b[name][:, 5]) if name in ("q", "k", "v") else (a[name][5], b[name][5])
        assert torch.equal(row_a, row_b), name
        assert not torch.equal(a[name], b[name]), name  # the other rows did differ


def test_the_device_chooses_by_default():
    assert LayerOps(4, 2, EPS, torch.device("cuda")).compiled
    assert not LayerOps(4, 2, EPS, CPU).compiled
    assert LayerOps(4, 2, EPS, CPU, compiled=True).compiled
    assert not LayerOps(4, 2, EPS, torch.device("cuda"), compiled=False).compiled


def refuse(*args, **kwargs):
    raise RuntimeError("torch.compile is not supported here\nsecond line")


def cannot_build(graph, example_inputs):
    """A compiler backend that fails as Inductor does without a C++ compiler or Triton."""
    raise RuntimeError("no working C++ compiler found")


def compile_with(backend):
    """torch.compile as LayerOps calls it, with another backend (Dynamo's tracing is real)."""
    compile_for_real = torch.compile

    def compile(fn, *, fullgraph, options):
        return compile_for_real(fn, backend=backend, fullgraph=fullgraph)

    return compile


@pytest.mark.parametrize("failure", ["refused", "not built"])
def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch, failure):
    monkeypatch.setattr(torch, "compile", refuse if failure == "refused" else compile_with(cannot_build))
    t = inputs(torch.float32, 2, 64, 4, 2)
    ops = LayerOps(4, 2, EPS, CPU, compiled=True)
    with pytest.warns(RuntimeWarning, match=r"torch\.compile failed .*run eagerly") as caught:
        got = run_all(ops, t)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert not ops.compiled
    expected = run_all(LayerOps(4, 2, EPS, CPU), t)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_all(ops, t)  # eager from now on, without another warning


def test_more_shapes_than_dynamos_recompile_limit_stay_compiled(monkeypatch):
    """Dynamo allows a function 8 compiled entries; after a second row count a part's row
    count is a variable, so any number of row counts stays within them."""
    monkeypatch.setattr(torch, "compile", compile_with("eager"))
    ops = LayerOps(4, 2, EPS, CPU, compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in range(1, 11):
            ops.silu_mul(torch.ones(rows, 8))
    assert ops.compiled and len(ops._kernels) == 1
