"""Unit tests for specdecode.verify on hand-built logits rows [k+1, V]."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CountingSampler

from specdecode.drafts import Draft
from specdecode.sampling import Sampler, SamplingParams, distribution
from specdecode.verify import verify_match, verify_rejection

V = 8
EOS = 1
GREEDY = SamplingParams(temperature=0.0, seed=0)
NO_EOG: frozenset[int] = frozenset()


def spelled(tokens: list[int], vocab: int = V, runner_up: int | None = None) -> torch.Tensor:
    """Logits rows whose argmax spells `tokens` (row i peaks at tokens[i])."""
    rows = torch.zeros(len(tokens), vocab, dtype=torch.float64)
    for i, token in enumerate(tokens):
        rows[i, token] = 5.0
        if runner_up is not None and runner_up != token:
            rows[i, runner_up] = 4.0
    return rows


def match(draft: list[int], logits, sampler, history, eog) -> list[int]:
    """verify_match on a chain, returning the emitted tokens."""
    return verify_match(Draft(list(draft)), logits, sampler, history, eog).emitted


def rejection(draft: list[int], probs, logits, sampler, history, eog) -> list[int]:
    """verify_rejection on a chain, returning the emitted tokens."""
    return verify_rejection(Draft(list(draft), probs), logits, sampler, history, eog).emitted


def random_rows(n: int, vocab: int = V, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------- greedy match


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_all_match_emits_k_plus_one_with_bonus(k):
    intended = [(3 + 2 * i) % V for i in range(k + 1)]
    if EOS in intended:
        intended = [t if t != EOS else 2 for t in intended]
    logits = spelled(intended)
    sampler = CountingSampler(GREEDY)
    out = match(intended[:k], logits, sampler, [], frozenset({EOS}))
    assert out == intended
    assert sampler.n_uniform == 0  # greedy verification takes no draws


@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_greedy_mismatch_at_i_emits_i_plus_one_ending_with_target_argmax(i):
    intended = [4, 5, 6, 7, 3]
    logits = spelled(intended)
    draft = intended[:4]
    draft[i] = 2  # wrong at position i
    out = match(draft, logits, Sampler(GREEDY), [], NO_EOG)
    assert out == [*intended[:i], intended[i]]
    assert len(out) == i + 1


def test_greedy_eos_matched_before_the_end_stops_the_step():
    intended = [4, EOS, 6, 7]
    logits = spelled(intended)
    out = match([4, EOS, 6], logits, Sampler(GREEDY), [], frozenset({EOS}))
    assert out == [4, EOS]
    # without EOS in eog_ids the step runs on
    assert match([4, EOS, 6], logits, Sampler(GREEDY), [], NO_EOG) == intended


def test_greedy_eos_as_last_draft_token_gets_no_bonus():
    logits = spelled([4, EOS, 6])
    assert match([4, EOS], logits, Sampler(GREEDY), [], frozenset({EOS})) == [4, EOS]


def test_greedy_eos_as_mismatch_ends_the_step_with_it():
    logits = spelled([4, EOS, 6, 7])
    assert match([4, 5, 6], logits, Sampler(GREEDY), [], frozenset({EOS})) == [4, EOS]


def test_any_eog_id_counts():
    logits = spelled([4, 6, 7, 3])
    out = match([4, 6, 7], logits, Sampler(GREEDY), [], frozenset({EOS, 6}))
    assert out == [4, 6]


def test_empty_draft_emits_one_token():
    logits = spelled([5])
    assert match([], logits, Sampler(GREEDY), [], NO_EOG) == [5]
    assert rejection([], None, logits, Sampler(GREEDY), [], NO_EOG) == [5]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    rows = random_rows(1)
    a = match([], rows, Sampler(p), [], NO_EOG)
    b = rejection([], None, rows, Sampler(p), [], NO_EOG)
    assert len(a) == 1 and len(b) == 1
    assert a == [Sampler(p).sample(rows[0], [])]
    assert b == a  # the bonus token is a plain sample in both modes


def test_wrong_logits_shape_is_refused():
    with pytest.raises(AssertionError):
        match([1, 2], spelled([1, 2]), Sampler(GREEDY), [], NO_EOG)


def test_verification_uses_history_plus_accepted_tokens_for_penalties():
    """Each row is scored after the history and the draft tokens kept so far: with a presence
    penalty, a token kept at row 0 is penalised at row 1."""
    rows = spelled([3, 3, 3], runner_up=5)  # 3 at 5.0, 5 at 4.0 in every row
    p = SamplingParams(temperature=0.0, presence_penalty=2.0)
    # row 0 picks 3; row 1 sees 3 in its context: 3 -> 3.0 < 4.0, so it picks 5
    assert match([3, 3], rows, Sampler(p), [], NO_EOG) == [3, 5]
    # draft [3, 5] is kept; the bonus row sees both (3 -> 3.0, 5 -> 2.0): it picks 3
    assert match([3, 5], rows, Sampler(p), [], NO_EOG) == [3, 5, 3]
    # 3 already in the history: row 0 picks 5
    assert match([3], rows[:2], Sampler(p), [3], NO_EOG) == [5]
    pr = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, presence_penalty=2.0, seed=1)
    assert rejection([3, 3], None, rows, Sampler(pr), [], NO_EOG) == [3, 5]


# --------------------------------------------------------------------------- seeded match


SAMPLED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=4242)


def plain_sampling(
    rows: torch.Tensor, draft: list[int], p: SamplingParams, history=()
) -> tuple[list[int], float]:
    """What plain generation does with these rows: one sample per row, in order, stopping at
    the first token that differs from the draft. Returns the tokens and the next uniform draw."""
    sampler = Sampler(p)
    context = list(history)
    out: list[int] = []
    for i, row in enumerate(rows):
        token = sampler.sample(row, context)
        out.append(token)
        if i < len(draft) and token != draft[i]:
            break
        context.append(token)
    return out, sampler.uniform()


def test_verify_match_seeded_is_deterministic():
    rows = random_rows(5, seed=1)
    draft = [1, 2, 3, 4]
    first = match(draft, rows, Sampler(SAMPLED), [], NO_EOG)
    for _ in range(3):
        assert match(draft, rows, Sampler(SAMPLED), [], NO_EOG) == first


@pytest.mark.parametrize("seed", range(25))
def test_verify_match_equals_plain_sampling_and_consumes_the_same_draws(seed):
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, min_p=0.02, repeat_penalty=1.3, seed=seed)
    rows = random_rows(5, seed=100 + seed, scale=1.0)
    history = [0, 2, 2]
    # drafts that agree with plain sampling fully, up to position 2, and not at all
    plain, _ = plain_sampling(rows, [], p, history)
    for draft in (plain[:4], [*plain[:2], (plain[2] + 1) % V, plain[3]], [(plain[0] + 1) % V] * 4):
        expected, next_draw = plain_sampling(rows[: len(draft) + 1], draft, p, history)
        sampler = CountingSampler(p)
        out = match(draft, rows, sampler, history, NO_EOG)
        assert out == expected
        assert sampler.n_uniform == len(out), "one draw per emitted token"
        assert sampler.uniform() == next_draw, "the generator must be where plain sampling leaves it"


def test_verify_match_all_accepted_draft_from_plain_sampling():
    rows = random_rows(4, seed=9)
    plain, next_draw = plain_sampling(rows, [], SAMPLED)
    sampler = Sampler(SAMPLED)
    assert match(plain[:3], rows, sampler, [], NO_EOG) == plain
    assert sampler.uniform() == next_draw


# --------------------------------------------------------------------------- rejection


TEMP1 = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def test_verify_rejection_seeded_is_deterministic():
    rows = random_rows(4, seed=2)
    q = torch.softmax(random_rows(3, seed=3), dim=1)
    p = SamplingParams(**TEMP1, seed=17)
    for probs in (None, q):
        first = rejection([1, 2, 3], probs, rows, Sampler(p), [], NO_EOG)
        assert all(rejection([1, 2, 3], probs, rows, Sampler(p), [], NO_EOG) == first for _ in range(3))


@pytest.mark.parametrize("seed", range(10))
def test_rejection_with_greedy_params_equals_match(seed):
    rows = random_rows(5, seed=seed)
    argmaxes = [int(t) for t in torch.argmax(rows, dim=1)]
    q = torch.softmax(random_rows(4, seed=seed + 50), dim=1)
    p = SamplingParams(temperature=0.0, seed=seed)
    for draft in (argmaxes[:4], [*argmaxes[:2], (argmaxes[2] + 1) % V, 0], [(argmaxes[0] + 3) % V] * 4):
        for probs in (None, q):
            matched = match(draft, rows, Sampler(p), [], frozenset({EOS}))
            assert rejection(draft, probs, rows, Sampler(p), [], frozenset({EOS})) == matched


def test_rejection_point_mass_draft_with_one_hot_target_is_always_accepted():
    # top_k=1 at temperature 1 is not greedy, but p is one-hot at the argmax: p(d) = 1 = q(d)
    intended = [3, 4, 5, 6]
    rows = spelled(intended)
    for seed in range(30):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed))
        assert rejection(intended[:3], None, rows, sampler, [], NO_EOG) == intended
    # and a draft token with p = 0 is always rejected in favour of the target's token
    for seed in range(30):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed))
        assert rejection([3, 2, 5], None, rows, sampler, [], NO_EOG) == [3, 4]


def test_rejection_with_draft_probs_equal_to_target_accepts_everything():
    rows = random_rows(4, seed=5)
    p = SamplingParams(**TEMP1, seed=0)
    q = torch.stack([distribution(rows[i], p, []) for i in range(3)])
    for seed in range(40):
        sp = SamplingParams(**TEMP1, seed=seed)
        draft_sampler = Sampler(SamplingParams(**TEMP1, seed=10_000 + seed))
        draft = [draft_sampler.draw(q[i]) for i in range(3)]
        out = rejection(draft, q, rows, Sampler(sp), [], NO_EOG)
        assert out[:3] == draft and len(out) == 4  # q == p: min(1, p/q) = 1


def test_rejection_of_a_point_mass_draft_never_recovers_the_rejected_token():
    """q concentrated on one token that p does not like much: it is accepted with probability
    p(d) / q(d) = p(d); on rejection the recovered token is never d (the residual max(0, p - q)
    is zero there). An explicit one-hot row and draft_probs=None must behave alike."""
    rows = random_rows(2, seed=6)
    p = SamplingParams(**TEMP1, seed=0)
    target = distribution(rows[0], p, [])
    d = int(torch.argmin(target))
    q = torch.zeros(1, V, dtype=torch.float64)
    q[0, d] = 1.0
    for probs in (q, None):
        outcomes = []
        for seed in range(300):
            out = rejection([d], probs, rows, Sampler(SamplingParams(**TEMP1, seed=seed)), [], NO_EOG)
            outcomes.append(out)
            assert len(out) in (1, 2)
            if len(out) == 1:
                assert out[0] != d
            else:
                assert out[0] == d
        assert any(len(o) == 1 for o in outcomes)


def test_rejection_eos_accepted_stops_the_step():
    rows = spelled([EOS, 5, 6])
    for seed in range(10):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed))
        assert rejection([EOS, 5], None, rows, sampler, [], frozenset({EOS})) == [EOS]
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=seed))
        assert rejection([EOS, 5], None, rows, sampler, [], NO_EOG) == [EOS, 5, 6]


@pytest.mark.parametrize("bad", [V, V + 1, V + 5])
def test_draft_token_outside_target_vocab_is_never_accepted(bad):
    rows = random_rows(3, seed=7, scale=0.5)
    wide = torch.zeros(2, V + 6, dtype=torch.float64)
    wide[:, bad] = 0.9  # the draft puts most of its mass on an id the target does not have
    wide[:, 0] = 0.1
    for seed in range(200):
        sp = SamplingParams(**TEMP1, seed=seed)
        for probs in (None, wide):
            out = rejection([bad, 0], probs, rows, Sampler(sp), [], NO_EOG)
            assert len(out) == 1
            assert 0 <= out[0] < V
        out = match([bad, 0], rows, Sampler(sp), [], NO_EOG)
        assert len(out) == 1 and out[0] < V
    # greedy: also never accepted
    assert len(rejection([bad], None, rows[:2], Sampler(GREEDY), [], NO_EOG)) == 1


def test_draft_probs_narrower_than_target_vocab():
    """A draft with a smaller vocabulary: its rows are padded with zeros, so proposals work and
    the recovered token may be any target id."""
    rows = random_rows(3, seed=8)
    narrow = torch.softmax(random_rows(2, vocab=V - 3, seed=9), dim=1)
    seen_first = set()
    for seed in range(300):
        sp = SamplingParams(**TEMP1, seed=seed)
        out = rejection([0, 1], narrow, rows, Sampler(sp), [], NO_EOG)
        assert 1 <= len(out) <= 3 and all(0 <= t < V for t in out)
        seen_first.add(out[0])
    assert seen_first & {V - 3, V - 2, V - 1}, "ids past the draft's vocabulary must still be emitted"


def test_rejection_uses_only_the_samplers_generator():
    """Randomness comes from the sampler alone: the global torch and numpy generators are
    untouched, and different seeds give different outcomes."""
    rows = random_rows(4, seed=10)
    q = torch.softmax(random_rows(3, seed=11), dim=1)
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    outs = {
        tuple(rejection([1, 2, 3], q, rows, Sampler(SamplingParams(**TEMP1, seed=s)), [], NO_EOG))
        for s in range(50)
    }
    assert len(outs) > 5
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert (
        after[0] == numpy_state[0]
        and np.array_equal(after[1], numpy_state[1])
        and after[2:] == numpy_state[2:]
    )
