"""The one interface every drafting strategy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specdecode.drafts import Draft


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


class KeepDrafting(Protocol):
    """A policy's rule for what a drafting model drafts, in place of p_min (and, in trees, of
    p_split and the node budget's ranking)."""

    def __call__(self, depth: int, confidence: float) -> bool:
        """Chains: draft the token at `depth` (1-based), of this top-1 confidence?"""

    def further(self, depth: int) -> bool:
        """Chains: run the model's next step, which shows the token after the one just drafted
        at `depth`? (No: the draft ends there, its last token never evaluated by the model.)"""

    def node(self, parent_reach: float, depth: int, confidence: float, nodes: int) -> float | None:
        """Trees: the chance that a node at `depth` with this confidence is reached and kept,
        given its parent's (1 for a child of the root), when that is worth its cost in a tree
        of `nodes` nodes so far; None when it is not."""


@runtime_checkable
class Steerable(Protocol):
    """A drafting model whose drafts a policy may steer: while `keep_drafting` is set, it
    replaces the `confidence >= p_min` rule, and in trees decides which nodes are drafted
    (the chain sets it for one draft call)."""

    keep_drafting: KeepDrafting | None
