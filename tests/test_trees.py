"""Token trees: one target pass scores every branch, verification walks down it, and the output
is still exactly plain generation's (greedy, seeded `match`) or the target's distribution
(`rejection`).

- The tree pass: each node's row equals a linear pass over its own path (bit for bit on the
  native backend, row-invariant in every dtype; to rounding through transformers' forward),
  over one or several passes; committing a path leaves the cache as a linear evaluation of it
  would.
- Verification of hand-built trees, and a chi-square test of tree `rejection` on the joint of
  the first two tokens, with sampled and with deterministic siblings.
- Exactness end to end: random trees of every shape from a test proposer, and the draft
  model's p_split trees, against plain generation.
"""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    TargetSpec,
    cached_tokenizer,
    chi_square_pvalue,
    cpu_policy,
    eagle3_head,
    eagle3_target,
    gpu_policy,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends.native import NativeBackend
from specdecode.chain import Chain
from specdecode.cli import main
from specdecode.drafts import Draft, path_to
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation
from specdecode.sampling import Sampler, distribution
from specdecode.testing import make_llama, perturbed_copy
from specdecode.verify import verify_match, verify_rejection

GREEDY = SamplingParams(temperature=0)
SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
PROMPT = list(range(5, 29))


@functools.cache
def bf16_model() -> LlamaForCausalLM:
    """bfloat16 with a 1536-wide MLP, whose down projection is not row-invariant as one product
    on common CPUs: the tree pass must still give each node its linear bits."""
    model = make_llama(
        VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=1536, init_std=0.5, seed=2
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.to(torch.bfloat16)


@functools.cache
def bf16_draft() -> LlamaForCausalLM:
    return perturbed_copy(bf16_model(), 0.1)


BACKENDS = ("hf-float64", "native-float64", "native-bfloat16")


def make_backend(zoo, kind: str, draft: bool = False, **kwargs):
    if kind == "native-bfloat16":
        return NativeBackend(bf16_draft() if draft else bf16_model(), cached_tokenizer(), **kwargs)
    model = zoo.draft(TargetSpec(), 0.1) if draft else zoo.target(TargetSpec())
    cls = HFBackend if kind == "hf-float64" else NativeBackend
    return cls(model, cached_tokenizer(), **kwargs)


def dtype_of(kind: str) -> str:
    return kind.rsplit("-", 1)[1]


def same(kind: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the native backend (row-invariant in every dtype), to rounding elsewhere."""
    return torch.equal(a, b) if kind.startswith("native") else torch.allclose(a, b, rtol=1e-9, atol=1e-9)


trees = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.tuples(*(st.integers(-1, i - 1) for i in range(n))),
        st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=n, max_size=n),
        st.integers(1, n),  # nodes in the first pass; the rest in a second one
    )
)


# --------------------------------------------------------------------------- the tree pass


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=12, **SETTINGS)
@given(tree=trees, keep=st.integers(0, 11))
def test_tree_rows_equal_linear_passes_over_their_paths(zoo, kind, tree, keep):
    parents, tokens, first = list(tree[0]), tree[1], tree[2]
    backend = make_backend(zoo, kind)
    backend.evaluate(PROMPT)
    rows = torch.cat(
        [backend.evaluate_tree(tokens[:first], parents[:first])]
        + ([backend.evaluate_tree(tokens[first:], parents[first:])] if first < len(tokens) else [])
    )
    assert backend.tokens == PROMPT  # pending nodes are not cached tokens
    linear = make_backend(zoo, kind)
    for node in range(len(tokens)):
        linear.truncate(0)
        linear.evaluate(PROMPT)
        for step in path_to(parents, node):
            row = linear.evaluate([tokens[step]])[-1]
        assert same(kind, rows[node], row), node
    # commit a path: the cache now holds it, and the next pass sees exactly that
    path = path_to(parents, keep % len(tokens))
    backend.commit(path)
    assert backend.tokens == PROMPT + [tokens[n] for n in path]
    linear.truncate(len(PROMPT))
    for step in path:
        linear.evaluate([tokens[step]])
    assert same(kind, backend.evaluate([7, 8])[-1], linear.evaluate([7, 8])[-1])


@pytest.mark.parametrize("kind", BACKENDS)
def test_commit_after_a_tree_equals_a_fresh_evaluation(zoo, kind):
    backend = make_backend(zoo, kind)
    backend.evaluate(PROMPT)
    backend.evaluate_tree([40, 41, 42, 43, 44], [-1, -1, 0, 1, 2])
    backend.commit([1, 3])
    fresh = make_backend(zoo, kind)
    expected = fresh.evaluate([*PROMPT, 41, 43, 50])[-1]
    got = backend.evaluate([50])[-1]
    tolerance = 0.05 if kind.endswith("bfloat16") else 1e-9  # one pass of 27 rows vs passes of 24, 1 and 1
    assert torch.allclose(got, expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("kind", BACKENDS)
def test_committed_path_keeps_its_hidden_states(zoo, kind):
    """What EAGLE-3 reads after a tree step: the kept path's feature rows, as a linear pass
    records them."""
    backend, linear = make_backend(zoo, kind), make_backend(zoo, kind)
    for b in (backend, linear):
        b.capture_hidden([0, 1, 2])
        b.evaluate(PROMPT)
    backend.evaluate_tree([40, 41, 42], [-1, -1, 1])
    backend.evaluate_tree([43], [2])
    backend.commit([1, 2, 3])
    for token in (41, 42, 43):
        linear.evaluate([token])
    end = len(PROMPT) + 3
    got, expected = backend.hidden_states(0, end), linear.hidden_states(0, end)
    assert got.shape == expected.shape
    assert (
        torch.equal(got, expected) if kind.endswith("bfloat16") else torch.allclose(got, expected, atol=1e-9)
    )


@pytest.mark.parametrize("kind", BACKENDS)
def test_truncate_and_evaluate_drop_pending_nodes(zoo, kind):
    backend = make_backend(zoo, kind)
    backend.evaluate(PROMPT)
    reference = backend.evaluate([60])[-1]
    backend.truncate(len(PROMPT))
    backend.evaluate_tree([40, 41], [-1, 0])
    assert same(kind, backend.evaluate([60])[-1], reference)  # evaluate forgot the tree
    backend.truncate(len(PROMPT))
    backend.evaluate_tree([40, 41], [-1, 0])
    backend.truncate(len(PROMPT))
    backend.commit([])
    assert backend.tokens == PROMPT
    assert same(kind, backend.evaluate([60])[-1], reference)


def test_bad_trees_and_paths_are_refused(zoo):
    backend = make_backend(zoo, "native-float64", n_ctx=PROMPT.__len__() + 4)
    backend.evaluate(PROMPT)
    with pytest.raises(ValueError, match="parent"):
        backend.evaluate_tree([40, 41], [-1, 1])
    with pytest.raises(ValueError, match="parents"):
        backend.evaluate_tree([40, 41], [-1])
    backend.truncate(len(PROMPT))
    backend.evaluate_tree([40, 41, 42], [-1, -1, 1])
    with pytest.raises(ValueError, match="root-to-node"):
        backend.commit([0, 2])
    with pytest.raises(SpecdecodeError, match="context full"):
        backend.evaluate_tree([43, 44], [2, 3])


def test_transformers_backend_without_custom_masks_refuses_trees(zoo):
    model = make_llama(VOCAB_SIZE, hidden=16, layers=1, heads=2, kv_heads=1)
    model.config._attn_implementation = "flex_attention"
    backend = HFBackend(model, cached_tokenizer())
    with pytest.raises(SpecdecodeError, match="token trees need the native backend"):
        backend.evaluate_tree([40], [-1])


# --------------------------------------------------------------------------- verification

V = 8


def peaked(tokens: list[int]) -> torch.Tensor:
    """Rows whose argmax is tokens[i]."""
    rows = torch.zeros(len(tokens), V, dtype=torch.float64)
    for i, token in enumerate(tokens):
        rows[i, token] = 5.0
    return rows


def test_match_descends_into_the_child_holding_the_sample():
    # root -> {3 (node 0), 4 (node 1)}; node 1 -> {5 (node 2), 6 (node 3)}; node 3 -> {2 (node 4)}
    draft = Draft([3, 4, 5, 6, 2], parents=[-1, -1, 1, 1, 3])
    # row i + 1 scores node i: after last 4, after node 1 (4) 6, after node 3 (6) 2, then 7 (bonus)
    logits = peaked([4, 0, 6, 0, 2, 7])
    verdict = verify_match(draft, logits, Sampler(GREEDY), [], frozenset())
    assert verdict.path == [1, 3, 4] and verdict.emitted == [4, 6, 2, 7]


def test_match_on_a_tree_stops_where_no_child_holds_the_sample_or_at_eog():
    draft = Draft([3, 4, 5], parents=[-1, -1, 0])
    assert verify_match(draft, peaked([6, 0, 0, 0]), Sampler(GREEDY), [], frozenset()).emitted == [6]
    verdict = verify_match(draft, peaked([3, 1, 0, 0]), Sampler(GREEDY), [], frozenset({1}))
    assert verdict.path == [0] and verdict.emitted == [3, 1]
    eog = verify_match(draft, peaked([3, 5, 0, 0]), Sampler(GREEDY), [], frozenset({3}))
    assert eog.path == [0] and eog.emitted == [3]  # an accepted end-of-generation token ends the step


def test_a_chain_given_as_a_tree_verifies_as_the_chain():
    rows = torch.randn(5, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = SamplingParams(temperature=1.0, seed=3)
    for tokens in ([1, 2, 3, 4], [int(rows[0].argmax()), int(rows[1].argmax()), 0, 0]):
        chain, tree = Draft(tokens), Draft(tokens, parents=[-1, 0, 1, 2])
        for verify in (verify_match, verify_rejection):
            assert verify(chain, rows, Sampler(params), [], frozenset()) == verify(
                tree, rows, Sampler(params), [], frozenset()
            )


# Tree rejection, chi-square: the target's joint of the first two tokens is p0(x1) p1(x2 | x1).
TEMP1 = SamplingParams(temperature=1.0)
P0 = 1.2 * torch.randn(V, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
P1 = 1.2 * torch.randn(V, V, generator=torch.Generator().manual_seed(12), dtype=torch.float64)  # row x1
Q0 = torch.softmax(1.5 * torch.randn(V, generator=torch.Generator().manual_seed(13), dtype=torch.float64), 0)
Q1 = torch.softmax(
    1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(14), dtype=torch.float64), 1
)


def without_replacement(
    q: torch.Tensor, count: int, rng: np.random.Generator
) -> list[tuple[int, torch.Tensor]]:
    picks, q = [], q.clone()
    for _ in range(count):
        q = q / q.sum()
        token = int(rng.choice(V, p=q.numpy()))
        picks.append((token, q))
        q = q.clone()
        q[token] = 0.0
    return picks


def random_tree(rng: np.random.Generator, sampled: bool) -> Draft:
    """Three children of the root, two below each: drawn from q without replacement, or the
    target's own top candidates (point masses, as a good deterministic draft proposes)."""
    tokens, parents, rows = [], [], []
    if sampled:
        level1 = without_replacement(Q0, 3, rng)
    else:
        level1 = [(int(t), None) for t in torch.argsort(P0, descending=True)[:3]]
    for token, row in level1:
        tokens.append(token)
        parents.append(-1)
        rows.append(row)
    for node in range(3):
        picks = (
            without_replacement(Q1[tokens[node]], 2, rng)
            if sampled
            else [(int(t), None) for t in torch.argsort(P1[tokens[node]], descending=True)[:2]]
        )
        for token, row in picks:
            tokens.append(token)
            parents.append(node)
            rows.append(row)
    return Draft(tokens, torch.stack(rows) if sampled else None, parents=parents)


def tree_rejection_trials(sampled: bool, trials: int) -> tuple[Counter, Counter]:
    """The joint counts of the first two tokens, and how often each first-level child was kept
    ("none" when the root's children were all rejected)."""
    rng = np.random.default_rng(5)
    joint: Counter = Counter()
    kept: Counter = Counter()
    for seed in range(trials):
        draft = random_tree(rng, sampled)
        logits = torch.stack([P0, *(P1[token] for token in draft.tokens)])
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        verdict = verify_rejection(draft, logits, sampler, [], frozenset())
        emitted = list(verdict.emitted)
        kept[verdict.path[0] if verdict.path else "none"] += 1
        if len(emitted) == 1:  # the next step would sample x2 from the target given x1
            emitted.append(sampler.sample(P1[emitted[0]], emitted))
        joint[tuple(emitted[:2])] += 1
    return joint, kept


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-siblings", "top-k-siblings"])
def test_tree_rejection_keeps_the_targets_joint_distribution(sampled):
    joint, kept = tree_rejection_trials(sampled, 8000)
    p0 = distribution(P0, TEMP1, [])
    expected = {(a, b): float(p0[a] * distribution(P1[a], TEMP1, [])[b]) for a in range(V) for b in range(V)}
    pvalue = chi_square_pvalue(joint, expected)
    assert pvalue > 0.001, pvalue
    # both branches of the algorithm run: every first-level sibling is kept now and then (the
    # later ones only after the earlier were rejected), and all of them are rejected too
    assert all(kept[node] > 300 for node in (0, 1, 2, "none")), kept


def test_tree_rejection_test_has_power():
    """Keeping the first child always (a wrong verifier) fails the same test."""
    rng = np.random.default_rng(5)
    joint: Counter = Counter()
    for seed in range(4000):
        draft = random_tree(rng, True)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        joint[(draft.tokens[0], sampler.sample(P1[draft.tokens[0]], []))] += 1
    p0 = distribution(P0, TEMP1, [])
    expected = {(a, b): float(p0[a] * distribution(P1[a], TEMP1, [])[b]) for a in range(V) for b in range(V)}
    assert chi_square_pvalue(joint, expected) < 0.001


# --------------------------------------------------------------------------- exactness end to end


class RandomTrees:
    """A proposer of random trees: a random-length piece of the true continuation (known from a
    plain run) hidden among random branches and siblings, in random order."""

    name = "random-trees"
    n_min = 0

    def __init__(self, truth: list[int], seed: int, vocab: int) -> None:
        self.truth = truth
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.prompt_length = 0

    def begin(self, prompt) -> None:
        self.prompt_length = len(prompt)

    def draft(self, history, last, n_max: int) -> Draft:
        done = len(history) + 1 - self.prompt_length  # tokens generated so far, `last` included
        truth = self.truth[done : done + n_max + 2]
        true_left = int(self.rng.integers(0, min(len(truth), 6) + 1))
        extra_left = int(self.rng.integers(0, 10))
        tokens: list[int] = []
        parents: list[int] = []
        true_nodes: list[int] = []
        while true_left or extra_left:
            if true_left and (not extra_left or self.rng.random() < 0.5):
                parents.append(true_nodes[-1] if true_nodes else -1)
                tokens.append(truth[len(true_nodes)])
                true_nodes.append(len(tokens) - 1)
                true_left -= 1
            else:
                parents.append(int(self.rng.integers(-1, len(tokens))))
                tokens.append(int(self.rng.integers(3, self.vocab)))
                extra_left -= 1
        if not tokens:
            return Draft()
        return Draft(tokens, parents=parents) if self.rng.random() < 0.85 else Draft(tokens)

    def accept(self, n_accepted: int) -> None:
        pass

    def end(self) -> None:
        pass


def generate_with(target, proposer, sampling: SamplingParams, config: GenerationConfig, prompt):
    run = Generation(target, Chain([proposer] if proposer else []), Sampler(sampling), config, prompt)
    for _ in run:
        pass
    return run


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=10, **SETTINGS)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]),
    prompt=st.sampled_from([PROMPT, PROMPT[:3], [9, 4, 9, 4, 9]]),
    n_predict=st.integers(1, 40),
    ignore_eos=st.booleans(),
)
def test_random_trees_give_plain_generations_output(
    zoo, exactness_log, kind, seed, temperature, prompt, n_predict, ignore_eos
):
    sampling = SamplingParams(temperature=temperature, seed=seed, top_k=0 if seed % 2 else 20)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=ignore_eos)
    plain = generate_with(make_backend(zoo, kind), None, sampling, config, prompt)
    truth = plain.tokens + [0] * 64
    ours = generate_with(
        make_backend(zoo, kind), RandomTrees(truth, seed, VOCAB_SIZE), sampling, config, prompt
    )
    assert ours.tokens == plain.tokens
    assert ours.text == plain.text
    assert ours.stats.stop_reason == plain.stats.stop_reason
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(f"tree/random-{mode}", kind, ours.stats, ours.stats.stop_reason, dtype_of(kind))


def test_random_trees_accept_and_branch(zoo):
    """The property test's proposer really exercises trees: branched drafts, kept paths, and
    accepted nodes that were not the first child."""
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    plain = generate_with(make_backend(zoo, "native-float64"), None, GREEDY, config, PROMPT)
    ours = generate_with(
        make_backend(zoo, "native-float64"),
        RandomTrees(plain.tokens + [0] * 64, 1, VOCAB_SIZE),
        GREEDY,
        config,
        PROMPT,
    )
    totals = ours.stats.totals
    assert ours.tokens == plain.tokens
    assert totals.n_tree_drafts > 3 and totals.n_accepted > 10 and totals.n_drafted > 2 * totals.n_accepted


DRAFT_TREES = st.builds(
    DraftModelConfig,
    n_max=st.integers(1, 10),
    p_min=st.sampled_from([0.0, 0.3, 0.75]),
    p_split=st.sampled_from([0.0, 0.05, 0.1, 0.3]),
    n_parallel=st.integers(2, 6),
)


def policy_of(name: str) -> dict:
    """Pipeline arguments for a policy: the adaptive one over fixed CPU-shaped costs (see
    `conftest.cpu_policy`), which it sizes each tree by."""
    return {"spec_policy": name, "policy_models": cpu_policy() if name == "adaptive" else None}


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=10, **SETTINGS)
@given(
    draft_config=DRAFT_TREES,
    temperature=st.sampled_from([0.0, 0.0, 1.0]),
    seed=st.integers(0, 1000),
    n_predict=st.integers(1, 40),
    policy=st.sampled_from(["classic", "adaptive"]),
)
def test_draft_model_trees_give_plain_generations_output(
    zoo, exactness_log, kind, draft_config, temperature, seed, n_predict, policy
):
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
    expected = Pipeline(make_backend(zoo, kind)).generate(PROMPT, sampling, config)
    pipeline = Pipeline(
        make_backend(zoo, kind),
        make_backend(zoo, kind, draft=True),
        draft_config=draft_config,
        **policy_of(policy),
    )
    result = pipeline.generate(PROMPT, sampling, config)
    assert result.tokens == expected.tokens
    mode = "greedy" if temperature == 0 else "match"
    label = f"tree/draft-p_split-{mode}" + ("/adaptive" if policy == "adaptive" else "")
    exactness_log.record(label, kind, result.stats, result.stats.stop_reason, dtype_of(kind))


def test_draft_model_tree_shape_follows_p_split(zoo):
    """Branches open where a non-top candidate is likelier than p_split, at most n_parallel
    leaves and n_max nodes; every depth is one pass of the draft; the draft keeps the top-1
    branch cached, as a chain would."""
    target, draft = make_backend(zoo, "native-float64"), make_backend(zoo, "native-float64", draft=True)
    config = DraftModelConfig(n_max=10, p_min=0.0, p_split=0.02, n_parallel=3)
    pipeline = Pipeline(target, draft, draft_config=config)
    run = pipeline.stream(PROMPT, GREEDY, GenerationConfig(n_predict=2))
    strategy = run.chain.strategies[0]
    passes = []
    original = draft.evaluate_tree
    draft.evaluate_tree = lambda ids, parents: passes.append(len(ids)) or original(ids, parents)
    target.evaluate(PROMPT)
    proposal = strategy.draft(PROMPT[:-1], PROMPT[-1], 10)
    leaves = set(range(len(proposal.tokens))) - set(proposal.parent_list())
    assert proposal.parents is not None and len(proposal.tokens) <= 10 and len(leaves) <= 3
    assert len(leaves) == 3  # this draft is unsure enough at p_split 0.02 to branch fully
    assert len(passes) == proposal.depth - 1  # one draft pass per depth, leaves never scored
    top1 = [proposal.tokens[0]]
    node = 0
    while node in proposal.parent_list():
        node = proposal.parent_list().index(node)
        top1.append(proposal.tokens[node])
    assert (
        draft.tokens[: len(PROMPT)] == PROMPT
        and draft.tokens[len(PROMPT) :] == top1[: len(draft.tokens) - len(PROMPT)]
    )


class RankRule:
    """A policy's rule (`KeepDrafting`) that makes a node of every candidate whose rank
    probability is above `floor`; chains by the same test."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.asked: list[tuple[int, float, int]] = []

    def __call__(self, depth: int, confidence: float) -> bool:
        return confidence > self.floor

    def node(self, parent_reach: float, depth: int, confidence: float, nodes: int) -> float | None:
        self.asked.append((depth, confidence, nodes))
        return parent_reach * confidence if confidence > self.floor else None


@pytest.mark.parametrize(("floor", "branches"), [(0.0, 3), (0.999, 0)])
def test_a_policys_rule_decides_the_tree_nodes_in_place_of_p_min_and_p_split(zoo, floor, branches):
    target, draft = make_backend(zoo, "native-float64"), make_backend(zoo, "native-float64", draft=True)
    config = DraftModelConfig(n_max=10, p_min=1.0, p_split=1.0, n_parallel=3)  # classic: no node
    run = Pipeline(target, draft, draft_config=config).stream(PROMPT, GREEDY, GenerationConfig(n_predict=2))
    strategy = run.chain.strategies[0]
    target.evaluate(PROMPT)
    strategy.keep_drafting = RankRule(floor)
    proposal = strategy.draft(PROMPT[:-1], PROMPT[-1], 10)
    leaves = set(range(len(proposal.tokens))) - set(proposal.parent_list())
    assert len(leaves) == branches  # all n_parallel branches, or (nothing likely enough) no draft
    assert proposal.confidences is None or len(proposal.confidences) == len(proposal.tokens)
    asked = strategy.keep_drafting.asked
    assert asked[0][0] == 1 and asked[0][2] == 0  # the root's best candidate first
    if branches:
        assert asked[1] == (1, pytest.approx(asked[1][1]), 1) and asked[0][1] >= asked[1][1]  # then rank 1
    else:
        assert len(asked) == 1 and proposal.tokens == []  # refused the best: none of the rest asked


def test_adaptive_policy_sizes_trees_each_step(zoo, exactness_log, steady_clock):
    """Under the policy, with room for four branches, the draft makes trees of several sizes
    (and chains, or nothing, where branching does not pay), and learns from their outcomes."""
    target, draft = make_backend(zoo, "native-float64"), make_backend(zoo, "native-float64", draft=True)
    models = cpu_policy()
    config = DraftModelConfig(n_max=8, n_parallel=4)
    pipeline = Pipeline(target, draft, draft_config=config, spec_policy="adaptive", policy_models=models)
    generation = GenerationConfig(n_predict=60, ignore_eos=True)
    result = pipeline.generate(PROMPT, GREEDY, generation)
    assert (
        result.tokens
        == Pipeline(make_backend(zoo, "native-float64")).generate(PROMPT, GREEDY, generation).tokens
    )
    sizes = {length for (strategy, length) in models.choices if strategy == "draft tree"}
    assert result.stats.totals.n_tree_drafts > 0 and len(sizes) > 1
    assert any(counts[1] > 0 for (_, depth, _), counts in models.acceptance.cells.items() if depth == 1)
    exactness_log.record("tree/draft-p_split-greedy/adaptive", "native-float64", result.stats, "n_predict")


def test_adaptive_eagle3_trees_grow_where_rows_are_cheap(exactness_log, steady_clock):
    """The same head and text under a CPU's costs and a GPU's (a verify row nearly free): the
    policy drafts bigger EAGLE-3 trees where rows cost less, and both give plain's output."""
    target = eagle3_target()
    config = GenerationConfig(n_predict=60, ignore_eos=True)
    expected = Pipeline(NativeBackend(target, cached_tokenizer())).generate(PROMPT, GREEDY, config)
    nodes = {}
    for name, models in (("cpu", cpu_policy()), ("gpu", gpu_policy())):
        pipeline = Pipeline(
            NativeBackend(target, cached_tokenizer()),
            eagle3=eagle3_head(),
            draft_config=DraftModelConfig(n_max=6, tree_tokens=16, tree_topk=4),
            spec_policy="adaptive",
            policy_models=models,
        )
        result = pipeline.generate(PROMPT, GREEDY, config)
        assert result.tokens == expected.tokens
        totals = result.stats.totals
        nodes[name] = totals.n_drafted / max(1, totals.n_drafts)
        exactness_log.record(
            f"tree/eagle3-greedy/adaptive-{name}", "native-float64", result.stats, "n_predict"
        )
    assert nodes["gpu"] > 1.3 * nodes["cpu"], nodes


def test_a_draft_tree_that_never_branches_is_the_chain(zoo):
    """No candidate above p_split: the same draft as a chain, drafted the chain's way (ordinary
    draft passes, no tree pass), and handed over as a chain (the target's plain pass)."""
    drafts = {}
    for n_parallel in (1, 4):
        target, draft = make_backend(zoo, "native-float64"), make_backend(zoo, "native-float64", draft=True)
        config = DraftModelConfig(n_max=8, p_min=0.0, p_split=1.0, n_parallel=n_parallel)
        run = Pipeline(target, draft, draft_config=config).stream(
            PROMPT, GREEDY, GenerationConfig(n_predict=2)
        )
        draft.evaluate_tree = None  # never called
        target.evaluate(PROMPT)
        drafts[n_parallel] = run.chain.strategies[0].draft(PROMPT[:-1], PROMPT[-1], 8)
        assert draft.tokens == PROMPT + drafts[n_parallel].tokens[:-1]
    assert drafts[4] == drafts[1] and drafts[4].parents is None


def test_sampled_draft_tree_rows_are_the_distributions_drawn_from(zoo):
    target, draft = make_backend(zoo, "native-float64"), make_backend(zoo, "native-float64", draft=True)
    config = DraftModelConfig(n_max=8, p_min=0.0, p_split=0.01, n_parallel=4)
    pipeline = Pipeline(target, draft, draft_config=config)
    run = pipeline.stream(
        PROMPT, SamplingParams(temperature=1.0, seed=4), GenerationConfig(n_predict=2, verify="rejection")
    )
    target.evaluate(PROMPT)
    proposal = run.chain.strategies[0].draft(PROMPT[:-1], PROMPT[-1], 8)
    assert proposal.probs is not None and proposal.parents is not None
    siblings: dict[int, list[int]] = {}
    for node, parent in enumerate(proposal.parents):
        row = proposal.probs[node]
        assert abs(float(row.sum()) - 1.0) < 1e-9 and float(row[proposal.tokens[node]]) > 0
        for earlier in siblings.get(parent, []):
            assert float(row[proposal.tokens[earlier]]) == 0.0  # drawn without replacement
        siblings.setdefault(parent, []).append(node)
    assert any(len(group) > 1 for group in siblings.values())


def test_tree_settings_are_checked():
    with pytest.raises(SpecdecodeError, match="--draft-n-parallel"):
        DraftModelConfig(n_parallel=0)
    with pytest.raises(SpecdecodeError, match="--draft-p-split"):
        DraftModelConfig(p_split=1.5)
    with pytest.raises(SpecdecodeError, match="--draft-tree-tokens"):
        DraftModelConfig(tree_tokens=-1)


def test_cli_draft_tree_reports_tree_stats(saved_model_dir, capsys):
    code = main(
        [
            "generate",
            "-m",
            str(saved_model_dir),
            "-md",
            str(saved_model_dir),
            "-p",
            "def f(x):",
            "-n",
            "12",
            "--temp",
            "0",
            "--draft-n-parallel",
            "3",
            "--draft-p-split",
            "0.0",
            "--draft-p-min",
            "0",
            "--spec-policy",
            "classic",  # the draft is the target itself: at its cost, the adaptive policy drafts nothing
            "--json",
        ]
    )
    assert code == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["totals"]["n_tree_drafts"] > 0 and stats["mean_tree_size"] > stats["mean_depth"]
    assert main(["generate", "-m", str(saved_model_dir), "-p", "x", "--draft-n-parallel", "0"]) == 2


@functools.cache
def eagle3_models(kind: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The EAGLE-3 test target in this backend's dtype, and a perturbed copy as a draft."""
    target = eagle3_target()
    if kind.endswith("bfloat16"):
        target = copy.deepcopy(target).to(torch.bfloat16)
    return target, perturbed_copy(target, 0.05)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=10, **SETTINGS)
@given(
    tree_tokens=st.integers(1, 24),
    topk=st.integers(1, 4),
    n_max=st.integers(1, 6),
    with_draft_tree=st.booleans(),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.integers(0, 1000),
    n_predict=st.integers(1, 40),
    policy=st.sampled_from(["classic", "adaptive"]),
)
def test_eagle3_trees_give_plain_generations_output(
    exactness_log, kind, tree_tokens, topk, n_max, with_draft_tree, temperature, seed, n_predict, policy
):
    """EAGLE-2 dynamic trees of the head, alone or behind the draft model's p_split trees in a
    chain (the head then catches up on the target's hidden rows of committed tree paths)."""
    cls = HFBackend if kind == "hf-float64" else NativeBackend
    target, draft = eagle3_models(kind)
    sampling = SamplingParams(temperature=temperature, seed=seed)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
    expected = Pipeline(cls(target, cached_tokenizer())).generate(PROMPT, sampling, config)
    draft_config = DraftModelConfig(
        n_max=n_max, p_min=0.5, tree_tokens=tree_tokens, tree_topk=topk, n_parallel=3, p_split=0.05
    )
    pipeline = Pipeline(
        cls(target, cached_tokenizer()),
        cls(draft, cached_tokenizer()) if with_draft_tree else None,
        eagle3=eagle3_head(),
        draft_config=draft_config,
        **policy_of(policy),
    )
    result = pipeline.generate(PROMPT, sampling, config)
    assert result.tokens == expected.tokens
    mode = "greedy" if temperature == 0 else "match"
    label = f"tree/eagle3-{mode}" + ("/adaptive" if policy == "adaptive" else "")
    exactness_log.record(label, kind, result.stats, result.stats.stop_reason, dtype_of(kind))


def test_eagle3_trees_accept_more_per_pass_than_its_chain():
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    target, _ = eagle3_models("native-float64")
    per_pass = {}
    for name, tree_tokens in (("chain", 0), ("tree", 12)):
        draft_config = DraftModelConfig(n_max=5, p_min=0.0, tree_tokens=tree_tokens, tree_topk=3)
        pipeline = Pipeline(
            NativeBackend(target, cached_tokenizer()), eagle3=eagle3_head(), draft_config=draft_config
        )
        stats = pipeline.generate(PROMPT, GREEDY, config).stats
        per_pass[name] = stats.tokens_per_pass
        if tree_tokens:
            assert stats.totals.n_tree_drafts > 0
    assert per_pass["tree"] > per_pass["chain"]
