"""EAGLE-3 strategy: a one-layer head over the target's own hidden states proposes the continuation.

llama.cpp's `draft-eagle3`, with the draft-model drafting policy (argmax chain, stop below
p_min on the softmax of the top-10 logits, n_max, n_min; sampling from the head's own
distribution for rejection verification).

Bookkeeping. The head's pair at position p is (token p+1, fc(target features of p)). When
asked to draft after `history` (in the target's cache, so its feature rows exist) and
`last`, the head's cache must hold the pairs 0..n-1 of that context (n = len(history)):
pair n-1, (last, g[n-1]), is the seed whose output proposes the first token. Pairs are
kept as long as the tokens they were made from still match (the longest common prefix, as
the draft model does), so after a verification only the newly verified pairs are run, in
one batch; the pairs drafted from the head's own states are always recomputed from the
target's features. No accept() bookkeeping is needed, and a step drafted by another
strategy of the chain simply leaves more pairs to catch up with.

Trees (`tree_tokens` > 0): an EAGLE-2 dynamic tree (Li et al., 2024, arXiv 2406.16858). A
node's score is the product of the head's probabilities along its path (its calibrated
confidence that the target accepts the path). Each depth expands the `tree_topk` best nodes
of that depth in one head pass, each giving its `tree_topk` best children; then the
`tree_tokens` best nodes overall are kept, best first (a child never outscores its parent, so
they form a tree, and so does every prefix of them: `Draft.truncated` keeps the best). Depth
is capped by n_max and the step's budget; p_min does not cut trees (the node budget does),
and a tree shallower than n_min is dropped. Under a policy's rule (`keep_drafting`) a node's
score is instead the chance the rule gives it of being reached and kept (from the same j-th
largest probabilities, capped at the earlier sibling's, so that siblings stay in the order
they were drawn), and a child the rule finds not worth its cost is not made at all, so the
budget is only an upper bound. Tree nodes are scratch in the head's cache
(`HeadTree`), dropped after each draft. For rejection verification the children are drawn
without replacement from the head's sampling distribution, each reporting the distribution
it was drawn from; the j-th drawn child is scored with the head's j-th largest probability
rather than with its own, so that whether a node is kept never depends on which token was
drawn into it: that would bias what verification sees and lose exactness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.backends import Backend, common_prefix, hidden_state_source
from specdecode.drafts import Draft, path_to
from specdecode.sampling import NO_TOKEN, Sampler, distribution
from specdecode.strategies.base import KeepDrafting
from specdecode.strategies.draft_model import DraftModelConfig, continue_draft, look_further, top1_confidence
from specdecode.strategies.eagle3_head import Eagle3Head, HeadCache, HeadTree

if TYPE_CHECKING:
    from specdecode.constraints import Constraint


class Eagle3Strategy:
    name: ClassVar[str] = "eagle3"

    def __init__(
        self,
        head: Eagle3Head,
        target: Backend,
        config: DraftModelConfig,
        sampler: Sampler | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """sampler: given for rejection verification at temperature > 0 (draft by sampling).
        constraint: the generation's, whose masks a chain draft takes."""
        self.head = head
        self.constraint = constraint
        self.target = hidden_state_source(target, "--spec-type eagle3")
        self.target.capture_hidden(head.config.target_layer_ids)
        self.config = config
        self.n_min = config.n_min
        self.sampler = sampler if sampler is not None and not sampler.params.greedy else None
        self.cache = HeadCache()
        self._context: list[int] = []  # tokens the cached true pairs were made from
        self.keep_drafting: KeepDrafting | None = None  # set by a policy: replaces p_min

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to do: the next draft reuses whatever prefix of the head's cache still matches."""

    def accept(self, n_accepted: int) -> None:
        """Nothing to do: pairs are matched by their tokens at the next draft."""

    def end(self) -> None:
        """The cache stays valid for a next generation sharing a prefix."""

    @torch.inference_mode()
    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        n = len(history)
        n_max = min(n_max, self.config.n_max)
        if n < 1 or n_max < 1:
            return Draft()
        context = [*history, last]
        keep = min(max(0, common_prefix(self._context, context) - 1), n - 1, self.cache.n)
        self.cache.truncate(keep)
        g = self.head.fc(self.target.hidden_states(keep, n).to(self.head.fc.weight.dtype))  # [n-keep, H]
        h = self.head.step(context[keep + 1 :], g, keep, self.cache)[-1]  # [H]
        self._context = context
        logits = self.head.target_logits(h)  # [V]
        if self.config.tree_tokens > 0:
            return self._draft_tree(h, logits, context, n_max)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidences: list[float] = []
        constraint = self.constraint
        try:
            while len(tokens) < n_max:
                if constraint is not None and (logits := constraint.draft_logits(logits)) is None:
                    break  # the grammar is complete
                # Every token the grammar allows may lie outside the head's vocabulary: no draft.
                if not bool(torch.isfinite(logits).any()):
                    break
                confidence = top1_confidence(logits)
                if not continue_draft(self.keep_drafting, len(tokens) + 1, confidence, self.config.p_min):
                    break
                token, row = self._pick(logits, [*context, *tokens])
                if token == NO_TOKEN:
                    break  # the logit bias bans every token left
                tokens.append(token)
                rows.append(row)
                confidences.append(confidence)
                if constraint is not None:
                    constraint.push(token)
                if not look_further(self.keep_drafting, len(tokens), n_max):
                    break
                h = self.head.step([token], h[None], n + len(tokens) - 1, self.cache)[-1]
                logits = self.head.target_logits(h)
        finally:
            if constraint is not None:
                constraint.rewind()
        if len(tokens) < self.n_min:
            return Draft()
        probs = torch.stack(rows) if tokens and self.sampler is not None else None
        return Draft(tokens, probs, confidences=confidences)

    def _pick(self, logits: torch.Tensor, context: list[int]) -> tuple[int, torch.Tensor | None]:
        if self.sampler is None:
            return int(torch.argmax(logits)), None
        probs = distribution(logits, self.sampler.params, context)  # [V], zero outside the draft vocab
        return self.sampler.draw(probs), probs

    def _draft_tree(
        self, seed: torch.Tensor, logits: torch.Tensor, context: list[int], depth_max: int
    ) -> Draft:
        """The EAGLE-2 tree after the seed pair (state `seed`, its logits [V]), at most depth_max deep."""
        budget, topk = self.config.tree_tokens, self.config.tree_topk
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []  # log of the path's score
        confidences: list[float] = []
        rows: list[torch.Tensor] = []
        states = {-1: seed}  # expanded node -> pre-norm state of its pair (-1: the seed pair)
        slots = {-1: -1}  # expanded node -> its index in the HeadTree (-1: none, the true pairs)
        expanded, expanded_logits = [-1], logits[None]
        tree = HeadTree(self.cache)
        try:
            for depth in range(1, depth_max + 1):
                level = len(tokens)
                for parent, row in zip(expanded, expanded_logits, strict=True):
                    path = [tokens[node] for node in path_to(parents, parent)]
                    if self.constraint is not None and (row := self.constraint.mask_at(path, row)) is None:
                        continue  # the grammar is complete after this node
                    if not bool(torch.isfinite(row).any()):
                        continue  # every token the grammar allows lies outside the head's vocabulary
                    history = context  # what penalties see: the path too when sampling
                    if self.sampler is not None:
                        history = [*context, *path]
                    children, child_scores, child_rows = tree_children(row, self.sampler, history, topk)
                    child_confidences = [math.exp(score) for score in child_scores]
                    base = scores[parent] if parent >= 0 else 0.0
                    if self.keep_drafting is not None:
                        child_scores = ruled_scores(
                            self.keep_drafting, base, depth, child_confidences, len(tokens)
                        )
                        children, child_rows = children[: len(child_scores)], child_rows[: len(child_scores)]
                        base = 0.0  # ruled scores are whole paths' already
                    tokens += children
                    parents += [parent] * len(children)
                    depths += [depth] * len(children)
                    scores += [base + score for score in child_scores]
                    confidences += child_confidences[: len(children)]
                    rows += child_rows
                if depth == depth_max:
                    break
                best = sorted(range(level, len(tokens)), key=lambda i: (-scores[i], i))[:topk]
                # descendants of a node that `budget` nodes score at least as high as would not be kept
                floor = sorted(scores, reverse=True)[budget - 1] if len(scores) >= budget else -math.inf
                expanded = [i for i in best if scores[i] > floor]
                if not expanded:
                    break
                g = torch.stack([states[parents[i]] for i in expanded])
                hs = self.head.tree_step(
                    [tokens[i] for i in expanded], g, [slots[parents[i]] for i in expanded], tree
                )
                for i, h in zip(expanded, hs, strict=True):
                    states[i], slots[i] = h, len(slots) - 1
                expanded_logits = self.head.target_logits(hs)  # [T, V]
        finally:
            tree.drop()
            if self.constraint is not None:
                self.constraint.rewind()
        return best_first(tokens, parents, depths, scores, confidences, rows, budget, self.n_min)


def best_first(
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    scores: list[float],
    confidences: list[float],
    rows: list[torch.Tensor],
    budget: int,
    n_min: int,
) -> Draft:
    """The `budget` best-scored nodes of a drafted tree (scores: logs), best first, a parent
    before its children on ties, so that every prefix is the best tree of its size; no draft
    where the tree is shallower than n_min. rows: the nodes' sampling rows, or none."""
    kept = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:budget]
    if not kept or max(depths[i] for i in kept) < n_min:
        return Draft()
    index = {old: new for new, old in enumerate(kept)}
    return Draft(
        [tokens[i] for i in kept],
        torch.stack([rows[i] for i in kept]) if rows else None,
        parents=[index.get(parents[i], -1) for i in kept],
        confidences=[confidences[i] for i in kept],
    )


def ruled_scores(
    keep_drafting: KeepDrafting, parent_score: float, depth: int, confidences: list[float], nodes: int
) -> list[float]:
    """The logs of the chances the policy's rule gives a node's children (best rank first),
    for as many as it finds worth their cost; parent_score is the log of the parent's.

    Each is capped at the one before: the rule's estimate need not fall with the rank's
    probability, and a later draw outscoring an earlier one would be tried first, or kept
    without it, against a row (the earlier draws removed) it was not drawn from."""
    scores: list[float] = []
    for rank, confidence in enumerate(confidences):
        reach = keep_drafting.node(math.exp(parent_score), depth, confidence, nodes + rank)
        if reach is None:
            break
        scores.append(min(math.log(reach), scores[-1]) if scores else math.log(reach))
    return scores


def tree_children(
    logits: torch.Tensor, sampler: Sampler | None, context: list[int], k: int
) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """Up to k children of a node with logits [V] after `context`: their tokens, the logs of
    their score factors and (rejection, with `sampler`) the distributions they were drawn from.
    The j-th child's factor is the drafter's j-th largest probability: its own for the top k,
    and for drawn children a factor that does not depend on which token was drawn. Tokens
    outside the drafter's vocabulary or a grammar's mask (-inf) are never children."""
    log_probs = torch.log_softmax(logits.to(torch.float64), dim=-1)
    if sampler is None:
        count = min(k, int(torch.isfinite(log_probs).sum()))
        top = torch.topk(log_probs, count)
        return top.indices.tolist(), top.values.tolist(), []
    remaining = distribution(logits, sampler.params, context)
    count = min(k, int(torch.count_nonzero(remaining)))
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(count):  # without replacement: each draw from what the earlier ones left
        rows.append(remaining / remaining.sum())
        tokens.append(sampler.draw(rows[-1]))
        remaining[tokens[-1]] = 0.0
    return tokens, torch.topk(log_probs, count).values.tolist(), rows
