"""EAGLE-3 token trees: tree attention in the head's cache.

The reference for every tree node is the head run linearly along its path (`HeadCache` and
`Eagle3Head.step`, as chain drafting does): tree attention must give each node exactly what
that run gives.
"""

from __future__ import annotations

import torch
from conftest import eagle3_head

from specdecode.eagle3.head import HeadCache, HeadTree

TIGHT = {"rtol": 0, "atol": 1e-12}


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
