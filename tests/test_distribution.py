"""Statistical tests: rejection verification (speculative sampling) is lossless.

The fits are chi-square goodness-of-fit tests of empirical token frequencies against the
exact target distribution p at significance level ALPHA = 0.001: for a correct
implementation each fit fails by chance with probability 0.001 (15 fits in this file, so at
most 0.015 for the file). The seeds are fixed, so every run gives the same verdict. Power
checks go with them: deliberately wrong verifiers (with half the sample size), the draft's
own distribution and a 20% contamination of p must all be rejected by the same test, which
shows that a passing fit is evidence and not a formality.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import chi_square_pvalue, gpu_policy

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.drafts import Draft
from specdecode.sampling import Sampler, distribution
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy
from specdecode.train.eagle3 import HeadShape, new_head, ttt_loss
from specdecode.verify import verify_rejection

ALPHA = 0.001
NO_EOG: frozenset[int] = frozenset()
TEMP1 = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


# --------------------------------------------------------------------------- function level

V = 6
K = 3
N_TRIALS = 10000  # per parameter set; the power checks below show this is plenty


def target_rows(seed: int = 0) -> torch.Tensor:
    return 1.2 * torch.randn(K + 1, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def draft_rows(vocab: int = V, seed: int = 1) -> torch.Tensor:
    """q: a distribution clearly different from p, including zeros on some ids."""
    logits = 1.5 * torch.randn(K, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q = torch.softmax(logits, dim=1)
    q[:, 0] = 0.0  # the draft never proposes id 0, which p likes
    return q / q.sum(dim=1, keepdim=True)


Verifier = Callable[..., list[int]]


def chain_rejection(draft: list[int], q, logits, sampler, history, eog) -> list[int]:
    """verify_rejection on a chain drafted from q, returning the emitted tokens."""
    return verify_rejection(Draft(list(draft), q), logits, sampler, history, eog).emitted


def run_trials(
    verifier: Verifier,
    logits: torch.Tensor,
    q: torch.Tensor | None,
    params: dict,
    n: int,
    fixed_draft: list[int] | None = None,
) -> list[list[int]]:
    """n verification steps with seeds 0..n-1. Draft tokens are drawn from q with their own
    stream (or fixed when q is None); the verifier gets a Sampler seeded with the trial seed."""
    if fixed_draft is None:
        # inverse-CDF draws d_i ~ q_i from a stream independent of the verifier's
        uniforms = np.random.default_rng(12345).random((n, K))
        cdf = np.cumsum(q.numpy(), axis=1)
        drafts = [
            [int(np.searchsorted(cdf[i], u * cdf[i, -1], side="right")) for i, u in enumerate(row)]
            for row in uniforms
        ]
    outs = []
    for seed in range(n):
        draft = fixed_draft if fixed_draft is not None else drafts[seed]
        sampler = Sampler(SamplingParams(**params, seed=seed))
        outs.append(verifier(draft, q if fixed_draft is None else None, logits, sampler, [], NO_EOG))
    return outs


def exact(logits_row: torch.Tensor, params: dict) -> dict[int, float]:
    p = distribution(logits_row, SamplingParams(**params), [])
    return {i: float(p[i]) for i in range(len(p))}


def position_counts(outs: list[list[int]], position: int) -> Counter:
    """Tokens emitted at `position`, among the steps that got that far (all earlier draft
    tokens accepted). Given that, the token must be distributed as p at that position."""
    return Counter(out[position] for out in outs if len(out) > position)


def always_accept(draft, draft_probs, logits, sampler, history, eog_ids):
    """Wrong: keeps every draft token (outputs the draft's distribution)."""
    return [*draft, sampler.sample(logits[len(draft)], [])]


def resample_from_target(draft, draft_probs, logits, sampler, history, eog_ids):
    """Wrong in a subtle way: on rejection it draws from p instead of norm(max(0, p - q))."""
    emitted = []
    for i, proposed in enumerate(draft):
        p = distribution(logits[i], sampler.params, [])
        q = draft_probs[i]
        if sampler.uniform() * float(q[proposed]) < float(p[proposed]):
            emitted.append(proposed)
            continue
        emitted.append(sampler.draw(p))
        return emitted
    emitted.append(sampler.sample(logits[len(draft)], []))
    return emitted


PARAM_SETS = {
    "temperature-1": TEMP1,
    # the sampler's transform defines p: here top-k 4 at temperature 0.7 (p is zero on two ids)
    "top-k-4-temperature-0.7": {"temperature": 0.7, "top_k": 4, "top_p": 1.0, "min_p": 0.0},
}


@pytest.fixture(scope="module")
def sampled_draft_trials():
    """N_TRIALS steps per parameter set with a sampled draft: shared by the fit and power tests."""
    logits, q = target_rows(), draft_rows()
    return {
        name: run_trials(chain_rejection, logits, q, params, N_TRIALS) for name, params in PARAM_SETS.items()
    }


@pytest.mark.parametrize("name", list(PARAM_SETS))
def test_first_token_matches_target_with_sampled_draft(sampled_draft_trials, name):
    logits, params = target_rows(), PARAM_SETS[name]
    outs = sampled_draft_trials[name]
    counts, p = position_counts(outs, 0), exact(logits[0], params)
    pvalue = chi_square_pvalue(counts, p)
    assert pvalue > ALPHA, pvalue
    # every id p gives a fair chance comes out, including those the draft never proposes
    assert {t for t, prob in p.items() if prob * len(outs) > 20} == set(counts)


@pytest.mark.parametrize("name", list(PARAM_SETS))
@pytest.mark.parametrize("position", [1, 2, 3])
def test_later_tokens_match_target_given_earlier_acceptance(sampled_draft_trials, name, position):
    """Token i of a step (i >= 1, so d_0..d_(i-1) were accepted) is distributed as p_i; position
    K is the bonus token."""
    logits, params = target_rows(), PARAM_SETS[name]
    counts = position_counts(sampled_draft_trials[name], position)
    assert sum(counts.values()) > 500  # enough accepted steps for the test to mean something
    assert chi_square_pvalue(counts, exact(logits[position], params)) > ALPHA


def test_rejections_happen_and_acceptance_rate_is_sum_of_min_p_q(sampled_draft_trials):
    """Acceptance at position 0 is sum_x min(p(x), q(x)); check it to within 4 standard errors."""
    logits, q = target_rows(), draft_rows()
    outs = sampled_draft_trials["temperature-1"]
    p0 = distribution(logits[0], SamplingParams(**TEMP1), [])
    rate = float(torch.minimum(p0, q[0]).sum())
    assert 0.2 < rate < 0.9  # the draft disagrees often, so the test exercises both branches
    observed = sum(len(out) > 1 for out in outs) / len(outs)
    assert abs(observed - rate) < 4 * np.sqrt(rate * (1 - rate) / len(outs))


@pytest.mark.parametrize("wrong", [always_accept, resample_from_target])
def test_power_wrong_verifiers_are_rejected(wrong):
    """The same test rejects a wrong verifier, even with half the sample size."""
    logits, q = target_rows(), draft_rows()
    outs = run_trials(wrong, logits, q, TEMP1, N_TRIALS // 2)
    assert chi_square_pvalue(position_counts(outs, 0), exact(logits[0], TEMP1)) < ALPHA


def test_first_token_matches_target_with_deterministic_draft():
    """draft_probs None: the proposer is a point mass (a greedy draft, for instance)."""
    logits = target_rows(seed=3)
    draft = [int(torch.argmin(logits[0])), int(torch.argmax(logits[1])), 2]
    outs = run_trials(chain_rejection, logits, None, TEMP1, 6000, fixed_draft=draft)
    assert chi_square_pvalue(position_counts(outs, 0), exact(logits[0], TEMP1)) > ALPHA
    assert chi_square_pvalue(position_counts(outs, 1), exact(logits[1], TEMP1)) > ALPHA
    # power: a verifier that keeps the point-mass draft fails the same test
    wrong = run_trials(always_accept, logits, None, TEMP1, 6000, fixed_draft=draft)
    assert chi_square_pvalue(position_counts(wrong, 0), exact(logits[0], TEMP1)) < ALPHA


def test_first_token_matches_target_with_wider_draft_vocab():
    """A draft vocabulary two ids larger than the target's, with 30% of its mass there: those
    proposals are always rejected and the output is still distributed as p."""
    logits = target_rows(seed=4)
    q = draft_rows(vocab=V + 2, seed=5)
    q[:, V:] = 0.15
    q[:, :V] *= 0.7 / q[:, :V].sum(dim=1, keepdim=True)
    outs = run_trials(chain_rejection, logits, q, TEMP1, 6000)
    assert all(all(t < V for t in out) for out in outs)
    assert chi_square_pvalue(position_counts(outs, 0), exact(logits[0], TEMP1)) > ALPHA


def first_branches(trials: int, rank: int) -> list[Draft]:
    """Trees as sampled drafting grows them (each node of the preferred path gets a first child
    drawn from q and a sibling drawn from q without it, with the renormalized q it came from),
    cut to one chain as a target that takes no trees verifies it: the first branch (rank 0),
    or, as a wrong choice, the root's second child (rank 1)."""
    q = draft_rows()
    rng = np.random.default_rng(7)
    drafts = []
    for _ in range(trials):
        tokens, parents, rows = [], [], []
        parent = -1
        for depth in range(K):
            first = int(rng.choice(V, p=q[depth].numpy()))
            rest = q[depth].clone()
            rest[first] = 0.0
            rest /= rest.sum()
            second = int(rng.choice(V, p=rest.numpy()))
            tokens += [first, second]
            parents += [parent, parent]
            rows += [q[depth], rest]
            parent = len(tokens) - 2
        tree = Draft(tokens, torch.stack(rows), parents=parents)
        drafts.append(tree.first_branch() if rank == 0 else tree.subset([1]))
    return drafts


def test_a_sampled_trees_first_branch_verified_as_a_chain_is_lossless(exactness_log):
    """What a target that scores chains only verifies of a tree (its preferred path): each node
    its parent's first child, drawn from the full q its row carries, so the chain is a proper
    draw and rejection sampling keeps p. A second child instead is drawn from q less the first,
    not from the q it would be verified against: the same fit rejects it."""
    logits = target_rows()

    def emitted(drafts: list[Draft]) -> list[list[int]]:
        samplers = [Sampler(SamplingParams(**TEMP1, seed=seed)) for seed in range(len(drafts))]
        return [
            verify_rejection(draft, logits[: len(draft.tokens) + 1], sampler, [], NO_EOG).emitted
            for draft, sampler in zip(drafts, samplers, strict=True)
        ]

    outs = emitted(first_branches(6000, 0))
    for position in (0, 1):
        assert chi_square_pvalue(position_counts(outs, position), exact(logits[position], TEMP1)) > ALPHA
    exactness_log.record_distribution("a sampled tree's first branch, verified as a chain", len(outs))
    wrong = emitted([replace(d, probs=draft_rows()[:1]) for d in first_branches(6000, 1)])
    assert chi_square_pvalue(position_counts(wrong, 0), exact(logits[0], TEMP1)) < ALPHA


# --------------------------------------------------------------------------- end to end

E2E_TOP_K = 4
E2E_SEEDS = 2500


def e2e_params(seed: int | None = None, **penalties) -> SamplingParams:
    # top_k 4 keeps the joint of three tokens at 4^3 = 64 cells; the sampler's transform is
    # what defines the target distribution, so p = distribution(logits, these params).
    return SamplingParams(temperature=1.0, top_k=E2E_TOP_K, top_p=1.0, min_p=0.0, seed=seed, **penalties)


@pytest.fixture
def one_thread():
    """Tiny models run several times faster on one thread (and torch's setting is global)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def e2e_models():
    tokenizer = make_tokenizer(vocab_size=270)
    target = make_llama(len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1, init_std=0.3, seed=0)
    draft = perturbed_copy(target, noise=0.03, seed=1)  # agrees often, not always
    return tokenizer, target, draft


def exact_joint(
    model, tokenizer, prompt: list[int], depth: int, params: SamplingParams
) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) under the sampler's distribution, by enumerating the top-k tree
    (each token's distribution after the prompt and every token before it, penalties included)."""
    backend = HFBackend(model, tokenizer, n_ctx=64)
    joint: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == depth:
            joint[prefix] = prob
            return
        backend.truncate(0)
        ids = [*prompt, *prefix]
        p = distribution(backend.evaluate(ids)[-1], params, ids)
        for token in torch.nonzero(p).flatten().tolist():
            expand((*prefix, token), prob * float(p[token]))

    expand((), 1.0)
    return joint


def e2e_pipeline(e2e_models) -> tuple[Pipeline, list[int]]:
    tokenizer, target, draft = e2e_models
    pipe = Pipeline(
        HFBackend(target, tokenizer, n_ctx=64),
        HFBackend(draft, tokenizer, n_ctx=64),
        draft_config=DraftModelConfig(n_max=3, p_min=0.0),
    )
    return pipe, pipe.encode("def f(x):")


def sample_first_three(pipe, prompt, n_seeds: int, verify: str, **penalties) -> tuple[Counter, int, int]:
    """Counts of the first three tokens over seeds 0..n_seeds-1, and (drafted, accepted) totals."""
    config = GenerationConfig(n_predict=4, verify=verify)
    counts: Counter = Counter()
    n_drafted = n_accepted = 0
    for seed in range(n_seeds):
        result = pipe.generate(prompt, e2e_params(seed, **penalties), config)
        assert len(result.tokens) == 4
        counts[tuple(result.tokens[:3])] += 1
        n_drafted += result.stats.totals.n_drafted
        n_accepted += result.stats.totals.n_accepted
    return counts, n_drafted, n_accepted


@pytest.mark.slow
def test_end_to_end_rejection_matches_target_distribution(e2e_models, one_thread, exactness_log):
    """Pipeline with a draft model, verify="rejection", temperature 1: over 2500 seeds the
    first three generated tokens follow the target's exact joint distribution (alpha 0.001).

    The first token is sampled from the prompt's logits without speculation; with n_predict=4
    the next step has a budget of two draft tokens, so tokens 2 and 3 are the first two that
    go through verify_rejection (accepted, recovered or bonus). (n_predict=2 would test
    nothing: the step after the first token then has a draft budget of 0.)
    """
    tokenizer, target, draft = e2e_models
    pipe, prompt = e2e_pipeline(e2e_models)
    counts, n_drafted, n_accepted = sample_first_three(pipe, prompt, E2E_SEEDS, "rejection")

    target_joint = exact_joint(target, tokenizer, prompt, 3, e2e_params())
    pvalue = chi_square_pvalue(counts, target_joint)
    assert pvalue > ALPHA, pvalue
    exactness_log.record_distribution("draft-model chain, end to end", E2E_SEEDS)

    # speculation really happened, and the draft disagreed often enough to matter
    assert n_drafted >= E2E_SEEDS * 2
    rejection_rate = n_accepted / n_drafted
    assert 0.3 < rejection_rate < 0.98

    # power: the draft model's joint is far from the target's (total variation > 0.2), and a
    # distribution only 20% contaminated by it is already rejected by the same test
    draft_joint = exact_joint(draft, tokenizer, prompt, 3, e2e_params())
    cells = {*target_joint, *draft_joint}
    tv = 0.5 * sum(abs(target_joint.get(c, 0.0) - draft_joint.get(c, 0.0)) for c in cells)
    assert tv > 0.2
    assert chi_square_pvalue(counts, draft_joint) < ALPHA
    mixture = {c: 0.8 * target_joint.get(c, 0.0) + 0.2 * draft_joint.get(c, 0.0) for c in cells}
    assert chi_square_pvalue(counts, mixture) < ALPHA

    # at temperature 1 rejection keeps more draft tokens than match verification, whose
    # greedy draft is kept only when the target happens to sample that very token
    # (here about 0.84 against 0.27; 300 seeds give a standard error below 0.02)
    _, match_drafted, match_accepted = sample_first_three(pipe, prompt, 300, "match")
    match_rate = match_accepted / match_drafted
    assert rejection_rate > match_rate + 0.2, (rejection_rate, match_rate)


@pytest.mark.slow
def test_end_to_end_rejection_with_penalties_matches_target_distribution(
    e2e_models, one_thread, exactness_log
):
    """The same with a presence penalty: each token's distribution depends on every token
    before it (the prompt, the first token, accepted draft tokens), so verification must score
    each row after exactly that context. 1500 seeds, alpha 0.001."""
    tokenizer, target, _ = e2e_models
    pipe, prompt = e2e_pipeline(e2e_models)
    penalties = {"presence_penalty": 1.0}
    counts, n_drafted, n_accepted = sample_first_three(pipe, prompt, 1500, "rejection", **penalties)
    assert n_drafted >= 1500 * 2 and n_accepted > 0
    target_joint = exact_joint(target, tokenizer, prompt, 3, e2e_params(**penalties))
    assert chi_square_pvalue(counts, target_joint) > ALPHA
    exactness_log.record_distribution("draft-model chain with penalties, end to end", 1500)
    # power: the joint without the penalty is rejected by the same test
    assert chi_square_pvalue(counts, exact_joint(target, tokenizer, prompt, 3, e2e_params())) < ALPHA


@pytest.fixture(scope="module")
def e2e_head(e2e_models):
    """An EAGLE-3 head for the end-to-end target (layers 0, 1 and 1: the target has one), over
    200 of its 270 ids (part of p lies outside the head's vocabulary), trained for a moment on
    the target's samples after the test's prompt, so that it agrees with the target often."""
    tokenizer, target, _ = e2e_models
    d2t = torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(0))[:200].sort().values
    shape = HeadShape(heads=2, kv_heads=1, intermediate=32, draft_vocab=200, unroll=2, layer_ids=(0, 1, 1))
    head = new_head(target, shape, d2t, seed=5)
    prompt = tokenizer("def f(x):")["input_ids"]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ids = torch.tensor([prompt] * 64)
        for _ in range(3):
            probs = torch.softmax(target(input_ids=ids).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    loss_fn = ttt_loss(target, shape.unroll)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(100):
        loss = loss_fn(head, ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)


@pytest.mark.slow
def test_end_to_end_rejection_with_eagle3_matches_target_distribution(
    e2e_models, e2e_head, one_thread, exactness_log
):
    """The same fit with an EAGLE-3 head drafting by sampling from its own distribution (zero
    outside its draft vocabulary): 2500 seeds, alpha 0.001, and drafts both kept and rejected."""
    tokenizer, target, _ = e2e_models
    pipe = Pipeline(
        HFBackend(target, tokenizer, n_ctx=64),
        eagle3=e2e_head,
        draft_config=DraftModelConfig(n_max=3, p_min=0.0),
    )
    prompt = pipe.encode("def f(x):")
    counts, n_drafted, n_accepted = sample_first_three(pipe, prompt, E2E_SEEDS, "rejection")
    target_joint = exact_joint(target, tokenizer, prompt, 3, e2e_params())
    assert chi_square_pvalue(counts, target_joint) > ALPHA
    exactness_log.record_distribution("eagle3 chain, end to end", E2E_SEEDS)
    assert n_drafted >= E2E_SEEDS * 2
    assert 0.2 < n_accepted / n_drafted < 0.95, n_accepted / n_drafted  # about 0.34
    # power: the same counts reject a 20% contamination of p by another model's joint
    _, _, draft = e2e_models
    draft_joint = exact_joint(draft, tokenizer, prompt, 3, e2e_params())
    mixture = {
        c: 0.8 * target_joint.get(c, 0.0) + 0.2 * draft_joint.get(c, 0.0)
        for c in {*target_joint, *draft_joint}
    }
    assert chi_square_pvalue(counts, mixture) < ALPHA


@pytest.mark.slow
def test_end_to_end_rejection_with_adaptive_trees_matches_target_distribution(
    e2e_models, one_thread, exactness_log, steady_clock
):
    """The same fit when the adaptive policy shapes the draft model's trees (at most three
    branches) node by node, learning across the seeds (with a GPU's costs, where branching
    pays): 2500 seeds, alpha 0.001. Its rule reads each candidate's rank probability, never
    which token was drawn into it."""
    tokenizer, target, draft = e2e_models
    models = gpu_policy()
    pipe = Pipeline(
        HFBackend(target, tokenizer, n_ctx=64),
        HFBackend(draft, tokenizer, n_ctx=64),
        draft_config=DraftModelConfig(n_max=3, n_parallel=3),
        spec_policy="adaptive",
        policy_models=models,
    )
    prompt = pipe.encode("def f(x):")
    counts, n_drafted, n_accepted = sample_first_three(pipe, prompt, E2E_SEEDS, "rejection")
    target_joint = exact_joint(target, tokenizer, prompt, 3, e2e_params())
    assert chi_square_pvalue(counts, target_joint) > ALPHA
    exactness_log.record_distribution("draft-model tree, adaptive (gpu costs), end to end", E2E_SEEDS)
    trees = sum(count for (strategy, _), count in models.choices.items() if strategy == "draft tree")
    assert trees > E2E_SEEDS // 10 and 0 < n_accepted < n_drafted, (trees, n_drafted, n_accepted)
    draft_joint = exact_joint(draft, tokenizer, prompt, 3, e2e_params())
    mixture = {
        c: 0.8 * target_joint.get(c, 0.0) + 0.2 * draft_joint.get(c, 0.0)
        for c in {*target_joint, *draft_joint}
    }
    assert chi_square_pvalue(counts, mixture) < ALPHA
