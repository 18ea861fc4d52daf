"""The adaptive speculation policy: each step, draft what maximises expected tokens per second.

`classic` is llama.cpp's rule: the first strategy in priority order with a draft wins, and a
model draft stops at the first token whose confidence is below p_min. Whether that pays
depends on the text, the models and the machine, so `adaptive` measures instead:

- Cost model: seconds of a target pass of T rows, a line a + b * T up to KNOT rows with a
  second slope beyond (once passes that long have run), a step up from one row to several
  (a kernel's shape changes there) and a cost per sequence sharing the pass (once batches
  have run), fitted to passes timed briefly at load and to the passes actually run, recent
  ones weighing more (contexts grow, machines get busy), the timings scaled to the speed the
  passes run at now (their shape holds where the machine slows every size alike); and the seconds
  of a drafting model's call as a line in its steps and in the tokens it reads first (those
  verified since its last call: a few when it runs every step, a whole gap after it idled),
  starting from its one-row pass timed at load.
- Acceptance model: per strategy, depth and draft-confidence bucket, P(the token is kept |
  its parent was), counted from every verified draft with decay, starting from the draft's
  calibrated confidence (model drafts) or from the estimate one depth up (model-free drafts).
- Decision: a chain of k tokens with acceptances a_1..a_k emits E_k = 1 + sum_j prod_{i<=j} a_i
  tokens for time(k) = drafting + pass(k + 1); its gain is E_k - rate * time(k), where rate is
  the tokens per second the policy has been achieving. Model-free drafts cost next to nothing,
  so all are asked and each is cut to its best length; a drafting model is run when its
  expected gain (the tokens its steps emitted, less what its usual draft length costs) beats
  the best of those and of a plain step. Its draft takes a token while the token's chance of
  being reached and kept pays for its verify row (the step that showed it has run), and runs
  the step that shows the next token while that token is expected to pay for its row by more
  than the step costs (over the confidences that followed this one's), so a draft may end on a
  token the model never evaluated. A plain step (k = 0, one row) is always a candidate, so a
  strategy that never gets accepted stops being paid for; a drafting model not run for a
  while is tried again, in case the text changed, with a short draft (a probe), ever more
  rarely while such probes keep losing; a probe that wins stands for the model's record, as
  the text it found. A model never run, or due for a probe, is run only where its best case
  (a draft all kept, at its step cost timed at load and the pass curve) beats the step's
  other candidates: where no draft of it could pay, it is never run.

Where verification keeps a draft token exactly when it equals the token emitted at its place
(`match`, or greedy sampling), every model-free draft is scored whole against the tokens
emitted, over as many steps as that takes: the one not chosen, and the part of the chosen one
that was cut off. Otherwise a strategy passed over would never be learnt from, and a draft cut
to k tokens would never show that its (k+1)-th token was right, so lengths could only shrink.

Batches: where sequences share each target pass (`specdecode.scheduler`), a sequence's draft
is priced at what its rows add to the pass everyone's rows make (the other sequences' rows as
many as they put in the previous pass), and a second is valued at the batch's rate: each step
is credited with its rows' share of the pass and its own share of the drafting round, so the
rate the policy achieves is the batch's tokens per second. A row that costs little beside one
sequence costs as many tokens as the whole batch makes in that time, so drafts shorten, and
vanish, as the batch grows, unless they are nearly always kept. A drafting model left unused
is probed again after so many passes, whichever sequence's turn it is: a probe stalls the
whole pass, so a batch probes no more often than one sequence does.

Trees: where the settings let a drafting model branch (--draft-n-parallel, --draft-tree-tokens),
the same rule decides node by node which of its candidates become nodes (a node is worth it
while its chance of being reached and kept beats the cost of its draft step and verify row at
the step's rate), so the tree's size and shape are chosen each step, down to a chain or
nothing; each verified tree teaches the acceptance model about every node whose parent was
kept. Whatever is drafted, verification keeps the output plain generation's, so the policy
changes speed only.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from specdecode.backends import Backend, common_prefix, pass_cache
from specdecode.config import SPEC_POLICIES
from specdecode.errors import SpecdecodeError

CALIBRATION_ROWS = (1, 2, 3, 5, 9, 17)
CALIBRATION_REPS = 3
CALIBRATION_CONTEXT = 32  # tokens in the cache while timing, as after a short prompt
CHECK_CONTEXT = 4  # ... while checking stored timings: a one-row pass costs nearly the same, the prompt less
PRIOR_PASS = 0.01  # seconds of a one-row pass before anything is measured
PRIOR_SLOPE = 0.1  # pass(T) / pass(1) = 1 + 0.1 (T - 1) before it is measured (a CPU's shape)
PRIOR_DRAFT_STEP = 0.1  # a draft step, as a share of a one-row target pass, where the model was not timed
DRAFT_TIMING_ROWS = (1,)  # a drafting model is timed at load by its one-row passes: its steps
STALE_FACTOR = 1.5  # stored timings whose one-row pass is now off by more than this, either way, are retimed
EMA = 0.1  # weight of the newest observation in the moving averages
CALIBRATION_WEIGHT = 2.0  # passes each load-time timing counts as in the cost fit
FIT_DECAY = 0.98  # per pass run: the weight of older passes in the cost fit
REFIT_EVERY = 8  # passes run between refits of the cost line (costs drift slowly)
BUCKETS = 10  # confidence buckets of model drafts
OWN_DEPTHS = 8  # depths with counts of their own; deeper ones share a cell per half-octave
KNOT = 17  # rows where the pass cost's second slope starts (the longest pass timed at load)
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior of an acceptance estimate
PRIOR_FREE = 0.5  # depth-1 prior of a model-free strategy, which reports no confidence
DECAY = 0.98  # a cell's counts shrink by this at each update: recent text weighs more
EXPLORE = 0.2  # optimism of a model draft's decision about a cell with no outcomes yet
PROBE_EVERY = 8  # a drafting model left unused this many steps is run again
MAX_PROBE_EVERY = 64  # ... a wait that doubles with each probe, and halves with each run on merit
PROBE_NODES = 4  # most tokens (tree nodes) a probe drafts: enough to tell whether the model pays again


def check_policy(name: str) -> str:
    if name not in SPEC_POLICIES:
        raise SpecdecodeError(f"unknown --spec-policy {name!r} (choose from {', '.join(SPEC_POLICIES)})")
    return name


class CostModel:
    """Seconds of target passes by row count, and of draft steps by strategy.

    A pass of T rows of S sequences costs a + b * T + c * max(0, T - KNOT) + s * (S - 1)
    + m * (T > 1), fitted by least squares to the load-time timings (each worth
    CALIBRATION_WEIGHT passes, always) and to the passes run (weights decaying by FIT_DECAY a
    pass, so the fit follows a growing context or a busier machine). A line, not a table: one
    size's noisy timing must not make one more row look free or dear. The second slope c is
    fitted only once passes longer than KNOT rows were timed or run (a CPU's long passes grow
    faster than its short ones), s once passes of several sequences were (each attends to its
    own cache), and m once passes of one row and of two sizes of several were timed or run (on a
    CPU the second row can cost twice what each next one does, after a long context: one row
    multiplies vectors, several multiply matrices; a line through them all made a doubtful
    one-token draft look nearly free, and, through the timings of a Q4_K target on two cores
    where each row costs nearly a one-row pass, put the one-row pass 60% above its timing, so
    that plain steps looked dear and drafts cheap); until then the line goes on."""

    def __init__(self) -> None:
        self.calibrated: dict[int, float] = {}  # rows -> the load-time median
        # (rows, sequences) -> [count, total seconds, total seconds predicted] of the passes run
        self.measured: dict[tuple[int, int], list[float]] = {}
        self.draft_calls: dict[str, DraftCalls] = {}  # drafting model -> its calls' cost line
        self._sums = DecayedSums(5)  # over the passes run, features _features(T, S)
        self._curve: tuple[float, ...] | None = None  # (a, b, c, s, m)
        self._stale = 0.0  # passes observed since the last fit
        self._times: dict[tuple[float, int], float] = {}  # (rows, sequences) -> pass_time now
        # decayed sums over the one-sequence passes run: their seconds, and the timings' fit's
        self._drift = [0.0, 0.0]
        self._timed: tuple[tuple[tuple[int, float], ...], np.ndarray] | None = None  # (timings, fit)

    def calibrate(self, backend: Backend, rows: tuple[int, ...] = CALIBRATION_ROWS) -> None:
        """Time passes of each row count on the target (`time_passes`)."""
        self.calibrated.update(time_passes(backend, rows))
        self._curve = None

    def observe_pass(self, rows: int, seconds: float, sequences: int = 1, weight: float = 1.0) -> None:
        """A pass of `rows` rows of `sequences` sequences took `seconds`. weight: the share of
        it this call reports (each sequence of a batch reports its rows' share, so that the
        pass counts once in all). What the model predicted for it, before learning from it, is
        kept beside it: the fit the policy acted on, which a multi-task run's final model is not."""
        predicted = self.pass_time(rows, sequences)  # the curve in force (a policy refits before it)
        self._sums.observe(_features(rows, sequences), seconds, weight)
        if sequences == 1 and rows <= max(self.calibrated, default=0):  # within the timings' sizes
            decay = FIT_DECAY**weight
            timed = sum(v * f for v, f in zip(self._timed_curve(), _features(rows), strict=True))
            self._drift = [decay * self._drift[0] + weight * seconds, decay * self._drift[1] + weight * timed]
        self._stale += weight
        totals = self.measured.setdefault((rows, sequences), [0.0, 0.0, 0.0])
        totals[0] += weight
        totals[1] += weight * seconds
        totals[2] += weight * predicted

    def pass_time(self, rows: float, sequences: int = 1) -> float:
        """Seconds of a pass of `rows` rows of `sequences` sequences (asked for many lengths
        every step: remembered until the next refit, every REFIT_EVERY passes run)."""
        if self._curve is None or self._stale >= REFIT_EVERY:
            self._curve = tuple(float(v) for v in self._fit())
            self._stale = 0.0
            self._times = {}
        key = (rows, sequences)
        if key not in self._times:
            self._times[key] = sum(
                v * f for v, f in zip(self._curve, _features(rows, sequences), strict=True)
            )
        return self._times[key]

    def _fit(self) -> np.ndarray:
        """(a, b, c, s, m) of the weighted least-squares fit, a + b > 0 (a one-row pass costs
        something; a may be 0 or below where each row costs as much as a one-row pass or more,
        which the mean, flat, made look free), b >= 0, c >= -b, s >= 0 and m >= 0 (costs never
        fall with more rows or sequences); the prior's before any timing. The
        second slope, the cost per sequence and the step from one row are fitted where passes
        showed them, as many of them as keep those bounds (the simpler line where none does)."""
        gram, moment = self._sums.arrays()
        timed_gram, timed_moment = self._timings_sums()
        return _bounded_fit(
            gram + timed_gram,
            moment + self.drift() * timed_moment,
            set(self.calibrated) | {rows for rows, _ in self.measured},
        )

    def drift(self) -> float:
        """How much slower (> 1) or faster the one-sequence passes run lately took than the
        load-time timings' fit says: a busier machine, or a longer context. The timings enter
        the fit scaled by it, as the shape of the costs at the speed the passes run at now:
        unscaled, where each row costs a one-row pass, plain steps on a machine three times as
        busy as at load made each row past the first cost a third of a one-row pass, and a draft
        model that could not pay looked as if it did."""
        seconds, timed = self._drift
        return seconds / timed if timed > 0 else 1.0

    def _timings_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """The normal equations of the load-time timings (each worth CALIBRATION_WEIGHT passes),
        or of the prior before any."""
        seeds = self.calibrated or {1: PRIOR_PASS, KNOT: PRIOR_PASS * _prior_shape(KNOT)}
        gram, moment = np.zeros((5, 5)), np.zeros(5)
        for n, seconds in seeds.items():
            features = np.array(_features(n))
            gram += CALIBRATION_WEIGHT * np.outer(features, features)
            moment += CALIBRATION_WEIGHT * features * seconds
        return gram, moment

    def _timed_curve(self) -> np.ndarray:
        """The fit of the load-time timings alone (remembered while they stay the same)."""
        key = tuple(sorted(self.calibrated.items()))
        if self._timed is None or self._timed[0] != key:
            self._timed = (key, _bounded_fit(*self._timings_sums(), set(self.calibrated)))
        return self._timed[1]

    def observe_draft(self, strategy: str, steps: int, seconds: float, missed: int) -> None:
        """A call of the drafting model `strategy` read the `missed` tokens verified since its
        previous call, then ran `steps` steps, in `seconds`."""
        self._draft_calls(strategy).observe(steps, seconds, missed)

    def step_time(self, strategy: str) -> float:
        """The seconds one more step of a drafting model adds to its call."""
        return self._draft_line(strategy)[1]

    def draft_time(self, strategy: str, steps: float, missed: float) -> float:
        """The seconds of a call of `steps` steps that first reads `missed` tokens."""
        a, b, g = self._draft_line(strategy)
        return a + b * steps + g * missed

    def _draft_line(self, strategy: str) -> tuple[float, float, float]:
        """The model's call cost line; until its calls have run, its load-time timing at the
        target's `drift` (the machine that slowed the target slows the model too)."""
        calls = self._draft_calls(strategy)
        if calls.calls:
            return calls.line()
        scale = self.drift()
        a, b, g = calls.line()
        return scale * a, scale * b, scale * g

    def _draft_calls(self, strategy: str) -> DraftCalls:
        if strategy not in self.draft_calls:
            self.draft_calls[strategy] = DraftCalls(PRIOR_DRAFT_STEP * self.pass_time(1))
        return self.draft_calls[strategy]

    def fit(self) -> list[dict]:
        """For each shape run (rows, sequences): the mean of the passes run against the mean of
        the model's predictions for them when they ran, the model now, and the load-time timing
        (where that size was timed, alone)."""
        rows = []
        for (n, sequences), (count, total, predicted) in sorted(
            self.measured.items(), key=lambda item: item[0][::-1]
        ):
            timed = self.calibrated.get(n) if sequences == 1 else None
            rows.append(
                {
                    "rows": n,
                    "sequences": sequences,
                    "passes": round(count, 3),
                    "measured_ms": 1e3 * total / count,
                    "predicted_ms": 1e3 * predicted / count,
                    "model_ms": 1e3 * self.pass_time(n, sequences),
                    "timed_ms": None if timed is None else 1e3 * timed,
                }
            )
        return rows


def _bounded_fit(gram: np.ndarray, moment: np.ndarray, shown: set[int]) -> np.ndarray:
    """`CostModel._fit`'s (a, b, c, s, m) from the normal equations, `shown` the row counts
    passes were timed or run at."""
    seen = [column for column in (2, 3) if gram[column, column] > 0]
    if 1 in shown and len(shown - {1}) >= 2:  # passes timed or run tell the step from the slope
        seen.append(4)
    for size in range(len(seen), -1, -1):
        for optional in combinations(seen, size):
            columns = [0, 1, *optional]
            curve = np.zeros(5)
            curve[columns] = _solve(gram[np.ix_(columns, columns)], moment[columns])
            a, b, c, s, m = curve
            if a + b > 0 and b >= 0 and c >= -b and s >= 0 and m >= 0:
                return curve
    # Never a pass for free, never cheaper with more rows: the mean, flat.
    return np.array([moment[0] / gram[0, 0], 0.0, 0.0, 0.0, 0.0])


class DraftCalls:
    """Seconds of a drafting model's calls as a + b * steps + g * missed, fitted to the calls
    run (weights decaying by FIT_DECAY a call). A call first reads the tokens verified since
    its previous one (`missed`: the step's few when it runs every step; the whole prompt at a
    generation's first call, or a long gap after plain steps or a copy), which costs it the
    same however many steps follow: so one more step costs b, not the mean seconds a step, and
    a model idle for a while must pay for its gap before it drafts again. Starts from `prior`
    seconds a step and nothing more, pseudo-calls that the calls run soon outweigh."""

    def __init__(self, prior: float) -> None:
        self._sums = DecayedSums(3)  # features (1, steps, missed)
        self._line: tuple[float, float, float] | None = None
        self.calls = 0  # the calls run: the prior's pseudo-calls below are none of them
        for steps in (1, 2):
            self._sums.observe((1.0, float(steps), 0.0), prior * steps)

    def observe(self, steps: int, seconds: float, missed: int) -> None:
        self._sums.observe((1.0, float(steps), float(missed)), seconds)
        self._line = None
        self.calls += 1

    def line(self) -> tuple[float, float, float]:
        """(a, b, g), each >= 0: the fit with as many of them as keep that (the gap's cost is
        left out until calls with different gaps have run)."""
        if self._line is None:
            gram, moment = self._sums.arrays()
            # The last one ([0]: what the calls took, all of it per call) always holds.
            for columns in ([0, 1, 2], [0, 1], [0, 2], [0]):
                fit = _solve(gram[np.ix_(columns, columns)], moment[columns])
                if (fit >= -1e-12).all():  # rounding aside
                    break
            line = np.zeros(3)
            line[columns] = np.maximum(fit, 0.0)
            self._line = (float(line[0]), float(line[1]), float(line[2]))
        return self._line


class DecayedSums:
    """The normal equations of a weighted least-squares fit whose older observations weigh
    FIT_DECAY less at each new one: the sums of w * f_i * f_j (`gram`, row-major) and of
    w * f_i * y (`moment`), in plain floats, since they are updated every step."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.gram = [0.0] * (size * size)
        self.moment = [0.0] * size

    def observe(self, features: Sequence[float], value: float, weight: float = 1.0) -> None:
        """One observation, or a share of one (weight < 1: the older ones decay by as much)."""
        n, decay = self.size, FIT_DECAY if weight == 1.0 else FIT_DECAY**weight
        w = [weight * f for f in features]
        self.gram = [decay * g + w[i // n] * features[i % n] for i, g in enumerate(self.gram)]
        self.moment = [decay * m + w[i] * value for i, m in enumerate(self.moment)]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (gram, moment) as numpy arrays, to add to and solve."""
        return np.array(self.gram).reshape(self.size, self.size), np.array(self.moment)


def time_passes(
    backend: Backend, rows: tuple[int, ...], context_length: int = CALIBRATION_CONTEXT
) -> dict[int, float]:
    """Seconds of a pass of each row count after a short context (a few reps, the median),
    leaving the backend's cache empty."""
    context = [i % backend.vocab.size for i in range(3, 3 + context_length)]
    backend.truncate(0)
    backend.evaluate(context, logits_rows=1)
    timings = {}
    for n in rows:
        if len(context) + n > backend.n_ctx:
            break
        samples = []
        for _ in range(CALIBRATION_REPS + 1):  # the first is a warm-up
            start = time.perf_counter()
            backend.evaluate(context[:n])
            samples.append(time.perf_counter() - start)
            backend.truncate(len(context))
        timings[n] = sorted(samples[1:])[len(samples[1:]) // 2]
    backend.truncate(0)
    return timings


def _prior_shape(rows: float) -> float:
    return 1.0 + PRIOR_SLOPE * (rows - 1)


def _features(rows: float, sequences: int = 1) -> tuple[float, float, float, float, float]:
    """A pass's features in the cost fit: 1, its rows, its rows past the knot, the sequences
    beside the first, and whether it has more than one row."""
    return 1.0, float(rows), max(0.0, rows - KNOT), float(sequences - 1), float(rows > 1)


def _solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """The least-squares coefficients from the normal equations (a singular system, e.g. one
    row count only, gets its minimum-norm solution)."""
    try:
        return np.linalg.solve(gram, moment)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(gram, moment, rcond=None)[0]


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


@dataclass
class Record:
    """Averages over the steps a drafting model ran: tokens emitted, rows verified and the
    model's own steps. It starts as one step that kept a one-token draft; the first steps are
    averaged plainly, later ones in a moving average (so that one unlucky first draft does not
    rule the model out)."""

    tokens: float = 2.0
    rows: float = 2.0
    steps: float = 2.0
    n: int = 1

    def update(self, tokens: float, rows: float, steps: float) -> None:
        self.n += 1
        weight = max(EMA, 1 / self.n)
        self.tokens = (1 - weight) * self.tokens + weight * tokens
        self.rows = (1 - weight) * self.rows + weight * rows
        self.steps = (1 - weight) * self.steps + weight * steps


@dataclass
class PolicyModels:
    """What the adaptive policy learns, shared by every generation of a pipeline (and its forks):
    costs, acceptance, each drafting model's record, and what was chosen (a histogram of
    (strategy or "none", draft length))."""

    costs: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    records: dict[str, Record] = field(default_factory=dict)
    probe_every: dict[str, int] = field(default_factory=dict)  # drafting model -> idle steps before a probe
    idle: Counter[str] = field(default_factory=Counter)  # drafting model -> passes since it last ran
    choices: Counter[tuple[str, int]] = field(default_factory=Counter)
    step_tokens: float = 0.0  # moving averages over all steps: tokens emitted, seconds taken
    step_seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        """Tokens per second over the recent steps (None before any)."""
        return self.step_tokens / self.step_seconds if self.step_seconds > 0 else None

    @classmethod
    def for_target(
        cls,
        target: Backend,
        progress: Callable[[str], None] | None = None,
        drafts: Mapping[str, Backend] | None = None,
    ) -> PolicyModels:
        """Models whose pass costs are timed on `target` now, or read from an earlier run's timing
        of the same model on this machine (`specdecode.backends.pass_cache`) where a one-row pass timed
        now agrees with it (`_staleness`; else all are timed again and stored); `progress` is
        told which. drafts: the drafting models by strategy name, whose steps (one-row passes)
        are timed the same way, too briefly to announce. Priced at PRIOR_DRAFT_STEP of a target pass until its
        calls had run, a model a third of the target's size (on llama.cpp with one thread, a
        step 0.8 of a target row) drafted 16 tokens at its first call, at 0.4x plain's speed."""
        say = progress or (lambda line: None)
        models = cls()
        stored = _stored_timings(target, CALIBRATION_ROWS)
        stale = _staleness(stored, time_passes(target, (1,), CHECK_CONTEXT)) if stored is not None else None
        if stored is not None and stale is None:
            say("reusing the target's pass timings from an earlier run")
            models.costs.calibrated = stored
        else:
            if stale is None:
                say("timing the target's passes for the adaptive policy")
            else:
                say(f"stored pass timings are {stale:.2g}x the target's one-row pass now: timing again")
            models.costs.calibrate(target)
            _store_timings(target, CALIBRATION_ROWS, models.costs.calibrated)
        for strategy, backend in (drafts or {}).items():
            now = time_passes(backend, DRAFT_TIMING_ROWS)  # as dear as checking stored steps
            steps = _stored_timings(backend, DRAFT_TIMING_ROWS)
            if steps is None or _staleness(steps, now) is not None:
                steps = now
                _store_timings(backend, DRAFT_TIMING_ROWS, steps)
            if steps:
                models.costs.draft_calls[strategy] = DraftCalls(steps[1])
        return models


def _stored_timings(backend: Backend, rows: tuple[int, ...]) -> dict[int, float] | None:
    """An earlier run's timings of `rows`-row passes on `backend`'s model, if the cache has them."""
    key = pass_cache.cache_key(backend, rows) if pass_cache.enabled() else None
    return pass_cache.read(key) if key is not None else None


def _staleness(stored: dict[int, float], now: dict[int, float]) -> float | None:
    """How many times the one-row pass timed `now` the stored timing is, where that is off by more
    than STALE_FACTOR either way; None where it holds. Timings taken on a busy machine read
    10-13x a one-row pass's later cost on small quantized models, and a run on a busy machine
    would otherwise price its passes by a quiet one's timings: a few one-row passes, a fraction
    of the whole timing, tell which."""
    if 1 not in stored or 1 not in now:
        return None
    ratio = stored[1] / now[1]
    return ratio if max(ratio, 1 / ratio) > STALE_FACTOR else None


def _store_timings(backend: Backend, rows: tuple[int, ...], timings: dict[int, float]) -> None:
    key = pass_cache.cache_key(backend, rows) if pass_cache.enabled() else None
    if key is not None and timings:
        pass_cache.write(key, timings)


@dataclass(frozen=True)
class PassLoad:
    """What else the target pass a step's rows join holds (a batch): the other sequences'
    rows and the sequences in all."""

    other_rows: int = 0
    sequences: int = 1


ALONE = PassLoad()


@dataclass(frozen=True)
class PassShare:
    """A step's part of a target pass shared with other sequences (a batch): the pass's rows
    and sequences in all, and the share of the step's measured drafting time that was its own
    (sequences that draft in one round wait on each other's turns: `specdecode.backends.gather`)."""

    rows: int
    sequences: int
    drafting: float = 1.0


class Stopper:
    """The drafting rule of one model draft (`strategies.base.KeepDrafting`), each decision a
    gain at the step's rate: the tokens it adds in expectation (a token's chance of being
    reached and kept) less what it costs.

    A chain's token is drafted while it pays its verify row: the step that showed its
    confidence has run already. The model's next step, which shows the token after it, runs
    while that token is expected to pay its row by more than the step costs; its confidence is
    not known yet, so the expectation is over the confidences that followed this one's. (A
    rule that charged each token its row and the step after it would stop one token early,
    after paying for the step that showed it, and would pay for the step that shows the token
    it stops at.) A tree's node, whose children are drafted level by level, pays its row and a
    step. Remembers the confidences of the chain tokens it let through, and the deepest depth
    it was asked about: the model ran a step for each depth up to there, chain or tree,
    whatever became of the draft (a tree may come out as a chain, or be cut)."""

    def __init__(
        self,
        models: PolicyModels,
        strategy: str,
        rate: float,
        source: str | None = None,
        load: PassLoad = ALONE,
        max_nodes: int | None = None,
    ) -> None:
        """source: the acceptance model's name for the strategy's drafts (`AdaptivePolicy.source`).
        load: the rest of the pass the draft's rows join (a batch). max_nodes: at most this many
        tokens or tree nodes (a probe's)."""
        self.models = models
        self.strategy = strategy
        self.source = source or strategy
        self.rate = rate  # tokens per second: what a second of this step is worth
        self.load = load
        self.max_nodes = max_nodes
        self.confidences: list[float] = []
        self.deepest = 0  # the deepest depth asked about
        self._reach = 1.0  # P(every token so far kept)

    def __call__(self, depth: int, confidence: float) -> bool:
        if self.confidences:  # a step ran after the last token: what followed its confidence
            self.models.acceptance.observe_next(self.source, self.confidences[-1], confidence)
        reach = self._worth(self._reach, depth, confidence, depth - 1, 0.0)
        if reach is None:
            return False
        self._reach = reach
        self.confidences.append(confidence)
        return True

    def further(self, depth: int) -> bool:
        """Run the model's next step after the chain's token at `depth`?"""
        if self.max_nodes is not None and depth >= self.max_nodes:
            return False
        row = self._row(depth)
        expected = 0.0
        for share, confidence in self.models.acceptance.next_confidences(self.source, self.confidences[-1]):
            _, optimistic = self._estimates(depth + 1, confidence)
            expected += share * max(0.0, self._reach * optimistic - self.rate * row)
        return expected > self.rate * self.models.costs.step_time(self.strategy)

    def node(self, parent_reach: float, depth: int, confidence: float, nodes: int) -> float | None:
        """A tree node's reach, when it is worth its row and the step that drafts its children."""
        return self._worth(parent_reach, depth, confidence, nodes, self.models.costs.step_time(self.strategy))

    def _worth(
        self, parent_reach: float, depth: int, confidence: float, nodes: int, step: float
    ) -> float | None:
        """The reach of a token or node at `depth` after `nodes` others, when what it adds beats
        the cost of its verify row and `step` seconds of drafting; None when it does not."""
        self.deepest = max(self.deepest, depth)
        if self.max_nodes is not None and nodes >= self.max_nodes:
            return None
        a, optimistic = self._estimates(depth, confidence)
        return parent_reach * a if parent_reach * optimistic > self.rate * (step + self._row(nodes)) else None

    def _estimates(self, depth: int, confidence: float) -> tuple[float, float]:
        """P(kept | parent kept) of a token at `depth` of this confidence, and the same with an
        optimism that fades as its cell's outcomes accumulate, which decisions are made on: a
        cell whose tokens are never drafted would never learn that they are kept more often
        than their confidence says (small drafts are underconfident)."""
        acceptance = self.models.acceptance
        a = acceptance.model_estimate(self.source, depth, confidence)
        bonus = EXPLORE / math.sqrt(1.0 + acceptance.seen(self.source, depth, confidence))
        return a, min(1.0, a + bonus)

    def _row(self, nodes: int) -> float:
        """What one more verify row adds to the pass, after this draft's `nodes` nodes."""
        costs = self.models.costs
        rows, sequences = self.load.other_rows + nodes + 1, self.load.sequences  # the pass without it
        return costs.pass_time(rows + 1, sequences) - costs.pass_time(rows, sequences)


@dataclass(frozen=True)
class _Probe:
    """A probe of a drafting model that is running: what the step's best other candidate
    offered (`rival`, its gain at `rate`, after `t_sunk` seconds of model-free drafting)."""

    rival: float
    rate: float
    t_sunk: float


class AdaptivePolicy:
    """The decisions of one generation, over shared `PolicyModels`.

    Each candidate is scored by its gain: expected tokens less expected seconds times the
    step's rate (`step_rate`: the tokens per second the policy has been achieving, plain
    generation's before any step, capped at the best this step's candidates offer).
    Maximising that is maximising the long-run rate (a renewal-reward argument); comparing
    ratios step by step would stop good drafts early and let poor ones run on.

    In a batch (`load`, set each step), a candidate's pass seconds are those of the pass
    holding the other sequences' rows too, so that candidates differ by what their rows add
    to it, and `rate` is the batch's (see the module docstring)."""

    def __init__(self, models: PolicyModels, counterfactual: bool = False, regime: str | None = None) -> None:
        """counterfactual: whether a draft token that was not verified would have been kept
        exactly when it equals the token emitted at its place (`match` verification, or greedy
        sampling), so that the drafts not chosen are learnt from too. regime: how this
        generation samples and verifies, when not greedily (e.g. "match, temperature 1"): a
        draft is kept far less often at temperature 1 than under greedy decoding, so each
        regime has acceptance estimates and records of its own (costs are shared)."""
        self.models = models
        self.counterfactual = counterfactual
        self.regime = regime
        self._position = 0  # of this step (`at`)
        self._start = 0  # of the first step: the prompt's length
        self._read: dict[str, int] = {}  # drafting model -> the position it has read up to
        self._missed = 0  # tokens the model run this step read first
        self._prompt_read = 0  # ... of them, the prompt's (its first call in this generation)
        self._probe: _Probe | None = None  # this step's, while it runs
        self._watched: list[tuple[str, list[int], int]] = []  # (strategy, draft, tokens kept so far)
        self.load = ALONE  # what else this step's pass holds

    def pass_seconds(self, rows: float) -> float:
        """Seconds of this step's target pass if this sequence puts `rows` rows in it."""
        return self.models.costs.pass_time(self.load.other_rows + rows, self.load.sequences)

    def _own_seconds(self, rows: float) -> float:
        """Its rows' share of that pass: what the step is credited with (`observe`)."""
        return self.pass_seconds(rows) * rows / (self.load.other_rows + rows)

    def expected(self, strategy: str, n_tokens: int) -> list[float]:
        """E_k for k = 0..n_tokens of a model-free draft of n_tokens by `strategy`."""
        return expected_tokens(self.models.acceptance.chain(self.source(strategy), [None] * n_tokens))

    def step_rate(self, expected: dict[str, list[float]], models: Sequence[str], t_sunk: float) -> float:
        """The tokens per second a second of this step is worth: the rate of the recent steps,
        but no more than the best candidate of this step achieves (a plain step, each
        model-free draft at its best length (`expected`: its E_k by strategy), each drafting
        model's record). Valued at a rate no candidate reaches here (the previous text's long
        copies, say), every candidate would look poor and the cheapest would win; but the text
        is what it is for a while yet, and its next tokens must be made at the rates it offers.
        Nor less than a plain step makes, which is always to be had: after drafts that lost, a
        second valued at their rate made every row look nearly free, and drafts ran long."""
        recent = self.models.rate if self.models.rate is not None else 1.0 / self._own_seconds(1)
        plain = best = 1.0 / (t_sunk + self._own_seconds(1))
        for values in expected.values():
            best = max(best, *(e / (t_sunk + self._own_seconds(k + 1)) for k, e in enumerate(values)))
        for strategy in models:
            record = self.models.records.get(self.source(strategy))
            if record is not None:
                seconds = t_sunk + self._draft_seconds(strategy, record) + self._own_seconds(record.rows)
                best = max(best, record.tokens / seconds)
        return max(plain, min(recent, best))

    def plain_gain(self, t_sunk: float, rate: float) -> float:
        return 1.0 - rate * (t_sunk + self.pass_seconds(1))

    def best_length(self, expected: list[float], t_sunk: float, rate: float) -> tuple[int, float]:
        """The prefix length of a model-free draft whose E_k are `expected` with the best gain at
        `rate`, and that gain (0 tokens: a plain step)."""
        gains = [e - rate * (t_sunk + self.pass_seconds(k + 1)) for k, e in enumerate(expected)]
        best = max(range(len(gains)), key=lambda k: (gains[k], -k))
        return best, gains[best]

    def model_gain(self, strategy: str, t_sunk: float, rate: float, n_max: int) -> float:
        """A drafting model's expected gain: the tokens its steps emitted, less what its steps'
        draft length costs now; where it has never run or is due for another try (a probe),
        the most it could gain (`best_case_gain`)."""
        record = self.models.records.get(self.source(strategy))
        if record is None or self._probing(strategy):
            return self.best_case_gain(strategy, t_sunk, rate, n_max)
        return self._record_gain(strategy, record, t_sunk, rate, self.missed(strategy))

    def best_case_gain(self, strategy: str, t_sunk: float, rate: float, n_max: int) -> float:
        """The gain of the model's best draft of up to n_max tokens were every token kept, at its
        measured step cost (timed at load, then its calls) and the pass curve. A model that has
        no record to go by is tried only where this beats the rest: on a CPU where each verify
        row costs nearly a plain step and each draft step a third or half of one (Qwen2.5-Coder
        1.5B drafted by its 0.5B sibling on llama.cpp, one thread each), no draft pays even
        when all of it is kept, and each try of the model there only loses."""
        missed, costs = self.missed(strategy), self.models.costs
        return max(
            (
                k + 1 - rate * (t_sunk + costs.draft_time(strategy, k, missed) + self.pass_seconds(k + 1))
                for k in range(1, n_max + 1)
            ),
            default=-math.inf,
        )

    def _record_gain(self, strategy: str, record: Record, t_sunk: float, rate: float, missed: float) -> float:
        """The gain of a step of `strategy`'s model that gives what `record` says, its call first
        reading `missed` tokens."""
        seconds = t_sunk + self.models.costs.draft_time(strategy, record.steps, missed)
        return record.tokens - rate * (seconds + self.pass_seconds(record.rows))

    def _draft_seconds(self, strategy: str, record: Record) -> float:
        """A call as long as the model's usual one, now: after the tokens it has missed."""
        return self.models.costs.draft_time(strategy, record.steps, self.missed(strategy))

    def at(self, position: int) -> None:
        """The step about to be drafted starts at `position` (history and last token)."""
        self._position = position
        self._start = self._start or position

    def missed(self, strategy: str) -> int:
        """Tokens the drafting model would read before drafting now that its call is charged
        for: those verified since it last ran in this generation. Its first call reads the
        prompt too, a cost any use of the model pays once a generation, not this step's (a
        long prompt would otherwise keep it idle until a probe)."""
        return self._position - self._read.get(strategy, self._start)

    def source(self, strategy: str) -> str:
        """The name the acceptance model and the records know `strategy`'s drafts by here."""
        return strategy if self.regime is None else f"{strategy} ({self.regime})"

    def _probing(self, strategy: str) -> bool:
        source = self.source(strategy)
        return self.models.idle[source] >= self.models.probe_every.get(source, PROBE_EVERY)

    def stopper(self, strategy: str, rate: float, rival: float, t_sunk: float) -> Stopper:
        """The stopping rule of `strategy`'s draft, which runs now, where the step's best other
        candidate has gain `rival`. A run that is only a probe drafts at most PROBE_NODES
        tokens (nodes) and doubles the wait before the next probe (up to MAX_PROBE_EVERY
        steps); each run on merit halves it. Where the model keeps losing, probing it every
        few steps, or drafting as far as optimism about its untried cells reaches, costs more
        than it finds (at temperature 1 a probe drafted 16 tokens and none was kept); a lucky
        probe is not a reason to probe often again. The wait is kept across generations, as
        the records are."""
        source, waits = self.source(strategy), self.models.probe_every
        wait = waits.get(source, PROBE_EVERY)
        probe = self._probing(strategy) and source in self.models.records
        waits[source] = min(MAX_PROBE_EVERY, 2 * wait) if probe else max(PROBE_EVERY, wait // 2)
        self._probe = _Probe(rival, rate, t_sunk) if probe else None
        self._missed = self._position - self._read.get(strategy, 0)  # what the call reads, prompt and all
        self._prompt_read = max(0, self._start - self._read.get(strategy, 0))
        self._read[strategy] = self._position
        self.models.idle[source] = 0
        return Stopper(self.models, strategy, rate, source, self.load, PROBE_NODES if probe else None)

    def skipped(self, strategies: list[str]) -> None:
        """These drafting models sat this step out: a pass more without them, counted in
        shares in a batch, whose every sequence steps in each pass (a probe stalls the whole
        pass, so a batch must not probe more often than one sequence does)."""
        for strategy in strategies:
            self.models.idle[self.source(strategy)] += 1.0 / self.load.sequences

    def observe(
        self,
        strategy: str | None,
        confidences: list[float | None],
        path: Sequence[int],
        t_draft: float,
        t_pass: float,
        model: str | None,
        model_steps: int,
        t_model: float,
        parents: Sequence[int] | None = None,
        share: PassShare | None = None,
    ) -> None:
        """One verified step: `strategy`'s draft (None: a plain step) of len(confidences) nodes,
        a chain or (parents) a tree, whose nodes `path` were kept, drafted in t_draft seconds
        and verified in a pass of t_pass; `model` is the drafting model run this step (if
        any), in model_steps steps taking t_model seconds; `share`: the batch the pass and the
        drafting were shared with (None: alone). A model-free chain is left to `watch` where
        verification is counterfactual."""
        models = self.models
        own_rows = len(confidences) + 1
        rows, sequences = (own_rows, 1) if share is None else (share.rows, share.sequences)
        if share is not None:  # the drafting time that was this sequence's own
            t_draft, t_model = t_draft * share.drafting, t_model * share.drafting
        weight = EMA if models.step_seconds > 0 else 1.0
        seconds = t_draft - self._prompt_seconds(model, model_steps, t_model) + t_pass * own_rows / rows
        models.step_tokens += weight * (1.0 + len(path) - models.step_tokens)
        models.step_seconds += weight * (seconds - models.step_seconds)
        models.costs.observe_pass(rows, t_pass, sequences, own_rows / rows)
        shape = "tree" if parents is not None else ""
        models.choices[(f"{strategy} {shape}".strip() if strategy else "none", len(confidences))] += 1
        if strategy is not None and (strategy == model or not self.counterfactual):
            if parents is None:
                models.acceptance.observe(self.source(strategy), confidences, len(path))
            else:
                models.acceptance.observe_tree(self.source(strategy), confidences, parents, path)
        if model is not None:
            models.costs.observe_draft(model, model_steps, t_model, self._missed)
            tokens, rows = 1.0 + len(path), len(confidences) + 1  # whoever drafted: what running it gave
            source, probe = self.source(model), self._probe
            outcome = Record(tokens, rows, model_steps)
            # A probe beat the rival, at the model's costs as if it ran every step (reading what
            # its last step emitted): the text changed, and a new average begins.
            if (
                probe is not None
                and self._record_gain(model, outcome, probe.t_sunk, probe.rate, tokens) > probe.rival
            ):
                models.records[source] = outcome
            else:
                models.records.setdefault(source, Record()).update(tokens, rows, model_steps)
        self._probe = None
        self._prompt_read = 0

    def _prompt_seconds(self, model: str | None, steps: int, seconds: float) -> float:
        """What reading the prompt took of this step's call of `model` (`seconds`, `steps` steps):
        the rest of the call at the model's costs. Not the step's: its draft did not choose to
        pay it, and the rate (whose first step weighs all) would value a second at a fraction of
        what it is worth, so that every row looked free and drafts ran 16 tokens long."""
        if model is None or not self._prompt_read:
            return 0.0
        rest = self.models.costs.draft_time(model, steps, self._missed - self._prompt_read)
        return max(0.0, seconds - rest)

    def watch(self, drafts: dict[str, list[int]], emitted: Sequence[int]) -> None:
        """Score model-free drafts against the tokens emitted (counterfactual verification
        only): this step's `drafts` (each strategy's whole draft, verified or not) and those of
        earlier steps still unresolved. A draft is kept up to its first token that differs
        from the one emitted at its place; one that reaches past the tokens emitted so far
        waits for the next steps' tokens."""
        if not self.counterfactual:
            return
        waiting = []
        for strategy, tokens, kept in [*self._watched, *((s, t, 0) for s, t in drafts.items() if t)]:
            matched = common_prefix(tokens[kept:], emitted)
            kept += matched
            if kept == len(tokens):
                self.models.acceptance.observe(self.source(strategy), [None] * kept, kept)
            elif matched < len(emitted):  # a token differs: kept up to there
                self.models.acceptance.observe(self.source(strategy), [None] * (kept + 1), kept)
            else:
                waiting.append((strategy, tokens, kept))
        self._watched = waiting
