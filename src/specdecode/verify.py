"""Verification: which draft tokens the target keeps, and which token it adds.

Terms used throughout specdecode:
- *target* and *draft*: the model whose distribution defines the output, and the proposer.
- `k`: the draft length; `n_accepted` (a): how many draft tokens were kept, excluding the
  token the target adds.
- *recovered*: the target's own token at the first rejected position; *bonus*: the extra
  token sampled after the last position when every draft token was kept.
- Every step emits `n_accepted + 1` tokens (fewer only when an end-of-generation token stops it).

Both functions are pure: they read logits rows [k+1, V] that the target computed for
`[last, d0, ..., d(k-1)]` in one forward pass and return the emitted tokens. They touch no
model, cache or strategy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.sampling import Sampler, distribution

VERIFY_MODES = ("match", "rejection")


def verify_match(
    draft: Sequence[int],
    logits: torch.Tensor,
    sampler: Sampler,
    history: Sequence[int],
    eog_ids: frozenset[int],
) -> list[int]:
    """Sample and match (llama.cpp's `common_sampler_sample_and_accept_n`).

    At each position the target samples with the full sampler; the draft token is kept only
    if it equals that sample. The first mismatch emits the sample; if all k match, a bonus
    token is sampled from the last row. One draw per emitted token, exactly as plain
    generation, so the output equals plain generation for the same seed at any temperature.
    An end-of-generation token matched before the end of the draft ends the step.

    logits: [k+1, V]. Returns the emitted tokens (length n_accepted + 1).
    """
    assert logits.ndim == 2 and logits.shape[0] == len(draft) + 1, "logits must be [k+1, V]"
    emitted: list[int] = []
    context = list(history)
    for i, proposed in enumerate(draft):
        token = sampler.sample(logits[i], context)
        emitted.append(token)
        if token != proposed or token in eog_ids:
            return emitted
        context.append(token)
    emitted.append(sampler.sample(logits[len(draft)], context))
    return emitted


def verify_rejection(
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    sampler: Sampler,
    history: Sequence[int],
    eog_ids: frozenset[int],
) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; p = target, q = draft).

    Keep d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection emit a
    recovered token drawn from norm(max(0, p - q)); after k acceptances emit a bonus token
    drawn from p. The emitted tokens are distributed exactly as samples from p.
    `draft_probs` None means a deterministic proposer: q is a point mass on each d_i.
    Greedy settings reduce to `verify_match` (p is one-hot).

    draft_probs: [k, V'] or None; logits: [k+1, V]. Returns the emitted tokens.
    """
    if sampler.params.greedy:
        return verify_match(draft, logits, sampler, history, eog_ids)
    assert logits.ndim == 2 and logits.shape[0] == len(draft) + 1, "logits must be [k+1, V]"
    vocab = logits.shape[1]
    emitted: list[int] = []
    context = list(history)
    for i, proposed in enumerate(draft):
        p = distribution(logits[i], sampler.params, context)  # [V]
        q = _draft_row(draft_probs, i, proposed, vocab)  # [V]
        p_x = float(p[proposed]) if proposed < vocab else 0.0
        q_x = float(q[proposed]) if proposed < vocab else 1.0
        if sampler.uniform() * q_x < p_x:
            emitted.append(proposed)
            if proposed in eog_ids:
                return emitted
            context.append(proposed)
            continue
        residual = torch.clamp(p - q, min=0.0)
        emitted.append(sampler.draw(residual if float(residual.sum()) > 0.0 else p))
        return emitted
    emitted.append(sampler.sample(logits[len(draft)], context))
    return emitted


def _draft_row(draft_probs: torch.Tensor | None, i: int, proposed: int, vocab: int) -> torch.Tensor:
    """q for position i as a [V] float64 row in the target's vocabulary.

    Draft vocabularies may differ in size from the target's: mass outside the target
    vocabulary cannot be emitted by the target, so it is dropped here.
    """
    if draft_probs is None:
        row = torch.zeros(vocab, dtype=torch.float64)
        if proposed < vocab:
            row[proposed] = 1.0
        return row
    row = draft_probs[i].to(torch.float64)
    if row.shape[0] >= vocab:
        return row[:vocab]
    return torch.cat([row, torch.zeros(vocab - row.shape[0], dtype=torch.float64)])
