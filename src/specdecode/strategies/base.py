"""The one interface every drafting strategy implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of `history + [last]`, in target ids.

    probs: [K, V] the distribution each token was sampled from (rejection verification);
    None for a deterministic proposer, which verification treats as a point mass.
    An empty draft means "no opinion": the step falls back to one plain target token.
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    strategy: str | None = None  # set by the chain: who drafted it

    def truncated(self, n: int) -> Draft:
        if len(self.tokens) <= n:
            return self
        return replace(self, tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n])


class Strategy(Protocol):
    """A proposer of draft tokens (llama.cpp's `common_speculative_impl`).

    - begin(prompt): a new generation starts; `prompt` is in the target's cache.
    - draft(history, last, n_max): up to n_max tokens continuing history + [last], where
      history is what the target's cache holds and `last` the newest token, not yet in it.
    - accept(n_accepted): how many of this strategy's last draft the target kept (> 0;
      the classic API never reports 0).
    - end(): the generation is over; persist whatever should outlive it.
    The chain keeps the counters; strategies keep only the state their algorithm needs.
    """

    name: str  # the --spec-type name
    n_min: int  # drafts shorter than this are dropped and the next strategy is tried

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft: ...

    def accept(self, n_accepted: int) -> None: ...

    def end(self) -> None: ...
