"""The strategy chain: who drafts, truncation, accept routing and the counters it keeps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import TargetSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.chain import Chain
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation
from specdecode.sampling import Sampler

GREEDY = SamplingParams(temperature=0)
V = 50


class FakeStrategy:
    """A scripted strategy that records every call it gets."""

    def __init__(
        self,
        name: str,
        propose: Callable[[Sequence[int], int, int], list[int]] | list[int] = (),
        n_min: int = 0,
        with_probs: bool = False,
    ) -> None:
        self.name = name
        self.n_min = n_min
        self.propose = propose
        self.with_probs = with_probs
        self.calls: list[tuple] = []

    def begin(self, prompt: Sequence[int]) -> None:
        self.calls.append(("begin", list(prompt)))

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.calls.append(("draft", len(history), last, n_max))
        tokens = list(self.propose(history, last, n_max) if callable(self.propose) else self.propose)
        if self.with_probs and tokens:
            probs = torch.zeros(len(tokens), V, dtype=torch.float64)
            probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            return Draft(tokens, probs)
        return Draft(tokens)

    def accept(self, n_accepted: int) -> None:
        self.calls.append(("accept", n_accepted))

    def end(self) -> None:
        self.calls.append(("end",))

    def named(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


# --------------------------------------------------------------------------- the chain alone


def test_first_nonempty_draft_wins_and_later_strategies_are_not_asked():
    a, b, c = FakeStrategy("a", []), FakeStrategy("b", [7, 8]), FakeStrategy("c", [9])
    chain = Chain([a, b, c])
    draft = chain.draft([1, 2, 3], 4, 16)
    assert draft.tokens == [7, 8]
    assert draft.strategy == "b"
    assert a.named("draft") == [("draft", 3, 4, 16)]
    assert b.named("draft") == [("draft", 3, 4, 16)]
    assert c.calls == []
    assert [s.n_call_draft for s in chain.stats] == [1, 1, 0]
    assert [s.n_gen_drafts for s in chain.stats] == [0, 1, 0]
    assert [s.n_gen_tokens for s in chain.stats] == [0, 2, 0]


def test_draft_shorter_than_n_min_is_dropped_for_the_next_strategy():
    a, b = FakeStrategy("a", [5], n_min=2), FakeStrategy("b", [6, 7, 8], n_min=3)
    chain = Chain([a, b])
    draft = chain.draft([1], 2, 16)
    assert (draft.tokens, draft.strategy) == ([6, 7, 8], "b")
    assert chain.stats[0].n_gen_drafts == 0 and chain.stats[0].n_call_draft == 1
    chain.accept(draft, 1)
    assert a.named("accept") == [] and b.named("accept") == [("accept", 1)]


def test_all_drafts_too_short_gives_an_empty_draft_and_accept_goes_nowhere():
    a, b = FakeStrategy("a", [5], n_min=2), FakeStrategy("b", [])
    chain = Chain([a, b])
    draft = chain.draft([1], 2, 16)
    assert draft.tokens == [] and draft.strategy is None
    chain.accept(draft, 0)
    assert a.named("accept") == b.named("accept") == []
    assert all(s.counts.n_drafts == 0 for s in chain.stats)


@pytest.mark.parametrize("with_probs", [False, True])
def test_winner_is_truncated_to_n_max(with_probs):
    a = FakeStrategy("a", list(range(10, 20)), with_probs=with_probs)
    chain = Chain([a])
    draft = chain.draft([1], 2, 3)
    assert draft.tokens == [10, 11, 12]
    assert chain.stats[0].n_gen_tokens == 3
    if with_probs:
        assert draft.probs.shape == (3, V)
        assert draft.probs.argmax(-1).tolist() == [10, 11, 12]
    else:
        assert draft.probs is None


def test_accept_routed_to_the_drafter_and_never_with_zero():
    a, b = FakeStrategy("a", []), FakeStrategy("b", [3, 4, 5])
    chain = Chain([a, b])
    chain.begin([1, 2])
    assert a.named("begin") == b.named("begin") == [("begin", [1, 2])]
    assert [s.n_call_begin for s in chain.stats] == [1, 1]

    chain.accept(chain.draft([1, 2], 9, 8), 2)
    chain.accept(chain.draft([1, 2, 9, 3, 4], 7, 8), 0)
    assert b.named("accept") == [("accept", 2)]
    assert a.named("accept") == []
    counts = chain.stats[1].counts
    assert (counts.n_drafts, counts.n_drafts_accepted, counts.n_drafted, counts.n_accepted) == (2, 1, 6, 2)
    assert chain.stats[1].n_call_accept == 1
    assert chain.stats[0].counts.n_drafts == 0


def test_empty_chain():
    chain = Chain([])
    assert not chain
    draft = chain.draft([1], 2, 4)
    assert draft.tokens == []
    chain.accept(draft, 0)
    assert chain.stats == []


# --------------------------------------------------------------------------- inside a generation


def _plain_tokens(zoo, spec, prompt, n):
    config = GenerationConfig(n_predict=n, ignore_eos=True)
    return Pipeline(zoo.backend(zoo.target(spec))).generate(prompt, GREEDY, config).tokens


def _oracle(prompt: list[int], reference: list[int], wrong_at: int | None, length: int):
    """Proposes the reference continuation, with the token at offset `wrong_at` replaced."""

    def propose(history, last, n_max):
        done = len(history) + 1 - len(prompt)  # tokens generated so far
        assert reference[done - 1] == last
        tokens = reference[done : done + min(n_max, length)]
        if wrong_at is not None and wrong_at < len(tokens):
            tokens[wrong_at] = 3 if tokens[wrong_at] != 3 else 4
        return tokens

    return propose


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    wrong_at=st.one_of(st.none(), st.integers(0, 5)),
    length=st.integers(1, 8),
    n_predict=st.integers(1, 30),
)
def test_oracle_drafts_are_accepted_up_to_the_first_wrong_token(zoo, wrong_at, length, n_predict):
    spec = TargetSpec(seed=0, hidden=16, layers=1)
    prompt = list(range(30, 45))
    reference = _plain_tokens(zoo, spec, prompt, 40)
    oracle = FakeStrategy("oracle", _oracle(prompt, reference, wrong_at, length))
    target = zoo.backend(zoo.target(spec))
    run = Generation(
        target,
        Chain([oracle]),
        Sampler(GREEDY),
        GenerationConfig(n_predict=n_predict, ignore_eos=True),
        prompt,
    )
    chunks = list(run)
    assert run.tokens == reference[:n_predict]
    for chunk in chunks[1:]:
        expected = chunk.n_drafted if wrong_at is None or wrong_at >= chunk.n_drafted else wrong_at
        assert chunk.n_accepted == expected
        assert len(chunk.tokens) == min(expected + 1, n_predict)  # kept drafts + the target's token
    accepted = [c.n_accepted for c in chunks[1:] if c.n_accepted > 0]
    assert oracle.named("accept") == [("accept", n) for n in accepted]
    assert target.tokens == prompt + run.tokens[:-1]


class _Scripted:
    """Draws proposals from a fixed list, cycling; an empty proposal defers to the next strategy."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = script
        self.i = 0

    def __call__(self, history, last, n_max):
        proposal = self.script[self.i % len(self.script)]
        self.i += 1
        return list(proposal)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script_a=st.lists(st.lists(st.integers(3, 40), max_size=4), min_size=1, max_size=4),
    script_b=st.lists(st.lists(st.integers(3, 40), max_size=6), min_size=1, max_size=4),
    n_min_a=st.integers(0, 2),
    n_predict=st.integers(1, 30),
    use_oracle=st.booleans(),
)
def test_strategy_counters_add_up_to_the_totals(zoo, script_a, script_b, n_min_a, n_predict, use_oracle):
    spec = TargetSpec(seed=1, hidden=16, layers=1)
    prompt = list(range(20, 30))
    reference = _plain_tokens(zoo, spec, prompt, 40)
    a = FakeStrategy("a", _Scripted(script_a), n_min=n_min_a)
    b = FakeStrategy("b", _oracle(prompt, reference, 2, 5) if use_oracle else _Scripted(script_b))
    target = zoo.backend(zoo.target(spec))
    run = Generation(
        target, Chain([a, b]), Sampler(GREEDY), GenerationConfig(n_predict=n_predict, ignore_eos=True), prompt
    )
    chunks = list(run)
    assert run.tokens == reference[:n_predict]
    check_counters_add_up(run.stats)
    for strategy, stats in zip((a, b), run.stats.strategies, strict=True):
        assert len(strategy.named("begin")) == stats.n_call_begin == 1
        assert len(strategy.named("draft")) == stats.n_call_draft
        assert len(strategy.named("accept")) == stats.n_call_accept
        mine = [c for c in chunks[1:] if c.strategy == strategy.name]
        assert stats.counts.n_drafts == stats.n_gen_drafts == len(mine)
        assert stats.counts.n_drafted == stats.n_gen_tokens == sum(c.n_drafted for c in mine)
        assert [("accept", c.n_accepted) for c in mine if c.n_accepted] == strategy.named("accept")


def check_counters_add_up(stats) -> None:
    totals = stats.totals
    for attr in ("n_drafts", "n_drafts_accepted", "n_drafted", "n_accepted"):
        assert getattr(totals, attr) == sum(getattr(s.counts, attr) for s in stats.strategies), attr
    assert totals.n_drafts == sum(s.n_gen_drafts for s in stats.strategies)
    assert totals.n_drafted == sum(s.n_gen_tokens for s in stats.strategies)


def test_a_step_without_drafting_records_no_draft(zoo):
    """Minimal case: the strategy drafts at step 1; step 2 has a budget of 0 (one token left),
    so nothing is drafted and nothing may be recorded for the strategy."""
    spec = TargetSpec(seed=1, hidden=16, layers=1)
    always = FakeStrategy("always", [3])
    run = Generation(
        zoo.backend(zoo.target(spec)),
        Chain([always]),
        Sampler(GREEDY),
        GenerationConfig(n_predict=3, ignore_eos=True),
        list(range(20, 30)),
    )
    list(run)
    assert len(always.named("draft")) == 1
    assert run.stats.totals.n_drafts == 1
    assert run.stats.strategies[0].counts.n_drafts == 1


@pytest.mark.parametrize("n_predict", [5, 6, 7, 8, 17, 33])
def test_draft_model_counters_add_up_to_the_totals(zoo, n_predict):
    """A real draft-model generation; the n_predict values end with a one-token step (budget 0)."""
    spec = TargetSpec(seed=3, hidden=32, layers=2)
    target, draft = zoo.pair(spec, 0.0)
    pipe = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
    result = pipe.generate(list(range(3, 20)), GREEDY, GenerationConfig(n_predict=n_predict, ignore_eos=True))
    assert result.stats.totals.n_accepted > 0
    check_counters_add_up(result.stats)


def test_end_reaches_every_strategy_once_when_generation_stops(zoo):
    spec = TargetSpec(seed=0, hidden=16, layers=1, eos_tie=False)
    target = zoo.backend(zoo.target(spec))
    first, second = FakeStrategy("first", propose=[]), FakeStrategy("second", propose=[5, 6])
    generation = Generation(
        target,
        Chain([first, second]),
        Sampler(SamplingParams(temperature=0)),
        GenerationConfig(n_predict=6, ignore_eos=True),
        [3, 4],
    )
    list(generation)
    assert first.named("end") == [("end",)] and second.named("end") == [("end",)]
    assert first.calls[-1] == ("end",) and second.calls[-1] == ("end",)


def test_end_runs_when_the_consumer_stops_early(zoo):
    spec = TargetSpec(seed=0, hidden=16, layers=1, eos_tie=False)
    target = zoo.backend(zoo.target(spec))
    strategy = FakeStrategy("only", propose=[5, 6])
    generation = Generation(
        target,
        Chain([strategy]),
        Sampler(SamplingParams(temperature=0)),
        GenerationConfig(n_predict=30, ignore_eos=True),
        [3, 4],
    )
    chunks = iter(generation)
    next(chunks)
    next(chunks)
    chunks.close()  # what a server does when its client disconnects
    assert strategy.named("end") == [("end",)]
    assert generation.stats.stop_reason == "abandoned"
    assert generation.stats.t_generation > 0


# --------------------------------------------------------------------------- failing strategies


class FailingStrategy(FakeStrategy):
    """A FakeStrategy whose `call` raises `error` on its `after`-th call of that kind."""

    def __init__(self, name: str, call: str, error: BaseException, after: int = 1, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.call, self.error, self.after = call, error, after

    def _maybe_fail(self, call: str) -> None:
        if call == self.call and len(self.named(call)) == self.after:
            raise self.error

    def begin(self, prompt: Sequence[int]) -> None:
        super().begin(prompt)
        self._maybe_fail("begin")

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        draft = super().draft(history, last, n_max)
        self._maybe_fail("draft")
        return draft

    def accept(self, n_accepted: int) -> None:
        super().accept(n_accepted)
        self._maybe_fail("accept")


@pytest.mark.parametrize(("call", "after"), [("begin", 1), ("draft", 1), ("draft", 3), ("accept", 2)])
def test_a_failing_strategy_is_no_draft_counted_warned_and_called_no_more(zoo, call, after):
    """Output is plain output; the strategy is not called again, not even to persist (end);
    the rest of the chain drafts on."""
    spec = TargetSpec(seed=0, hidden=16, layers=1)
    prompt = list(range(30, 45))
    reference = _plain_tokens(zoo, spec, prompt, 24)
    error = IndexError("index 900 is out of bounds")
    failing = FailingStrategy("failing", call, error, after, propose=_oracle(prompt, reference, None, 3))
    other = FakeStrategy("other", propose=_oracle(prompt, reference, 1, 4))
    generation = Generation(
        zoo.backend(zoo.target(spec)),
        Chain([failing, other]),
        Sampler(GREEDY),
        GenerationConfig(n_predict=24, ignore_eos=True),
        prompt,
    )
    with pytest.warns(RuntimeWarning, match=f"strategy failing failed in {call} .IndexError: index 900"):
        list(generation)
    assert generation.tokens == reference
    failed, fine = generation.stats.strategies
    assert (failed.n_failed, fine.n_failed) == (1, 0)
    assert len(failing.named(call)) == after
    assert failing.named("end") == [] and other.named("end") == [("end",)]
    assert failing.calls[-1][0] == call  # nothing after the failure
    assert fine.n_gen_drafts > 0
    assert "FAILED 1x" in generation.stats.format()


@pytest.mark.parametrize(
    "error", [SpecdecodeError("a refusal of the user's settings"), MemoryError(), torch.OutOfMemoryError()]
)
@pytest.mark.parametrize("call", ["begin", "draft", "accept"])
def test_refusals_and_exhaustion_are_not_the_strategys_and_propagate(zoo, error, call):
    spec = TargetSpec(seed=0, hidden=16, layers=1)
    prompt = list(range(30, 45))
    reference = _plain_tokens(zoo, spec, prompt, 12)
    strategy = FailingStrategy("failing", call, error, propose=_oracle(prompt, reference, None, 3))
    generation = Generation(
        zoo.backend(zoo.target(spec)),
        Chain([strategy]),
        Sampler(GREEDY),
        GenerationConfig(n_predict=12, ignore_eos=True),
        prompt,
    )
    with pytest.raises(type(error)):
        list(generation)
