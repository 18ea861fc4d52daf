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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from specdecode.backends import Backend, common_prefix, hidden_state_source
from specdecode.eagle3.head import Eagle3Head, HeadCache
from specdecode.sampling import Sampler, distribution
from specdecode.strategies.base import Draft
from specdecode.strategies.draft_model import DraftModelConfig, top1_confidence


class Eagle3Strategy:
    name: ClassVar[str] = "eagle3"

    def __init__(
        self, head: Eagle3Head, target: Backend, config: DraftModelConfig, sampler: Sampler | None = None
    ) -> None:
        """sampler: given for rejection verification at temperature > 0 (draft by sampling)."""
        self.head = head
        self.target = hidden_state_source(target, "--spec-type eagle3")
        self.target.capture_hidden(head.config.target_layer_ids)
        self.config = config
        self.n_min = config.n_min
        self.sampler = sampler if sampler is not None and not sampler.params.greedy else None
        self.cache = HeadCache()
        self._context: list[int] = []  # tokens the cached true pairs were made from

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
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < n_max and top1_confidence(logits) >= self.config.p_min:
            token, row = self._pick(logits, [*context, *tokens])
            tokens.append(token)
            rows.append(row)
            if len(tokens) < n_max:
                h = self.head.step([token], h[None], n + len(tokens) - 1, self.cache)[-1]
                logits = self.head.target_logits(h)
        if len(tokens) < self.n_min:
            return Draft()
        return Draft(tokens, torch.stack(rows) if tokens and self.sampler is not None else None)

    def _pick(self, logits: torch.Tensor, context: list[int]) -> tuple[int, torch.Tensor | None]:
        if self.sampler is None:
            return int(torch.argmax(logits)), None
        probs = distribution(logits, self.sampler.params, context)  # [V], zero outside the draft vocab
        return self.sampler.draw(probs), probs
