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
state, e.g. ngram-cache's dynamic file).

With an `AdaptivePolicy` (`specdecode.policy`) the chain asks every model-free strategy, keeps
the draft (cut to the length) with the best expected tokens per second, and runs a drafting
model only when its measured rate beats that, shaping its draft (a chain's length, a tree's
nodes) by the policy's rule instead of p_min and p_split; no draft at all (a plain step) is a
candidate too. `accept` then reports the step's outcome (the accepted path, for trees) and
pass time to the policy. Errors that are not the strategy's propagate: a
SpecdecodeError (a refusal of the user's input or settings), and running out of memory (the
target's pass would be next).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from specdecode.constraints import Constraint
from specdecode.costs import ALONE, PassLoad, PassShare, time_draft
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.policy import AdaptivePolicy, Stopper
from specdecode.stats import StrategyStats
from specdecode.strategies import Strategy
from specdecode.strategies.base import Steerable

# Raised by a strategy, these end the generation as they would without speculation.
PROPAGATED = (SpecdecodeError, MemoryError, torch.OutOfMemoryError)


class Chain:
    def __init__(
        self,
        strategies: Sequence[Strategy],
        policy: AdaptivePolicy | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """policy: None for the classic chain. constraint: the generation's grammar, if any;
        every draft is cut at its first token the grammar forbids, before the n_min rule."""
        self.strategies = list(strategies)
        self.constraint = constraint
        self.stats = [StrategyStats(s.name) for s in self.strategies]
        self.policy = policy
        self._steerable = {i for i, s in enumerate(self.strategies) if isinstance(s, Steerable)}
        if policy is not None:  # drafters whose whole draft is one pass are priced so
            policy.models.costs.one_pass.update(
                s.name for s in self.strategies if getattr(s, "one_pass", False)
            )
        self._last: int | None = None  # index of the strategy whose draft is being verified
        self._failed: set[int] = set()  # strategies that raised: not called again
        self._step: _Step | None = None  # the adaptive policy's record of this step's drafting
        self.n_max = 0  # the longest draft a step has asked for (`specdecode.verdicts` prices it)

    def __bool__(self) -> bool:
        return bool(self.strategies)

    def begin(self, prompt: Sequence[int]) -> None:
        for index, (strategy, stats) in enumerate(zip(self.strategies, self.stats, strict=True)):
            start = time.perf_counter()
            self._guarded(index, "begin", strategy.begin, prompt)
            stats.t_begin += time.perf_counter() - start
            stats.n_call_begin += 1

    def end(self) -> None:
        """The generation is over: let strategies persist what should outlive it."""
        for index, strategy in enumerate(self.strategies):
            if index not in self._failed:
                strategy.end()

    def draft(
        self,
        history: Sequence[int],
        last: int,
        n_max: int,
        n_nodes: int | None = None,
        load: PassLoad = ALONE,
        remaining: int | None = None,
    ) -> Draft:
        """The first non-empty draft at least n_min deep, cut to n_max tokens deep and (trees)
        n_nodes nodes; empty if none. With a policy: the draft it chooses for a pass that also
        holds `load` (a batch's other sequences), or none, the generation having `remaining`
        tokens left to emit (what a drafting model's catch-up is spread over)."""
        self._last = None
        self.n_max = max(self.n_max, n_max)
        if self.policy is not None:
            self.policy.load = load
            return self._draft_adaptive(self.policy, history, last, n_max, n_nodes, remaining)
        for index, strategy in enumerate(self.strategies):
            if index in self._failed:
                continue
            draft = self._ask(index, history, last, n_max)
            if draft.tokens and draft.depth >= strategy.n_min:
                return self._chosen(index, draft.truncated(n_max, n_nodes).simplified())
        return Draft()

    def _ask(self, index: int, history: Sequence[int], last: int, n_max: int) -> Draft:
        """Strategy `index`'s draft, timed and counted; empty if it failed."""
        start = time.perf_counter()
        strategy = self.strategies[index]
        draft = self._guarded(index, "draft", strategy.draft, history, last, n_max, failed=Draft())
        if self.constraint is not None:
            draft = self.constraint.prune(draft)
        self.stats[index].t_draft += time.perf_counter() - start
        self.stats[index].n_call_draft += 1
        self.stats[index].n_offered += bool(draft.tokens)
        return draft

    def _chosen(self, index: int, draft: Draft) -> Draft:
        """The draft to verify, from strategy `index`."""
        stats = self.stats[index]
        stats.n_gen_drafts += 1
        stats.n_gen_tokens += len(draft.tokens)
        self._last = index
        return replace(draft, strategy=self.strategies[index].name)

    def _draft_adaptive(
        self,
        policy: AdaptivePolicy,
        history: Sequence[int],
        last: int,
        n_max: int,
        n_nodes: int | None,
        remaining: int | None,
    ) -> Draft:
        """Every model-free draft cut to its best length, against a plain step, against the
        drafting model with the best measured rate (run only if that rate is the best; its
        draft, a chain or a tree, is shaped by the policy's rule as it drafts).

        A drafting model that wins a step with a long backlog to read first (the prompt, a long
        stretch it sat out) reads it in chunks, one a step while the step's other candidates
        draft (`AdaptivePolicy.catch_up_chunk`), the last chunk by its drafting call; a model
        not timed yet is timed where it could first win (`costs.time_draft`). Neither counts in
        the step's seconds: the catch-up is priced spread over the steps left, the timing is
        once a machine. Chunks rather than a background thread: reading the backlog costs the
        same CPU-seconds on any thread, and beside a thread the target's passes slow down
        (Qwen2.5-Coder 1.5B with its 0.5B sibling reading 384 tokens, llama.cpp, one thread
        each, two cores: 5.9-6.4 CPU-seconds either way, the target's one-row pass 25-75%
        slower beside the thread), so tokens per CPU-second gain nothing from a thread, the pass timings the
        policy learns from are disturbed, and chunks keep each step's stall to a quarter of the
        catch-up."""
        start = time.perf_counter()
        aside = 0.0  # seconds of catch-up and timing: not the step's
        step = self._step = _Step()
        policy.at(len(history) + 1, remaining)
        free: dict[int, Draft] = {}  # model-free strategy -> its draft
        models: list[int] = []
        for index, strategy in enumerate(self.strategies):
            if index in self._failed:
                continue
            if index in self._steerable:
                models.append(index)
                continue
            # The policy prices chains: a model-free tree is weighed as its preferred path.
            draft = self._ask(index, history, last, n_max).truncated(n_max).first_branch()
            if draft.tokens:
                free[index] = draft
                step.drafts[strategy.name] = draft.tokens
        t_sunk = time.perf_counter() - start
        names = {index: self.strategies[index].name for index in [*free, *models]}
        expected = {names[i]: policy.expected(names[i], len(draft.tokens)) for i, draft in free.items()}
        rate = policy.step_rate(expected, [names[i] for i in models], t_sunk)
        best_gain, best_index, best_draft = policy.plain_gain(t_sunk, rate), -1, Draft()
        for index, draft in free.items():
            k, gain = policy.best_length(expected[names[index]], t_sunk, rate)
            if k > 0 and gain > best_gain:
                best_gain, best_index, best_draft = gain, index, draft.truncated(k)
        if models:
            aside += self._time_untimed(policy, models, names, t_sunk, rate, n_max, best_gain)
            gains = {i: policy.model_gain(names[i], t_sunk, rate, n_max) for i in models}
            index = max(models, key=gains.__getitem__)
            chunk = policy.catch_up_chunk(names[index]) if gains[index] > best_gain else 0
            if chunk and hasattr(self.strategies[index], "catch_up"):
                aside += self._catch_up(index, policy, history, last, chunk)
            elif gains[index] > best_gain:
                strategy = self.strategies[index]
                step.model = strategy.name
                step.stopper = policy.stopper(strategy.name, rate, best_gain, t_sunk)
                model_start = time.perf_counter()
                strategy.keep_drafting = step.stopper
                try:
                    draft = self._ask(index, history, last, n_max)
                finally:
                    strategy.keep_drafting = None
                step.t_model = time.perf_counter() - model_start
                if draft.tokens:
                    best_index, best_draft = index, draft.truncated(n_max, n_nodes).simplified()
            policy.skipped([names[i] for i in models if names[i] != step.model])
        step.t_draft = time.perf_counter() - start - aside
        if best_index < 0:
            return Draft()
        step.strategy = self.strategies[best_index].name
        return self._chosen(best_index, best_draft)

    def _time_untimed(
        self,
        policy: AdaptivePolicy,
        models: list[int],
        names: dict[int, str],
        t_sunk: float,
        rate: float,
        n_max: int,
        rival: float,
    ) -> float:
        """Time the drafting models not timed yet, where a draft that cost nothing and was all
        kept would beat the step's best other candidate (`rival`): elsewhere none of theirs
        could. The seconds that took."""
        costs, seconds = policy.models.costs, 0.0
        for index in models:
            name = names[index]
            if name not in costs.untimed or policy.free_gain(t_sunk, rate, n_max) <= rival:
                continue
            backend = getattr(self.strategies[index], "backend", None)
            if backend is None:
                costs.untimed.discard(name)
            else:
                seconds += time_draft(costs, name, backend)
        return seconds

    def _catch_up(
        self, index: int, policy: AdaptivePolicy, history: Sequence[int], last: int, chunk: int
    ) -> float:
        """Strategy `index` reads `chunk` tokens of its backlog; the seconds that took."""
        start = time.perf_counter()
        strategy = self.strategies[index]
        self._guarded(index, "catch_up", strategy.catch_up, history, last, chunk)
        policy.caught_up(strategy.name, chunk)
        seconds = time.perf_counter() - start
        self.stats[index].t_draft += seconds
        return seconds

    def accept(
        self,
        draft: Draft,
        n_accepted: int,
        t_pass: float = 0.0,
        emitted: Sequence[int] = (),
        path: Sequence[int] | None = None,
        share: PassShare | None = None,
    ) -> None:
        """Report the verification of the last draft: n_accepted tokens kept, down one path
        (the nodes `path`; None: a chain's first n_accepted), for strategies a no-op without a
        draft, in a target pass of t_pass seconds (shared with a batch: `share`) that emitted
        these tokens."""
        if self.policy is not None:  # a step with no room to draft was a plain step all the same
            kept = list(range(n_accepted)) if path is None else list(path)
            (self._step or _Step()).report(self.policy, draft, kept, t_pass, emitted, share)
            self._step = None
        if self._last is None:
            return
        index, self._last = self._last, None
        strategy, stats = self.strategies[index], self.stats[index]
        stats.counts.record(len(draft.tokens), draft.depth, n_accepted)
        if n_accepted == 0:
            return  # classic API: accept(0) reaches no strategy
        start = time.perf_counter()
        self._guarded(index, "accept", strategy.accept, n_accepted)
        stats.t_accept += time.perf_counter() - start
        stats.n_call_accept += 1

    def _guarded(
        self, index: int, call: str, method: Callable[..., Any], *args: Any, failed: Any = None
    ) -> Any:
        """method(*args) of strategy `index`; if it fails (not with a PROPAGATED error), the
        failure is recorded (`_fail`) and the result is `failed`."""
        try:
            return method(*args)
        except PROPAGATED:
            raise
        except Exception as exc:
            self._fail(index, call, exc)
            return failed

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


class _Step:
    """What the adaptive chain drafted in one step, until `accept` reports its outcome."""

    def __init__(self) -> None:
        self.strategy: str | None = None  # whose draft is verified (None: a plain step)
        self.model: str | None = None  # the drafting model run, if any
        self.stopper: Stopper | None = None  # its stopping rule, which saw its confidences
        self.t_draft = 0.0
        self.t_model = 0.0
        self.drafts: dict[str, list[int]] = {}  # model-free strategy -> its whole draft

    def report(
        self,
        policy: AdaptivePolicy,
        draft: Draft,
        path: list[int],
        t_pass: float,
        emitted: Sequence[int],
        share: PassShare | None,
    ) -> None:
        k = len(draft.tokens)
        confidences: list[float | None] = [None] * k
        if self.stopper is not None and self.strategy == self.model:
            seen = self.stopper.confidences
            if draft.confidences is not None:
                confidences = list(draft.confidences)
            elif seen:  # a translated draft may differ in length: pad with the last
                confidences = [seen[min(i, len(seen) - 1)] for i in range(k)]
        steps = 0
        if self.stopper is not None:  # the model's steps, chain or tree: one per depth it was asked about
            steps = max(1, self.stopper.deepest)  # (depth 1's reads the context)
        policy.observe(
            self.strategy,
            confidences,
            path,
            self.t_draft,
            t_pass,
            self.model,
            steps,
            self.t_model,
            parents=draft.parents,
            share=share,
        )
        policy.watch(self.drafts, emitted)
