"""A model's weights arranged for the native forward, and which models it can run.

q/k/v and gate/up are fused into one product each, every projection planned for row-invariance
(see `invariant`), once per model: the forks of a model, and the graph passes (`graph`), share
them. Apart from `native` so that loading a model reads apart from the forward and its cache.

Why short passes are padded to a row count timed at load: a plan that runs 2 to 128 rows in
one order of summation gives a row the same bits padded to any count in that band, so the
padding decides only the speed. Where decoding streams the weights from memory, that speed is
the kernel's, not the rows': oneDNN's packed float32 product of 2 rows read a step of the
bundled target's weights in about 11 ms on a 2-core EPYC, of 4 to 6 rows in about 8 ms (MKL's
one-row GEMV, transformers' kernel, about 12 ms). Which count streams fastest is the kernel
library's choice for the CPU at hand, so it is timed there, over the model's own weights.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specdecode.backends.invariant import INVARIANT_DTYPES, Plan, Projection, invariance_plan

# Row counts a pass of fewer rows may be padded to, within a plan's band (see the module
# docstring; 1: none); the smallest whose products are timed within PAD_TOLERANCE of the
# fastest wins.
PAD_ROWS = (1, 2, 3, 4, 6, 8)
PAD_TOLERANCE = 1.03
PAD_ROUNDS = 3  # timed rounds, after a warm-up one, candidates interleaved: the least of each
PAD_TIMED_BYTES = 1 << 28  # weights read per timed step: beyond the caches, as a decode step reads

NATIVE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def native_unsupported(config) -> str | None:
    """Why the native forward cannot run a model of this config; None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in NATIVE_MODEL_TYPES:
        return f"model_type {kind!r} (supported: {', '.join(sorted(NATIVE_MODEL_TYPES))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (needs silu)"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    if kind == "qwen2" and getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (its angles depend on the sequence length)"
    return None


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Projection
    out: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


class NativeWeights:
    """A model's weights arranged for the native forward (fused, probed), shared by forks."""

    def __init__(self, model: PreTrainedModel, invariant: bool) -> None:
        config = model.config
        decoder = model.get_decoder()
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.eps = float(config.rms_norm_eps)
        self.embeddings = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.rotary = decoder.rotary_emb
        plans: dict[tuple, Plan] = {}  # one probe per weight shape
        self.layers = [self._layer(layer, invariant, plans) for layer in decoder.layers]
        self.lm_head = self._projection(model.get_output_embeddings().weight, None, invariant, plans)
        self.plans = plans
        on_cpu = self.embeddings.device.type == "cpu"  # a GPU's passes are timed otherwise
        self.pad_rows = _pad_fastest(self.projections()) if invariant and on_cpu else 1

    def projections(self) -> list[Projection]:
        """Every projection, in the order a pass runs them."""
        projections = [p for layer in self.layers for p in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        return [*projections, self.lm_head]

    def _layer(self, layer, invariant: bool, plans: dict) -> Layer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        qkv = _fuse(projections)
        biases = [p.bias for p in projections]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return Layer(
            input_norm=layer.input_layernorm.weight,
            qkv=self._projection(qkv, qkv_bias, invariant, plans),
            out=self._projection(attention.o_proj.weight, attention.o_proj.bias, invariant, plans),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=self._projection(_fuse((mlp.gate_proj, mlp.up_proj)), None, invariant, plans),
            down=self._projection(mlp.down_proj.weight, None, invariant, plans),
        )

    @staticmethod
    def _projection(
        weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool, plans: dict
    ) -> Projection:
        if not invariant:
            return Projection(weight, bias)
        key = (tuple(weight.shape), bias is not None)
        if key not in plans:
            plans[key] = invariance_plan(weight, bias)
        return Projection(weight, bias, plans[key])


@torch.inference_mode()
def _pad_fastest(projections: Sequence[Projection]) -> int:
    """Pads shorter passes to the row count of PAD_ROWS whose products, over the projections a
    pass runs first (up to PAD_TIMED_BYTES of weights), are fastest here, and returns it (1:
    none). A count outside a projection's band leaves that projection's plan as it is."""
    timed: list[Projection] = []
    read = 0
    for projection in projections:
        if read >= PAD_TIMED_BYTES:
            break
        timed.append(projection)
        read += projection.weight.nbytes
    candidates = [rows for rows in PAD_ROWS if any(_pads_to(p, rows) for p in timed)]
    if not candidates:
        return 1
    rows = candidates[0] if len(candidates) == 1 else _fastest(timed, candidates)
    for projection in projections:
        if _pads_to(projection, rows):
            projection.plan = replace(projection.plan, min_rows=rows)
    return rows


def _fastest(timed: Sequence[Projection], candidates: Sequence[int]) -> int:
    """The smallest of `candidates` whose one-row pass over `timed` takes within PAD_TOLERANCE
    of the fastest's time (the least of PAD_ROUNDS rounds, candidates interleaved)."""
    inputs = {rows: [p.weight.new_zeros(rows, p.weight.shape[1]) for p in timed] for rows in (1, *candidates)}
    best: dict[int, float] = {}
    for round_ in range(PAD_ROUNDS + 1):
        for rows in candidates:
            began = time.perf_counter()
            for projection, padded, alone in zip(timed, inputs[rows], inputs[1], strict=True):
                if _pads_to(projection, rows):
                    projection.product(padded)
                else:
                    projection(alone)  # as its plan runs one row
            seconds = time.perf_counter() - began
            if round_:
                best[rows] = min(best.get(rows, seconds), seconds)
    fastest = min(best.values())
    return next(rows for rows in candidates if best[rows] <= fastest * PAD_TOLERANCE)


def _pads_to(projection: Projection, rows: int) -> bool:
    """Whether a pass of fewer rows may be padded to `rows` and keep its bits: one band of row
    counts, from the plan's least, holds it."""
    plan = projection.plan
    return plan.max_rows > 1 and plan.min_rows <= rows <= plan.max_rows


def _fuse(modules: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """One weight for several projections of the same input; the modules keep views into it,
    so transformers' own forward still works and the weights are held once."""
    fused = torch.cat([m.weight.detach() for m in modules]).contiguous()
    start = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


_SHARED: weakref.WeakKeyDictionary[PreTrainedModel, dict[bool, NativeWeights]] = weakref.WeakKeyDictionary()


def native_weights(model: PreTrainedModel, row_invariant: bool = True) -> NativeWeights:
    """The arranged weights of `model`, made (and, for row-invariant passes, probed) once per
    model and kind of pass."""
    arranged = _SHARED.setdefault(model, {})
    if row_invariant not in arranged:
        dtype = next(model.parameters()).dtype
        arranged[row_invariant] = NativeWeights(model, invariant=row_invariant and dtype in INVARIANT_DTYPES)
    return arranged[row_invariant]
