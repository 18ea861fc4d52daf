"""The adaptive policy's cost model: seconds of target passes and draft steps, timed once at load.

Apart from the policy that acts on it (`specdecode.policy`): the classic batch rule
(`specdecode.scheduler.LoadRule`) prices a batch's rows by the same model, and a pipeline is
calibrated here once, before it is assembled (`calibrate`: timing the target's passes, or
reusing an earlier run's timings from `specdecode.backends.pass_cache`, and its drafting
models' steps).

- Cost model: seconds of a target pass of T rows, a line a + b * T up to KNOT rows with a
  second slope beyond (once passes that long have run), a step up from one row to several
  (a kernel's shape changes there) and a cost per sequence sharing the pass (once batches
  have run), fitted to passes timed briefly at load and to the passes actually run, recent
  ones weighing more (contexts grow, machines get busy), the timings scaled to the speed the
  passes run at now (their shape holds where the machine slows every size alike); and the seconds
  of a drafting model's call as a line in its steps and in the tokens it reads first (those
  verified since its last call: a few when it runs every step, a whole gap after it idled),
  starting from its one-row pass timed at load.

Batches: where sequences share each target pass (`specdecode.scheduler`), a step's rows join
a pass holding the other sequences' rows (`PassLoad`), and after it the step is credited with
its part of the pass and of the drafting round (`PassShare`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from specdecode.backends import Backend, pass_cache

CALIBRATION_ROWS = (1, 2, 3, 5, 9, 17)
BATCH_CALIBRATION_ROWS = (
    1,
    2,
    4,
    8,
    16,
    32,
    64,
)  # the classic batch rule's (`specdecode.scheduler.LoadRule`)
CALIBRATION_REPS = 3
CALIBRATION_CONTEXT = 32  # tokens in the cache while timing, as after a short prompt
CHECK_CONTEXT = 4  # ... while checking stored timings: a one-row pass costs nearly the same, the prompt less
PRIOR_PASS = 0.01  # seconds of a one-row pass before anything is measured
PRIOR_SLOPE = 0.1  # pass(T) / pass(1) = 1 + 0.1 (T - 1) before it is measured (a CPU's shape)
PRIOR_DRAFT_STEP = 0.1  # a draft step, as a share of a one-row target pass, where the model was not timed
DRAFT_TIMING_ROWS = (1,)  # a drafting model is timed at load by its one-row passes: its steps
STALE_FACTOR = 1.5  # stored timings whose one-row pass is now off by more than this, either way, are retimed
CALIBRATION_WEIGHT = 2.0  # passes each load-time timing counts as in the cost fit
FIT_DECAY = 0.98  # per pass run: the weight of older passes in the cost fit
REFIT_EVERY = 8  # passes run between refits of the cost line (costs drift slowly)
KNOT = 17  # rows where the pass cost's second slope starts (the longest pass timed at load)
LOAD_WINDOW = 9  # the latest passes whose speed against the timings is the machine's load now
LOAD_SPREAD = 1.5  # ... those of them within this many times the median's speed
OUTLIER = 3.0  # a pass or call counts as at most this many times what was predicted for it


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
        # drafting models whose call is one pass whatever the draft's length (a DFlash block)
        self.one_pass: set[str] = set()
        self.untimed: set[str] = set()  # drafting models not timed yet (`time_draft`)
        self._sums = DecayedSums(5)  # over the passes run, features _features(T, S)
        self._curve: tuple[float, ...] | None = None  # (a, b, c, s, m)
        self._stale = 0.0  # passes observed since the last fit
        self._times: dict[tuple[float, int], float] = {}  # (rows, sequences) -> pass_time now
        # the latest one-sequence passes' seconds over the timings' fit's for them (`drift`)
        self._loads: deque[tuple[float, float]] = deque(maxlen=LOAD_WINDOW)  # (seconds, timed)
        self._load = 1.0
        self._timed: tuple[tuple[tuple[int, float], ...], np.ndarray] | None = None  # (timings, fit)

    def calibrate(self, backend: Backend, rows: tuple[int, ...] = CALIBRATION_ROWS) -> None:
        """Time passes of each row count on the target (`time_passes`)."""
        self.calibrated.update(time_passes(backend, rows))
        self._curve = None

    def observe_pass(self, rows: int, seconds: float, sequences: int = 1, weight: float = 1.0) -> None:
        """A pass of `rows` rows of `sequences` sequences took `seconds`. weight: the share of
        it this call reports (each sequence of a batch reports its rows' share, so that the
        pass counts once in all). What the model predicted for it, before learning from it, is
        kept beside it: the fit the policy acted on, which a multi-task run's final model is not.
        Returns its seconds at the timings' speed (`steady`), which the fit learns from."""
        predicted = self.pass_time(rows, sequences)  # the curve in force (a policy refits before it)
        if sequences == 1 and rows <= max(self.calibrated, default=0):  # within the timings' sizes
            timed = sum(v * f for v, f in zip(self._timed_curve(), _features(rows), strict=True))
            self._loads.append((seconds, timed))
            self._load = _load(self._loads)
        steady = self.steady(seconds, predicted)
        self._sums.observe(_features(rows, sequences), steady, weight)
        self._stale += weight
        totals = self.measured.setdefault((rows, sequences), [0.0, 0.0, 0.0])
        totals[0] += weight
        totals[1] += weight * seconds
        totals[2] += weight * predicted
        return steady

    def steady(self, seconds: float, predicted: float) -> float:
        """`seconds` measured now, as at the timings' speed (divided by the load, `drift`), and
        at most OUTLIER times the `predicted` seconds (at the load now): a pass or call stalled
        10-100x (a process descheduled) would otherwise move the fit for dozens of passes, or
        rule a drafting model out after one slow call. (Nothing stalls the other way: a call
        far faster than predicted is news.)"""
        if predicted <= 0:
            return seconds / self._load
        return min(seconds, predicted * OUTLIER) / self._load

    def pass_time(self, rows: float, sequences: int = 1) -> float:
        """Seconds of a pass of `rows` rows of `sequences` sequences at the load now (asked for
        many lengths every step: remembered until the next refit, every REFIT_EVERY passes run)."""
        if self._curve is None or self._stale >= REFIT_EVERY:
            self._curve = tuple(float(v) for v in self._fit())
            self._stale = 0.0
            self._times = {}
        key = (rows, sequences)
        if key not in self._times:
            self._times[key] = sum(
                v * f for v, f in zip(self._curve, _features(rows, sequences), strict=True)
            )
        return self._load * self._times[key]

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
            moment + timed_moment,
            set(self.calibrated) | {rows for rows, _ in self.measured},
        )

    def drift(self) -> float:
        """How much slower (> 1) or faster the latest LOAD_WINDOW one-sequence passes ran than
        the load-time timings' fit says (of those near the median's speed: one stalled pass
        moves it not at all): the load now, of a busier machine or a longer context. Passes and
        draft calls are fitted at the timings' speed (`steady`: each divided by the load when it
        ran) and predicted at the load now, so that a load swinging 2-4x scales a draft's cost
        and plain's alike. A fit of seconds as measured mixed moments: draft calls timed while
        the machine was quiet, priced against passes run while it was busy, made a losing draft
        model look cheap; and unscaled timings, where each row costs a one-row pass, made each
        row past the first cost a third of one on a machine three times as busy as at load."""
        return self._load

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

    def observe_draft(self, strategy: str, steps: int, seconds: float, missed: int) -> float:
        """A call of the drafting model `strategy` read the `missed` tokens verified since its
        previous call, then ran `steps` steps, in `seconds`; returns them as the fit learns them
        (`steady`)."""
        steady = self.steady(seconds, self.draft_time(strategy, steps, missed))
        self._draft_calls(strategy).observe(self._steps(strategy, steps), steady, missed)
        return steady

    def step_time(self, strategy: str) -> float:
        """The seconds one more step of a drafting model adds to its call (none for a one-pass model)."""
        return 0.0 if strategy in self.one_pass else self._load * self._draft_calls(strategy).step()

    def draft_time(self, strategy: str, steps: float, missed: float) -> float:
        """The seconds of a call of `steps` steps that first reads `missed` tokens."""
        a, b, g = self._draft_line(strategy)
        return a + b * self._steps(strategy, steps) + g * missed

    def read_time(self, strategy: str, tokens: float) -> float:
        """The seconds the drafting model takes to read `tokens` tokens it missed: its calls'
        cost per token read first, or, before calls with different gaps have shown that, its
        step's cost times the share of a one-row pass each further row of a target pass costs
        (a read is a pass of many rows; on a CPU where each verify row costs nearly a plain
        step, each token read costs nearly a draft step)."""
        _, b, g = self._draft_line(strategy)
        if g <= 0:
            one = self.pass_time(1)
            g = b * min(1.0, max(0.0, (self.pass_time(KNOT) - one) / ((KNOT - 1) * one)))
        return g * tokens

    def _steps(self, strategy: str, steps: float) -> float:
        """A one-pass model's call is one step, however many tokens it drafts."""
        return min(steps, 1.0) if strategy in self.one_pass else steps

    def _draft_line(self, strategy: str) -> tuple[float, float, float]:
        """The model's call cost line (its load-time timing until its calls have run) at the
        target's load now: the machine that slows the target slows the model too."""
        a, b, g = self._draft_calls(strategy).line()
        return self._load * a, self._load * b, self._load * g

    def _draft_calls(self, strategy: str) -> DraftCalls:
        if strategy not in self.draft_calls:
            self.draft_calls[strategy] = DraftCalls(PRIOR_DRAFT_STEP * self.pass_time(1) / self._load)
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


def _load(passes: Sequence[tuple[float, float]]) -> float:
    """The seconds of `passes` (seconds, the timings' fit's for them) over the fit's, of those
    within LOAD_SPREAD times the median pass's ratio either way: a stall moves it not at all."""
    median = statistics.median_low(seconds / timed for seconds, timed in passes)  # one of them
    kept = [(s, t) for s, t in passes if median / LOAD_SPREAD <= s / t <= median * LOAD_SPREAD]
    return sum(seconds for seconds, _ in kept) / sum(timed for _, timed in kept)


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
        self.prior = prior
        self._sums = DecayedSums(3)  # features (1, steps, missed)
        self._line: tuple[float, float, float] | None = None
        self._per_step = True  # whether the fit kept b
        self.calls = 0  # the calls run: the prior's pseudo-calls below are none of them
        for steps in (1, 2):
            self._sums.observe((1.0, float(steps), 0.0), prior * steps)

    def observe(self, steps: int, seconds: float, missed: int) -> None:
        self._sums.observe((1.0, float(steps), float(missed)), seconds)
        self._line = None
        self.calls += 1

    def line(self) -> tuple[float, float, float]:
        """(a, b, g), each >= 0: of the fits of some of them, the others 0, that keep that, the
        one closest to the calls (the gap's cost is left out until calls with different gaps
        have run). Dropping a fixed list of them in turn, a few calls timed on a busy machine
        left the call's cost alone, and a draft of several steps was priced as one."""
        if self._line is None:
            gram, moment = self._sums.arrays()
            best, line = math.inf, np.zeros(3)
            for size in (3, 2, 1):  # ([0] alone, what the calls took, all of it per call, holds)
                for columns in map(list, combinations(range(3), size)):
                    fit = _solve(gram[np.ix_(columns, columns)], moment[columns])
                    if not (fit >= -1e-12).all():  # rounding aside
                        continue
                    curve = np.zeros(3)
                    curve[columns] = np.maximum(fit, 0.0)
                    loss = float(curve @ gram @ curve - 2 * curve @ moment)  # the squares, less a constant
                    if loss < best - 1e-15:
                        best, line = loss, curve
            self._line = (float(line[0]), float(line[1]), float(line[2]))
            self._per_step = line[1] > 0
        return self._line

    def step(self) -> float:
        """What one more step adds to a call: b, or where the fit left b out (calls of more
        steps timed no dearer, on a busy machine), the step timed at load. Not nothing: after a
        few one-step calls that read gaps, a step priced at nothing let a model whose every
        token lost draft 16."""
        b = self.line()[1]
        return b if self._per_step else self.prior


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


def calibrate(
    backend: Backend,
    rows: tuple[int, ...] = CALIBRATION_ROWS,
    *,
    drafts: Mapping[str, Backend] | None = None,
    progress: Callable[[str], None] | None = None,
    store: bool = True,
) -> CostModel:
    """A cost model whose pass costs are timed on `backend` now (passes of `rows` rows), or,
    with `store`, read from an earlier run's timing of the same model on this machine
    (`specdecode.backends.pass_cache`) where a one-row pass timed now agrees with it
    (`_staleness`; else all are timed again and stored); `progress` is told which. drafts: the
    drafting models by strategy name, whose steps (one-row passes) are read from the store, or
    (without `store`) timed now; a model with no stored timing is left `untimed`, to be timed
    when it could first win a step (`time_draft`), so that a model the policy never runs costs
    nothing but its load. Priced at PRIOR_DRAFT_STEP of a target pass until its calls had run, a
    model a third of the target's size (on llama.cpp with one thread, a step 0.8 of a target
    row) drafted 16 tokens at its first call, at 0.4x plain's speed.

    The adaptive policy's models are calibrated with the store (`PolicyModels.for_target`); the
    classic batch rule times BATCH_CALIBRATION_ROWS without it (`scheduler.LoadRule.timed`)."""
    say = progress or (lambda line: None)
    costs = CostModel()
    speed = 1.0  # how many times the stored timings the machine's passes take now
    if store:
        speed = _timed_or_stored(costs, backend, rows, say)
    else:
        costs.calibrate(backend, rows)
    for strategy, draft in (drafts or {}).items():
        steps = _stored_timings(draft, DRAFT_TIMING_ROWS) if store else time_passes(draft, DRAFT_TIMING_ROWS)
        if steps and speed != 1.0:  # the machine changed: stored as the target's timings are
            steps = {rows: seconds * speed for rows, seconds in steps.items()}
            _store_timings(draft, DRAFT_TIMING_ROWS, steps)
        if steps:
            costs.draft_calls[strategy] = DraftCalls(steps[1])
        else:
            costs.untimed.add(strategy)
    return costs


def time_draft(costs: CostModel, strategy: str, backend: Backend) -> float:
    """Time the drafting model `strategy`'s steps on `backend` now, for `costs` and for later
    runs (`specdecode.backends.pass_cache`); the seconds that took. A pipeline loads with its
    drafting models' stored timings or none (`calibrate`): timing a model at load cost every
    run a 32-token read and four steps of a model the policy might never run. The chain calls
    this the first time a drafting model could win a step (`specdecode.chain`), once a
    machine: its calls refit the cost line from then on, and until they run, the stored step
    is scaled by the target's `drift` (the machine that slowed the target slows the model)."""
    start = time.perf_counter()
    steps = time_passes(backend, DRAFT_TIMING_ROWS)
    _store_timings(backend, DRAFT_TIMING_ROWS, steps)
    if steps:  # timed at the load now: kept at the target's timings' speed, as calls are
        costs.draft_calls[strategy] = DraftCalls(steps[1] / costs.drift())
    costs.untimed.discard(strategy)
    return time.perf_counter() - start


def _timed_or_stored(
    costs: CostModel, backend: Backend, rows: tuple[int, ...], say: Callable[[str], None]
) -> float:
    """Calibrate `costs` from the stored timings of `backend`'s passes where they hold, else
    by timing them now and storing those (see `calibrate`); how many times the stored ones
    the timings now are where they were stale (1 otherwise): a drafting model's stored step
    is scaled by as much, its check not being worth a run's time."""
    stored = _stored_timings(backend, rows)
    stale = _staleness(stored, time_passes(backend, (1,), CHECK_CONTEXT)) if stored is not None else None
    if stored is not None and stale is None:
        say("reusing the target's pass timings from an earlier run")
        costs.calibrated = stored
        return 1.0
    if stale is None:
        say("timing the target's passes for the adaptive policy")
    else:
        say(f"stored pass timings are {stale:.2g}x the target's one-row pass now: timing again")
    costs.calibrate(backend, rows)
    _store_timings(backend, rows, costs.calibrated)
    return 1.0 if stale is None else 1.0 / stale


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
