"""Batched speculation: many generations share every target pass (continuous batching).

Each generation keeps everything of its own: its fork of the pipeline (KV caches), its chain
of strategies, its sampler and its stop rules. A step of the `BatchEngine` does, for all of
them at once, what `Generation.step` does for one:

1. sequences that were cancelled leave;
2. every decoding sequence drafts with its own chain (`Generation.plan`): the more rows share
   a pass, the dearer a draft token, so drafts shorten, and vanish, as the batch grows. The
   adaptive policy prices rows so by itself (`specdecode.policy`, told what else each pass
   holds, a `PassLoad`, and after it its share, a `PassShare`); classic chains are capped by
   the `LoadRule`. For both, the `SpeculationGate` lets a batch draft only in steps where
   drafting is expected to emit more tokens per second than a plain step, by the measured
   costs of passes of several sequences and the sequences' acceptance;
3. one target pass scores every sequence's rows (`evaluate_groups`), and prompt chunks of
   newly joined sequences fill what the step's budget of rows leaves (see `BatchEngine.step`):
   a running stream waits about two decode passes a step, whatever prompt arrives;
4. each sequence verifies, accepts and rolls back on its own (`Generation.finish`) and hands
   its chunk to its consumer; finished sequences leave, and new ones may join before the
   next step.

Nothing a sequence emits depends on the others: its rows get the bits they would get in a
pass of their own wherever the backend is row-invariant (the native backend, up to
`max_pass_rows` rows a pass), its prompt's chunks are cut below a solo run's only where that
changes no bit (`Generation.prefill_rows`), and its draws come from its own sampler. So a
greedy or seeded `match` answer equals the answer the same request gets alone.
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
from specdecode.backends.batch import RowGroup, evaluate_each, score_alone, shares_passes
from specdecode.backends.gather import DraftPasses, outcome
from specdecode.costs import BATCH_CALIBRATION_ROWS, CostModel, PassLoad, PassShare, calibrate
from specdecode.generate import Chunk, Generation, StepPlan

logger = logging.getLogger(__name__)

ACCEPTANCE_PRIOR = 0.6  # P(draft token kept | its parent was) before any sequence drafted
ACCEPTANCE_WEIGHT = 4.0  # pseudo-observations behind a prior
ACCEPTANCE_DECAY = 0.95  # older steps weigh less: the text changes
PROBE_EVERY = 8  # a sequence kept from drafting this many steps may draft one token again
DRAFT_COST_EMA = 0.2  # weight of the newest step in the drafting cost's moving average
GATE_EMA = 0.2  # weight of the newest step in the gate's measured seconds and draft lengths
EXPLORE_MIN = 16  # the gate tries the way it did not choose after this many steps at the soonest,
EXPLORE_MAX = 512  # ... and at the latest,
EXPLORE_BUDGET = 0.01  # ... waiting long enough that trying it loses at most this share of the tokens
PREFILL_PASSES = 2.0  # a step with prompt rows may take this many decode passes' seconds
PREFILL_FLOOR = 16  # prompt rows a step takes whatever its budget, so that prompts progress
PREFILL_MAX_ROWS = 1 << 16  # the budget's bound where prompts run in passes of their own
PREFILL_EMA = 0.3  # weight of the newest chunk in a prompt row's measured seconds

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
    length: float | None = None  # moving average of its drafts' tokens in steps allowed to draft

    @property
    def done(self) -> bool:
        return self.cancelled or self.error is not None or bool(self.generation.stats.stop_reason)

    def acceptance(self, prior: float) -> float:
        """P(a draft token is kept | its parent was): this sequence's counts, pulled towards
        `prior` (what the batch's sequences have seen) while it has drafted little."""
        kept, tried = self.counts
        return (kept + ACCEPTANCE_WEIGHT * prior) / (tried + ACCEPTANCE_WEIGHT)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        """A verified chain of a step allowed to draft: tokens 1..n_accepted were kept, the
        next one (if any) was not."""
        self.length = moved(self.length, n_drafted, GATE_EMA)
        if n_drafted == 0:
            self.steps_without_draft += 1
            return
        self.steps_without_draft = 0
        self.counts = decayed(self.counts, n_drafted, n_accepted)


def moved(average: float | None, value: float, weight: float) -> float:
    """A moving average after one more value (the value itself when there was none)."""
    return value if average is None else average + weight * (value - average)


def expected_step_tokens(acceptance: float, length: float) -> float:
    """Tokens a step emits whose draft of `length` tokens (a mean: it may be fractional) has each
    token kept with probability `acceptance` given its parent: 1 + a + a^2 + ... + a^length."""
    if acceptance >= 1.0:
        return 1.0 + length
    return 1.0 + acceptance * (1.0 - acceptance**length) / (1.0 - acceptance)


def decayed(counts: list[float], n_drafted: int, n_accepted: int) -> list[float]:
    """[kept, tried] after a verified chain of n_drafted tokens (older steps decayed)."""
    tried = n_accepted + (1 if n_accepted < n_drafted else 0)
    return [ACCEPTANCE_DECAY * counts[0] + n_accepted, ACCEPTANCE_DECAY * counts[1] + tried]


class LoadRule:
    """How many tokens a sequence may draft when `batch` sequences share a pass.

    A pass of T rows costs a + b*T (the cost model's line, timed at start by
    `specdecode.costs.calibrate` and refined from every pass run). Without drafts the batch
    emits `batch` tokens per a + b*batch seconds; one more draft token costs b (its verify
    row) plus the seconds of drafting it, that is
    (b + draft) * batch / (a + b*batch) tokens of the batch's output. The j-th token of a
    chain is kept with probability acceptance^j, so a sequence drafts the j-th token only
    while acceptance^j exceeds that price. One sequence alone pays little for a row (a
    dominates), so its drafts stay long; as the batch grows the price nears one token, and
    drafting stops unless it is nearly always right."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    @classmethod
    def timed(cls, backend: Backend) -> LoadRule:
        """A rule whose cost model times passes of up to 64 rows on `backend` (its cache is
        left empty). Where timing fails, the rule starts from the cost model's prior and learns
        from the passes run: a backend that cannot time a pass fails its requests, not this."""
        try:
            return cls(calibrate(backend, BATCH_CALIBRATION_ROWS, store=False))
        except Exception as exc:
            logger.warning("pass costs could not be timed (%s): starting from the prior", exc)
            return cls(CostModel())

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


class SpeculationGate:
    """Whether a batch drafts this step: the way expected to emit more tokens per second.

    A plain step of B sequences emits B tokens in pass(B, B) + B * o seconds. A drafting step
    in which sequence i drafts k_i tokens, each kept with probability a_i given its parent,
    emits sum_i (1 + a_i + ... + a_i^k_i) tokens in pass(B + sum k_i, B) + B * o + d * sum k_i
    seconds. pass(rows, sequences) is the cost model of passes of several sequences, refined
    from every pass the batch runs; o, what a sequence's step costs besides the pass
    (planning, verifying, emitting), is measured on plain steps, and d, what a drafted token
    adds besides its verify row (drafting it, the drafting round's hand-offs, a draft model
    catching up on what it missed), on drafting steps; a_i and k_i are the sequence's
    acceptance and draft length when it was last let draft (the batch's while it has not
    been). So where a verify row costs nearly what a sequence's token does (a CPU whose cores
    a batch already keeps busy) the batch steps plainly, and where rows are nearly free (a
    memory-bound pass: a GPU, a large model) and drafts are kept, it drafts.

    The way not chosen is still tried now and then, so that o, d and the acceptances follow
    the text and the machine: after EXPLORE_MIN steps at the soonest, and the more tokens a
    step of it is expected to lose (its rate's shortfall over its own, longer or shorter,
    seconds) the longer the wait, so that trying it costs at most EXPLORE_BUDGET of the
    tokens, up to EXPLORE_MAX steps. (On a CPU a drafting step can take four plain steps'
    time: a wait priced by the rates alone spent 5% of the tokens on tries.)"""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self.plain_seconds: float | None = None  # o: a sequence's seconds of a plain step besides the pass
        self.draft_seconds: float | None = None  # the same of a drafting step
        self.length: float | None = None  # draft tokens of a sequence's drafting step
        self.steps = 0
        self.last = {True: 0, False: 0}  # drafting? -> the step that way last ran

    def choose(self, sequences: Sequence[tuple[float, float | None]]) -> bool:
        """Draft in this step? sequences: each one's acceptance and draft length (None: it has
        not drafted yet)."""
        self.steps += 1
        if self.draft_seconds is None or self.plain_seconds is None:
            drafting = self.draft_seconds is None  # each way once, drafting first
        else:
            (plain_tokens, plain_seconds), (draft_tokens, draft_seconds) = self.steps_ahead(sequences)
            plain, draft = plain_tokens / plain_seconds, draft_tokens / draft_seconds
            best = draft > plain
            # The tokens a try loses, as a share of a step of the chosen way's.
            lost = abs(plain - draft) * (plain_seconds if best else draft_seconds)
            share = lost / (draft_tokens if best else plain_tokens)
            wait = min(EXPLORE_MAX, max(EXPLORE_MIN, math.ceil(share / EXPLORE_BUDGET)))
            drafting = best if self.steps - self.last[not best] < wait else not best
        self.last[drafting] = self.steps
        return drafting

    def rates(self, sequences: Sequence[tuple[float, float | None]]) -> tuple[float, float]:
        """Expected tokens per second of a plain step and of a drafting step (once both ways
        have been measured)."""
        (plain_tokens, plain_seconds), (draft_tokens, draft_seconds) = self.steps_ahead(sequences)
        return plain_tokens / plain_seconds, draft_tokens / draft_seconds

    def steps_ahead(
        self, sequences: Sequence[tuple[float, float | None]]
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """(expected tokens, seconds) of a plain step and of a drafting step."""
        if self.plain_seconds is None or self.draft_seconds is None:
            raise ValueError("the gate has not measured both ways yet")
        batch, usual = len(sequences), self.length or 0.0
        lengths = [usual if length is None else length for _, length in sequences]
        drafted = sum(lengths)
        tokens = sum(expected_step_tokens(a, k) for (a, _), k in zip(sequences, lengths, strict=True))
        per_token = max(0.0, self.draft_seconds - self.plain_seconds) / usual if usual > 0 else 0.0
        sunk = batch * self.plain_seconds
        plain = self.costs.pass_time(batch, batch) + sunk
        draft = self.costs.pass_time(batch + drafted, batch) + sunk + per_token * drafted
        return (float(batch), plain), (tokens, draft)

    def observe(self, batch: int, drafting: bool, drafted: int, seconds: float) -> None:
        """A step of `batch` sequences (drafting: let draft, `drafted` tokens in all) took
        `seconds` besides its target pass."""
        if drafting:
            self.draft_seconds = moved(self.draft_seconds, seconds / batch, GATE_EMA)
            self.length = moved(self.length, drafted / batch, GATE_EMA)
        else:
            self.plain_seconds = moved(self.plain_seconds, seconds / batch, GATE_EMA)


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
        costs: CostModel | None = None,
    ) -> None:
        """rule: caps classic chains' drafts under load (None: drafts as the chains choose,
        which the adaptive policy does knowing the batch).
        gate: whether a `SpeculationGate` decides each step if the batch drafts at all (None:
        with the rule). The adaptive policy prices each sequence's rows, not what the batch's
        drafting step costs besides the pass: the hand-offs between the sequences' threads,
        and the stall while one sequence catches its draft model up or probes it.
        costs: the target's pass costs the gate decides by, where something else learns them
        from every pass (the adaptive policy's models, each sequence reporting its share);
        None: the rule's, or a model of the engine's own, which the engine feeds every pass.
        draft_passes: the rounds that batch the sequences' drafting models, when their
        pipelines were forked with it (`Pipeline.fork(draft_passes=...)`); None: each
        sequence drafts in turn."""
        self.rule = rule
        self.on_pass = on_pass
        self.draft_passes = draft_passes
        self.entries: list[Entry] = []
        self.draft_token_seconds = 0.0  # moving average: drafting time per drafted token
        self.counts = [0.0, 0.0]  # [kept, tried] draft tokens of every sequence, decayed
        gated = rule is not None if gate is None else gate
        self.costs = costs if costs is not None else rule.costs if rule is not None else CostModel()
        self._feeds = costs is None  # the engine teaches self.costs (the prompt budget reads them)
        self.gate = SpeculationGate(self.costs) if gated else None
        self._prompt_row_seconds: float | None = None  # what a prompt row adds to a pass, lately

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
        cancelled), already closed.

        A step has a budget of rows: the decoding sequences' rows first (as many as in their
        last pass), then prompt chunks of the sequences still prefilling, oldest first, fill
        what the budget leaves: as many rows as keep the step within PREFILL_PASSES decode
        passes by the measured pass costs, at least PREFILL_FLOOR. Where the backend shares
        passes the chunks ride in the decode pass (within its `max_pass_rows`); elsewhere the
        oldest prompt's chunk runs in a pass of its own after it. A chunk shrinks, and shares a
        pass, only where that changes no bit of the prompt's cache (`Generation.prefill_rows`);
        where it cannot, the oldest prompt's whole chunk goes in all the same, in a pass of its
        own as long as a solo run's.
        With nothing decoding, the oldest prompt's chunk is a solo run's."""
        decoding = [e for e in self.entries if not e.done and not e.generation.prefilling]
        prompts = [e for e in self.entries if not e.done and e.generation.prefilling]
        if decoding:
            room = self._shared_room(decoding)
            budget = self._prefill_budget(sum(e.rows for e in decoding), len(decoding), room)
            chunks = self._prompt_chunks(prompts if room is not None else prompts[:1], budget)
            # Chunks that fit the decode pass's room ride in it; a whole chunk (one that cannot
            # be cut exactly) runs in a pass of its own, as in a solo run.
            riding: list[tuple[Entry, RowGroup]] = []
            alone: list[tuple[Entry, RowGroup]] = []
            for entry, group in chunks:
                fits = len(group) <= (room or 0) - sum(len(g) for _, g in riding)
                rides = fits and entry.generation.exact_prompt_cuts
                (riding if rides else alone).append((entry, group))
            if not self._decode(decoding, riding):  # no pass ran (no plan): none rode in it
                alone = riding + alone
            self._prefill_alone(alone)  # the whole chunks, and those no decode pass took
        elif prompts:
            self._prefill_alone(self._prompt_chunks(prompts[:1], None))
        left = [e for e in self.entries if e.done]
        for entry in left:
            entry.generation.close()
        self.entries = [e for e in self.entries if not e.done]
        return left

    @staticmethod
    def _shared_room(decoding: list[Entry]) -> int | None:
        """Rows a decode pass of these sequences (as many rows as in their last one) still
        takes for prompt chunks; None where the backend runs each sequence in a pass of its
        own, so that prompt chunks do too."""
        backends = [entry.generation.target for entry in decoding]
        first = backends[0]
        if not all(shares_passes(b) and b.pass_key == first.pass_key for b in backends):
            return None
        return max(0, first.max_pass_rows - sum(entry.rows for entry in decoding))

    def _prefill_budget(self, rows: int, sequences: int, room: int | None) -> int:
        """Prompt rows a step whose decode pass holds `rows` rows of `sequences` sequences may
        add: as many as cost PREFILL_PASSES - 1 such passes, at the seconds a prompt row has
        measured (`_observe_prompt_rows`), within the `room` the pass has left where the
        prompt rides in it (None: it runs in a pass of its own). At least PREFILL_FLOOR."""
        decode = self.costs.pass_time(rows, sequences)
        row = self._prompt_row_seconds
        if row is None:  # before any prompt row was measured: the cost model's slope
            extra = PREFILL_FLOOR
            with_rows = (
                self.costs.pass_time(rows + extra, sequences + 1)
                if room is not None
                else decode + self.costs.pass_time(extra, 1)
            )
            row = max(0.0, with_rows - decode) / extra
        allowed = (PREFILL_PASSES - 1) * decode
        budget = PREFILL_MAX_ROWS if row <= 0.0 else int(allowed / row)
        return max(PREFILL_FLOOR, min(budget, room if room is not None else PREFILL_MAX_ROWS))

    def _observe_prompt_rows(self, rows: int, seconds: float) -> None:
        """`rows` prompt rows added `seconds` to their pass. A prompt row's cost grows with its
        position (it attends to every position before it), which the cost model's line of rows
        does not see: so it is measured, as a moving average over the chunks run."""
        if rows <= 0:
            return
        seconds = max(0.0, seconds) / rows
        old = self._prompt_row_seconds
        self._prompt_row_seconds = seconds if old is None else old + PREFILL_EMA * (seconds - old)

    def _prompt_chunks(self, prompts: list[Entry], budget: int | None) -> list[tuple[Entry, RowGroup]]:
        """Oldest first, the prompt chunks that `budget` rows hold (None: a solo run's chunk):
        the oldest's always (a chunk that cannot shrink goes in whole), the others' while rows
        are left."""
        chunks: list[tuple[Entry, RowGroup]] = []
        left = budget
        for entry in prompts:
            if chunks and left is not None and left <= 0:
                break
            limit = None if left is None else max(1, left)
            group = self._guarded(entry, partial(entry.generation.prefill_rows, limit))
            if group is None:
                continue
            if chunks and left is not None and len(group) > left:  # a whole chunk waits its turn
                break
            chunks.append((entry, group))
            if left is not None:
                left -= len(group)
        return chunks

    def _prefill_alone(self, chunks: list[tuple[Entry, RowGroup]]) -> None:
        """Each prompt chunk in a pass of its own."""
        for entry, group in chunks:
            start = time.perf_counter()
            scored = self._guarded(entry, partial(score_alone, group))
            if scored is not None:
                seconds = time.perf_counter() - start
                self._observe_prompt_rows(len(group), seconds)
                if self._feeds:
                    self.costs.observe_pass(len(group), seconds)
                self._prefilled([(entry, group)], [scored])

    def _prefilled(self, chunks: list[tuple[Entry, RowGroup]], logits: Sequence) -> None:
        """Each prompt chunk is in its sequence's cache; a prompt's last one starts its
        sequence (its first token is emitted)."""
        for (entry, group), scored in zip(chunks, logits, strict=True):
            if isinstance(scored, BaseException):
                entry.error = scored
                continue
            done = partial(entry.generation.prefill_done, group, scored)
            self._deliver(entry, self._guarded(entry, done))

    def _decode(self, decoding: list[Entry], riding: list[tuple[Entry, RowGroup]]) -> bool:
        """A step of the decoding sequences, the prompt chunks `riding` in its pass; a
        sequence alone drafts as its chain chooses, a batch as the gate does. Whether a pass
        ran (none where no sequence planned one)."""
        batch = len(decoding)
        gate = self.gate if batch >= 2 else None
        drafting = True
        if gate is not None:
            prior = self._acceptance_prior()
            drafting = gate.choose([(entry.acceptance(prior), entry.length) for entry in decoding])
        began = time.perf_counter()
        ran = self._decode_step(decoding, drafting, riding)
        if gate is not None and ran is not None:
            drafted, t_pass = ran
            gate.observe(batch, drafting, drafted, time.perf_counter() - began - t_pass)
        return ran is not None

    def _decode_step(
        self, decoding: list[Entry], drafting: bool, riding: list[tuple[Entry, RowGroup]]
    ) -> tuple[int, float] | None:
        """Plan, one shared pass (with the prompt chunks `riding`), finish; returns the tokens
        drafted and the pass's seconds (None: no pass ran)."""
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
            return None
        start = time.perf_counter()
        # One shared pass; if it fails, each plan alone, so a failure is its sequence's own.
        logits = evaluate_each([plan.rows for _, plan in plans] + [group for _, group in riding])
        seconds = time.perf_counter() - start
        self._prefilled(riding, logits[len(plans) :])
        logits = logits[: len(plans)]
        rows = sum(len(plan.rows) for _, plan in plans)
        pass_rows = rows + sum(len(group) for _, group in riding)
        if self._feeds:
            self.costs.observe_pass(pass_rows, seconds, len(plans) + len(riding))
        elif riding:  # each sequence reports its rows' share of the pass; the prompts' is here
            self.costs.observe_pass(pass_rows, seconds, len(plans) + len(riding), 1.0 - rows / pass_rows)
        if riding:
            self._observe_prompt_rows(pass_rows - rows, seconds - self.costs.pass_time(rows, len(plans)))
        if self.on_pass is not None:
            self.on_pass(PassRecord(len(plans) + len(riding), pass_rows, seconds))
        # The sequences' drafting overlapped in the round (each waits on the others' turns):
        # each is credited with its part of the round's seconds.
        t_drafting = sum(plan.t_draft for _, plan in plans)
        drafting_share = min(1.0, t_round / t_drafting) if t_drafting > 0 else 1.0
        share = PassShare(pass_rows, len(plans) + len(riding), drafting_share)
        for (entry, plan), scored in zip(plans, logits, strict=True):
            if isinstance(scored, BaseException):
                entry.error = scored
                continue
            chunk = self._guarded(
                entry, lambda e=entry, p=plan, s=scored: e.generation.finish(p, s, seconds, share)
            )
            if chunk is not None:
                entry.rows = len(plan.rows)
                if drafting:
                    entry.observe(len(plan.draft.tokens), chunk.n_accepted)
                if plan.draft.tokens:
                    self.counts = decayed(self.counts, len(plan.draft.tokens), chunk.n_accepted)
                self._deliver(entry, chunk)
        return rows - len(plans), seconds

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
        cap = self.rule.max_draft(batch, entry.acceptance(self._acceptance_prior()), self.draft_token_seconds)
        if cap == 0 and entry.steps_without_draft >= PROBE_EVERY:
            return 1  # a sequence never allowed to draft would never show it has become worth it
        return cap

    def _acceptance_prior(self) -> float:
        """What the batch's sequences have seen: the acceptance of one that has drafted little."""
        kept, tried = self.counts
        return (kept + ACCEPTANCE_WEIGHT * ACCEPTANCE_PRIOR) / (tried + ACCEPTANCE_WEIGHT)

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
