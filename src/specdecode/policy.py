"""The adaptive speculation policy: each step, draft what maximises expected tokens per second.

`classic` is llama.cpp's rule: the first strategy in priority order with a draft wins, and a
model draft stops at the first token whose confidence is below p_min. Whether that pays
depends on the text, the models and the machine, so `adaptive` measures instead:

- Cost model (`specdecode.costs`): seconds of a target pass by its rows and the sequences
  sharing it, and of a drafting model's call by its steps and the tokens it reads first,
  timed briefly at load and fitted to the passes and calls actually run.
- Acceptance model (`specdecode.acceptance`): per strategy, depth and draft-confidence bucket,
  P(the token is kept | its parent was), counted from every verified draft with decay.
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

A busy machine: every second measured (a pass, a drafting call, a step) is kept at the speed of
the load-time timings, divided by the load of its own moment (`CostModel.drift`, robust to a
stalled pass), and at most 3 times what was predicted for it (`specdecode.costs.OUTLIER`);
every cost is priced at the load now. So a load swinging 2-4x scales a draft's cost and a
plain step's alike, and one slow call does not rule a drafting model out. A model whose steps
made fewer tokens a second, by measure, than plain steps make at the same load (`Realised`)
runs on probes only, whatever its record says: exploring it costs what the probes' doubling
wait allows.

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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specdecode.acceptance import AcceptanceModel, expected_tokens
from specdecode.backends import Backend, common_prefix
from specdecode.config import SPEC_POLICIES
from specdecode.costs import ALONE, CostModel, PassLoad, PassShare, calibrate
from specdecode.errors import SpecdecodeError

EMA = 0.1  # weight of the newest observation in the moving averages
EXPLORE = 0.2  # optimism of a model draft's decision about a cell with no outcomes yet
PROBE_EVERY = 8  # a drafting model left unused this many steps is run again
MAX_PROBE_EVERY = 64  # ... a wait that doubles with each probe, and halves with each run on merit
PROBE_NODES = 4  # most tokens (tree nodes) a probe drafts: enough to tell whether the model pays again
CATCH_UP_STEPS = 4  # a drafting model's backlog is read in this many steps' chunks, the last by its call
CATCH_UP_STALL = 4.0  # ... where reading it takes longer than this many plain steps (else its call reads it)


def check_policy(name: str) -> str:
    if name not in SPEC_POLICIES:
        raise SpecdecodeError(
            f"unknown spec_policy {name!r} (--spec-policy; choose from {', '.join(SPEC_POLICIES)})"
        )
    return name


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
class Realised:
    """What the steps that ran a drafting model made by measure: tokens emitted and seconds
    taken (its call and its rows' pass, each at the load-time timings' speed:
    `CostModel.steady`), averaged as a `Record` is, but never replaced by a probe: a model
    kept 80% of the time whose every draft costs more than it brings wins most probes, and,
    run on merit after each, lost 5-7% of plain's speed on a busy machine."""

    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0

    def update(self, tokens: float, seconds: float) -> None:
        self.n += 1
        weight = max(EMA, 1 / self.n)
        self.tokens = (1 - weight) * self.tokens + weight * tokens
        self.seconds = (1 - weight) * self.seconds + weight * seconds


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
    realised: dict[str, Realised] = field(default_factory=dict)  # drafting model -> its steps' measure
    step_tokens: float = 0.0  # moving averages over all steps: tokens emitted, seconds taken
    step_seconds: float = 0.0  # ... at the load-time timings' speed (`CostModel.steady`)

    @property
    def rate(self) -> float | None:
        """Tokens per second over the recent steps, at the load now (None before any): each
        step's seconds count at the speed of its own moment, so that a stretch of steps that
        ran while the machine was busy does not value a second less now."""
        if self.step_seconds <= 0:
            return None
        return self.step_tokens / (self.step_seconds * self.costs.drift())

    @classmethod
    def for_target(
        cls,
        target: Backend,
        progress: Callable[[str], None] | None = None,
        drafts: Mapping[str, Backend] | None = None,
    ) -> PolicyModels:
        """Models whose costs are calibrated on `target` and its drafting models `drafts` (by
        strategy name) now, or from an earlier run's timings where they hold: see
        `specdecode.costs.calibrate`, whose `progress` lines say which."""
        return cls(costs=calibrate(target, drafts=drafts, progress=progress))


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
        self._previous = 0  # of the step before it
        self._start = 0  # of the first step: the prompt's length
        self._remaining: int | None = None  # tokens the generation may still emit (None: not said)
        self._chunks: dict[str, list[int]] = {}  # drafting model -> [its catch-up's chunk, chunks read]
        self._read: dict[str, int] = {}  # drafting model -> the position it has read up to
        self._missed = 0  # tokens the model run this step read first
        self._prompt_read = 0  # ... of them, its backlog's (`backlog`)
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
        if self._behind_plain(strategy):
            return -math.inf
        catch_up = rate * self.catch_up_seconds(strategy, record.tokens)
        return self._record_gain(strategy, record, t_sunk, rate, self.missed(strategy)) - catch_up

    def best_case_gain(self, strategy: str, t_sunk: float, rate: float, n_max: int) -> float:
        """The gain of the model's best draft of up to n_max tokens were every token kept, at its
        measured step cost (timed at load, then its calls) and the pass curve. A model that has
        no record to go by is tried only where this beats the rest: on a CPU where each verify
        row costs nearly a plain step and each draft step a third or half of one (Qwen2.5-Coder
        1.5B drafted by its 0.5B sibling on llama.cpp, one thread each), no draft pays even
        when all of it is kept, and each try of the model there only loses."""
        missed, costs = self.missed(strategy), self.models.costs

        def seconds(k: int) -> float:  # a draft of k tokens, all kept
            drafting = costs.draft_time(strategy, k, missed) + self.catch_up_seconds(strategy, k + 1)
            return t_sunk + drafting + self.pass_seconds(k + 1)

        return max((k + 1 - rate * seconds(k) for k in range(1, n_max + 1)), default=-math.inf)

    def free_gain(self, t_sunk: float, rate: float, n_max: int) -> float:
        """The gain of the best draft of up to n_max tokens that cost nothing to make and were
        all kept: what no drafting model can beat (a model not timed yet is timed only where
        this beats the step's other candidates)."""
        return max(
            (k + 1 - rate * (t_sunk + self.pass_seconds(k + 1)) for k in range(1, n_max + 1)),
            default=-math.inf,
        )

    def _record_gain(self, strategy: str, record: Record, t_sunk: float, rate: float, missed: float) -> float:
        """The gain of a step of `strategy`'s model that gives what `record` says, its call first
        reading `missed` tokens."""
        seconds = t_sunk + self.models.costs.draft_time(strategy, record.steps, missed)
        return record.tokens - rate * (seconds + self.pass_seconds(record.rows))

    def _behind_plain(self, strategy: str) -> bool:
        """Whether the steps that ran `strategy`'s model made fewer tokens a second, by measure,
        than plain steps make at the same load (`Realised`): where the cost model says the
        model pays and the measure says it does not, it runs on probes only, whose wait
        doubles with each, so a model that loses costs a bounded share of the time."""
        realised = self.models.realised.get(self.source(strategy))
        plain = self._own_seconds(1) / self.models.costs.drift()
        return realised is not None and realised.tokens * plain < realised.seconds

    def _draft_seconds(self, strategy: str, record: Record) -> float:
        """A call as long as the model's usual one, now: after the tokens it has missed, with
        its share of the catch-up."""
        missed = self.missed(strategy)
        catch_up = self.catch_up_seconds(strategy, record.tokens)
        return self.models.costs.draft_time(strategy, record.steps, missed) + catch_up

    def at(self, position: int, remaining: int | None = None) -> None:
        """The step about to be drafted starts at `position` (history and last token); the
        generation may emit `remaining` tokens more (None: not said)."""
        self._previous = self._position if self._start else position - 1
        self._position = position
        self._start = self._start or position
        self._remaining = remaining

    def missed(self, strategy: str) -> int:
        """Of the tokens the drafting model has not read (`unread`), those charged whole to its
        call: what a model run every step reads too (the previous step's). The rest, the prompt
        or a stretch it sat out, is its `backlog`, priced by `catch_up_seconds`."""
        return min(self.unread(strategy), self._position - self._previous)

    def unread(self, strategy: str) -> int:
        return self._position - self._read.get(strategy, 0)

    def backlog(self, strategy: str) -> int:
        return self.unread(strategy) - self.missed(strategy)

    def catch_up_seconds(self, strategy: str, tokens_per_step: float) -> float:
        """The price in a step of `strategy`'s model emitting `tokens_per_step` tokens of
        reading its `backlog`, spread over the steps left at that many tokens each (`at`'s
        budget; none said, nothing). Charged whole to one step, a prompt's read made the model
        never run; ignored, a chat edit read a long prompt for a short answer at 0.44x plain."""
        backlog = self.backlog(strategy)
        if backlog <= 0 or self._remaining is None:
            return 0.0
        share = min(1.0, tokens_per_step / max(1, self._remaining))
        return share * self.models.costs.read_time(strategy, backlog)

    def catch_up_chunk(self, strategy: str) -> int:
        """Tokens of its backlog `strategy`'s model should read this step in place of drafting,
        now that it beats the step's other candidates (0: draft now, its call reading the rest).
        A backlog whose reading would stall a step by more than CATCH_UP_STALL plain steps is
        read in chunks of a quarter (CATCH_UP_STEPS), or of what that stall reads where more,
        one a step, the last (with what the steps meanwhile emitted) by the drafting call. A
        cheaper one is read by the call at once: each step spent on a chunk is a step the
        model does not draft (see `specdecode.chain` for why chunks, not a thread)."""
        backlog = self.backlog(strategy)
        if strategy not in self._chunks:
            per_token = self.models.costs.read_time(strategy, 1)
            stall = CATCH_UP_STALL * self.pass_seconds(1)
            quarter = -(-backlog // CATCH_UP_STEPS)
            self._chunks[strategy] = [max(quarter, int(stall / per_token) if per_token > 0 else backlog), 0]
        chunk, read = self._chunks[strategy]
        return chunk if backlog > chunk and read < CATCH_UP_STEPS - 1 else 0

    def caught_up(self, strategy: str, tokens: int) -> None:
        """`strategy`'s model read `tokens` tokens of its backlog (`catch_up_chunk`)."""
        self._read[strategy] = self._read.get(strategy, 0) + tokens
        self._chunks[strategy][1] += 1

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
        self._missed = self.unread(strategy)  # what the call reads, backlog and all
        self._prompt_read = self.backlog(strategy)
        self._read[strategy] = self._position
        self._chunks.pop(strategy, None)
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
        # The model's call (less its backlog) and the pass, as at the timings' speed and within
        # OUTLIER times their prediction; the rest of the drafting (model-free) as measured.
        costs, t_call = models.costs, t_model - self._prompt_seconds(model, model_steps, t_model)
        predicted = self._own_seconds(own_rows)
        if model is not None:
            predicted += costs.draft_time(model, model_steps, self._missed - self._prompt_read)
        load = costs.drift()
        costs.observe_pass(rows, t_pass, sequences, own_rows / rows)  # the load now, this pass told
        steady = costs.steady(t_call + t_pass * own_rows / rows, predicted * costs.drift() / load)
        seconds = steady + max(0.0, t_draft - t_model) / costs.drift()
        models.step_tokens += weight * (1.0 + len(path) - models.step_tokens)
        models.step_seconds += weight * (seconds - models.step_seconds)
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
            models.realised.setdefault(source, Realised()).update(tokens, steady)
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
        """What reading its backlog (the prompt, a gap) took of this step's call of `model`
        (`seconds`, `steps` steps): the rest of the call at the model's costs. Not the step's:
        the decision priced it spread over the steps left (`catch_up_seconds`), and the rate
        (whose first step weighs all) would value a second at a fraction of what it is worth,
        so that every row looked free and drafts ran 16 tokens long."""
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
