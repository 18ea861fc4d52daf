"""DFlash strategy: a block-diffusion drafter over the target's hidden states proposes a whole
block in one forward (arXiv 2602.06036; z-lab's `DFlashDraftModel`).

The drafter's context rows are made from the target's features of positions 0..n-1 (n =
len(history), the positions in the target's cache); the block [last, mask, ..., mask] sits at
positions n..n+B-1 and its rows 1..B-1 give logits for the B - 1 positions after `last`, all
from one pass (`DFlashHead.block`). Context rows are kept while the tokens they were made from
still match (the longest common prefix, as the EAGLE-3 head's pairs are), so after a
verification only the newly verified positions are added. The block always has the
checkpoint's B rows, the shape it was trained on: a shorter draft costs the same pass.

Chains follow the draft-model policy (argmax, or sampling from the drafter's distribution for
rejection verification; p_min on the top-10 softmax, or a policy's `keep_drafting`; at most
min(n_max, B - 1) tokens; n_min). Position i's logits do not depend on the tokens picked before
it (the block was computed without them): a grammar masks each position after the picks
before it, and each pick is drawn from its own position's distribution, so rejection
verification stays exact.

Trees (`tree_tokens` > 0): EAGLE-3's dynamic tree, built without further passes: every node at
depth d - 1 takes its children from position d's logits. Nodes are scored by the product of
their path's probabilities (or a policy's rule), the `tree_topk` best of a depth are expanded,
and the `tree_tokens` best nodes are kept, best first (`eagle3.best_first`). For rejection
verification children are drawn without replacement and scored by rank, as EAGLE-3's are
(`eagle3.tree_children`), so whether a node is kept never depends on which token was drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.backends import Backend, common_prefix, hidden_state_source
from specdecode.drafts import Draft, path_to
from specdecode.errors import SpecdecodeError
from specdecode.sampling import NO_TOKEN, Sampler, distribution
from specdecode.strategies.base import KeepDrafting
from specdecode.strategies.dflash_head import ContextCache, DFlashHead
from specdecode.strategies.draft_model import DraftModelConfig, continue_draft, look_further, top1_confidence
from specdecode.strategies.eagle3 import best_first, ruled_scores, tree_children

if TYPE_CHECKING:
    from specdecode.constraints import Constraint


class DFlashStrategy:
    name: ClassVar[str] = "dflash"
    one_pass: ClassVar[bool] = True  # a draft costs one drafter pass whatever its length (`costs`)

    def __init__(
        self,
        head: DFlashHead,
        target: Backend,
        config: DraftModelConfig,
        sampler: Sampler | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """sampler: given for rejection verification at temperature > 0 (draft by sampling).
        constraint: the generation's, whose masks a draft takes."""
        self.head = head
        self.constraint = constraint
        self.target = hidden_state_source(target, "--spec-type dflash")
        if head.config.vocab_size != target.vocab.size:
            raise SpecdecodeError(
                f"the DFlash drafter was made for a vocabulary of {head.config.vocab_size} ids, "
                f"the target has {target.vocab.size}"
            )
        self.target.capture_hidden(head.config.target_layer_ids)
        self.config = config
        self.n_min = config.n_min
        self.longest = head.config.drafted  # a block's drafted positions: no draft is longer
        self.sampler = sampler if sampler is not None and not sampler.params.greedy else None
        self.cache = ContextCache(head.config.num_hidden_layers)
        self._context: list[int] = []  # tokens the cached context rows were made from
        self.keep_drafting: KeepDrafting | None = None  # set by a policy: replaces p_min

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to do: the next draft reuses whatever prefix of the context still matches."""

    def accept(self, n_accepted: int) -> None:
        """Nothing to do: context rows are matched by their tokens at the next draft."""

    def end(self) -> None:
        """The context stays valid for a next generation sharing a prefix."""

    @torch.inference_mode()
    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        n = len(history)
        n_max = min(n_max, self.config.n_max, self.head.config.drafted)
        if n < 1 or n_max < 1:
            return Draft()
        keep = min(common_prefix(self._context, history), self.cache.n)
        self.cache.truncate(keep)
        self.head.extend_context(self.target.hidden_states(keep, n), self.cache)
        self._context = list(history)
        block = self.head.block(last, self.cache)  # [B - 1, V]: position n + 1 + i in row i
        context = [*history, last]
        if self.config.tree_tokens > 0:
            return self._draft_tree(block, context, n_max)
        return self._draft_chain(block, context, n_max)

    def _draft_chain(self, block: torch.Tensor, context: list[int], n_max: int) -> Draft:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidences: list[float] = []
        constraint = self.constraint
        try:
            while len(tokens) < n_max:
                logits = block[len(tokens)]
                if constraint is not None and (logits := constraint.draft_logits(logits)) is None:
                    break  # the grammar is complete
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
        probs = distribution(logits, self.sampler.params, context)  # [V]
        return self.sampler.draw(probs), probs

    def _draft_tree(self, block: torch.Tensor, context: list[int], depth_max: int) -> Draft:
        """The dynamic tree over the block's positions, at most depth_max deep: a node at depth
        d takes its children from block row d (the path does not change the logits)."""
        budget, topk = self.config.tree_tokens, self.config.tree_topk
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []  # log of the path's score
        confidences: list[float] = []
        rows: list[torch.Tensor] = []
        expanded = [-1]  # the nodes whose children the next depth makes (-1: the root, `last`)
        try:
            for depth in range(1, depth_max + 1):
                level = len(tokens)
                for parent in expanded:
                    row = block[depth - 1]
                    path = [tokens[node] for node in path_to(parents, parent)]
                    if self.constraint is not None and (row := self.constraint.mask_at(path, row)) is None:
                        continue  # the grammar is complete after this node
                    if not bool(torch.isfinite(row).any()):
                        continue
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
        finally:
            if self.constraint is not None:
                self.constraint.rewind()
        return best_first(tokens, parents, depths, scores, confidences, rows, budget, self.n_min)
