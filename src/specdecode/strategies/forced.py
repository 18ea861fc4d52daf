"""Forced-token drafting: where the grammar allows a single token, draft it for free.

Under a constraint, some stretches of the output are fixed by the grammar alone (a JSON
schema's keys, quotes, colons and braces). The `forced` strategy drafts them without any
model: the target keeps each with certainty (its masked distribution has all its mass there),
so a forced stretch of k tokens costs one target pass instead of k. Without a constraint it
is not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from specdecode.drafts import Draft

if TYPE_CHECKING:
    from specdecode.constraints import Constraint


class ForcedStrategy:
    name: ClassVar[str] = "forced"
    n_min = 1

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to index: the grammar's state is the constraint's."""

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        """The tokens forced after `last`; the constraint has committed every emitted token,
        `last` included."""
        return Draft(self.constraint.forced(n_max))

    def accept(self, n_accepted: int) -> None:
        """Nothing to learn: forced tokens are always kept."""

    def end(self) -> None:
        """Nothing outlives the generation."""
