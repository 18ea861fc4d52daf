"""EAGLE-3 token trees: tree attention in the head's cache and EAGLE-2 dynamic tree drafting.

The reference for every tree is the head run linearly along one path (`HeadCache` and
`Eagle3Head.step`, as chain drafting does): tree attention must give each node exactly what
that run gives, and the kept nodes must be the best-scored of a brute-force EAGLE-2 expansion
built from such runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import (
    VOCAB_SIZE,
    chi_square_pvalue,
    cpu_policy,
    eagle3_corpus,
    eagle3_head,
    eagle3_target,
    gpu_policy,
)

from specdecode import DraftModelConfig, Sampler, SamplingParams
from specdecode.drafts import Draft
from specdecode.policy import PolicyModels, Stopper
from specdecode.sampling import distribution
from specdecode.strategies.eagle3 import Eagle3Strategy
from specdecode.strategies.eagle3_head import HeadCache, HeadTree
from specdecode.verify import verify_rejection

# wide sampling (no truncation): siblings are drawn from the whole draft vocabulary; the
# penalty makes each node's distribution depend on the path above it
WIDE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5)
TIGHT = {"rtol": 0, "atol": 1e-12}
TEMP1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def contexts(count: int = 4, length: int = 14) -> list[list[int]]:
    """Windows of the target's own generations: where the trained head is often right."""
    tokens = eagle3_corpus()
    return [tokens[start : start + length].tolist() for start in range(0, 200 * count, 200)]


def strategy_after(zoo, ids: list[int], config: DraftModelConfig, sampler: Sampler | None = None):
    """A fresh strategy whose target has evaluated ids[:-1] (ids[-1] is `last`)."""
    target = zoo.backend(eagle3_target())
    strategy = Eagle3Strategy(eagle3_head(), target, config, sampler)
    target.evaluate(ids[:-1])
    return strategy


class LinearHead:
    """The head run linearly after a context's true pairs, along any path of drafted tokens."""

    def __init__(self, strategy: Eagle3Strategy, ids: list[int]) -> None:
        self.head, self.n = strategy.head, len(ids) - 1
        self.cache = HeadCache()
        g = self.head.fc(strategy.target.hidden_states(0, self.n))
        self.seed = self.head.step(ids[1:], g, 0, self.cache)[-1]

    @torch.inference_mode()
    def state(self, path: tuple[int, ...]) -> torch.Tensor:
        self.cache.truncate(self.n)
        h = self.seed
        for j, token in enumerate(path):
            h = self.head.step([token], h[None], self.n + j, self.cache)[-1]
        return h

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.head.target_logits(self.state(path))


def paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each node's path of tokens from the root."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens, draft.parent_list(), strict=True):
        out.append((*(out[parent] if parent >= 0 else ()), token))
    return out


def children(draft: Draft) -> dict[int, list[int]]:
    """parent index (-1: the root) -> its children's indices, in order."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(draft.parent_list()):
        out.setdefault(parent, []).append(i)
    return out


# --------------------------------------------------------------------------- the head


def test_tree_attention_sees_the_true_pairs_and_the_ancestors_only():
    """Nodes added in passes of mixed depths give the states of linear runs along their paths,
    and dropping the tree leaves the true pairs as they were."""
    head = eagle3_head()
    gen = torch.Generator().manual_seed(0)
    size = head.config.hidden_size
    true_tokens, n = [7, 9, 11, 13, 15], 5
    tokens = [21, 22, 23, 24, 25, 26, 27, 28, 29]
    g = torch.randn(len(tokens), size, generator=gen, dtype=torch.float64)
    passes = [[-1, -1, -1], [0, 0, 2, -1], [3, 5]]  # node 6 (depth 1) arrives with depth-2 nodes
    with torch.inference_mode():
        cache = HeadCache()
        head.step(true_tokens, torch.randn(n, size, generator=gen, dtype=torch.float64), 0, cache)
        reference = HeadCache()
        reference.append(cache.k[:, :, :n], cache.v[:, :, :n])
        tree, states, node_parents = HeadTree(cache), [], []
        for parents in passes:
            first = len(states)
            states += head.tree_step(
                tokens[first : first + len(parents)], g[first : first + len(parents)], parents, tree
            )
            node_parents += parents
        assert cache.n == n + len(tokens)
        for node, state in enumerate(states):
            path = [node]
            while node_parents[path[0]] >= 0:
                path.insert(0, node_parents[path[0]])
            reference.truncate(n)
            for depth, i in enumerate(path):
                linear = head.step([tokens[i]], g[i][None], n + depth, reference)[-1]
            torch.testing.assert_close(state, linear, **TIGHT)
        tree.drop()
        assert cache.n == n and tree.paths == []
        torch.testing.assert_close(cache.k[:, :, :n], reference.k[:, :, :n], rtol=0, atol=0)


# --------------------------------------------------------------------------- drafting


@pytest.mark.parametrize(
    ("tree_tokens", "topk", "n_max", "budget"),
    [(8, 4, 6, 16), (16, 4, 6, 16), (32, 4, 6, 16), (16, 4, 6, 3), (5, 2, 6, 16), (1, 4, 6, 16)],
)
def test_tree_drafts_are_trees_within_their_budgets(zoo, tree_tokens, topk, n_max, budget):
    config = DraftModelConfig(n_max=n_max, p_min=0.75, tree_tokens=tree_tokens, tree_topk=topk)
    depths = []
    for ids in contexts():
        strategy = strategy_after(zoo, ids, config)
        draft = strategy.draft(ids[:-1], ids[-1], budget)
        assert strategy.cache.n == len(ids) - 1  # tree nodes were scratch
        assert not draft.is_chain and draft.probs is None and 0 < len(draft.tokens) <= tree_tokens
        assert all(-1 <= p < i for i, p in enumerate(draft.parents))  # parents first: ancestor-closed
        assert draft.depth <= min(n_max, budget, tree_tokens)
        for siblings in children(draft).values():
            assert len({draft.tokens[i] for i in siblings}) == len(siblings) <= topk
        depths.append(draft.depth)
    if tree_tokens >= 8 and budget > 3:
        assert max(depths) >= 3  # p_min does not cut trees: the trained head drafts deep ones


def test_children_are_the_heads_top_k_along_their_path(zoo, monkeypatch):
    """Every head state the tree computes equals a linear run along the node's path, and each
    node's kept children are the best of that run's logits, in descending order."""
    config = DraftModelConfig(n_max=5, tree_tokens=16, tree_topk=3)
    for ids in contexts(3):
        strategy = strategy_after(zoo, ids, config)
        node_tokens: list[int] = []
        computed: dict[tuple[int, ...], torch.Tensor] = {}  # path -> the state the tree computed
        real = strategy.head.tree_step

        def recording(tokens, g, parents, tree, real=real, node_tokens=node_tokens, computed=computed):
            states = real(tokens, g, parents, tree)
            node_tokens += tokens
            for node_path, state in zip(tree.paths[-len(tokens) :], states, strict=True):
                computed[tuple(node_tokens[i] for i in node_path)] = state
            return states

        monkeypatch.setattr(strategy.head, "tree_step", recording)
        draft = strategy.draft(ids[:-1], ids[-1], 16)
        monkeypatch.undo()
        linear = LinearHead(strategy, ids)
        assert len(computed) == len(node_tokens) > 0
        for path, state in computed.items():
            torch.testing.assert_close(state, linear.state(path), **TIGHT)
        node_paths = paths(draft)
        for parent, kids in children(draft).items():
            path = node_paths[parent] if parent >= 0 else ()
            assert parent < 0 or path in computed  # expanded by a tree pass
            logits = linear.logits(path)
            if path:
                torch.testing.assert_close(strategy.head.target_logits(computed[path]), logits, **TIGHT)
            assert [draft.tokens[i] for i in kids] == torch.topk(logits, len(kids)).indices.tolist()


def reference_tree(linear: LinearHead, topk: int, depth: int) -> dict[tuple[int, ...], float]:
    """Brute-force EAGLE-2 expansion without pruning: every candidate path and its log-score."""
    scores: dict[tuple[int, ...], float] = {}
    frontier = [()]
    for level in range(1, depth + 1):
        new = {}
        for path in frontier:
            log_probs = torch.log_softmax(linear.logits(path).double(), dim=-1)
            top = torch.topk(log_probs, topk)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                new[(*path, token)] = scores.get(path, 0.0) + value
        scores.update(new)
        if level < depth:
            frontier = sorted(new, key=new.__getitem__, reverse=True)[:topk]
    return scores


@pytest.mark.parametrize(("tree_tokens", "topk", "depth"), [(6, 2, 4), (10, 3, 4), (4, 4, 3)])
def test_the_best_scored_nodes_are_kept(zoo, tree_tokens, topk, depth):
    config = DraftModelConfig(n_max=depth, tree_tokens=tree_tokens, tree_topk=topk)
    for ids in contexts(3):
        strategy = strategy_after(zoo, ids, config)
        draft = strategy.draft(ids[:-1], ids[-1], 16)
        scores = reference_tree(LinearHead(strategy, ids), topk, depth)
        best = sorted(scores, key=scores.__getitem__, reverse=True)[:tree_tokens]
        assert paths(draft) == best  # best first
        for size in range(1, tree_tokens):  # so a cut tree is the best tree of its size
            assert paths(draft.truncated(depth, size)) == best[:size]
        kept = [scores[path] for path in paths(draft)]
        others = [score for path, score in scores.items() if path not in set(paths(draft))]
        assert min(kept) >= max(others, default=-np.inf)


def test_tree_tokens_0_is_the_chain_and_topk_1_the_same_tokens(zoo):
    for ids in contexts(3):
        chain = strategy_after(zoo, ids, DraftModelConfig(n_max=5, p_min=0.0)).draft(ids[:-1], ids[-1], 16)
        assert chain.is_chain and len(chain.tokens) == 5
        strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=5, tree_tokens=5, tree_topk=1))
        linear = LinearHead(strategy, ids)
        greedy: tuple[int, ...] = ()
        for _ in range(5):
            greedy += (int(torch.argmax(linear.logits(greedy))),)
        assert tuple(chain.tokens) == greedy
        tree = strategy.draft(ids[:-1], ids[-1], 16)
        assert tree.tokens == chain.tokens and tree.parents == [-1, 0, 1, 2, 3]


def test_n_min_drops_shallow_trees_and_the_budget_caps_depth(zoo):
    ids = contexts(1)[0]
    config = DraftModelConfig(n_max=6, n_min=3, tree_tokens=12, tree_topk=2)
    strategy = strategy_after(zoo, ids, config)
    assert strategy.draft(ids[:-1], ids[-1], 2).tokens == []
    assert strategy.draft(ids[:-1], ids[-1], 3).depth == 3
    assert strategy.draft(ids[:-1], ids[-1], 16).depth >= 3


def test_reused_head_cache_drafts_what_a_fresh_head_drafts(zoo):
    """True pairs are reused across drafts (growing, rolled back, diverging contexts) while tree
    nodes are not: every draft equals a fresh strategy's."""
    tokens = eagle3_corpus()[300:330].tolist()
    steps = [tokens[:10], tokens[:14], tokens[:11], [*tokens[:8], 5, 6], tokens[:20]]
    config = DraftModelConfig(n_max=4, tree_tokens=10, tree_topk=3)
    target = zoo.backend(eagle3_target())
    strategy = Eagle3Strategy(eagle3_head(), target, config)
    for ids in steps:
        target.truncate(0)
        target.evaluate(ids[:-1])
        draft = strategy.draft(ids[:-1], ids[-1], 16)
        fresh = strategy_after(zoo, ids, config).draft(ids[:-1], ids[-1], 16)
        assert (draft.tokens, draft.parents) == (fresh.tokens, fresh.parents)


# --------------------------------------------------------------------------- rejection verification


def rejection_draft(zoo, ids: list[int], seed: int) -> Draft:
    config = DraftModelConfig(n_max=4, tree_tokens=12, tree_topk=3)
    return strategy_after(zoo, ids, config, Sampler(replace(WIDE, seed=seed))).draft(ids[:-1], ids[-1], 16)


def test_rejection_siblings_are_drawn_without_replacement(zoo):
    """Each node's row is the distribution it was drawn from: its parent's sampling distribution
    with the earlier siblings removed and renormalised."""
    for seed, ids in enumerate(contexts(3)):
        draft = rejection_draft(zoo, ids, seed)
        assert draft.depth > 1 and draft.probs.shape == (len(draft.tokens), VOCAB_SIZE)
        torch.testing.assert_close(draft.probs.sum(1), torch.ones(len(draft.tokens), dtype=torch.float64))
        assert all(float(draft.probs[i, token]) > 0 for i, token in enumerate(draft.tokens))
        linear = LinearHead(strategy_after(zoo, ids, DraftModelConfig()), ids)
        node_paths = paths(draft)
        for parent, kids in children(draft).items():
            path = node_paths[parent] if parent >= 0 else ()
            expected = distribution(linear.logits(path), WIDE, [*ids, *path])
            earlier = [draft.tokens[i] for i in kids]
            assert len(set(earlier)) == len(earlier)
            for j, i in enumerate(kids):
                assert float(draft.probs[i, earlier[:j]].abs().sum()) == 0.0
                torch.testing.assert_close(draft.probs[i], expected / expected.sum(), **TIGHT)
                expected = expected.clone()
                expected[earlier[j]] = 0.0
        # seeded: the same tree again; another seed draws another one
        again = rejection_draft(zoo, ids, seed)
        assert (again.tokens, again.parents) == (draft.tokens, draft.parents)
        assert torch.equal(again.probs, draft.probs)
    assert any(
        rejection_draft(zoo, ids, 100).tokens != rejection_draft(zoo, ids, 0).tokens for ids in contexts(3)
    )


def recursive_rejection(p: torch.Tensor, tokens: list[int], rows: torch.Tensor, rng) -> int:
    """One step of SpecInfer's verification over sibling drafts: try each against the residual."""
    residual = p
    for token, q in zip(tokens, rows, strict=True):
        if rng.random() * float(q[token]) < float(residual[token]):
            return token
        residual = (residual - q).clamp(min=0)
        residual = residual / residual.sum()
    return int(rng.choice(len(residual), p=residual.numpy()))


def test_kept_siblings_leave_rejection_exact(zoo):
    """Ranking a drawn child by its own probability would keep the likelier of the draws and
    bias verification (this test then gives chi-square near 100); ranking the j-th draw by the
    j-th largest probability keeps a prefix of the draws, and the first token verified against
    any target distribution p follows p."""
    ids = contexts(1)[0]
    config = DraftModelConfig(n_max=1, tree_tokens=2, tree_topk=4)
    strategy = strategy_after(zoo, ids, config, Sampler(replace(WIDE, seed=1)))
    with torch.no_grad():
        p = torch.softmax(eagle3_target()(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
    rng, n = np.random.default_rng(0), 2000
    counts = np.zeros(len(p))
    for _ in range(n):
        draft = strategy.draft(ids[:-1], ids[-1], 1)
        assert len(draft.tokens) == 2
        counts[recursive_rejection(p, draft.tokens, draft.probs, rng)] += 1
    order = torch.argsort(p, descending=True).numpy()
    groups = [order[:1], order[1:3], order[3:6], order[6:]]
    expected = np.array([float(p[g].sum()) for g in groups]) * n
    observed = np.array([counts[g].sum() for g in groups])
    assert float(((observed - expected) ** 2 / expected).sum()) < 16.3  # chi-square, 3 dof, p = 0.001


def ruled_first_tokens(
    zoo, models: PolicyModels, n: int, reversed_siblings: bool = False
) -> tuple[Counter, dict]:
    """The first token of n rejection verifications of depth-1 trees whose nodes the adaptive
    policy's rule chooses, and the target's distribution it should follow. The rule is shown
    first that drafts of the head's second-largest probability were always kept, so that it
    rates the second draw above the first (as acceptance counts by confidence bucket may well
    do). reversed_siblings: verify the siblings last drawn first, each against its own row (a
    wrong verification, for the test's power)."""
    ids = contexts(1)[0]
    strategy = strategy_after(zoo, ids, DraftModelConfig(n_max=1, tree_tokens=3, tree_topk=4))
    first, second = strategy.draft(ids[:-1], ids[-1], 1).confidences[:2]  # classic: the top ranks
    for _ in range(6):
        models.acceptance.observe_tree("eagle3", [second], [-1], [0])
    rule = Stopper(models, "eagle3", 1.0 / models.costs.pass_time(1))
    assert rule.node(1.0, 1, second, 1) > rule.node(1.0, 1, first, 0)
    strategy.sampler = Sampler(replace(TEMP1, seed=1))
    strategy.keep_drafting = rule
    with torch.no_grad():
        root = eagle3_target()(input_ids=torch.tensor([ids])).logits[0, -1].double()
    verifier = Sampler(replace(TEMP1, seed=2))
    counts: Counter = Counter()
    for _ in range(n):
        draft = strategy.draft(ids[:-1], ids[-1], 1)
        assert len(draft.tokens) == 3 and draft.parents == [-1, -1, -1]
        if reversed_siblings:
            draft = replace(draft, tokens=draft.tokens[::-1], probs=draft.probs.flip(0))
        logits = root[None].expand(len(draft.tokens) + 1, -1)  # only the root's row is read
        counts[verify_rejection(draft, logits, verifier, ids, frozenset()).emitted[0]] += 1
    return counts, {token: float(p) for token, p in enumerate(distribution(root, TEMP1, ids))}


@pytest.mark.parametrize("policy", [gpu_policy, cpu_policy], ids=["gpu-costs", "cpu-costs"])
def test_adaptive_rule_leaves_rejection_exact(zoo, policy, exactness_log):
    """Siblings are verified in the order they were drawn, each against the row it was drawn
    from, whatever the rule's estimates of their ranks: 1000 verifications, chi-square at
    alpha 0.001. (Ordered by the rule's own estimates, the second draw was tried first: p about
    1e-30.)"""
    counts, expected = ruled_first_tokens(zoo, policy(), 1000)
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > 0.001, pvalue
    exactness_log.record_distribution(f"eagle3 tree, adaptive ({policy.__name__})", sum(counts.values()))


def test_adaptive_rule_rejection_test_has_power(zoo):
    """The same fit fails when the siblings are verified in another order than they were drawn."""
    counts, expected = ruled_first_tokens(zoo, gpu_policy(), 1000, reversed_siblings=True)
    assert chi_square_pvalue(counts, expected) < 0.001
