"""Speculative generation is lossless: it emits exactly what plain generation emits.

Property tests over random tiny float64 Llama pairs (float64 so that the different batch
shapes of plain and speculative passes cannot flip an argmax by rounding), and over float32
copies of them on the native backend, whose passes are row-invariant in every dtype: there a
verify pass gives each row the bits plain generation's one-row pass gives it, so even a draw
at a distribution's boundary cannot tell them apart. Every case is compared token for token,
text and stop reason included, with plain generation of the same target;
`conftest.EXACTNESS_LOG` counts the cases (by dtype) and the acceptance they saw, printed in
the terminal summary.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import (
    INDEPENDENT,
    NOISES,
    OTHER_VOCAB_SIZE,
    VOCAB_SIZE,
    TargetSpec,
    cached_tokenizer,
    cpu_policy,
    eagle3_head,
    eagle3_target,
    in_dtype,
    target_model,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends.native import NativeBackend
from specdecode.sampling import Sampler, greedy_token
from specdecode.strategies import NgramMapConfig, NgramModConfig, NgramSettings
from specdecode.testing import make_llama, perturbed_copy, truncated_copy

GREEDY = SamplingParams(temperature=0)
DRAFT_KINDS = (*NOISES, INDEPENDENT)
# Weighted towards drafts that agree with the target, so that most cases accept something.
WEIGHTED_KINDS = (0.0, 0.0, 0.02, 0.02, 0.02, 0.1, 0.5, INDEPENDENT)
assert set(WEIGHTED_KINDS) == set(DRAFT_KINDS)
# Mostly long enough for several steps; sometimes 1-3 tokens (no step, or a budget-0 step).
n_predicts = st.one_of(st.integers(12, 32), st.integers(12, 32), st.integers(1, 11))

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}

target_specs = st.builds(
    TargetSpec,
    seed=st.integers(0, 2),
    hidden=st.sampled_from([16, 32]),
    layers=st.sampled_from([1, 2]),
    eos_tie=st.booleans(),
)
id_prompts = st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=40)
text_prompts = st.text(alphabet="abcdefxyz _():=\n\t0123é", min_size=1, max_size=50)
prompts = st.one_of(id_prompts, id_prompts, text_prompts)
draft_configs = st.builds(
    DraftModelConfig,
    n_max=st.integers(1, 16),
    n_min=st.sampled_from([0, 0, 0, 2]),
    p_min=st.sampled_from([0.0, 0.75]),
)


draft_trees = st.builds(  # p_split trees, which the adaptive policy sizes node by node
    DraftModelConfig,
    n_max=st.integers(1, 16),
    p_split=st.sampled_from([0.02, 0.1]),
    n_parallel=st.integers(2, 4),
)


def check_same(spec_result, plain_result) -> None:
    assert spec_result.tokens == plain_result.tokens
    assert spec_result.text == plain_result.text
    assert spec_result.stats.stop_reason == plain_result.stats.stop_reason
    assert spec_result.stats.n_generated == len(plain_result.tokens)


def plain(zoo, spec: TargetSpec, prompt, sampling: SamplingParams, config: GenerationConfig, **backend_kw):
    return Pipeline(zoo.backend(zoo.target(spec), **backend_kw)).generate(prompt, sampling, config)


# --------------------------------------------------------------------------- properties


@settings(max_examples=40, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from(WEIGHTED_KINDS),
    prompt=prompts,
    draft_config=draft_configs,
    n_predict=n_predicts,
    ignore_eos=st.booleans(),
    verify=st.sampled_from(["match", "rejection"]),
    stop=st.sampled_from([(), (), ("e",), ("\n", "x")]),
)
def test_greedy_speculative_equals_plain(
    zoo, exactness_log, spec, kind, prompt, draft_config, n_predict, ignore_eos, verify, stop
):
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos, verify=verify, stop=stop)
    expected = plain(zoo, spec, prompt, GREEDY, config)
    target, draft = zoo.pair(spec, kind)
    result = Pipeline(target, draft, draft_config=draft_config).generate(prompt, GREEDY, config)
    check_same(result, expected)
    if kind == 0.0 and ignore_eos and not stop:
        # an identical draft with its own (reused, rolled back) KV cache predicts every greedy token
        assert result.stats.totals.n_accepted == result.stats.totals.n_drafted
    exactness_log.record(f"greedy/{verify}", str(kind), result.stats, result.stats.stop_reason)


@pytest.mark.parametrize("p_min", [0.0, 0.75])
@pytest.mark.parametrize("n_max", range(1, 17))
def test_every_draft_length_is_exact(zoo, exactness_log, n_max, p_min):
    """Every n_max in 1..16 with both p_min values, whatever the property tests happen to draw."""
    spec = TargetSpec(seed=1, hidden=32, layers=2, eos_tie=False)
    config = GenerationConfig(n_predict=24, ignore_eos=True)
    prompt = list(range(3, 3 + n_max))
    expected = plain(zoo, spec, prompt, GREEDY, config)
    target, draft = zoo.pair(spec, 0.02)
    result = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=n_max, p_min=p_min)).generate(
        prompt, GREEDY, config
    )
    check_same(result, expected)
    exactness_log.record("greedy/every-n_max", "0.02", result.stats, result.stats.stop_reason)


@settings(max_examples=20, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from(WEIGHTED_KINDS),
    prompt=prompts,
    draft_config=draft_configs,
    n_predict=n_predicts,
    ignore_eos=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.8, 0.8, 0.3, 1.5]),
)
def test_match_sampling_equals_plain_sampling(
    zoo, exactness_log, spec, kind, prompt, draft_config, n_predict, ignore_eos, seed, temperature
):
    """`match` verification takes the sampler's draws in plain generation's order
    (default top_k / top_p / min_p, no penalties: see the next test for those)."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos, verify="match")
    expected = plain(zoo, spec, prompt, sampling, config)
    target, draft = zoo.pair(spec, kind)
    result = Pipeline(target, draft, draft_config=draft_config).generate(prompt, sampling, config)
    check_same(result, expected)
    assert result.stats.seed == expected.stats.seed == seed
    exactness_log.record("sampled/match", str(kind), result.stats, result.stats.stop_reason)


penalties = st.sampled_from(
    [
        {"repeat_penalty": 1.3},
        {"repeat_penalty": 2.0, "repeat_last_n": 8},
        {"presence_penalty": 3.0},
        {"frequency_penalty": 1.0, "repeat_last_n": -1},
    ]
)


# Pinned: found by the property; speculative output differed from plain output here.
@example(
    spec=TargetSpec(seed=0, hidden=16, layers=1),
    kind=0.0,
    prompt=[3],
    n_max=1,
    n_predict=12,
    seed=1,
    temperature=0.8,
    penalty={"repeat_penalty": 1.3},
)
@settings(max_examples=12, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from([0.0, 0.0, 0.02, 0.1]),
    prompt=prompts,
    n_max=st.integers(1, 8),
    n_predict=st.integers(8, 32),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.0, 0.8]),
    penalty=penalties,
)
def test_penalties_keep_speculation_lossless(
    zoo, exactness_log, spec, kind, prompt, n_max, n_predict, seed, temperature, penalty
):
    """With repetition / presence / frequency penalties the sampler depends on the history,
    so the history seen at each verified position must be the one plain generation sees."""
    sampling = SamplingParams(temperature=temperature, seed=seed, **penalty)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
    expected = plain(zoo, spec, prompt, sampling, config)
    target, draft = zoo.pair(spec, kind)
    result = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=n_max, p_min=0.0)).generate(
        prompt, sampling, config
    )
    check_same(result, expected)
    exactness_log.record("penalties", str(kind), result.stats, result.stats.stop_reason)


@settings(max_examples=12, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from(WEIGHTED_KINDS),
    prompt=st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=20, max_size=60),
    draft_config=draft_configs,
    draft_n_ctx=st.sampled_from([2, 8, 17, 24, 24, 48]),
    n_predict=st.integers(10, 40),
    verify=st.sampled_from(["match", "rejection"]),
)
def test_small_draft_context_is_still_exact(
    zoo, exactness_log, spec, kind, prompt, draft_config, draft_n_ctx, n_predict, verify
):
    """A draft whose context is far smaller than the prompt: its window slides, output is unchanged."""
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True, verify=verify)
    expected = plain(zoo, spec, prompt, GREEDY, config)
    target, draft = zoo.pair(spec, kind, draft_n_ctx=draft_n_ctx)
    result = Pipeline(target, draft, draft_config=draft_config).generate(prompt, GREEDY, config)
    check_same(result, expected)
    assert len(draft.tokens) <= draft_n_ctx
    exactness_log.record("small-draft-context", str(kind), result.stats)


@settings(max_examples=8, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from([0.0, 0.02, INDEPENDENT]),
    prompt=st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=30),
    target_n_ctx=st.integers(32, 64),
    n_max=st.integers(1, 16),
    temperature=st.sampled_from([0.0, 0.8]),
)
def test_until_context_full_is_exact(
    zoo, exactness_log, spec, kind, prompt, target_n_ctx, n_max, temperature
):
    """n_predict -1 runs into the target's context limit at the same token either way."""
    sampling = SamplingParams(temperature=temperature, seed=5)
    config = GenerationConfig(n_predict=-1, ignore_eos=True)
    expected = plain(zoo, spec, prompt, sampling, config, n_ctx=target_n_ctx)
    assert expected.stats.stop_reason == "context"
    assert len(prompt) + len(expected.tokens) == target_n_ctx + 1  # the last token is never evaluated
    target, draft = zoo.pair(spec, kind, target_n_ctx=target_n_ctx)
    draft_config = DraftModelConfig(n_max=n_max, p_min=0.0)
    result = Pipeline(target, draft, draft_config=draft_config).generate(prompt, sampling, config)
    check_same(result, expected)
    exactness_log.record("until-context-full", str(kind), result.stats)


eagle3_chains = st.sampled_from([["eagle3"], ["eagle3"], ["draft", "eagle3"], ["ngram-simple", "eagle3"]])


@settings(max_examples=25, **SETTINGS)
@given(
    types=eagle3_chains,
    prompt=prompts,
    draft_config=draft_configs,
    n_predict=n_predicts,
    ignore_eos=st.booleans(),
    verify=st.sampled_from(["match", "rejection"]),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    stop=st.sampled_from([(), (), ("e",)]),
    policy=st.sampled_from(["classic", "classic", "adaptive"]),
)
def test_eagle3_speculation_equals_plain(
    exactness_log, types, prompt, draft_config, n_predict, ignore_eos, verify, temperature, seed, stop, policy
):
    """EAGLE-3 alone and in chains, on conftest's EAGLE-3 target with its briefly trained head,
    under either policy: greedy (either verification) and `match` at temperature 0.8 give plain
    generation's tokens."""
    if temperature > 0:
        verify = "match"  # rejection sampling is checked for its distribution, not its tokens
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos, verify=verify, stop=stop)
    tokenizer = cached_tokenizer()
    target = eagle3_target()
    expected = Pipeline(HFBackend(target, tokenizer)).generate(prompt, sampling, config)
    draft = HFBackend(perturbed_copy(target, 1.0), tokenizer) if "draft" in types else None
    pipe = Pipeline(
        HFBackend(target, tokenizer),
        draft,
        eagle3=eagle3_head(),
        spec_types=types,
        draft_config=draft_config,
        spec_policy=policy,
        policy_models=cpu_policy(),
    )
    result = pipe.generate(prompt, sampling, config)
    check_same(result, expected)
    label = f"eagle3/{verify}" + ("/adaptive" if policy == "adaptive" else "")
    exactness_log.record(label, ",".join(types), result.stats, result.stats.stop_reason)


# --------------------------------------------------------------------------- float32, native backend

TRANSLATED = "translated"
NATIVE_CHAINS = (
    ["draft"],
    ["draft"],
    ["ngram-simple", "draft"],
    ["ngram-map-k", "ngram-cache", "draft"],
    ["ngram-map-k4v", "ngram-mod", "draft"],
    ["ngram-mod"],
    ["suffix"],
)
# Keyed on one or two tokens, so that the n-gram strategies find matches in random models' output.
SHORT_NGRAMS = NgramSettings(
    simple=NgramMapConfig(size_n=2, size_m=12),
    map_k=NgramMapConfig(size_n=1, size_m=8),
    map_k4v=NgramMapConfig(size_n=1, size_m=8),
    mod=NgramModConfig(n_match=1, n_min=1, n_max=24),
)
native_penalties = st.sampled_from(
    [{}, {}, {"presence_penalty": 0.5}, {"repeat_penalty": 1.3}, {"frequency_penalty": 0.5, "top_k": 3}]
)


@functools.cache
def other_vocab_draft(dtype: torch.dtype):
    """A model of another tokenizer (384 ids, other text): a draft through text translation."""
    return make_llama(OTHER_VOCAB_SIZE, hidden=16, layers=1, init_std=0.5, seed=21).to(dtype)


def native_draft(zoo, spec: TargetSpec, kind) -> NativeBackend:
    if kind == TRANSLATED:
        return NativeBackend(other_vocab_draft(torch.float32), cached_tokenizer(OTHER_VOCAB_SIZE, "difflib"))
    return NativeBackend(in_dtype(zoo.draft(spec, kind), torch.float32), cached_tokenizer())


@settings(max_examples=150, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from([*WEIGHTED_KINDS, TRANSLATED]),
    types=st.sampled_from(NATIVE_CHAINS),
    prompt=prompts,
    draft_config=draft_configs,
    n_predict=n_predicts,
    ignore_eos=st.booleans(),
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.7, 1.7]),
    penalty=native_penalties,
    seed=st.integers(0, 2**64 - 1),
    verify=st.sampled_from(["match", "rejection"]),
    stop=st.sampled_from([(), (), ("e",)]),
)
def test_native_float32_speculation_equals_plain(
    zoo,
    exactness_log,
    spec,
    kind,
    types,
    prompt,
    draft_config,
    n_predict,
    ignore_eos,
    temperature,
    penalty,
    seed,
    verify,
    stop,
):
    """float32 on the native backend, greedy or seeded `match` up to temperature 1.7, with
    penalties, chains of n-gram strategies and the draft model (also through translation)."""
    if temperature > 0:
        verify = "match"  # rejection sampling keeps the distribution, not the tokens
    sampling = SamplingParams(temperature=temperature, seed=seed, **penalty)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos, verify=verify, stop=stop)
    target = in_dtype(zoo.target(spec), torch.float32)
    expected = Pipeline(NativeBackend(target, cached_tokenizer())).generate(prompt, sampling, config)
    pipe = Pipeline(
        NativeBackend(target, cached_tokenizer()),
        native_draft(zoo, spec, kind),
        spec_types=types,
        draft_config=draft_config,
        ngram=SHORT_NGRAMS,
        replacements=[("    ", "\t")] if kind == TRANSLATED else None,
    )
    result = pipe.generate(prompt, sampling, config)
    check_same(result, expected)
    assert all(s.n_failed == 0 for s in result.stats.strategies)
    label = f"float32/{verify if temperature == 0 else 'sampled'}"
    exactness_log.record(label, str(kind), result.stats, result.stats.stop_reason, dtype="float32")


# --------------------------------------------------------------------------- deterministic cases


ADAPTIVE_CHAINS = (
    ["draft"],
    ["draft"],
    ["ngram-simple", "draft"],
    ["ngram-map-k4v", "ngram-mod", "draft"],
    ["ngram-simple", "ngram-cache"],
    ["suffix", "draft"],
)


# Learns across the examples, so that later ones run the policy from many learnt states.
SHARED_POLICY = cpu_policy()


@settings(max_examples=30, **SETTINGS)
@given(
    spec=target_specs,
    kind=st.sampled_from(WEIGHTED_KINDS),
    types=st.sampled_from(ADAPTIVE_CHAINS),
    prompt=prompts,
    draft_config=st.one_of(draft_configs, draft_configs, draft_trees),
    n_predict=n_predicts,
    ignore_eos=st.booleans(),
    verify=st.sampled_from(["match", "rejection"]),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    shared=st.booleans(),
)
def test_adaptive_policy_equals_plain(
    zoo,
    exactness_log,
    spec,
    kind,
    types,
    prompt,
    draft_config,
    n_predict,
    ignore_eos,
    verify,
    temperature,
    seed,
    shared,
):
    """Whatever the adaptive policy drafts (strategy, length, no draft), greedy generation
    (either verification) and `match` sampling give plain generation's tokens."""
    if temperature > 0:
        verify = "match"  # rejection sampling is checked for its distribution, not its tokens
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos, verify=verify)
    expected = plain(zoo, spec, prompt, sampling, config)
    target, draft = zoo.pair(spec, kind)
    pipe = Pipeline(
        target,
        draft if "draft" in types else None,
        spec_types=types,
        draft_config=draft_config,
        ngram=SHORT_NGRAMS,
        spec_policy="adaptive",
        policy_models=SHARED_POLICY if shared else cpu_policy(),
    )
    result = pipe.generate(prompt, sampling, config)
    check_same(result, expected)
    shape = " tree" if draft_config.n_parallel > 1 and "draft" in types else ""
    exactness_log.record(
        f"adaptive/{verify}", f"{kind} {','.join(types)}{shape}", result.stats, result.stats.stop_reason
    )


def test_adaptive_policy_drafts_what_is_kept(zoo, exactness_log, steady_clock):
    """The adaptive property test is not vacuous: with a draft identical to the target, the
    policy drafts, and everything it drafts is kept."""
    spec = TargetSpec(seed=1, hidden=32, layers=2, eos_tie=False)
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    prompt = list(range(3, 20))
    expected = plain(zoo, spec, prompt, GREEDY, config)
    target, draft = zoo.pair(spec, 0.0)
    pipe = Pipeline(target, draft, spec_policy="adaptive", policy_models=cpu_policy())
    result = pipe.generate(prompt, GREEDY, config)
    check_same(result, expected)
    assert result.stats.totals.n_accepted == result.stats.totals.n_drafted >= 16
    exactness_log.record("adaptive/match", "0.0 draft", result.stats, result.stats.stop_reason)


def test_property_setup_is_not_vacuous(zoo):
    """The models are peaked enough that drafts are accepted, partly rejected, and that
    p_min 0.75 still lets drafts through; otherwise the properties above would prove little."""
    spec = TargetSpec(seed=0, hidden=32, layers=2)
    prompt = list(range(3, 23))
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    counts = {}
    for kind in (0.0, 0.02):
        for p_min in (0.0, 0.75):
            target, draft = zoo.pair(spec, kind)
            result = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=8, p_min=p_min)).generate(
                prompt, GREEDY, config
            )
            counts[kind, p_min] = (result.stats.totals.n_drafted, result.stats.totals.n_accepted)
    # an identical draft: everything it drafts is accepted
    assert counts[0.0, 0.0][0] > 0 and counts[0.0, 0.0][0] == counts[0.0, 0.0][1]
    assert counts[0.0, 0.75][1] > 0
    # a slightly perturbed draft: some accepted, some rejected
    drafted, accepted = counts[0.02, 0.0]
    assert 0 < accepted < drafted
    assert counts[0.02, 0.75][1] > 0


def test_identical_draft_makes_fewer_target_passes(zoo):
    spec = TargetSpec(seed=1, hidden=32, layers=2)
    target, draft = zoo.pair(spec, 0.0)
    config = GenerationConfig(n_predict=33, ignore_eos=True)
    result = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=8, p_min=0.0)).generate(
        list(range(3, 13)), GREEDY, config
    )
    # the first token comes from the prompt pass; 32 more in steps of 8 + 1 bonus
    assert result.stats.n_passes == 4
    assert result.stats.totals.n_drafted == result.stats.totals.n_accepted == 28
    assert result.stats.tokens_per_pass == 8.0


@pytest.mark.parametrize("verify", ["match", "rejection"])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_inside_an_accepted_draft(zoo, exactness_log, verify, ignore_eos):
    """An EOS the draft proposes and the target confirms ends the step (or, ignored, does not)."""
    spec = TargetSpec(seed=0, hidden=32, layers=2, eos_tie=True)
    prompt = list(range(3, 23))
    config = GenerationConfig(n_predict=40, ignore_eos=ignore_eos, verify=verify)
    expected = plain(zoo, spec, prompt, GREEDY, config)
    assert 1 in expected.tokens, "the EOS-tied model should produce EOS here"
    assert (expected.stats.stop_reason == "eos") != ignore_eos
    target, draft = zoo.pair(spec, 0.0)
    result = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=16, p_min=0.0)).generate(
        prompt, GREEDY, config
    )
    check_same(result, expected)
    assert result.stats.totals.n_accepted > 0
    exactness_log.record("eos", "0.0", result.stats, result.stats.stop_reason)


def _early_exit_friendly_target(layers: int, seed: int):
    """A target whose later layers change the residual stream little, so that its
    truncated copy (an early-exit draft) agrees with it often."""
    model = copy.deepcopy(target_model(TargetSpec(seed=seed, hidden=32, layers=layers)))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


@pytest.mark.parametrize(("layers", "draft_layers", "seed"), [(3, 1, 0), (3, 2, 1), (4, 1, 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_truncated_copy_draft_is_exact(tokenizer, exactness_log, layers, draft_layers, seed, temperature):
    target = _early_exit_friendly_target(layers, seed)
    draft = truncated_copy(target, draft_layers)
    assert draft.config.num_hidden_layers == draft_layers
    sampling = SamplingParams(temperature=temperature, seed=11)
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    for prompt in (list(range(3, 30)), "def wrap(text, width=70):\n    "):
        expected = Pipeline(HFBackend(target, tokenizer)).generate(prompt, sampling, config)
        pipe = Pipeline(
            HFBackend(target, tokenizer),
            HFBackend(draft, tokenizer),
            draft_config=DraftModelConfig(n_max=6, p_min=0.0),
        )
        result = pipe.generate(prompt, sampling, config)
        check_same(result, expected)
        assert result.stats.totals.n_accepted > 0
        exactness_log.record("truncated-copy", f"truncated:{draft_layers}/{layers}", result.stats)


def test_reused_pipeline_matches_fresh_runs(zoo, exactness_log):
    """Backends keep their caches between generations (prefix reuse); output must not depend on it."""
    spec = TargetSpec(seed=2, hidden=16, layers=2)
    target, draft = zoo.pair(spec, 0.02)
    pipe = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=5, p_min=0.0))
    base = list(range(40, 60))
    prompts = [base, base[:10], [*base, 7, 8], base, base[:10] + [99] * 5, [5], base]
    for index, prompt in enumerate(prompts):
        sampling = GREEDY if index % 2 else SamplingParams(temperature=0.8, seed=index)
        config = GenerationConfig(n_predict=12, ignore_eos=True)
        expected = plain(zoo, spec, prompt, sampling, config)
        result = pipe.generate(prompt, sampling, config)
        check_same(result, expected)
        exactness_log.record("reused-pipeline", "0.02", result.stats)


def test_stream_chunks_add_up(zoo):
    spec = TargetSpec(seed=0, hidden=32, layers=2)
    target, draft = zoo.pair(spec, 0.02)
    pipe = Pipeline(target, draft, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
    run = pipe.stream(list(range(3, 20)), GREEDY, GenerationConfig(n_predict=30, ignore_eos=True))
    chunks = list(run)
    assert [t for c in chunks for t in c.tokens] == run.tokens
    assert "".join(c.text for c in chunks) == run.text
    assert sum(c.n_accepted for c in chunks) == run.stats.totals.n_accepted
    assert sum(c.n_drafted for c in chunks) == run.stats.totals.n_drafted
    for chunk in chunks[1:]:
        if chunk.tokens:
            assert len(chunk.tokens) == chunk.n_accepted + 1
            assert chunk.strategy == ("draft" if chunk.n_drafted else None)


# --------------------------------------------------------------------------- against a reference loop


def reference_generate(model, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy decoding the slow obvious way: the full sequence through the model every token,
    the sampler's history being every token before the one chosen."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = greedy_token(logits, params, ids)
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(temperature=0, repeat_penalty=100.0, repeat_last_n=64),
        SamplingParams(temperature=0, presence_penalty=50.0),
        SamplingParams(temperature=0, frequency_penalty=50.0, repeat_last_n=-1),
    ],
    ids=["plain", "repeat-penalty", "presence-penalty", "frequency-penalty"],
)
@pytest.mark.parametrize("speculative", [False, True])
def test_generation_matches_reference_loop(zoo, params, speculative):
    """Plain (and speculative) greedy output equals a from-scratch loop over the HF model.

    With penalties this checks that the penalty window is the whole history, the newest
    token included (llama.cpp accepts every token into the sampler before the next draw).
    """
    spec = TargetSpec(seed=0, hidden=32, layers=2)
    model = zoo.target(spec)
    prompt = [3, 4, 5, 6]
    expected = reference_generate(model, prompt, params, 16)
    target, draft = zoo.pair(spec, 0.0)
    pipe = (
        Pipeline(target, draft, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
        if speculative
        else (Pipeline(target))
    )
    result = pipe.generate(prompt, params, GenerationConfig(n_predict=16, ignore_eos=True))
    assert result.tokens == expected


def test_sampled_generation_matches_reference_loop(zoo):
    """Plain sampling = one draw per token from `distribution(logits, params, history)`."""
    spec = TargetSpec(seed=1, hidden=32, layers=2)
    model = zoo.target(spec)
    params = SamplingParams(temperature=0.8, seed=1234)
    prompt = [10, 11, 12]
    sampler = Sampler(params)
    ids = list(prompt)
    expected = []
    with torch.no_grad():
        for _ in range(20):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = sampler.sample(logits, ids)
            expected.append(token)
            ids.append(token)
    result = Pipeline(zoo.backend(model)).generate(
        prompt, params, GenerationConfig(n_predict=20, ignore_eos=True)
    )
    assert result.tokens == expected
