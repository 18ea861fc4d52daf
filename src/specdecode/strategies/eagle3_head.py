"""The EAGLE-3 draft head (Li et al., 2025, arXiv 2503.01840), as published checkpoints lay it out.

    g   = fc([f_low ; f_mid ; f_high])                     target features -> [H]
    x   = [input_layernorm(embed(token)) ; hidden_norm(g)]  [2H], the attention's input
    h   = g + o_proj(attention(q_proj x, k_proj x, v_proj x))
    h   = h + mlp(post_attention_layernorm(h))               SwiGLU; h is the "pre-norm" state
    out = lm_head(norm(h))                                   logits over the draft vocabulary

The pair at position p is (token at p+1, g at p): target features of position p with the
token that followed it, predicting the token after that. Drafting further than the target
has gone feeds h back as the next g (EAGLE's "own features"). `d2t` maps draft-vocabulary
indices to target ids (absolute ids here; the files store offsets, see `eagle3_checkpoint`).

Token trees (EAGLE-2 drafting) put scratch nodes after the cached true pairs (`HeadTree`):
a node at depth d sits at position n + d - 1, like the d-th pair of a chain, and attends to
the true pairs, its ancestors and itself, so each branch computes what a chain along it would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdecode.backends.hidden import capture, features

# attend(q [B, heads, T, D], k [B, kv, T, D], v [B, kv, T, D]) -> [B, heads, T, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]  # residual-stream input of these target layers
    vocab_size: int  # the target's
    draft_vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 at least (as Llama does), float64 kept for exact tests
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding of x [B, heads, T, D] at integer positions [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None]  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(
        self, config: Eagle3Config, width: int | None = None, bias: bool = False, output_bias: bool = False
    ) -> None:
        """width: the input's, 2H by default (the head's [embedding ; g]); bias, output_bias:
        whether q/k/v and o_proj have biases (an MTP layer's block may)."""
        super().__init__()
        h, d = config.hidden_size, config.dim
        width = 2 * h if width is None else width
        self.config = config
        self.q_proj = nn.Linear(width, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(width, config.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(width, config.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=output_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [B, T, width] at positions [T] -> [B, T, H]."""
        b, t, _ = x.shape
        c = self.config

        def heads(proj: nn.Linear, n: int) -> torch.Tensor:
            return proj(x).view(b, t, n, c.dim).transpose(1, 2)  # [B, n, T, D]

        q = rotate(heads(self.q_proj, c.num_attention_heads), positions, c.rope_theta)
        k = rotate(heads(self.k_proj, c.num_key_value_heads), positions, c.rope_theta)
        v = heads(self.v_proj, c.num_key_value_heads)
        return self.o_proj(attend(q, k, v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The one decoder layer, over [norm(embedding) ; norm(g)]."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)

    def forward(
        self, embedded: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """embedded, g: [B, T, H] -> the pre-norm state h [B, T, H]."""
        x = torch.cat([self.input_layernorm(embedded), self.hidden_norm(g)], dim=-1)
        h = g + self.self_attn(x, positions, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


# Every SDPA kernel but cuDNN's, which builds a new plan for each new shape: tens of
# milliseconds for every new cache length a head attends over, on every step of a draft.
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA under a boolean mask; on CUDA without the cuDNN kernel (see NO_CUDNN)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, kv, T, D] -> [B, kv * times, T, D] (grouped-query attention)."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


class HeadCache:
    """The head's own KV cache for one sequence: keys and values of positions 0..n-1."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [1, kv, capacity, D]
        self.v: torch.Tensor | None = None
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add positions n..n+T-1; return all cached keys and values [1, kv, n+T, D]."""
        need = self.n + k.shape[2]
        if self.k is None or need > self.k.shape[2]:
            capacity = max(need, 2 * (self.k.shape[2] if self.k is not None else 64))
            shape = (*k.shape[:2], capacity, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if self.k is not None:
                grown_k[:, :, : self.n] = self.k[:, :, : self.n]
                grown_v[:, :, : self.n] = self.v[:, :, : self.n]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.n : need] = k
        self.v[:, :, self.n : need] = v
        self.n = need
        return self.k[:, :, :need], self.v[:, :, :need]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, max(0, n))


class HeadTree:
    """Scratch token-tree nodes in a HeadCache, after its true pairs 0..base-1.

    Node i takes cache slot base + i and position base + depth_i - 1, and sees the true pairs,
    its ancestors and itself: never its siblings or other branches. drop() gives the cache back
    as it was, so the true pairs are reused by the next draft and the nodes are not.
    """

    def __init__(self, cache: HeadCache) -> None:
        self.cache = cache
        self.base = cache.n
        self.paths: list[list[int]] = []  # node i: its ancestors' indices, root first, then i

    def add(self, parents: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Register nodes below `parents` (earlier nodes, or -1 for children of the true pairs);
        return their positions [T] and what they see [T, base + nodes so far] (bool)."""
        first = len(self.paths)
        for parent in parents:
            assert -1 <= parent < first, "a parent must be added before its children"
            self.paths.append([*(self.paths[parent] if parent >= 0 else []), len(self.paths)])
        new = self.paths[first:]
        positions = torch.tensor([self.base + len(path) - 1 for path in new], device=device)
        visible = torch.zeros(len(new), self.base + len(self.paths), dtype=torch.bool, device=device)
        visible[:, : self.base] = True
        rows = [t for t, path in enumerate(new) for _ in path]
        cols = [self.base + node for path in new for node in path]
        visible[rows, cols] = True
        return positions, visible

    def drop(self) -> None:
        self.cache.truncate(self.base)
        self.paths = []


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, embeddings: torch.Tensor | None = None) -> None:
        """embeddings: the target's token embeddings [V, H], used (not trained, not saved) when
        the head carries none of its own; None gives the head its own `embed_tokens`."""
        super().__init__()
        self.config = config
        width = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size))  # draft index -> target id
        # how the layer ids were chosen or read (`eagle3_checkpoint.load_head` says which convention)
        self.layer_note = f"EAGLE-3 head reads target layer inputs {list(config.target_layer_ids)}"
        self.shares_embeddings = embeddings is not None
        if embeddings is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.register_buffer("shared_embeddings", embeddings.detach(), persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.shared_embeddings if self.shares_embeddings else self.embed_tokens.weight
        return F.embedding(tokens, weight).to(self.fc.weight.dtype)

    def layer(
        self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Pairs (tokens [B, T], g [B, T, H]) at positions [T] -> pre-norm states [B, T, H]."""
        return self.midlayer(self.embed(tokens), g, positions, attend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm states [..., H] -> draft-vocabulary logits [..., V_draft]."""
        return self.lm_head(self.norm(h))

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Pre-norm states [..., H] -> logits [..., V] over the target's vocabulary, -inf outside
        the draft's."""
        draft = self.logits(h)
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.d2t] = draft
        return full

    def step(self, tokens: list[int], g: torch.Tensor, start: int, cache: HeadCache) -> torch.Tensor:
        """Run pairs (tokens, g [T, H]) at positions start.. through the layer with `cache`, which
        must hold exactly positions 0..start-1; returns the pre-norm states [T, H]."""
        return self.step_many([(tokens, g, start, cache)])[0]

    def step_many(self, steps: list[tuple[list[int], torch.Tensor, int, HeadCache]]) -> list[torch.Tensor]:
        """Several sequences' `step`s, (tokens, g, start, cache) each, in one pass of the layer:
        their rows side by side, each sequence's attending over its own cache."""
        for _, _, start, cache in steps:
            assert cache.n == start, (cache.n, start)
        device = self.fc.weight.device
        sizes = [len(tokens) for tokens, _, _, _ in steps]
        ids = torch.tensor(
            [[token for tokens, _, _, _ in steps for token in tokens]], dtype=torch.long, device=device
        )
        positions = torch.cat(
            [
                torch.arange(start, start + n, device=device)
                for (_, _, start, _), n in zip(steps, sizes, strict=True)
            ]
        )
        g = torch.cat([g for _, g, _, _ in steps]).to(self.fc.weight.dtype)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out, first = [], 0
            for (_, _, _, cache), n in zip(steps, sizes, strict=True):
                rows = slice(first, first + n)
                keys, values = cache.append(k[:, :, rows], v[:, :, rows])
                # query t (position start + t) sees keys 0..start + t
                mask = torch.arange(keys.shape[2], device=device)[None] <= positions[rows, None]  # [T, S]
                out.append(
                    masked_attention(q[:, :, rows], repeat_kv(keys, groups), repeat_kv(values, groups), mask)
                )
                first += n
            return torch.cat(out, dim=2)

        return list(self.layer(ids, g[None], positions, attend)[0].split(sizes))

    def tree_step(
        self, tokens: list[int], g: torch.Tensor, parents: list[int], tree: HeadTree
    ) -> torch.Tensor:
        """Run tree nodes (tokens, g [T, H]) below `parents` (see `HeadTree.add`) in one pass;
        returns their pre-norm states [T, H]."""
        assert tree.cache.n == tree.base + len(tree.paths), "the tree must own the cache's tail"
        device = self.fc.weight.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions, visible = tree.add(parents, device)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = tree.cache.append(k, v)
            return masked_attention(q, repeat_kv(keys, groups), repeat_kv(values, groups), visible)

        return self.layer(ids, g[None].to(self.fc.weight.dtype), positions, attend)[0]


def unrolled_attention(
    config: Eagle3Config, step: int, history: list[tuple[torch.Tensor, torch.Tensor]]
) -> Attend:
    """Training-time test: attention of unroll step `step` (0 = the pairs from target features).

    The query of step j at position p stands for the j-th drafted pair after a verified prefix
    0..p-j: it sees the step-0 keys of positions 0..p-j and, for each step i = 1..j, the key
    step i made at position p-j+i (the pairs drafted before it on the same path, itself last).
    `history` holds the (k, v) of steps 0..step-1; this step's are appended to it.
    """
    groups = config.num_attention_heads // config.num_key_value_heads
    scale = 1.0 / math.sqrt(config.dim)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        history.append((k, v))
        t = q.shape[2]
        k0, v0 = (repeat_kv(x, groups) for x in history[0])
        wide = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
        scores = (q @ k0.transpose(-1, -2)).to(wide) * scale  # [B, heads, T, T]
        rows = torch.arange(t, device=q.device)
        visible = rows[None] <= rows[:, None] - step  # key c visible from query p iff c <= p - j
        scores = scores.masked_fill(~visible, float("-inf"))
        shifted = []
        for i in range(1, step + 1):
            ki, vi = (_shift(repeat_kv(x, groups), step - i) for x in history[i])
            shifted.append(vi)
            scores = torch.cat([scores, ((q * ki).sum(-1).to(wide) * scale)[..., None]], dim=-1)
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        out = weights[..., :t] @ v0
        for i, vi in enumerate(shifted):
            out = out + weights[..., t + i, None] * vi
        return out

    return attend


def read_target(
    target: nn.Module, layer_ids: tuple[int, ...], batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the frozen target over batch [B, T+1]: its logits [B, T+1, V] and the
    features at `layer_ids` of pairs 0..T-1 [B, T, F] (pair p: token p+1, features of p)."""
    with torch.no_grad(), capture(target, layer_ids) as sink:
        logits = target(input_ids=batch).logits
        return logits, features(sink, layer_ids)[:, :-1]


def unrolled_states(
    head: Eagle3Head, tokens: torch.Tensor, g: torch.Tensor, unroll: int
) -> Iterator[torch.Tensor]:
    """The head's pre-norm states [B, T, H] at unroll steps 0..unroll-1 over the pairs
    (tokens [B, T], g [B, T, H]): step j at position p is what drafting computes j tokens past
    the verified prefix ending at p - j (only positions p >= j are reachable)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(min(unroll, tokens.shape[1])):
        h = head.layer(tokens, g, positions, unrolled_attention(head.config, step, history))
        yield h
        g = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # own state, one position on


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, n, T, D] moved `by` positions later along T (row p holds row p - by; zeros first)."""
    if by == 0:
        return x
    if by >= x.shape[2]:
        return torch.zeros_like(x)
    return torch.cat([x.new_zeros(*x.shape[:2], by, x.shape[3]), x[:, :, :-by]], dim=2)
