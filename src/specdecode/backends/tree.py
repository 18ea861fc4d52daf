"""The rows of a forward pass that scores a token tree, and what each row may see.

One pass, many rows: each row is a token at a position, and attends to the cache entries and
earlier rows it may see. For a tree after a committed prefix of n tokens, row i is a node:
its position is n + depth(i) - 1 and it sees the prefix and its own ancestors (and itself),
never a sibling or a cousin. A chain is the tree whose every node has the previous one as
parent, which is exactly the causal mask of an ordinary multi-token pass. Several sequences
in one pass are the same thing again, each sequence's rows seeing its own prefix and
ancestors; the backends here hold one sequence.

Nodes are scored in one or more passes (a draft model extends its tree one depth per pass)
and stay *pending* after the prefix until `commit(path)` keeps one root-to-node path as the
next cached positions and drops the rest. `PendingTree` is the bookkeeping every backend
shares: tokens, parents, depths, the ancestor sets, validation of both calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.errors import SpecdecodeError


class PendingTree:
    """The pending nodes after a backend's committed prefix, numbered in the order they came."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self._ancestors: list[list[int]] = []  # root .. node itself

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens.clear()
        self.parents.clear()
        self.depths.clear()
        self._ancestors.clear()

    def add(self, ids: Sequence[int], parents: Sequence[int]) -> range:
        """Append nodes; parents[i] is -1 (follows the prefix) or an earlier node's index,
        counted over every pending node. Returns the new nodes' indices."""
        if len(ids) != len(parents):
            raise ValueError(f"{len(ids)} tokens but {len(parents)} parents")
        if not ids:
            raise ValueError("a tree pass needs at least one node")
        first = len(self.tokens)
        for offset, (token, parent) in enumerate(zip(ids, parents, strict=True)):
            node = first + offset
            if not -1 <= parent < node:
                raise ValueError(f"node {node}: parent {parent} must be -1 or an earlier node")
            self.tokens.append(int(token))
            self.parents.append(int(parent))
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            self._ancestors.append([*(self._ancestors[parent] if parent >= 0 else []), node])
        return range(first, first + len(ids))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, itself last."""
        return self._ancestors[node]

    def is_chain(self) -> bool:
        """Whether node i follows node i - 1 for every i (an ordinary causal pass)."""
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def check_path(self, path: Sequence[int]) -> list[int]:
        """`path` as a list, after checking that it runs from the root down, parent by parent."""
        path = [int(node) for node in path]
        if path and (not 0 <= path[-1] < len(self.tokens) or self._ancestors[path[-1]] != path):
            raise ValueError(f"{path} is not a root-to-node path of the pending tree")
        return path

    def visibility(self, rows: Sequence[int], prefix: int, device: torch.device) -> torch.Tensor:
        """[len(rows), prefix + len(self)] booleans: which entries each row sees, the pending
        nodes laid out after the prefix in node order."""
        visible = torch.zeros(len(rows), prefix + len(self.tokens), dtype=torch.bool)
        visible[:, :prefix] = True
        for r, node in enumerate(rows):
            visible[r, [prefix + a for a in self._ancestors[node]]] = True
        return visible.to(device)


def check_tree_room(name: str, prefix: int, pending: int, new: int, n_ctx: int) -> None:
    """Pending nodes occupy cache entries after the prefix until committed: refuse a pass that
    would not fit."""
    if prefix + pending + new > n_ctx:
        raise SpecdecodeError(
            f"{name}: context full ({prefix} cached + {pending + new} tree nodes > n_ctx {n_ctx})"
        )
