"""A checkpoint's own multi-token-prediction (MTP) layer (DeepSeek-V3, arXiv 2412.19437, §2.2), as
vLLM's `deepseek_mtp` and `mimo_mtp` run it:

    x   = proj([enorm(embed(token)) ; hnorm(h)])    DeepSeek order; MiMo's is [hnorm(h) ; enorm(e)]
    y   = block(x)                                  one dense Llama/Qwen2 decoder layer
    out = lm_head(norm(y))                          the target's output head unless the layer has one

The pair at position p is (token p+1, h_p). The first step reads h = the target's last hidden
state after its final norm (what the target's forward returns to vLLM); further steps chain the
one layer, feeding it its own state: y (DeepSeek's layer, whose `shared_head.norm` is applied only
for the logits) or norm(y) (MiMo's, whose `final_layernorm` ends the layer). As in vLLM, the
embedding of the pair at position 0 is zeroed. The block's rotary embedding is plain Llama's at
`rope_theta` (a target's rope scaling is not applied: that changes acceptance, never output).

The layer drives like an EAGLE-3 head: it is one, in interface (`fc` is the target's final norm,
reading the target's layer-n_layers features; `step`, `step_many` and `tree_step`, with their
caches, are the head's), so the EAGLE-3 strategy's chains and trees, its batching and its
training-time test run it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.strategies.eagle3_head import MLP, Attend, Attention, Eagle3Head, RMSNorm

DEEPSEEK = "deepseek"  # model.layers.{L}.enorm / hnorm / eh_proj / shared_head.*: GLM-4.5 too
MIMO = "mimo"  # model.mtp_layers.{i}.token_layernorm / hidden_layernorm / input_proj / final_layernorm


@dataclass(frozen=True)
class MtpConfig:
    """The target's decoder-layer shape (the MTP block has it) and how the layer is wired."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    n_layers: int  # the target's: the layer reads its features at id n_layers (the last layer's output)
    layout: str = DEEPSEEK
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # q/k/v biases (Qwen2-style blocks, MiMo's)
    output_bias: bool = False  # an o_proj bias too (Llama's attention_bias)

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return (self.n_layers,)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size


class FixedNorm(nn.Module):
    """An RMSNorm whose weight is a buffer: the target's final norm, neither trained nor saved."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


class Block(nn.Module):
    """A dense pre-norm decoder layer, named as Llama's and Qwen2's are."""

    def __init__(self, config: MtpConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        # Llama's attention over [B, T, H] (the head's over [B, T, 2H]), with the block's biases
        self.self_attn = Attention(config, h, config.attention_bias, config.output_bias)  # type: ignore[arg-type]
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)  # type: ignore[arg-type]  # reads hidden_size and intermediate_size

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpLayer(Eagle3Head):
    def __init__(
        self,
        config: MtpConfig,
        embeddings: torch.Tensor,
        lm_head: torch.Tensor,
        target_norm: torch.Tensor,
    ) -> None:
        """embeddings [V, H], lm_head [V, H], target_norm [H]: the target's token embeddings,
        output head and final norm (or the layer's own embeddings and head, where it has them);
        used, not trained, not saved."""
        nn.Module.__init__(self)  # an EAGLE-3 head in interface only: none of its modules
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config  # type: ignore[assignment]
        self.fc = FixedNorm(target_norm, eps)  # type: ignore[assignment]
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Block(config)
        self.norm = RMSNorm(h, eps)
        self.register_buffer("embeddings", embeddings.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.register_buffer("d2t", torch.arange(config.vocab_size), persistent=False)
        self.layer_note = f"MTP layer ({config.layout} layout) over the target's last hidden state"

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embeddings).to(self.eh_proj.weight.dtype)

    def layer(
        self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Pairs (tokens [B, T], h [B, T, H]) at positions [T] -> the states chained on [B, T, H]."""
        embedded = self.embed(tokens) * (positions != 0)[None, :, None]  # vLLM zeroes position 0's
        parts = [self.enorm(embedded), self.hnorm(g)]
        if self.config.layout == MIMO:
            parts.reverse()
        y = self.block(self.eh_proj(torch.cat(parts, dim=-1)), positions, attend)
        return self.norm(y) if self.config.layout == MIMO else y

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Chained states [..., H] -> logits [..., V]."""
        normed = h if self.config.layout == MIMO else self.norm(h)
        return F.linear(normed, self.lm_head)

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.logits(h)  # the layer's vocabulary is the target's
