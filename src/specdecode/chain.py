"""The strategy chain: the first strategy with a usable draft wins.

Strategies are tried in priority order (see `specdecode.strategies.PRIORITY`). A draft
shorter than its strategy's n_min is dropped and the next strategy is tried (llama.cpp's
classic rule). The chain truncates the winner to the step's budget, remembers who drafted,
routes `accept` to that strategy and keeps every counter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from specdecode.stats import StrategyStats
from specdecode.strategies import Draft, Strategy


class Chain:
    def __init__(self, strategies: Sequence[Strategy]) -> None:
        self.strategies = list(strategies)
        self.stats = [StrategyStats(s.name) for s in self.strategies]
        self._last: int | None = None  # index of the strategy whose draft is being verified

    def __bool__(self) -> bool:
        return bool(self.strategies)

    def begin(self, prompt: Sequence[int]) -> None:
        for strategy, stats in zip(self.strategies, self.stats, strict=True):
            start = time.perf_counter()
            strategy.begin(prompt)
            stats.t_begin += time.perf_counter() - start
            stats.n_call_begin += 1

    def end(self) -> None:
        """The generation is over: let strategies persist what should outlive it."""
        for strategy in self.strategies:
            strategy.end()

    def draft(self, history: Sequence[int], last: int, n_max: int, n_nodes: int | None = None) -> Draft:
        """The first non-empty draft at least n_min deep, cut to n_max tokens deep and (trees)
        n_nodes nodes; empty if none."""
        self._last = None
        for index, (strategy, stats) in enumerate(zip(self.strategies, self.stats, strict=True)):
            start = time.perf_counter()
            draft = strategy.draft(history, last, n_max)
            stats.t_draft += time.perf_counter() - start
            stats.n_call_draft += 1
            if draft.tokens and draft.depth >= strategy.n_min:
                draft = replace(draft.truncated(n_max, n_nodes), strategy=strategy.name)
                stats.n_gen_drafts += 1
                stats.n_gen_tokens += len(draft.tokens)
                self._last = index
                return draft
        return Draft()

    def accept(self, draft: Draft, n_accepted: int) -> None:
        """Report the verification of the last draft: n_accepted tokens kept, down one path
        (no-op without a draft)."""
        if self._last is None:
            return
        strategy, stats = self.strategies[self._last], self.stats[self._last]
        self._last = None
        stats.counts.record(len(draft.tokens), draft.depth, n_accepted)
        if n_accepted == 0:
            return  # classic API: accept(0) reaches no strategy
        start = time.perf_counter()
        strategy.accept(n_accepted)
        stats.t_accept += time.perf_counter() - start
        stats.n_call_accept += 1
