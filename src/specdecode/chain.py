"""The strategy chain: the first strategy with a usable draft wins.

Strategies are tried in priority order (see `specdecode.strategies.PRIORITY`). A draft
shorter than its strategy's n_min is dropped and the next strategy is tried (llama.cpp's
classic rule). The chain truncates the winner to the step's budget, remembers who drafted,
routes `accept` to that strategy and keeps every counter.

A strategy that fails (raises in begin, draft or accept) is not allowed to end the generation:
its failure is "no draft", and it is counted (`StrategyStats.n_failed`) and warned about once.
That is safe because a strategy owns neither the target's cache nor the sampler: whatever it
proposes is verified, and the step cuts the target back to `history` after drafting, so the
output stays plain generation's. What is not known after an exception is the strategy's own
state, so it is not called again in that generation (not even `end`, which would persist that
state, e.g. ngram-cache's dynamic file). Errors that are not the strategy's propagate: a
SpecdecodeError (a refusal of the user's input or settings), and running out of memory (the
target's pass would be next).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch

from specdecode.errors import SpecdecodeError
from specdecode.stats import StrategyStats
from specdecode.strategies import Draft, Strategy

# Raised by a strategy, these end the generation as they would without speculation.
PROPAGATED = (SpecdecodeError, MemoryError, torch.OutOfMemoryError)


class Chain:
    def __init__(self, strategies: Sequence[Strategy]) -> None:
        self.strategies = list(strategies)
        self.stats = [StrategyStats(s.name) for s in self.strategies]
        self._last: int | None = None  # index of the strategy whose draft is being verified
        self._failed: set[int] = set()  # strategies that raised: not called again

    def __bool__(self) -> bool:
        return bool(self.strategies)

    def begin(self, prompt: Sequence[int]) -> None:
        for index, (strategy, stats) in enumerate(zip(self.strategies, self.stats, strict=True)):
            start = time.perf_counter()
            try:
                strategy.begin(prompt)
            except PROPAGATED:
                raise
            except Exception as exc:
                self._fail(index, "begin", exc)
            stats.t_begin += time.perf_counter() - start
            stats.n_call_begin += 1

    def end(self) -> None:
        """The generation is over: let strategies persist what should outlive it."""
        for index, strategy in enumerate(self.strategies):
            if index not in self._failed:
                strategy.end()

    def draft(self, history: Sequence[int], last: int, n_max: int, n_nodes: int | None = None) -> Draft:
        """The first non-empty draft at least n_min deep, cut to n_max tokens deep and (trees)
        n_nodes nodes; empty if none."""
        self._last = None
        for index, (strategy, stats) in enumerate(zip(self.strategies, self.stats, strict=True)):
            if index in self._failed:
                continue
            start = time.perf_counter()
            try:
                draft = strategy.draft(history, last, n_max)
            except PROPAGATED:
                raise
            except Exception as exc:
                self._fail(index, "draft", exc)
                draft = Draft()
            stats.t_draft += time.perf_counter() - start
            stats.n_call_draft += 1
            if draft.tokens and draft.depth >= strategy.n_min:
                draft = replace(draft.truncated(n_max, n_nodes).simplified(), strategy=strategy.name)
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
        index, self._last = self._last, None
        strategy, stats = self.strategies[index], self.stats[index]
        stats.counts.record(len(draft.tokens), draft.depth, n_accepted)
        if n_accepted == 0:
            return  # classic API: accept(0) reaches no strategy
        start = time.perf_counter()
        try:
            strategy.accept(n_accepted)
        except PROPAGATED:
            raise
        except Exception as exc:
            self._fail(index, "accept", exc)
        stats.t_accept += time.perf_counter() - start
        stats.n_call_accept += 1

    def _fail(self, index: int, call: str, exc: Exception) -> None:
        """Count a strategy's failure, warn about it, and call it no more in this generation."""
        self._failed.add(index)
        self.stats[index].n_failed += 1
        warnings.warn(
            f"strategy {self.strategies[index].name} failed in {call} ({type(exc).__name__}: {exc}); "
            "it drafts nothing more in this generation, whose output is unaffected",
            RuntimeWarning,
            stacklevel=3,
        )
