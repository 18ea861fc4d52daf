"""A model's weights arranged for the native forward, and which models it can run.

q/k/v and gate/up are fused into one product each, every projection planned for row-invariance
(see `invariant`), once per model: the forks of a model, and the graph passes (`graph`), share
them. Apart from `native` so that loading a model reads apart from the forward and its cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdecode.backends.invariant import INVARIANT_DTYPES, Plan, Projection, invariance_plan

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
