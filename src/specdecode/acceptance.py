"""The adaptive policy's acceptance model: how often each kind of draft token is kept.

Apart from the policy that acts on it (`specdecode.policy`), as the cost model is
(`specdecode.costs`): it counts what verification showed and knows nothing of costs.

- Acceptance model: per strategy, depth and draft-confidence bucket, P(the token is kept |
  its parent was), counted from every verified draft with decay, starting from the draft's
  calibrated confidence (model drafts) or from the estimate one depth up (model-free drafts).
- A chain of k tokens with acceptances a_1..a_k emits E_k = 1 + sum_j prod_{i<=j} a_i tokens
  (`expected_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

BUCKETS = 10  # confidence buckets of model drafts
OWN_DEPTHS = 8  # depths with counts of their own; deeper ones share a cell per half-octave
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior of an acceptance estimate
PRIOR_FREE = 0.5  # depth-1 prior of a model-free strategy, which reports no confidence
DECAY = 0.98  # a cell's counts shrink by this at each update: recent text weighs more


class AcceptanceModel:
    """P(a draft token is kept | its parent was), per (strategy, depth, confidence bucket).

    Counts are [kept, rejected] pseudo-observations; an estimate mixes them with a prior worth
    PRIOR_WEIGHT of them: for a model draft, its confidence bucket's estimate over all depths
    (`model_prior`), itself starting from the confidence (a confidence of c is kept about c of
    the time if the draft is calibrated); for model-free drafts, the estimate one depth up."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, int, int], list[float]] = {}
        # (strategy, bucket) -> decayed counts of the bucket of the next token a step showed
        self.followers: dict[tuple[str, int], list[float]] = {}

    def estimate(self, strategy: str, depth: int, confidence: float | None, prior: float) -> float:
        kept, rejected = self.cells.get(_cell(strategy, depth, confidence), (0.0, 0.0))
        return (kept + PRIOR_WEIGHT * prior) / (kept + rejected + PRIOR_WEIGHT)

    def model_prior(self, strategy: str, confidence: float) -> float:
        """What a model draft's token of this confidence is worth at any depth: its bucket's
        estimate over all depths, which deep cells (seldom reached) start from."""
        return self.estimate(strategy, 0, confidence, confidence)

    def model_estimate(self, strategy: str, depth: int, confidence: float) -> float:
        """The estimate for a model draft's token of this confidence at `depth`."""
        return self.estimate(strategy, depth, confidence, self.model_prior(strategy, confidence))

    def seen(self, strategy: str, depth: int, confidence: float | None) -> float:
        """How many (decayed) outcomes the estimate of this cell rests on."""
        return sum(self.cells.get(_cell(strategy, depth, confidence), (0.0, 0.0)))

    def chain(self, strategy: str, confidences: list[float | None]) -> list[float]:
        """The estimate at each depth of a chain whose tokens had these confidences (None: a
        model-free draft's)."""
        estimates: list[float] = []
        for depth, confidence in enumerate(confidences, start=1):
            if confidence is not None:
                estimates.append(self.model_estimate(strategy, depth, confidence))
            else:
                prior = estimates[-1] if estimates else PRIOR_FREE
                estimates.append(self.estimate(strategy, depth, None, prior))
        return estimates

    def observe(self, strategy: str, confidences: list[float | None], n_accepted: int) -> None:
        """A verified chain: depths 1..n_accepted kept, the next one rejected, the rest unseen."""
        for depth, confidence in enumerate(confidences[: n_accepted + 1], start=1):
            self._count(strategy, depth, confidence, depth <= n_accepted)

    def observe_tree(
        self, strategy: str, confidences: list[float | None], parents: Sequence[int], path: Sequence[int]
    ) -> None:
        """A verified tree whose nodes `path` were kept: every node whose parent was kept (or
        is the root) was kept or rejected; the nodes below a rejected one are unseen."""
        kept = set(path)
        depths: list[int] = []
        for node, parent in enumerate(parents):
            depths.append(1 if parent < 0 else depths[parent] + 1)
            if parent < 0 or parent in kept:
                self._count(strategy, depths[node], confidences[node], node in kept)

    def observe_next(self, strategy: str, confidence: float, next_confidence: float) -> None:
        """A drafting model's step after a token of `confidence` showed one of `next_confidence`
        (whether or not that token was then drafted)."""
        counts = self.followers.setdefault((strategy, _bucket(confidence)), [0.0] * BUCKETS)
        counts[:] = [DECAY * count for count in counts]
        counts[_bucket(next_confidence)] += 1.0

    def next_confidences(self, strategy: str, confidence: float) -> list[tuple[float, float]]:
        """(probability, confidence) of the next token's bucket (its middle) after a token of
        `confidence`, before the step that shows it runs: counted from the steps run, starting
        from the same bucket (a draft's confidence runs in stretches), worth PRIOR_WEIGHT steps."""
        bucket = _bucket(confidence)
        counts = list(self.followers.get((strategy, bucket), [0.0] * BUCKETS))
        counts[bucket] += PRIOR_WEIGHT
        total = sum(counts)
        return [(count / total, (b + 0.5) / BUCKETS) for b, count in enumerate(counts) if count > 0]

    def _count(self, strategy: str, depth: int, confidence: float | None, kept: bool) -> None:
        pooled = () if confidence is None else (0,)  # depth 0: a model bucket over all depths
        for cell_depth in (depth, *pooled):
            cell = self.cells.setdefault(_cell(strategy, cell_depth, confidence), [0.0, 0.0])
            cell[0] *= DECAY
            cell[1] *= DECAY
            cell[0 if kept else 1] += 1.0


def _cell(strategy: str, depth: int, confidence: float | None) -> tuple[str, int, int]:
    return strategy, depth_cell(depth), -1 if confidence is None else _bucket(confidence)


def _bucket(confidence: float) -> int:
    return min(int(confidence * BUCKETS), BUCKETS - 1)


def depth_cell(depth: int) -> int:
    """The first depth of the cell `depth` counts in: depths up to OWN_DEPTHS have their own,
    deeper ones share one per half-octave (9-12, 13-16, 17-24, 25-32, ...), so that what long
    drafts showed at depth 40 also speaks for depth 41."""
    if depth <= OWN_DEPTHS:
        return depth
    half = 1 << ((depth - 1).bit_length() - 1)  # the power of two below depth
    return half + 1 if depth <= half + half // 2 else half + half // 2 + 1


def expected_tokens(acceptances: list[float]) -> list[float]:
    """E_k for k = 0..len: tokens a step emits when the chain's first k tokens are verified."""
    values = [1.0]
    reach = 1.0
    for a in acceptances:
        reach *= a
        values.append(values[-1] + reach)
    return values
