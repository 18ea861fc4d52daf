"""Unit tests for specdecode.sampling: parameter validation, penalties, the distribution
transform (penalties -> top-k -> top-p -> min-p -> temperature) and the seeded Sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import CountingSampler
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specdecode.errors import SpecdecodeError
from specdecode.sampling import (
    NO_TOKEN,
    Sampler,
    SamplingParams,
    apply_penalties,
    candidates,
    distribution,
    greedy_token,
)

# A "plain" non-greedy setting with every truncation disabled: the distribution is softmax(logits / T).
PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **PLAIN, **kwargs})


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -math.inf),
        ("top_k", -2),  # -1 is vLLM's "no top-k"
        ("top_p", 0.0),
        ("top_p", -0.1),
        ("top_p", 1.0000001),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_last_n", -2),
        ("presence_penalty", math.nan),
        ("presence_penalty", -math.inf),
        ("frequency_penalty", math.inf),
        ("frequency_penalty", math.nan),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_sampling_params_rejects_bad_values(field, value):
    with pytest.raises(SpecdecodeError):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("top_k", 0),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("repeat_penalty", 0.5),
        ("repeat_last_n", -1),
        ("repeat_last_n", 0),
        ("seed", 0),
        ("seed", 2**32 - 1),
        ("seed", 2**64 - 1),
        ("presence_penalty", -2.0),
    ],
)
def test_sampling_params_accepts_boundary_values(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=-0.5).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# --------------------------------------------------------------------------- penalties


def test_repeat_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.5], dtype=torch.float64)
    out = apply_penalties(logits, params(repeat_penalty=2.0), history=[0, 1, 1, 1])
    # seen tokens 0 and 1: once each, however often they occur
    assert out.tolist() == [1.0, -4.0, 3.0, -1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 3.0, -1.0, 0.5], "input must not be modified"


def test_repeat_penalty_below_one_boosts():
    logits = torch.tensor([2.0, -2.0, 1.0], dtype=torch.float64)
    out = apply_penalties(logits, params(repeat_penalty=0.5), history=[0, 1])
    assert out.tolist() == [4.0, -1.0, 1.0]


def test_repeat_penalty_window_is_last_n_tokens():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    history = [3, 0, 1, 2, 1]
    out = apply_penalties(logits, params(repeat_penalty=2.0, repeat_last_n=2), history)
    assert out.tolist() == [2.0, 1.0, 1.0, 2.0]  # only the window [2, 1]
    out = apply_penalties(logits, params(repeat_penalty=2.0, repeat_last_n=4), history)
    assert out.tolist() == [1.0, 1.0, 1.0, 2.0]  # window [0, 1, 2, 1]: 3 is outside
    out = apply_penalties(logits, params(repeat_penalty=2.0, repeat_last_n=-1), history)
    assert out.tolist() == [1.0, 1.0, 1.0, 1.0]  # -1: the whole history
    out = apply_penalties(logits, params(repeat_penalty=2.0, repeat_last_n=0), history)
    assert out.tolist() == [2.0, 2.0, 2.0, 2.0]  # 0 disables penalties


def test_repeat_window_longer_than_history():
    logits = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    out = apply_penalties(logits, params(repeat_penalty=4.0, repeat_last_n=64), [2])
    assert out.tolist() == [1.0, 1.0, 0.25]


def test_presence_and_frequency_penalties_exact_values():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    history = [0, 1, 1, 1, 4]
    p = params(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, p, history)
    expected = [
        1.0 - 0.5 - 1 * 0.25,  # seen once
        1.0 - 0.5 - 3 * 0.25,  # seen three times
        1.0,
        1.0,
        -1.0 - 0.5 - 0.25,
    ]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_all_penalties_combined_and_windowed():
    logits = torch.tensor([4.0, -4.0, 2.0], dtype=torch.float64)
    history = [2, 2, 0, 1, 1]
    p = params(repeat_penalty=2.0, repeat_last_n=3, presence_penalty=1.0, frequency_penalty=0.5)
    out = apply_penalties(logits, p, history)  # window [0, 1, 1]
    expected = [4.0 / 2 - 1.0 - 0.5, -4.0 * 2 - 1.0 - 2 * 0.5, 2.0]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_penalties_ignore_out_of_vocab_history_ids():
    logits = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = apply_penalties(logits, params(presence_penalty=1.0), [5, -1, 1])
    assert out.tolist() == [1.0, 0.0]


def test_no_penalty_configured_or_empty_history_returns_input():
    logits = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert apply_penalties(logits, params(), [0, 1]) is logits
    assert apply_penalties(logits, params(repeat_penalty=2.0), []) is logits


def test_penalties_feed_greedy_and_distribution():
    logits = torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64)
    greedy = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert greedy_token(logits, greedy, []) == 0
    assert greedy_token(logits, greedy, [0]) == 1
    probs = distribution(logits, params(presence_penalty=2.0), [0])
    expected = torch.softmax(torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64), 0)
    torch.testing.assert_close(probs, expected)


# --------------------------------------------------------------------------- distribution


def test_plain_distribution_is_softmax_and_float64():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7], dtype=torch.float32)
    probs = distribution(logits, params(), [])
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs, torch.softmax(logits.double(), 0))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k(k):
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.7, 3.0, -0.2, 1.0], dtype=torch.float64)
    probs = distribution(logits, params(top_k=k), [])
    top = torch.argsort(logits, descending=True)[:k]
    assert support(probs) == set(top.tolist())
    torch.testing.assert_close(probs[top], torch.softmax(logits[top], 0))


def test_top_k_at_or_above_vocab_keeps_all():
    logits = torch.tensor([0.1, 2.0, -1.0], dtype=torch.float64)
    for k in (3, 4, 1000):
        torch.testing.assert_close(distribution(logits, params(top_k=k), []), torch.softmax(logits, 0))


@pytest.mark.parametrize(
    ("top_p", "expected_support"),
    [
        # probabilities: id 3 -> 0.4, id 0 -> 0.3, id 2 -> 0.2, id 1 -> 0.1
        # cumulative in descending order: 0.4, 0.7, 0.9, 1.0
        (0.05, {3}),
        (0.39, {3}),
        (0.41, {3, 0}),
        (0.69, {3, 0}),
        (0.71, {3, 0, 2}),
        (0.89, {3, 0, 2}),
        (0.91, {3, 0, 2, 1}),
        (1.0, {3, 0, 2, 1}),
    ],
)
def test_top_p_keeps_minimal_prefix_reaching_p(top_p, expected_support):
    logits = logits_of([0.3, 0.1, 0.2, 0.4])
    probs = distribution(logits, params(top_p=top_p), [])
    assert support(probs) == expected_support
    kept = sorted(expected_support)
    base = torch.tensor([0.3, 0.1, 0.2, 0.4], dtype=torch.float64)
    torch.testing.assert_close(probs[kept], base[kept] / base[kept].sum())


def test_top_p_is_computed_after_top_k():
    # probs 0.4, 0.3, 0.2, 0.1; top_k=2 renormalises to 4/7, 3/7 before top-p.
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(distribution(logits, params(top_k=2, top_p=0.55), [])) == {0}
    assert support(distribution(logits, params(top_k=2, top_p=0.6), [])) == {0, 1}
    # without top-k, p=0.6 needs 0.4 + 0.3 anyway; p=0.75 needs three tokens
    assert support(distribution(logits, params(top_p=0.75), [])) == {0, 1, 2}


@pytest.mark.parametrize(
    ("min_p", "expected_support"),
    [
        # p_max = 0.4: thresholds 0.4*min_p
        (0.0, {0, 1, 2, 3}),
        (0.2, {0, 1, 2, 3}),  # 0.08 <= 0.1
        (0.3, {0, 1, 2}),  # 0.12
        (0.55, {0, 1}),  # 0.22
        (0.8, {0}),  # 0.32
        (1.0, {0}),
    ],
)
def test_min_p_keeps_tokens_above_fraction_of_max(min_p, expected_support):
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    probs = distribution(logits, params(min_p=min_p), [])
    assert support(probs) == expected_support


def test_min_p_keeps_all_tied_maxima():
    logits = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    probs = distribution(logits, params(min_p=1.0), [])
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 10.0])
def test_temperature_scales_logits(temperature):
    logits = torch.tensor([1.0, -0.5, 0.25, 2.0, 0.0], dtype=torch.float64)
    probs = distribution(logits, params(temperature=temperature), [])
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, 0))
    # log-ratios scale by 1/T
    ratio = math.log(float(probs[3] / probs[1]))
    assert ratio == pytest.approx((2.0 - (-0.5)) / temperature, rel=1e-9)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    cold = distribution(logits, params(temperature=0.5), [])
    warm = distribution(logits, params(temperature=2.0), [])
    assert cold[0] > torch.softmax(logits, 0)[0] > warm[0]


def test_truncation_is_applied_before_temperature():
    """Top-p and min-p decide the candidate set on temperature-1 probabilities (llama.cpp order);
    temperature then only reshapes the kept candidates."""
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    for kwargs in ({"top_p": 0.71}, {"min_p": 0.3}, {"top_k": 3}):
        reference = support(distribution(logits, params(temperature=1.0, **kwargs), []))
        assert reference == {0, 1, 2}
        for temperature in (0.1, 0.5, 3.0, 50.0):
            probs = distribution(logits, params(temperature=temperature, **kwargs), [])
            assert support(probs) == reference
            kept = [0, 1, 2]
            torch.testing.assert_close(probs[kept], torch.softmax(logits[kept] / temperature, 0))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_distribution_is_one_hot_at_argmax(temperature):
    logits = torch.tensor([0.1, 2.0, -1.0, 5.0, 4.9], dtype=torch.float64)
    p = SamplingParams(temperature=temperature)
    probs = distribution(logits, p, [])
    expected = torch.zeros(5, dtype=torch.float64)
    expected[3] = 1.0
    assert torch.equal(probs, expected)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0], dtype=torch.float64)
    p = SamplingParams(temperature=0.0)
    assert greedy_token(logits, p, []) == 1
    assert int(torch.argmax(distribution(logits, p, []))) == 1


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, allow_nan=False), min_size=1, max_size=40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    history=st.lists(st.integers(0, 39), max_size=10),
    repeat_penalty=st.sampled_from([1.0, 1.3]),
)
def test_distribution_is_a_normalised_truncation(
    logits, temperature, top_k, top_p, min_p, history, repeat_penalty
):
    x = torch.tensor(logits, dtype=torch.float64)
    p = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty
    )
    probs = distribution(x, p, history)
    assert probs.shape == x.shape and probs.dtype == torch.float64
    assert bool((probs >= 0).all())
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
    kept = support(probs)
    assert 1 <= len(kept) <= (top_k if 0 < top_k < len(logits) else len(logits))
    penalised = apply_penalties(x, p, history)
    # the best (penalised) logit is always kept, and every kept logit beats every dropped one
    assert float(penalised[list(kept)].max()) == float(penalised.max())
    dropped = set(range(len(logits))) - kept
    if dropped:
        assert float(penalised[list(kept)].min()) >= float(penalised[list(dropped)].max())
    # inside the kept set, probabilities follow softmax(logit / T)
    ids = sorted(kept)
    torch.testing.assert_close(probs[ids], torch.softmax(penalised[ids] / temperature, 0))


# --------------------------------------------------------------------------- Sampler


class FixedSampler(Sampler):
    """A sampler whose uniform draws are given."""

    def __init__(self, p: SamplingParams, draws: list[float]) -> None:
        super().__init__(p)
        self.draws = list(draws)

    def uniform(self) -> float:
        return self.draws.pop(0)


def random_rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def test_same_seed_same_sequence_different_seed_differs():
    rows = random_rows(50, 30)
    p = params(temperature=0.9, seed=1234)

    def run(sampler: Sampler) -> list[int]:
        history: list[int] = []
        for row in rows:
            history.append(sampler.sample(row, history))
        return history

    first, second = run(Sampler(p)), run(Sampler(p))
    assert first == second
    other = run(Sampler(params(temperature=0.9, seed=1235)))
    assert other != first


def test_unseeded_sampler_records_a_reproducible_seed():
    a = Sampler(params(seed=None))
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**32
    b = Sampler(params(seed=a.seed))
    assert [a.uniform() for _ in range(5)] == [b.uniform() for _ in range(5)]


def test_uniform_stream_is_numpy_default_rng():
    sampler = Sampler(params(seed=7))
    reference = np.random.default_rng(7)
    assert [sampler.uniform() for _ in range(10)] == [float(reference.random()) for _ in range(10)]


def draws(sampler: Sampler, n: int = 8) -> list[float]:
    return [sampler.uniform() for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1, 2**64 - 1])
def test_spawned_streams_are_independent_of_neighbouring_seeds(seed):
    """The draft's and the EAGLE-3 head's streams (1, 2) share draws with no seed's own stream
    (seed + 1 as a seed gave the draft the next seed's plain draws), nor with each other; the
    seed's own stream (0) stays numpy's default_rng(seed), plain generation's."""
    p = params(temperature=0.9, seed=seed)
    own, draft, head = (draws(Sampler(p, stream)) for stream in (0, 1, 2))
    assert own == [float(x) for x in np.random.default_rng(seed).random(8)]
    nearby = [s for s in range(seed - 2, seed + 3) if s != seed and 0 <= s < 2**64]
    neighbours = [draws(Sampler(params(temperature=0.9, seed=s))) for s in nearby]
    for stream in (draft, head):
        assert stream not in neighbours and stream != own
        assert not set(stream) & {x for n in neighbours for x in n}
    assert draft != head
    assert draws(Sampler(p, 1)) == draft  # reproducible


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"top_k": 3}, {"top_k": 1}, {"top_p": 0.2}, {"min_p": 0.9}, {"temperature": 0.1}],
)
def test_exactly_one_draw_per_non_greedy_sample(kwargs):
    rows = random_rows(20, 16, seed=3)
    p = params(seed=99, **kwargs)
    counting = CountingSampler(p)
    history: list[int] = []
    for i, row in enumerate(rows):
        history.append(counting.sample(row, history))
        assert counting.n_uniform == i + 1
    # the generator state advanced by exactly 20 draws: the next value is the 21st of the stream
    reference = np.random.default_rng(99)
    for _ in range(20):
        reference.random()
    plain = Sampler(p)
    for row in rows:
        plain.sample(row, [])
    assert plain.uniform() == float(reference.random())


def test_greedy_sample_takes_no_draw():
    rows = random_rows(10, 16, seed=4)
    p = SamplingParams(temperature=0.0, seed=5)
    counting = CountingSampler(p)
    for row in rows:
        assert counting.sample(row, []) == int(torch.argmax(row))
    assert counting.n_uniform == 0
    plain = Sampler(p)
    for row in rows:
        plain.sample(row, [])
    assert plain.uniform() == float(np.random.default_rng(5).random())


def test_draw_is_inverse_cdf():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    cases = [(0.0, 1), (0.1, 1), (0.2499, 1), (0.25, 3), (0.74, 3), (0.75, 4), (0.999, 4)]
    sampler = FixedSampler(params(), [u for u, _ in cases])
    assert [sampler.draw(probs) for _ in cases] == [expected for _, expected in cases]


def test_draw_accepts_unnormalised_probs():
    probs = torch.tensor([0.0, 2.0, 0.0, 6.0], dtype=torch.float32)  # normalised: 0.25, 0.75
    sampler = FixedSampler(params(), [0.2, 0.3, 0.0])
    assert [sampler.draw(probs) for _ in range(3)] == [1, 3, 1]


@pytest.mark.parametrize("u", [0.0, 1e-300, 0.5, 1.0 - 2**-53, 1.0])
@pytest.mark.parametrize(
    "probs",
    [
        [0.0, 0.0, 1.0, 0.0, 0.0],
        [0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
        [0.5, 0.5, 0.0],
        [0.0, 1e-300, 1.0],
        [1.0, 0.0, 0.0, 1e-300],
    ],
)
def test_draw_never_returns_zero_mass_ids_even_at_the_edges(u, probs):
    # u = 1.0 is outside [0, 1) but checks the documented clamp at the end of the CDF.
    probs = torch.tensor(probs, dtype=torch.float64)
    token = FixedSampler(params(), [u]).draw(probs)
    assert 0 <= token < len(probs)
    assert probs[token] > 0


def test_draw_returns_only_supported_ids_over_many_draws():
    probs = torch.zeros(50, dtype=torch.float64)
    probs[[3, 17, 49]] = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    sampler = Sampler(params(seed=11))
    seen = {sampler.draw(probs) for _ in range(2000)}
    assert seen == {3, 17, 49}


def test_draw_frequencies_match_probs_chi_square():
    """Chi-square goodness of fit of 40000 draws; with a correct sampler the test fails with
    probability alpha = 0.001 (the seed is fixed, so the outcome is deterministic)."""
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05], dtype=torch.float64)
    sampler = Sampler(params(seed=2024))
    n = 40000
    counts = np.bincount([sampler.draw(probs) for _ in range(n)], minlength=len(probs))
    nonzero = probs.numpy() > 0
    assert counts[~nonzero].sum() == 0
    result = stats.chisquare(counts[nonzero], n * probs.numpy()[nonzero])
    assert result.pvalue > 0.001, result
    # power: the same test clearly rejects a slightly different distribution
    shifted = probs.numpy()[nonzero] + np.array([0.02, -0.02, 0, 0, 0, 0])
    assert stats.chisquare(counts[nonzero], n * shifted).pvalue < 0.001


def test_sample_frequencies_match_distribution_with_truncation():
    """Sampler.sample draws from `distribution` (top-k + temperature here); alpha = 0.001."""
    logits = torch.tensor([1.0, 0.2, -0.3, 0.8, 1.5, -2.0], dtype=torch.float64)
    p = params(temperature=0.7, top_k=4, seed=77)
    expected = distribution(logits, p, []).numpy()
    sampler = Sampler(p)
    n = 20000
    counts = np.bincount([sampler.sample(logits, []) for _ in range(n)], minlength=6)
    keep = expected > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], n * expected[keep]).pvalue > 0.001


def whole_vocabulary_draw(probs: torch.Tensor, u: float) -> int:
    """How a draw read the [V] distribution before draws walked only the candidates: inverse CDF
    over the whole vocabulary, clamped to the last id with mass."""
    cumulative = torch.cumsum(probs.to(torch.float64), dim=0)
    target = torch.tensor([u * float(cumulative[-1])], dtype=torch.float64)
    index = int(torch.searchsorted(cumulative, target, right=True))
    return min(index, int(torch.nonzero(probs)[-1]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},  # the command's defaults
        {"temperature": 1.3, **PLAIN},  # the whole vocabulary
        {"temperature": 0.01, "top_k": 50},  # tiny probabilities that round to zero
        {"temperature": 0.7, "top_k": 8, "repeat_penalty": 1.3, "presence_penalty": 0.5},
    ],
)
def test_sample_draws_the_token_the_whole_vocabulary_draw_gives(kwargs):
    """`sample` draws among the candidates only; for every row and draw it picks what inverse CDF
    over the [V] vector picks, bit for bit, with draws at the ends of [0, 1) too."""
    p = params(seed=3, **kwargs)
    rows = random_rows(24, 997, seed=5).to(torch.float32)
    rows[:4, 100:104] = rows[:4].max(-1, keepdim=True).values  # ties at the top
    history = [100, 101, 7, 7]
    draws = [0.0, 1e-300, 0.5, 1.0 - 2**-53, *np.random.default_rng(1).random(20).tolist()]
    for row in rows:
        probs = distribution(row, p, history)
        for u in draws:
            assert FixedSampler(p, [u]).sample(row, history) == whole_vocabulary_draw(probs, u)
            assert FixedSampler(p, [u]).draw(probs) == whole_vocabulary_draw(probs, u)


def test_candidates_are_the_distributions_support_in_id_order():
    p = params(temperature=0.9, top_k=30, top_p=0.9)
    for row in random_rows(8, 500, seed=9):
        ids, probs = candidates(row, p, [])
        full = distribution(row, p, [])
        assert ids.tolist() == sorted(ids.tolist()) and torch.equal(full[ids], probs)
        full[ids] = 0.0
        assert not full.any()


def test_greedy_token_is_numpys_argmax_on_cpu_floats_and_torchs_elsewhere():
    """Ties go to the lowest id whichever library takes the argmax."""
    row = torch.tensor([0.5, 2.0, -1.0, 2.0, 2.0])
    greedy = SamplingParams(temperature=0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert greedy_token(row.to(dtype), greedy, []) == 1
    assert greedy_token(torch.tensor([float("nan"), 3.0, float("nan")]), greedy, []) == int(
        torch.argmax(torch.tensor([float("nan"), 3.0, float("nan")]))
    )


# --------------------------------------------------------------------------- a row that allows no token


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 1.0, **PLAIN}]
)
def test_a_row_that_allows_no_token_samples_no_token_without_a_draw(kwargs, dtype):
    """Every logit -inf once the bias is added (here: the bias bans the three tokens a
    grammar's mask left): nothing is drawn, and the generation is to end there."""
    row = torch.tensor([1.0, -math.inf, 2.0, 0.5, -math.inf], dtype=dtype)
    p = SamplingParams(**kwargs, seed=1, logit_bias=((0, -math.inf), (2, -math.inf), (3, -math.inf)))
    counting = CountingSampler(p)
    assert counting.sample(row, [1]) == NO_TOKEN and counting.n_uniform == 0
    assert greedy_token(row, p, []) == NO_TOKEN
    ids, probs = candidates(row, p, [])
    assert len(ids) == len(probs) == 0
    assert not distribution(row, p, []).any()
    assert counting.draw(torch.zeros(5, dtype=torch.float64)) == NO_TOKEN and counting.n_uniform == 0
    # one token left unbanned is the only one ever sampled
    lenient = SamplingParams(**kwargs, seed=1, logit_bias=((0, -math.inf), (2, -math.inf)))
    assert {Sampler(lenient).sample(row, []) for _ in range(20)} == {3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_bias_past_the_dtypes_range_saturates_and_never_lifts_a_masked_token(dtype):
    """Biases of 1e300 (finite, past every dtype's range) on tokens 1 and 3, and on token 2,
    which a grammar's mask holds at -inf: tokens 1 and 3 share the mass; 2 is never drawn."""
    row = torch.tensor([0.5, 1.0, -math.inf, 2.0, 0.0], dtype=dtype)
    bias = ((1, 1e300), (2, 1e300), (3, 1e300), (3, 1e300))
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, **PLAIN}):
        p = SamplingParams(**kwargs, seed=2, logit_bias=bias)
        probs = distribution(row, p, [])
        assert not probs.isnan().any() and probs[2] == 0.0
        if p.greedy:
            assert greedy_token(row, p, []) == 1
        else:
            assert probs[1] == probs[3] == 0.5
