"""The DFlash drafter (block diffusion for speculative decoding; arXiv 2602.06036), as z-lab's
published checkpoints lay it out.

DFlash predicts a whole block in one forward. Like an EAGLE-3 head it reads features of several
target layers, but it fuses them once and feeds them to every draft layer as extra keys and
values; a query block [last token, mask, mask, ...] attends, without a causal mask, to those
context keys and to itself, and the target's own output head turns every block position but the
first into logits:

    c     = hidden_norm(fc([f_1 ; ... ; f_m]))              context rows, one per verified position
    x     = embed_target([last, mask, ..., mask])           the block, positions n .. n+B-1
    layer:  a = input_layernorm(x)
            q = q_norm(q_proj a),  k = k_norm(k_proj [c ; a]),  v = v_proj [c ; a]   (rotary on q, k)
            x = x + o_proj(attention(q, k, v))              every block row sees every context
            x = x + mlp(post_attention_layernorm(x))        row and the whole block
    out   = lm_head_target(norm(x[1:]))                     B - 1 drafted positions

Context rows do not go through the layers: each layer only projects them into its keys and
values, so they are computed once per verified position and cached (`ContextCache`), and a
draft costs one pass over B rows whatever the context's length. The block's own keys are
never cached.

Layer ids here name the residual-stream input of target layer l, as everywhere in this package;
z-lab's files name the output of layer l (their feature l is hidden_states[l + 1]), so reading
one adds 1 (`dflash_checkpoint`). The embeddings and the output head are the target's, held here
as buffers (neither trained nor saved).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.strategies.eagle3_head import MLP, RMSNorm, masked_attention, repeat_kv

# Rotary scalings whose angles depend on the position alone (transformers computes their
# frequencies); the others depend on the sequence's length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def default_layer_ids(n_layers: int, count: int = 5) -> tuple[int, ...]:
    """z-lab's choice, as layer inputs: `count` outputs spread evenly from layer 1 to layer
    n_layers - 3 (Qwen3-8B's 36 layers: outputs 1, 9, 17, 25, 33), each read as the next
    layer's input. Short targets get what fits."""
    last = max(1, n_layers - 3)
    count = max(1, min(count, last))
    outputs = [round(1 + (last - 1) * i / max(1, count - 1)) for i in range(count)]
    return tuple(sorted({output + 1 for output in outputs}))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # the target's: the block is embedded, and read out, with the target's matrices
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]  # residual-stream input of these target layers
    block_size: int  # B: one query row for the last token and B - 1 drafted positions
    mask_token_id: int
    vocab_size: int  # the target's
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    sliding_window: int | None = None  # for the layers listed in `sliding_layers`
    sliding_layers: tuple[int, ...] = ()
    # rope_parameters beyond rope_theta, as transformers reads them ({"rope_type": "llama3",
    # "factor": 8.0, ...}); empty for plain rotary
    rope_scaling: dict = field(default_factory=dict, hash=False)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def drafted(self) -> int:
        """Tokens one block proposes."""
        return self.block_size - 1


class Rotary:
    """Rotary embedding at integer positions: Llama's rotate-half form, its angles in float64,
    with the frequencies (and yarn's attention factor) of the config's scaling."""

    def __init__(self, config: DFlashConfig) -> None:
        dim = config.dim
        self.scale = 1.0
        kind = config.rope_scaling.get("rope_type") or config.rope_scaling.get("type") or "default"
        if kind == "default":
            self.inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            return
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        parameters = {**config.rope_scaling, "rope_type": kind, "rope_theta": config.rope_theta}
        llama = LlamaConfig(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=parameters,
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](llama, "cpu")
        self.inv_freq, self.scale = inv_freq.to(torch.float64), float(scale)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D] at positions [T]."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(x.device)[None]  # [T, D/2]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = (angles.cos() * self.scale).to(x.dtype), (angles.sin() * self.scale).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, rotary: Rotary) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.dim, config.attention_bias
        self.config = config
        self.rotary = rotary
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [B, T, H] at positions [T] -> rotated keys and values [B, kv, T, D]."""
        b, t, _ = x.shape
        c = self.config
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.dim).transpose(1, 2)
        return self.rotary(k, positions), v

    def forward(
        self,
        a: torch.Tensor,
        positions: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Normed block rows a [B, T, H] at positions [T], attending to the context's keys and
        values [B, kv, S, D] and to the block's own; visible [T, S + T] (bool) or None (all)."""
        b, t, _ = a.shape
        c = self.config
        q = self.q_norm(self.q_proj(a).view(b, t, c.num_attention_heads, c.dim)).transpose(1, 2)
        q = self.rotary(q, positions)
        k, v = self.keys_values(a, positions)
        keys = torch.cat([context_kv[0], k], dim=2)
        values = torch.cat([context_kv[1], v], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
        if visible is None:
            out = F.scaled_dot_product_attention(q, keys, values)
        else:
            out = masked_attention(q, keys, values, visible)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, rotary: Rotary) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DFlashAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)  # gate/up/down_proj over hidden_size and intermediate_size

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, context_kv, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextCache:
    """Each layer's keys and values of context rows 0..n-1 for one sequence."""

    def __init__(self, layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * layers  # [1, kv, capacity, D]
        self.v: list[torch.Tensor | None] = [None] * layers
        self.n = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add rows n..n+T-1 of one layer; `advance` moves n once every layer has them."""
        need = self.n + k.shape[2]
        old_k = self.k[layer]
        if old_k is None or need > old_k.shape[2]:
            capacity = max(need, 2 * (old_k.shape[2] if old_k is not None else 64))
            shape = (*k.shape[:2], capacity, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if old_k is not None:
                grown_k[:, :, : self.n] = old_k[:, :, : self.n]
                grown_v[:, :, : self.n] = self.v[layer][:, :, : self.n]
            self.k[layer], self.v[layer] = grown_k, grown_v
        self.k[layer][:, :, self.n : need] = k
        self.v[layer][:, :, self.n : need] = v

    def advance(self, rows: int) -> None:
        self.n += rows

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, kv, n, D] of one layer."""
        k, v = self.k[layer], self.v[layer]
        assert k is not None and v is not None, "no context rows yet"
        return k[:, :, : self.n], v[:, :, : self.n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, max(0, n))


class DFlashHead(nn.Module):
    def __init__(self, config: DFlashConfig, embeddings: torch.Tensor, output: torch.Tensor) -> None:
        """embeddings, output: the target's token embeddings and output head [V, H] (not trained,
        not saved)."""
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        rotary = Rotary(config)
        self.layers = nn.ModuleList(DFlashLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.register_buffer("target_embeddings", embeddings.detach(), persistent=False)
        self.register_buffer("target_output", output.detach(), persistent=False)
        self.layer_note = f"DFlash drafter reads target layer inputs {list(config.target_layer_ids)}"

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.target_embeddings).to(self.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target feature rows [..., m * H] -> context rows [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Block states [..., H] -> logits [..., V] through the target's output head."""
        return F.linear(self.norm(x), self.target_output.to(x.dtype))

    def window(self, layer: int, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor | None:
        """What a sliding-window layer lets query rows see [T, S] (bool); None for full attention."""
        c = self.config
        if c.sliding_window is None or layer not in c.sliding_layers:
            return None
        distance = q_positions[:, None] - k_positions[None]
        return distance.abs() < c.sliding_window

    def blocks(
        self,
        noise: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Training's forward, without a cache: block rows noise [B, T, H] (embedded) at positions
        [T] over context rows [B, S, H] at context_positions [S]; visible [T, S + T] says which
        context rows and block rows each block row sees. Returns the final states [B, T, H]
        (before `logits`)."""
        x = noise.to(self.dtype)
        k_positions = torch.cat([context_positions, positions])
        for index, layer in enumerate(self.layers):
            mask = visible
            window = self.window(index, positions, k_positions)
            if window is not None:
                mask = window if mask is None else mask & window
            x = layer(x, positions, layer.self_attn.keys_values(context, context_positions), mask)
        return x

    def extend_context(self, features: torch.Tensor, cache: ContextCache) -> None:
        """Append the context rows of target feature rows [T, m * H] (positions cache.n ..)."""
        if features.shape[0] == 0:
            return
        device = self.fc.weight.device
        positions = torch.arange(cache.n, cache.n + features.shape[0], device=device)
        c = self.context(features.to(device))[None]
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(c, positions)
            cache.append(index, k, v)
        cache.advance(features.shape[0])

    def block(self, last: int, cache: ContextCache, size: int | None = None) -> torch.Tensor:
        """The block after the cached context: its first row holds `last` at position cache.n,
        the others the mask token. Returns logits [size - 1, V] for positions cache.n + 1 ..
        (size: the block's rows, at most the configured block_size)."""
        size = self.config.block_size if size is None else size
        device = self.fc.weight.device
        tokens = torch.full((1, size), self.config.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = last
        positions = torch.arange(cache.n, cache.n + size, device=device)
        x = self.embed(tokens)
        k_positions = torch.arange(cache.n + size, device=device)
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, cache.view(index), self.window(index, positions, k_positions))
        return self.logits(x[0, 1:])
