"""Greedy output with every n-gram strategy, and every combination with the draft model,
equals plain greedy output; the chain prefers the cheaper strategy when it has a draft.

Small n-gram sizes make the strategies fire often on the repetitive text tiny random models
produce, so the verification and rollback paths are exercised, not skipped.
"""

from __future__ import annotations

import itertools

import pytest
from conftest import TargetSpec, cached_tokenizer, eagle3_head, eagle3_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.strategies import AVAILABLE, NgramMapConfig, NgramModConfig, NgramSettings

GREEDY = SamplingParams(temperature=0)
NGRAM_TYPES = [name for name in AVAILABLE if name.startswith("ngram-")]
SMALL = NgramSettings(
    simple=NgramMapConfig(size_n=2, size_m=4),
    map_k=NgramMapConfig(size_n=2, size_m=4),
    map_k4v=NgramMapConfig(size_n=2, size_m=4, min_hits=2),
    mod=NgramModConfig(n_match=2, n_min=1, n_max=8),
)
COMBINATIONS = [
    list(combo)
    for size in range(1, len(NGRAM_TYPES) + 1)
    for combo in itertools.combinations(NGRAM_TYPES, size)
]


@pytest.mark.parametrize("with_draft", [False, True], ids=["alone", "with-draft"])
@pytest.mark.parametrize("types", COMBINATIONS, ids=lambda types: ",".join(types))
def test_every_ngram_combination_is_exact(zoo, exactness_log, types, with_draft):
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    target, draft = zoo.pair(spec, 0.02)
    expected = Pipeline(target).generate(prompt, GREEDY, config)
    names = [*types, "draft"] if with_draft else types
    pipeline = Pipeline(
        target,
        draft if with_draft else None,
        spec_types=names,
        draft_config=DraftModelConfig(n_max=6, p_min=0.0),
        ngram=SMALL,
    )
    result = pipeline.generate(prompt, GREEDY, config)
    assert result.tokens == expected.tokens
    stats = result.stats
    assert [s.name for s in stats.strategies] == [n for n in AVAILABLE if n in names]
    # per-strategy counters add up to the totals
    assert sum(s.counts.n_drafted for s in stats.strategies) == stats.totals.n_drafted
    assert sum(s.counts.n_accepted for s in stats.strategies) == stats.totals.n_accepted
    exactness_log.record("ngram/" + ("with-draft" if with_draft else "alone"), ",".join(types), stats)


@pytest.mark.parametrize("types", [[name] for name in NGRAM_TYPES] + [NGRAM_TYPES], ids=",".join)
def test_ngram_strategies_chained_with_eagle3_are_exact(exactness_log, types):
    """Each n-gram strategy (and all of them) before EAGLE-3, on conftest's EAGLE-3 target."""
    tokenizer, target = cached_tokenizer(), eagle3_target()
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    expected = Pipeline(HFBackend(target, tokenizer)).generate(prompt, GREEDY, config)
    pipeline = Pipeline(
        HFBackend(target, tokenizer),
        eagle3=eagle3_head(),
        spec_types=[*types, "eagle3"],
        draft_config=DraftModelConfig(n_max=6, p_min=0.0),
        ngram=SMALL,
    )
    result = pipeline.generate(prompt, GREEDY, config)
    assert result.tokens == expected.tokens
    assert result.stats.strategies[-1].name == "eagle3" and result.stats.strategies[-1].n_gen_drafts > 0
    exactness_log.record("ngram/with-eagle3", ",".join(types), result.stats)


def test_ngram_strategies_do_draft_on_repetitive_output(zoo):
    """Guards the test above against vacuity: on this target each n-gram strategy drafts."""
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, _ = zoo.pair(spec, 0.02)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    for name in NGRAM_TYPES:
        stats = (
            Pipeline(target, spec_types=[name], ngram=SMALL)
            .generate(prompt, GREEDY, GenerationConfig(n_predict=48, ignore_eos=True))
            .stats
        )
        assert stats.totals.n_drafted > 0, name


def test_cheaper_strategy_wins_and_draft_model_fills_in(zoo):
    """ngram-simple,draft: the n-gram draft wins whenever it exists; the draft model drafts
    only on the other steps."""
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, draft = zoo.pair(spec, 0.02)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    ngram = NgramSettings(simple=NgramMapConfig(size_n=2, size_m=2))  # classic n_min = size_m = 2
    run = Pipeline(
        target,
        draft,
        spec_types=["draft", "ngram-simple"],
        draft_config=DraftModelConfig(p_min=0.0),
        ngram=ngram,
    ).stream(prompt, GREEDY, config)
    chunks = list(run)
    simple_stats, draft_stats = run.stats.strategies
    assert (simple_stats.name, draft_stats.name) == ("ngram-simple", "draft")
    assert simple_stats.n_gen_drafts > 0 and draft_stats.n_gen_drafts > 0
    # the draft model is asked only when ngram-simple had nothing
    assert draft_stats.n_call_draft == simple_stats.n_call_draft - simple_stats.n_gen_drafts
    by_chunk = [c.strategy for c in chunks if c.strategy]
    assert by_chunk.count("ngram-simple") == simple_stats.n_gen_drafts


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2),
    types=st.lists(st.sampled_from(NGRAM_TYPES), min_size=1, max_size=3, unique=True),
    prompt=st.lists(st.integers(3, 12), min_size=1, max_size=30),
    n_predict=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.8]),
)
def test_ngram_chains_match_plain_generation(zoo, exactness_log, seed, types, prompt, n_predict, temperature):
    """Greedy, and `match` at temperature 0.8 with a seed, over random prompts and chains."""
    spec = TargetSpec(seed=seed, hidden=16, layers=1, eos_tie=False)
    target, _ = zoo.pair(spec, 0.02)
    sampling = SamplingParams(temperature=temperature, seed=seed + 11)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
    expected = Pipeline(target).generate(prompt, sampling, config)
    result = Pipeline(target, spec_types=types, ngram=SMALL).generate(prompt, sampling, config)
    assert result.tokens == expected.tokens
    exactness_log.record("ngram/property", ",".join(types), result.stats)
