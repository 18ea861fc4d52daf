"""Passes that score the rows of several sequences at once.

A sequence is a backend with its own KV cache (a fork of one loaded model); a batched pass
is the tree pass's rows again, with a sequence column: each row is a token of one sequence at
a position, seeing that sequence's cached entries and its own earlier rows (or ancestors), and
nothing of any other sequence. Backends whose forks share their weights and forward can run
every sequence's rows through one forward (`SharedPasses`); any other backend scores each
sequence in a pass of its own, which gives the same logits at the cost of more passes.

A group is one sequence's rows: a chain appended after its cached tokens (what `evaluate`
takes, `parents` None), or tree nodes (what `evaluate_tree` takes). The logits of every row
(of a chain's last `logits_rows`) come back, in group order, exactly what the group's own
pass would return: bit for bit where the backend is row-invariant, which the native backend
is for passes of up to its `max_pass_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdecode.backends import Backend


@dataclass
class RowGroup:
    """One sequence's rows in a batched pass."""

    backend: Backend
    ids: list[int]
    parents: list[int] | None = None  # None: a chain after the cached tokens; else tree nodes
    logits_rows: int | None = None  # a chain's last rows whose logits are wanted (None: all)
    # The logits may stay on the backend's device (float32, or float64 where the model is): the
    # consumer reduces them there (`specdecode.sampling.reduce_rows`). Only a backend that says
    # `logits_on_device` is asked; every other group's logits come to the host.
    on_device: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def wanted(self) -> int:
        """Rows whose logits come back."""
        return len(self.ids) if self.logits_rows is None else min(self.logits_rows, len(self.ids))


@runtime_checkable
class SharedPasses(Protocol):
    """A backend whose forks can share one forward: groups whose backends have equal
    `pass_key`s may be scored together by `evaluate_groups`."""

    max_pass_rows: int  # the most rows one shared pass takes (row-invariance holds up to it)

    @property
    def pass_key(self) -> object: ...

    def evaluate_groups(self, groups: Sequence[RowGroup]) -> list[torch.Tensor]:
        """Score every group in one forward (their backends share this one's pass_key)."""
        ...


def shares_passes(backend: object) -> bool:
    """`isinstance(backend, SharedPasses)`, answered as the Protocol check answers it (data
    members present, methods not None) without its machinery, which costs more than the
    rest of a step's bookkeeping when asked for every sequence of every step."""
    return (
        hasattr(backend, "max_pass_rows")
        and hasattr(backend, "pass_key")
        and getattr(backend, "evaluate_groups", None) is not None
    )


def evaluate_groups(groups: Sequence[RowGroup]) -> list[torch.Tensor]:
    """Logits [len(group), V] of every group, in order, in as few passes as the backends allow:
    groups whose backends share a forward go through it together, packed in order into passes
    of at most `max_pass_rows` rows; the others run one pass each."""
    out: list[torch.Tensor | None] = [None] * len(groups)
    shared: dict[object, list[int]] = {}
    for index, group in enumerate(groups):
        backend = group.backend
        if len(groups) > 1 and shares_passes(backend):
            shared.setdefault(backend.pass_key, []).append(index)
        else:
            out[index] = score_alone(group)
    for indices in shared.values():
        for batch in _packed(indices, groups):
            if len(batch) == 1:
                out[batch[0]] = score_alone(groups[batch[0]])
                continue
            scored = groups[batch[0]].backend.evaluate_groups([groups[i] for i in batch])
            for index, logits in zip(batch, scored, strict=True):
                out[index] = logits
    return out  # type: ignore[return-value]


def score_alone(group: RowGroup) -> torch.Tensor:
    """One group's own pass (through `evaluate_groups` where its logits stay on the device:
    a group alone gets the bits its own pass gives it)."""
    if group.on_device:
        return group.backend.evaluate_groups([group])[0]  # type: ignore[attr-defined]
    if group.parents is None:
        return group.backend.evaluate(group.ids, group.logits_rows)
    return group.backend.evaluate_tree(group.ids, group.parents)


def _packed(indices: list[int], groups: Sequence[RowGroup]) -> list[list[int]]:
    """Consecutive runs of groups whose rows fit one pass (a group larger than a pass alone)."""
    limit = groups[indices[0]].backend.max_pass_rows
    batches: list[list[int]] = []
    rows = 0
    for index in indices:
        size = len(groups[index])
        if batches and rows + size <= limit:
            batches[-1].append(index)
            rows += size
        else:
            batches.append([index])
            rows = size
    return batches


def evaluate_each(groups: list[RowGroup]) -> list:
    """Logits of every group from shared passes; if those fail, each group alone, so that a
    failure is only the failing group's."""
    try:
        return evaluate_groups(groups)
    except Exception:
        results: list = []
        for group in groups:
            group.backend.truncate(len(group.backend.tokens))  # drop nodes a failed pass left pending
            try:
                results.append(score_alone(group))
            except Exception as exc:
                results.append(exc)
        return results
