"""What a strategy proposes: a chain or a tree of target ids, with what verification needs.

It lives below the strategies because constraints prune drafts and verification reads them
without knowing which strategy made one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class Draft:
    """Proposed continuation of `history + [last]`, in target ids: a chain or a token tree.

    tokens: the nodes, parents before children. parents: None for a chain (node i follows
    node i-1, node 0 follows `last`); for a tree, parents[i] is the index of node i's parent
    (< i), or -1 when node i follows `last` directly. Siblings are listed in the order
    verification tries them.
    probs: [K, V] the distribution each node was drawn from (rejection verification): for
    siblings drawn without replacement, node i's row is the parent's distribution with the
    earlier siblings removed and renormalised. None for a deterministic proposer, which
    verification treats as a point mass on each node.
    confidences: a drafting model's confidence in each node (the top-1 probability it drafted a
    chain token at; for the j-th child of a tree node, the j-th largest probability), which
    the adaptive policy learns acceptance by; None for model-free drafts.
    An empty draft means "no opinion": the step falls back to one plain target token.
    """

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    strategy: str | None = None  # set by the chain: who drafted it
    parents: list[int] | None = None
    confidences: list[float] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            assert len(self.parents) == len(self.tokens), "one parent per node"
            assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents must come first"
        if self.confidences is not None:
            assert len(self.confidences) == len(self.tokens), "one confidence per node"

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent_list(self) -> list[int]:
        """parents[i] for every node, chains included."""
        return list(range(-1, len(self.tokens) - 1)) if self.parents is None else list(self.parents)

    def depths(self) -> list[int]:
        """depths[i]: 1 for a child of `last`, parent's depth + 1 below it."""
        depths: list[int] = []
        for parent in self.parent_list():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        """The longest path: the most tokens a verification can accept."""
        return len(self.tokens) if self.parents is None else max(self.depths(), default=0)

    def simplified(self) -> Draft:
        """The same draft, as a chain when its tree has a single branch (the cheaper pass)."""
        if self.parents is not None and all(parent == node - 1 for node, parent in enumerate(self.parents)):
            return replace(self, parents=None)
        return self

    def first_branch(self) -> Draft:
        """The chain that takes every node's first child from the root down: a tree's
        preferred path (siblings come in the order verification tries them)."""
        if self.parents is None:
            return self
        keep: list[int] = []
        for node, parent in enumerate(self.parents):
            if parent == (keep[-1] if keep else -1):
                keep.append(node)
        return replace(self.subset(keep), parents=None)

    def truncated(self, depth: int, nodes: int | None = None) -> Draft:
        """The draft cut to paths of at most `depth` tokens and (trees) the first `nodes` nodes."""
        if self.parents is None:
            n = min(depth, len(self.tokens) if nodes is None else nodes)
            return self if len(self.tokens) <= n else self.subset(list(range(n)))
        keep = [i for i, d in enumerate(self.depths()) if d <= depth][:nodes]
        return self if len(keep) == len(self.tokens) else self.subset(keep)

    def subset(self, keep: list[int]) -> Draft:
        """The nodes `keep` (ascending, each one's parent kept too), with what each carries."""
        index = {old: new for new, old in enumerate(keep)}
        return replace(
            self,
            tokens=[self.tokens[i] for i in keep],
            parents=None if self.parents is None else [index.get(self.parents[i], -1) for i in keep],
            probs=None if self.probs is None else self.probs[keep],
            confidences=None if self.confidences is None else [self.confidences[i] for i in keep],
        )


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes of a tree (parents as in `Draft`) from the root's child down to `node`, itself
    last; none for -1 (the root)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
