"""Verification: which draft tokens the target keeps, and which token it adds.

Terms used throughout specdecode:
- *target* and *draft*: the model whose distribution defines the output, and the proposer.
- `k`: the draft length; `n_accepted` (a): how many draft tokens were kept, excluding the
  token the target adds.
- *recovered*: the target's own token at the first rejected position; *bonus*: the extra
  token sampled after the last position when every draft token was kept.
- Every step emits `n_accepted + 1` tokens (fewer only when an end-of-generation token stops it).

A draft is a chain or a token tree (`Draft.parents`); a chain is the tree with one branch and
both functions treat it so. They read logits rows [N+1, V] that the target computed in one
pass for `last` (row 0) and the draft's nodes (row i + 1 for node i), walk down from the
root, and return the emitted tokens with the accepted path. They touch no model, cache or
strategy. The rows are a host tensor or, reduced where the pass ran, one
`specdecode.sampling.ReducedRow` each: the sampler reads either alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.config import VERIFY_MODES as VERIFY_MODES  # re-exported: generate reads it here
from specdecode.drafts import Draft
from specdecode.sampling import ReducedRow, Sampler, distribution, row_vocab

LogitsRows = torch.Tensor | Sequence[ReducedRow]  # [N+1, V] on the host, or each row's stage 1


@dataclass(frozen=True)
class Verdict:
    """What a verification keeps: the emitted tokens and the draft nodes accepted, root first
    (`emitted[:len(path)]` are those nodes' tokens)."""

    emitted: list[int]
    path: list[int]


def children_of(draft: Draft) -> dict[int, list[int]]:
    """Node -> its children in draft order; -1 is the root (`last`)."""
    children: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(draft.parent_list()):
        children.setdefault(node, [])
        children[parent].append(node)
    return children


def verify_match(
    draft: Draft,
    logits: LogitsRows,
    sampler: Sampler,
    history: Sequence[int],
    eog_ids: frozenset[int],
) -> Verdict:
    """Sample and match (llama.cpp's `common_sampler_sample_and_accept_n`), down a tree.

    At each node the target samples with the full sampler; the walk descends into the child
    holding that sample, if any. The first sample no child holds is emitted and ends the step;
    at a leaf that sample is the bonus token. One draw per emitted token, exactly as plain
    generation, so the output equals plain generation for the same seed at any temperature.
    An end-of-generation token matched inside the draft ends the step.

    logits: [N+1, V]. Returns the emitted tokens (length n_accepted + 1) and the path.
    """
    assert len(logits) == len(draft.tokens) + 1, "logits must be [N+1, V]"
    children = children_of(draft)
    emitted: list[int] = []
    path: list[int] = []
    context = list(history)
    node = -1
    while True:
        token = sampler.sample(logits[node + 1], context)
        emitted.append(token)
        child = next((c for c in children[node] if draft.tokens[c] == token), None)
        if child is None:
            return Verdict(emitted, path)
        path.append(child)
        if token in eog_ids:
            return Verdict(emitted, path)
        context.append(token)
        node = child


def verify_rejection(
    draft: Draft,
    logits: LogitsRows,
    sampler: Sampler,
    history: Sequence[int],
    eog_ids: frozenset[int],
) -> Verdict:
    """Speculative sampling down a tree (Leviathan et al. 2023 for a chain; SpecInfer's
    recursive rejection over siblings, Miao et al. 2024, for a tree; p = target, q = draft).

    At a node, try its children in order: keep child x with probability min(1, p(x) / q_x(x)),
    where q_x is the distribution x was drawn from; on rejection p <- norm(max(0, p - q_x)) and
    the next child is tried. When every child is rejected, the recovered token is drawn from
    the last p; at a leaf, the bonus token from the target. Each rejection removes from p
    exactly the mass the rejected proposal could have claimed, so the emitted tokens are
    distributed exactly as samples from the target, whatever the tree's shape, as long as
    each q_x is the distribution x was truly drawn from (`Draft.probs`; None means point
    masses: a deterministic proposer). Greedy settings reduce to `verify_match`.

    logits: [N+1, V]. Returns the emitted tokens and the accepted path.
    """
    if sampler.params.greedy:
        return verify_match(draft, logits, sampler, history, eog_ids)
    assert len(logits) == len(draft.tokens) + 1, "logits must be [N+1, V]"
    vocab = row_vocab(logits[0])
    children = children_of(draft)
    emitted: list[int] = []
    path: list[int] = []
    context = list(history)
    node = -1
    while children[node]:
        p = distribution(logits[node + 1], sampler.params, context)  # [V]
        kept = None
        for child in children[node]:
            proposed = draft.tokens[child]
            q = _draft_row(draft.probs, child, proposed, vocab)  # [V]
            p_x = float(p[proposed]) if proposed < vocab else 0.0
            q_x = float(q[proposed]) if proposed < vocab else 1.0
            if sampler.uniform() * q_x < p_x:
                kept = child
                break
            residual = torch.clamp(p - q, min=0.0)
            mass = float(residual.sum())
            if mass <= 0.0:
                break  # p within q everywhere: nothing left to recover but p itself
            p = residual / mass
        if kept is None:
            emitted.append(sampler.draw(p))
            return Verdict(emitted, path)
        emitted.append(draft.tokens[kept])
        path.append(kept)
        if draft.tokens[kept] in eog_ids:
            return Verdict(emitted, path)
        context.append(draft.tokens[kept])
        node = kept
    emitted.append(sampler.sample(logits[node + 1], context))
    return Verdict(emitted, path)


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
