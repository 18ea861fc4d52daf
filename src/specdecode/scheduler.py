"""Batched speculation: many generations share every target pass (continuous batching).

Each generation keeps everything of its own: its fork of the pipeline (KV caches), its chain
of strategies, its sampler and its stop rules. A step of the `BatchEngine` does, for all of
them at once, what `Generation.step` does for one:

1. sequences that were cancelled leave; at most one prompt chunk of a newly joined sequence
   is evaluated (prompts enter a chunk per step, so a long prompt does not stall the others);
2. every decoding sequence drafts with its own chain (`Generation.plan`): the more rows share
   a pass, the dearer a draft token, so drafts shorten, and vanish, as the batch grows. The
   adaptive policy prices rows so by itself (`specdecode.policy`, told what else each pass
   holds, a `PassLoad`, and after it its share, a `PassShare`); classic chains are capped by
   the `LoadRule`. For both, the `SpeculationGate` lets a batch draft only while drafting
   steps measure faster than plain ones;
3. one target pass scores every sequence's rows (`evaluate_groups`);
4. each sequence verifies, accepts and rolls back on its own (`Generation.finish`) and hands
   its chunk to its consumer; finished sequences leave, and new ones may join before the
   next step.

Nothing a sequence emits depends on the others: its rows get the bits they would get in a
pass of their own wherever the backend is row-invariant (the native backend, up to
`max_pass_rows` rows a pass), and its draws come from its own sampler. So a greedy or seeded
`match` answer equals the answer the same request gets alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from specdecode.backends import Backend
from specdecode.backends.batch import evaluate_each
from specdecode.backends.gather import DraftPasses, outcome
from specdecode.generate import Chunk, Generation, StepPlan
from specdecode.policy import CostModel, PassLoad, PassShare

BATCH_CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
ACCEPTANCE_PRIOR = 0.6  # P(draft token kept | its parent was) before any sequence drafted
ACCEPTANCE_WEIGHT = 4.0  # pseudo-observations behind a prior
ACCEPTANCE_DECAY = 0.95  # older steps weigh less: the text changes
PROBE_EVERY = 8  # a sequence kept from drafting this many steps may draft one token again
DRAFT_COST_EMA = 0.2  # weight of the newest step in the drafting cost's moving average
EXPLORE_EVERY = 16  # one step in this many tries the way the gate did not choose
GATE_EMA = 0.2  # weight of the newest step in the gate's throughput averages

logger = logging.getLogger(__name__)
Seat = TypeVar("Seat")  # what a generation runs on (a fork of a pipeline)


@dataclass
class Entry:
    """A generation in the batch, with what receives its chunks."""

    generation: Generation
    emit: Callable[[Chunk], None]
    cancelled: bool = False  # set from any thread: the sequence leaves at the next step
    error: BaseException | None = None
    # [kept, tried] decayed counts of draft tokens reached by verification (see LoadRule).
    counts: list[float] = field(default_factory=lambda: [0.0, 0.0])
    steps_without_draft: int = 0
    rows: int = 1  # rows it put in the last pass (1 before any: a plain step's)

    @property
    def done(self) -> bool:
        return self.cancelled or self.error is not None or bool(self.generation.stats.stop_reason)

    def acceptance(self, prior: float) -> float:
        """P(a draft token is kept | its parent was): this sequence's counts, pulled towards
        `prior` (what the batch's sequences have seen) while it has drafted little."""
        kept, tried = self.counts
        return (kept + ACCEPTANCE_WEIGHT * prior) / (tried + ACCEPTANCE_WEIGHT)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        """A verified chain: tokens 1..n_accepted were kept, the next one (if any) was not."""
        if n_drafted == 0:
            self.steps_without_draft += 1
            return
        self.steps_without_draft = 0
        self.counts = decayed(self.counts, n_drafted, n_accepted)


def decayed(counts: list[float], n_drafted: int, n_accepted: int) -> list[float]:
    """[kept, tried] after a verified chain of n_drafted tokens (older steps decayed)."""
    tried = n_accepted + (1 if n_accepted < n_drafted else 0)
    return [ACCEPTANCE_DECAY * counts[0] + n_accepted, ACCEPTANCE_DECAY * counts[1] + tried]


class LoadRule:
    """How many tokens a sequence may draft when `batch` sequences share a pass.

    A pass of T rows costs a + b*T (the cost model's line, timed at start and refined from
    every pass run). Without drafts the batch emits `batch` tokens per a + b*batch seconds;
    one more draft token costs b (its verify row) plus the seconds of drafting it, that is
    (b + draft) * batch / (a + b*batch) tokens of the batch's output. The j-th token of a
    chain is kept with probability acceptance^j, so a sequence drafts the j-th token only
    while acceptance^j exceeds that price. One sequence alone pays little for a row (a
    dominates), so its drafts stay long; as the batch grows the price nears one token, and
    drafting stops unless it is nearly always right."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def max_draft(self, batch: int, acceptance: float, draft_seconds: float) -> int | None:
        """The most draft tokens worth their price (None: no cap, every token pays)."""
        pass_time = self.costs.pass_time(batch, batch)
        slope = max(0.0, self.costs.pass_time(batch + 1, batch) - pass_time)
        price = (slope + draft_seconds) * batch / pass_time
        if price <= 0.0 or (acceptance >= 1.0 and price < 1.0):
            return None
        if acceptance <= 0.0 or price >= 1.0:
            return 0
        return max(0, math.floor(math.log(price) / math.log(acceptance)))

    @classmethod
    def timed(cls, backend: Backend) -> LoadRule:
        """A rule whose cost model times passes of up to 64 rows on `backend` (its cache is
        left empty). Where timing fails, the rule starts from the cost model's prior and learns
        from the passes run: a backend that cannot time a pass fails its requests, not this."""
        costs = CostModel()
        try:
            costs.calibrate(backend, BATCH_CALIBRATION_ROWS)
        except Exception as exc:
            logger.warning("pass costs could not be timed (%s): starting from the prior", exc)
            costs = CostModel()
        return cls(costs)


class SpeculationGate:
    """Whether a batch drafts at all this step, from the throughput its steps measured.

    The load rule prices a draft token from a line of pass costs; what a drafting step really
    costs also holds the drafting itself, verification and the work per sequence around the
    pass, which no line of pass times sees (on a CPU where a batch of sequences already keeps
    the cores busy, a verify row costs nearly what a sequence's token does). So the gate
    measures, per batch size (by powers of two), a moving average of the tokens per second of
    decode steps that drafted as the rule allowed and of steps that did not draft; a step
    drafts when drafting steps have been the faster, and one step in EXPLORE_EVERY tries the
    other way, so that both averages follow the text and the machine."""

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], float] = {}  # (bucket, drafted) -> tokens/s
        self.steps: dict[int, int] = {}

    def choose(self, batch: int) -> bool:
        """Draft in this step of `batch` sequences?"""
        bucket = batch.bit_length()
        self.steps[bucket] = step = self.steps.get(bucket, 0) + 1
        drafting, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if drafting is None or plain is None:
            return drafting is None  # each way once, drafting first
        better = drafting >= plain
        return better if step % EXPLORE_EVERY else not better

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        key = (batch.bit_length(), drafted)
        rate = tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + GATE_EMA * (rate - old)


@dataclass
class PassRecord:
    """One batched step, for metrics: how many sequences and rows shared the target pass."""

    sequences: int
    rows: int
    seconds: float


class BatchEngine:
    """Steps a changing set of generations together (see the module docstring). Not
    thread-safe: one thread calls `add` and `step`, except `Entry.cancelled`, which any
    thread may set."""

    def __init__(
        self,
        rule: LoadRule | None = None,
        on_pass: Callable[[PassRecord], None] | None = None,
        draft_passes: DraftPasses | None = None,
        gate: bool | None = None,
    ) -> None:
        """rule: caps classic chains' drafts under load (None: drafts as the chains choose,
        which the adaptive policy does knowing the batch).
        gate: whether a `SpeculationGate` decides each step if the batch drafts at all (None:
        with the rule). The adaptive policy's costs are of passes and draft calls; a drafting
        round in a batch also pays hand-offs between the sequences' threads and the stall
        while one sequence catches its draft model up or probes it, which only measuring
        steps sees.
        draft_passes: the rounds that batch the sequences' drafting models, when their
        pipelines were forked with it (`Pipeline.fork(draft_passes=...)`); None: each
        sequence drafts in turn."""
        self.rule = rule
        self.on_pass = on_pass
        self.draft_passes = draft_passes
        self.entries: list[Entry] = []
        self.draft_token_seconds = 0.0  # moving average: drafting time per drafted token
        self.counts = [0.0, 0.0]  # [kept, tried] draft tokens of every sequence, decayed
        self.gate = SpeculationGate() if (rule is not None if gate is None else gate) else None

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, generation: Generation, emit: Callable[[Chunk], None]) -> Entry:
        entry = Entry(generation, emit)
        self.entries.append(entry)
        return entry

    def run(
        self,
        seats: Sequence[Seat],
        count: int,
        start: Callable[[Seat, int], Generation],
        done: Callable[[int, Entry], None],
    ) -> None:
        """Generations 0..count-1, as many at once as there are seats: start(seat, i) makes
        generation i on a free seat, done(i, entry) receives it once it has left the batch
        (finished, or failed: entry.error), and its seat takes the next one. If a callback
        raises, the generations still running are closed."""
        waiting, free = deque(range(count)), deque(seats)
        running: dict[int, tuple[int, Seat]] = {}  # id(entry) -> (generation index, its seat)
        try:
            while waiting or self.entries:
                while waiting and free:
                    index, seat = waiting.popleft(), free.popleft()
                    running[id(self.add(start(seat, index), _ignore))] = (index, seat)
                for entry in self.step():
                    index, seat = running.pop(id(entry))
                    done(index, entry)
                    free.append(seat)
        finally:
            for entry in self.entries:
                entry.generation.close()

    def step(self) -> list[Entry]:
        """One step of every sequence; returns the entries that left (finished, failed or
        cancelled), already closed."""
        self._prefill_one()
        decoding = [e for e in self.entries if not e.done and not e.generation.prefilling]
        if decoding:
            self._decode(decoding)
        left = [e for e in self.entries if e.done]
        for entry in left:
            entry.generation.close()
        self.entries = [e for e in self.entries if not e.done]
        return left

    def _prefill_one(self) -> None:
        """The next prompt chunk of the sequence that joined first among those prefilling."""
        for entry in self.entries:
            if not entry.done and entry.generation.prefilling:
                self._guarded(entry, lambda e=entry: self._deliver(e, e.generation.prefill_step()))
                return

    def _decode(self, decoding: list[Entry]) -> None:
        batch = len(decoding)
        drafting = self.gate is None or batch < 2 or self.gate.choose(batch)
        began = time.perf_counter()
        emitted = self._decode_step(decoding, drafting)
        if self.gate is not None and batch >= 2:
            self.gate.observe(batch, drafting, emitted, time.perf_counter() - began)

    def _decode_step(self, decoding: list[Entry], drafting: bool) -> int:
        """Plan, one shared pass, finish; returns the tokens emitted."""
        plans: list[tuple[Entry, StepPlan]] = []
        planned, t_round = self._plan(decoding, drafting)
        for entry, plan in zip(decoding, planned, strict=True):
            if isinstance(plan, BaseException):
                entry.error = plan
            elif plan is not None:
                plans.append((entry, plan))
            else:  # the context is full: the generation has stopped
                self._deliver(entry, entry.generation.final_chunk())
        if not plans:
            return 0
        start = time.perf_counter()
        # One shared pass; if it fails, each plan alone, so a failure is its sequence's own.
        logits = evaluate_each([plan.rows for _, plan in plans])
        seconds = time.perf_counter() - start
        rows = sum(len(plan.rows) for _, plan in plans)
        if self.rule is not None:
            self.rule.costs.observe_pass(rows, seconds, len(plans))
        if self.on_pass is not None:
            self.on_pass(PassRecord(len(plans), rows, seconds))
        # The sequences' drafting overlapped in the round (each waits on the others' turns):
        # each is credited with its part of the round's seconds.
        t_drafting = sum(plan.t_draft for _, plan in plans)
        share = PassShare(rows, len(plans), min(1.0, t_round / t_drafting) if t_drafting > 0 else 1.0)
        emitted = 0
        for (entry, plan), scored in zip(plans, logits, strict=True):
            if isinstance(scored, BaseException):
                entry.error = scored
                continue
            chunk = self._guarded(
                entry, lambda e=entry, p=plan, s=scored: e.generation.finish(p, s, seconds, share)
            )
            if chunk is not None:
                emitted += len(chunk.tokens)
                entry.rows = len(plan.rows)
                if drafting:
                    entry.observe(len(plan.draft.tokens), chunk.n_accepted)
                if plan.draft.tokens:
                    self.counts = decayed(self.counts, len(plan.draft.tokens), chunk.n_accepted)
                self._deliver(entry, chunk)
        return emitted

    def _plan(self, decoding: list[Entry], drafting: bool) -> tuple[list, float]:
        """Every sequence's StepPlan (None: its context is full; an exception: it failed), in
        one round when the drafting models are batched, and the round's seconds; and what a
        drafted token cost. drafting False: plain steps for all."""
        caps = [self._cap(entry, len(decoding)) if drafting else 0 for entry in decoding]
        # The rest of the pass, for the adaptive policy: the others' rows as in their last one.
        rows = sum(entry.rows for entry in decoding)
        loads = [PassLoad(rows - entry.rows, len(decoding)) for entry in decoding]
        jobs = [
            partial(entry.generation.plan, cap, load)
            for entry, cap, load in zip(decoding, caps, loads, strict=True)
        ]
        start = time.perf_counter()
        if self.draft_passes is not None and sum(cap != 0 for cap in caps) > 1:
            plans = self.draft_passes.round(jobs)
        else:
            plans = [outcome(job) for job in jobs]
        seconds = time.perf_counter() - start
        drafted = sum(len(p.draft.tokens) for p in plans if isinstance(p, StepPlan))
        if drafted:
            self.draft_token_seconds += DRAFT_COST_EMA * (seconds / drafted - self.draft_token_seconds)
        return plans, seconds

    def _cap(self, entry: Entry, batch: int) -> int | None:
        """A sequence alone drafts as its chain chooses (its policy, classic or adaptive)."""
        if self.rule is None or batch < 2:
            return None
        kept, tried = self.counts
        prior = (kept + ACCEPTANCE_WEIGHT * ACCEPTANCE_PRIOR) / (tried + ACCEPTANCE_WEIGHT)
        cap = self.rule.max_draft(batch, entry.acceptance(prior), self.draft_token_seconds)
        if cap == 0 and entry.steps_without_draft >= PROBE_EVERY:
            return 1  # a sequence never allowed to draft would never show it has become worth it
        return cap

    @staticmethod
    def _guarded(entry: Entry, work: Callable[[], object]):
        """Run one sequence's part of a step; an exception fails that sequence alone."""
        try:
            return work()
        except Exception as exc:
            entry.error = exc
            return None

    @staticmethod
    def _deliver(entry: Entry, chunk: Chunk | None) -> None:
        if chunk is not None and (chunk.tokens or chunk.text):
            entry.emit(chunk)


def _ignore(chunk: Chunk) -> None:
    """`run`'s callers read whole generations, not chunks as they come."""
