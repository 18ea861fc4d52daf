"""The adaptive speculation policy: each step, draft what maximises expected tokens per second.

`classic` is llama.cpp's rule: the first strategy in priority order with a draft wins, and a
model draft stops at the first token whose confidence is below p_min. Whether that pays
depends on the text, the models and the machine, so `adaptive` measures instead:

- Cost model: seconds of a target pass of T rows (timed briefly at load, then an exponential
  moving average of the passes actually run) and of one step of each drafting model.
- Acceptance model: per strategy, depth and draft-confidence bucket, P(the token is kept |
  its parent was), counted from every verified draft with decay, starting from the draft's
  calibrated confidence (model drafts) or from the estimate one depth up (model-free drafts).
- Decision: a chain of k tokens with acceptances a_1..a_k emits E_k = 1 + sum_j prod_{i<=j} a_i
  tokens for time(k) = drafting + pass(k + 1). Model-free drafts cost next to nothing, so all
  are asked and each is cut to its best length; a drafting model is run when its expected rate
  (the tokens its steps emitted, over what its usual draft length costs) beats the best of
  those and of a plain step, and it stops growing its draft when one more token would lower
  E / time. A plain step
  (k = 0, one row) is always a candidate, so a strategy that never gets accepted stops being
  paid for; one not run for a while is tried again, in case the text changed.

Drafts are chains: trees are left to `classic`. Whatever is drafted, verification keeps the
output plain generation's, so the policy changes speed only.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from specdecode.backends import Backend
from specdecode.errors import SpecdecodeError

SPEC_POLICIES = ("classic", "adaptive")
CALIBRATION_ROWS = (1, 2, 3, 5, 9, 17)
CALIBRATION_REPS = 3
CALIBRATION_CONTEXT = 32  # tokens in the cache while timing, as after a short prompt
PRIOR_PASS = 0.01  # seconds of a one-row pass before anything is measured
PRIOR_SLOPE = 0.1  # pass(T) / pass(1) = 1 + 0.1 (T - 1) before it is measured (a CPU's shape)
PRIOR_DRAFT_STEP = 0.1  # a draft step, as a share of a one-row target pass, before it is measured
EMA = 0.1  # weight of the newest observation in the moving averages
BUCKETS = 10  # confidence buckets of model drafts
MAX_DEPTH = 64  # deeper tokens share the last depth's counts
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior of an acceptance estimate
PRIOR_FREE = 0.5  # depth-1 prior of a model-free strategy, which reports no confidence
DECAY = 0.98  # a cell's counts shrink by this at each update: recent text weighs more
PROBE_EVERY = 8  # a drafting model left unused this many steps is run again


def check_policy(name: str) -> str:
    if name not in SPEC_POLICIES:
        raise SpecdecodeError(f"unknown --spec-policy {name!r} (choose from {', '.join(SPEC_POLICIES)})")
    return name


class CostModel:
    """Seconds of target passes by row count, and of draft steps by strategy."""

    def __init__(self) -> None:
        self.passes: dict[int, float] = {}  # rows -> moving average
        self.calibrated: dict[int, float] = {}  # rows -> the load-time median
        self.measured: dict[int, list[float]] = {}  # rows -> [count, total seconds] of passes run
        self.draft_step: dict[str, float] = {}  # strategy -> moving average of one step

    def calibrate(self, backend: Backend, rows: tuple[int, ...] = CALIBRATION_ROWS) -> None:
        """Time passes of each row count after a short context (a few reps, the median), leaving
        the backend's cache empty."""
        context = [i % backend.vocab.size for i in range(3, 3 + CALIBRATION_CONTEXT)]
        backend.truncate(0)
        backend.evaluate(context, logits_rows=1)
        for n in rows:
            if len(context) + n > backend.n_ctx:
                break
            samples = []
            for _ in range(CALIBRATION_REPS + 1):  # the first is a warm-up
                start = time.perf_counter()
                backend.evaluate(context[:n])
                samples.append(time.perf_counter() - start)
                backend.truncate(len(context))
            self.calibrated[n] = self.passes[n] = sorted(samples[1:])[len(samples[1:]) // 2]
        backend.truncate(0)

    def observe_pass(self, rows: int, seconds: float) -> None:
        old = self.passes.get(rows)
        self.passes[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        count_total = self.measured.setdefault(rows, [0, 0.0])
        count_total[0] += 1
        count_total[1] += seconds

    def pass_time(self, rows: int) -> float:
        """Seconds of a pass of `rows` rows: measured, else interpolated between the nearest
        measured row counts, else scaled from the nearest one by the prior shape."""
        if rows in self.passes:
            return self.passes[rows]
        below = max((n for n in self.passes if n < rows), default=None)
        above = min((n for n in self.passes if n > rows), default=None)
        if below is not None and above is not None:
            share = (rows - below) / (above - below)
            return (1 - share) * self.passes[below] + share * self.passes[above]
        nearest = below if below is not None else above
        if nearest is None:
            return PRIOR_PASS * _prior_shape(rows)
        return self.passes[nearest] * _prior_shape(rows) / _prior_shape(nearest)

    def observe_draft(self, strategy: str, steps: int, seconds: float) -> None:
        """A draft of `steps` steps took `seconds`: at most twice the estimate counts, since the
        first step may also catch up with a whole prompt, which is not what a step costs."""
        old = self.step_time(strategy)
        self.draft_step[strategy] = (1 - EMA) * old + EMA * min(seconds / max(1, steps), 2 * old)

    def step_time(self, strategy: str) -> float:
        return self.draft_step.get(strategy, PRIOR_DRAFT_STEP * self.pass_time(1))

    def draft_time(self, strategy: str, steps: float) -> float:
        return self.step_time(strategy) * steps

    def fit(self) -> list[dict]:
        """For each row count run: the load-time prediction against the mean of the passes run."""
        rows = []
        for n, (count, total) in sorted(self.measured.items()):
            predicted = self.calibrated.get(n)
            rows.append({"rows": n, "passes": count, "measured_ms": 1e3 * total / count})
            rows[-1]["predicted_ms"] = None if predicted is None else 1e3 * predicted
        return rows


def _prior_shape(rows: int) -> float:
    return 1.0 + PRIOR_SLOPE * (rows - 1)


class AcceptanceModel:
    """P(a draft token is kept | its parent was), per (strategy, depth, confidence bucket).

    Counts are [kept, rejected] pseudo-observations; an estimate mixes them with a prior worth
    PRIOR_WEIGHT of them: a model draft's own confidence (it is calibrated: a confidence of c is
    kept about c of the time), or for model-free drafts the estimate one depth up."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, int, int], list[float]] = {}

    def estimate(self, strategy: str, depth: int, confidence: float | None, prior: float) -> float:
        kept, rejected = self.cells.get(_cell(strategy, depth, confidence), (0.0, 0.0))
        return (kept + PRIOR_WEIGHT * prior) / (kept + rejected + PRIOR_WEIGHT)

    def chain(self, strategy: str, confidences: list[float | None]) -> list[float]:
        """The estimate at each depth of a chain whose tokens had these confidences (None: a
        model-free draft's)."""
        estimates: list[float] = []
        for depth, confidence in enumerate(confidences, start=1):
            prior = confidence if confidence is not None else estimates[-1] if estimates else PRIOR_FREE
            estimates.append(self.estimate(strategy, depth, confidence, prior))
        return estimates

    def observe(self, strategy: str, confidences: list[float | None], n_accepted: int) -> None:
        """A verified chain: depths 1..n_accepted kept, the next one rejected, the rest unseen."""
        for depth, confidence in enumerate(confidences[: n_accepted + 1], start=1):
            cell = self.cells.setdefault(_cell(strategy, depth, confidence), [0.0, 0.0])
            cell[0] *= DECAY
            cell[1] *= DECAY
            cell[0 if depth <= n_accepted else 1] += 1.0


def _cell(strategy: str, depth: int, confidence: float | None) -> tuple[str, int, int]:
    bucket = -1 if confidence is None else min(int(confidence * BUCKETS), BUCKETS - 1)
    return strategy, min(depth, MAX_DEPTH), bucket


def expected_tokens(acceptances: list[float]) -> list[float]:
    """E_k for k = 0..len: tokens a step emits when the chain's first k tokens are verified."""
    values = [1.0]
    reach = 1.0
    for a in acceptances:
        reach *= a
        values.append(values[-1] + reach)
    return values


@dataclass
class Record:
    """Averages over the steps a drafting model ran: tokens emitted and rows verified. It starts
    as one step that kept a one-token draft; the first steps are averaged plainly, later ones
    in a moving average (so that one unlucky first draft does not rule the model out)."""

    tokens: float = 2.0
    rows: float = 2.0
    n: int = 1

    def update(self, tokens: float, rows: float) -> None:
        self.n += 1
        weight = max(EMA, 1 / self.n)
        self.tokens = (1 - weight) * self.tokens + weight * tokens
        self.rows = (1 - weight) * self.rows + weight * rows


@dataclass
class PolicyModels:
    """What the adaptive policy learns, shared by every generation of a pipeline (and its forks):
    costs, acceptance, each drafting model's record, and what was chosen (a histogram of
    (strategy or "none", draft length))."""

    costs: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    records: dict[str, Record] = field(default_factory=dict)
    choices: Counter[tuple[str, int]] = field(default_factory=Counter)

    @classmethod
    def for_target(cls, target: Backend) -> PolicyModels:
        """Models whose pass costs are timed on `target` now."""
        models = cls()
        models.costs.calibrate(target)
        return models


class Stopper:
    """The "keep drafting?" rule of one model draft: grow while one more token raises the step's
    expected tokens per second. Remembers the confidences of the tokens it let through."""

    def __init__(self, models: PolicyModels, strategy: str, t_sunk: float) -> None:
        self.models = models
        self.strategy = strategy
        self.t_sunk = t_sunk  # drafting time already spent this step by other strategies
        self.confidences: list[float] = []
        self._tokens = 1.0  # E of the chain so far
        self._reach = 1.0  # P(every token so far kept)

    def __call__(self, depth: int, confidence: float) -> bool:
        """May the token at `depth` (1-based), of this top-1 confidence, be drafted?"""
        a = self.models.acceptance.estimate(self.strategy, depth, confidence, confidence)
        tokens = self._tokens + self._reach * a
        if tokens / self._time(depth + 1, depth + 1) <= self._tokens / self._time(depth, depth):
            return False
        self._tokens, self._reach = tokens, self._reach * a
        self.confidences.append(confidence)
        return True

    def _time(self, steps: int, rows: int) -> float:
        costs = self.models.costs
        return self.t_sunk + costs.draft_time(self.strategy, steps) + costs.pass_time(rows)


class AdaptivePolicy:
    """The decisions of one generation, over shared `PolicyModels`."""

    def __init__(self, models: PolicyModels) -> None:
        self.models = models
        self._idle: Counter[str] = Counter()  # drafting model -> steps since it was last run

    def plain_rate(self, t_sunk: float) -> float:
        return 1.0 / (t_sunk + self.models.costs.pass_time(1))

    def best_length(self, strategy: str, n_tokens: int, t_sunk: float) -> tuple[int, float]:
        """The prefix length of a model-free draft of n_tokens with the best expected tokens per
        second, and that rate (0 tokens: a plain step)."""
        values = expected_tokens(self.models.acceptance.chain(strategy, [None] * n_tokens))
        costs = self.models.costs
        rates = [e / (t_sunk + costs.pass_time(k + 1)) for k, e in enumerate(values)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        return best, rates[best]

    def model_rate(self, strategy: str, t_sunk: float) -> float:
        """A drafting model's expected tokens per second: the tokens its steps emitted, over what
        its steps' draft length costs now; infinite when it has never run or is due for another
        try."""
        record = self.models.records.get(strategy)
        if record is None or self._idle[strategy] >= PROBE_EVERY:
            return float("inf")
        costs = self.models.costs
        seconds = t_sunk + costs.draft_time(strategy, record.rows) + costs.pass_time(round(record.rows))
        return record.tokens / seconds

    def stopper(self, strategy: str, t_sunk: float) -> Stopper:
        self._idle[strategy] = 0
        return Stopper(self.models, strategy, t_sunk)

    def skipped(self, strategies: list[str]) -> None:
        for strategy in strategies:
            self._idle[strategy] += 1

    def observe(
        self,
        strategy: str | None,
        confidences: list[float | None],
        n_accepted: int,
        t_pass: float,
        model: str | None,
        model_steps: int,
        t_model: float,
    ) -> None:
        """One verified step: `strategy`'s chain (None: a plain step) of len(confidences) tokens,
        n_accepted kept, in a pass of t_pass seconds; `model` is the drafting model run this step
        (if any), in model_steps steps taking t_model seconds."""
        models = self.models
        models.costs.observe_pass(len(confidences) + 1, t_pass)
        models.choices[(strategy or "none", len(confidences))] += 1
        if strategy is not None:
            models.acceptance.observe(strategy, confidences, n_accepted)
        if model is not None:
            models.costs.observe_draft(model, model_steps, t_model)
            tokens, rows = 1.0 + n_accepted, len(confidences) + 1  # whoever drafted: what running it gave
            models.records.setdefault(model, Record()).update(tokens, rows)
