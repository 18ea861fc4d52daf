"""Replaying acceptance traces: every pass a recorded generation made, run again on other models.

A trace (`specdecode.bench.traces`) says what each step of a real generation drafted and kept.
A replay runs the generation loop once more over a target of another shape (random weights on
a GPU, where the real weights cannot go), with two stand-ins:

- in the chain, a `ReplayDrafter` per recorded strategy: it runs a real drafter of that
  strategy (`DraftModels`: a draft model, an EAGLE-3 head, a DFlash drafter or an MTP layer at
  its own shape, the model-free strategies' own code over the replayed history) for its cost,
  then proposes the recorded draft, its ids in the target's vocabulary and a tree's parents kept;
- a `ReplayGeneration`, whose verification samples the target's logits as a real run's does
  (down the recorded path: the sampler's host work) and then keeps what the trace kept, so
  that the target's cache is committed or rolled back as the recording's was.

Every pass a real run makes runs: the drafter's steps, the target's verify pass of the
recorded rows or tree nodes, the caches' commit or rollback, the sampling. Only the accept
decision and the emitted ids come from the trace, so tokens per target pass are the recorded
ones exactly (`check_replay`).

What a drafting model costs depends on the recording's chain, named by the trace header's
"policy". The classic chain (llama.cpp's, "classic") asks its model every step, and a chain it
cut on p_min ran one step more than it kept (the step whose confidence fell short): so its
replay drafts one token more than was recorded (within "draft_n_max", default 16), and one
on steps that drafted nothing. Otherwise (the adaptive policy, which runs a model only where
it pays) the model runs on the steps that drafted, as many steps as the draft is deep.
Model-free strategies are asked every step, as both chains ask them. A tree's drafting is
approximated by a chain as deep as the tree (its depth's passes of the drafting model, one row
each, where the real drafter scored each depth's nodes in one pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup
from specdecode.backends.gather import DraftPasses, GatheredBackend, GatheredHead
from specdecode.bench.traces import Trace, mapped_ids
from specdecode.chain import Chain
from specdecode.config import PRIORITY, DraftModelConfig, NgramSettings
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.sampling import Sampler, SamplingParams
from specdecode.scheduler import BatchEngine, Entry
from specdecode.stats import GenerationStats
from specdecode.strategies import SharedState, SpecSetup, Strategy, build_strategies
from specdecode.strategies.base import Steerable
from specdecode.strategies.dflash_head import DFlashHead
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.mtp_head import MtpLayer
from specdecode.verify import Verdict

CLASSIC_N_MAX = DraftModelConfig().n_max  # a classic recording's draft n_max, where its header names none
MODELS = ("draft", "eagle3", "dflash", "mtp")  # the strategies that draft with a model, which share no state
INNER_N_MAX = 1024  # the real drafters' own cap: the replay asks them for exactly what it needs


class ReplayError(SpecdecodeError):
    """A replay that could not follow its trace (it propagates through the chain's guard)."""


@dataclass(frozen=True)
class ReplayStep:
    """One recorded step in the target's ids: the draft, the emitted tokens, the accepted path."""

    emitted: list[int]
    draft: Draft
    path: list[int]
    strategy: str | None


class Script:
    """A trace in the target's ids, and how far a replay has got through it."""

    def __init__(self, trace: Trace, target: Backend) -> None:
        if not trace.steps:
            raise ReplayError(f"trace {trace.name} has no steps")
        ids = ids_for(trace, target)
        self.trace = trace
        self.prompt = ids(trace.prompt)
        self.tokens = ids(trace.tokens)
        self.steps = [
            ReplayStep(
                emitted=ids(step.emitted),
                draft=Draft(ids(step.draft), parents=step.parents),
                path=list(step.path) if step.path is not None else list(range(step.accepted)),
                strategy=step.strategy if step.drafted else None,
            )
            for step in trace.steps
        ]
        self.at = 0  # the step the replay verifies next

    @property
    def current(self) -> ReplayStep | None:
        return self.steps[self.at] if self.at < len(self.steps) else None

    @property
    def stop_reason(self) -> str:
        """Why the recording stopped where it did, as the generation loop names it."""
        if self.trace.tokens and self.trace.tokens[-1] in self.trace.eog:
            return "eos"
        return "n_predict" if len(self.tokens) >= recorded_n_predict(self.trace) else "trace end"


def ids_for(trace: Trace, target: Backend) -> Callable[[Sequence[int]], list[int]]:
    """The function giving the trace's ids in the target's vocabulary: the ids themselves where
    the target has the recorded vocabulary (its size and end-of-generation ids), else `mapped_ids`."""
    eog = target.vocab.eog_ids
    if trace.vocab == target.vocab.size and set(trace.eog) <= eog:
        return list
    eog_id = min(eog, default=target.vocab.size - 1)
    return lambda ids: mapped_ids(ids, trace, target.vocab.size, eog_id)


def recorded_n_predict(trace: Trace) -> int:
    """The recording's n_predict (its header's, else the tokens it emitted)."""
    n_predict = int(trace.meta.get("n_predict") or 0)
    return n_predict if n_predict > 0 else len(trace.tokens)


def replay_context(trace: Trace) -> int:
    """The context a replay's target needs: the prompt, n_predict and the largest draft."""
    largest = max((len(step.draft) for step in trace.steps), default=0)
    return len(trace.prompt) + recorded_n_predict(trace) + largest + 1


def sampling_of(trace: Trace) -> SamplingParams:
    """The recording's sampling: its temperature and seed (the other settings at their defaults)."""
    seed = trace.meta.get("seed")
    return SamplingParams(temperature=float(trace.meta.get("temperature") or 0.0), seed=seed)


def strategies_of(trace: Trace) -> list[str]:
    """The strategies the recording ran (its header's "spec", and those that drafted), in the
    chain's order."""
    spec = trace.meta.get("spec") or []
    named = set(spec.split(",") if isinstance(spec, str) else spec)
    named |= {step.strategy for step in trace.steps if step.drafted and step.strategy}
    return [name for name in PRIORITY if name in named]


class ScriptedSampler(Sampler):
    """Samples every row it is given for real (the host work of a real run's verification),
    and answers the tokens it was told to: the trace's. `followed`: every real sample since
    `tell` was the told token (the target itself would have decided as the trace did)."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__(params)
        self._told: list[int] = []
        self._next = 0
        self._agreed = True

    def tell(self, tokens: Sequence[int]) -> None:
        self._told, self._next, self._agreed = list(tokens), 0, True

    @property
    def followed(self) -> bool:
        return self._agreed and self._next == len(self._told)

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        token = super().sample(logits, history)
        if self._next >= len(self._told):  # the walk went on past the trace (ids merged by mapping)
            return token
        told = self._told[self._next]
        self._next += 1
        self._agreed = self._agreed and token == told
        return told


@dataclass
class ReplayGeneration(Generation):
    """A Generation that verifies as a real one does, then keeps what its trace kept, and stops
    where the recording stopped. Its sampler is a ScriptedSampler, its chain ReplayDrafters."""

    script: Script | None = None
    n_agreed: int = 0  # steps (the prompt's pass too) whose real verification gave the trace's verdict

    def prefill_done(self, rows: RowGroup, logits: torch.Tensor) -> Chunk | None:
        script, sampler = self._script_and_sampler()
        sampler.tell(script.steps[0].emitted)  # the prompt's pass emits the trace's first token
        chunk = super().prefill_done(rows, logits)
        if chunk is not None:
            self.n_agreed += sampler.followed
            script.at = 1
        return chunk

    def _verify(self, draft: Draft, logits: torch.Tensor, context: Sequence[int]) -> Verdict:
        script, sampler = self._script_and_sampler()
        step = script.current
        if step is None:
            raise ReplayError(
                f"trace {script.trace.name}: the replay went on past its {len(script.steps)} steps"
            )
        if draft.tokens != step.draft.tokens or draft.parent_list() != step.draft.parent_list():
            raise ReplayError(
                f"trace {script.trace.name}, step {script.at}: the replay verifies {draft.tokens} "
                f"but the trace drafted {step.draft.tokens}"
            )
        sampler.tell(step.emitted)
        super()._verify(draft, logits, context)  # the real verification, for its host work
        self.n_agreed += sampler.followed
        script.at += 1
        return Verdict(list(step.emitted), list(step.path))

    def _stop_reason(self, token: int) -> str:
        script, _ = self._script_and_sampler()
        if len(self.tokens) >= len(script.tokens):
            return script.stop_reason
        return super()._stop_reason(token)

    def _script_and_sampler(self) -> tuple[Script, ScriptedSampler]:
        assert self.script is not None and isinstance(self.sampler, ScriptedSampler), (
            "built by replay_generation"
        )
        return self.script, self.sampler


class ReplayDrafter:
    """A `Strategy` named as a recorded one: each step it runs a real drafter of that strategy
    (`inner`) for its cost, as deep as the module docstring says, and proposes the trace's
    draft where the recorded step was this strategy's (nothing elsewhere)."""

    n_min = 0

    def __init__(self, name: str, inner: Strategy, script: Script, classic_n_max: int | None) -> None:
        """classic_n_max: the classic chain's draft n_max, for a classic recording; None else."""
        self.name = name
        self.inner = inner
        self.script = script
        self.classic_n_max = classic_n_max
        self.model = isinstance(inner, Steerable)  # a drafting model, not model-free code
        self.n_inner_calls = 0  # the real drafter's draft calls

    def begin(self, prompt: Sequence[int]) -> None:
        self.inner.begin(prompt)

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        step = self.script.current
        mine = step is not None and step.strategy == self.name
        depth = step.draft.depth if step is not None and mine else 0
        if depth > n_max:
            raise ReplayError(
                f"trace {self.script.trace.name}, step {self.script.at}: a draft {depth} deep where the "
                f"replay allows {n_max} (a context or n_predict smaller than the recording's)"
            )
        asked = self._inner_depth(depth, n_max)
        if asked > 0:
            self.inner.draft(history, last, asked)  # for its cost: its draft is not the recorded one
            self.n_inner_calls += 1
        return step.draft if step is not None and mine else Draft()

    def _inner_depth(self, depth: int, n_max: int) -> int:
        """How deep the real drafter drafts this step (the module docstring says why)."""
        if not self.model:
            return n_max
        if self.classic_n_max is None:
            return depth
        return min(depth + 1, self.classic_n_max, n_max)

    def accept(self, n_accepted: int) -> None:
        self.inner.accept(n_accepted)

    def end(self) -> None:
        self.inner.end()


@dataclass
class DraftModels:
    """The real drafters replays run, by strategy: a draft model's backend (of the target's
    vocabulary), an EAGLE-3 head, a DFlash drafter, an MTP layer, the model-free strategies'
    settings; their shared state (the ngram-mod pool, the suffix store) made once and shared by
    forks, as a pipeline's."""

    draft: Backend | None = None
    head: Eagle3Head | None = None
    dflash: DFlashHead | None = None
    mtp: MtpLayer | None = None
    ngram: NgramSettings = field(default_factory=NgramSettings)
    shared: SharedState | None = None

    def strategy(self, name: str, target: Backend, sampling: SamplingParams, verify: str) -> Strategy:
        """The real strategy `name` for a replay over `target`: a drafting model drafts every
        token asked for (p_min 0), whatever its confidence."""
        if name == "draft" and self.draft is not None and self.draft.vocab.size != target.vocab.size:
            raise ReplayError(
                f"the draft model has {self.draft.vocab.size} ids, the target {target.vocab.size}: "
                "a replay's draft model must share the target's vocabulary"
            )
        setup = SpecSetup(
            target=target,
            sampling=sampling,
            verify=verify,
            seed=sampling.seed or 0,
            draft_backend=self.draft,
            draft=DraftModelConfig(n_max=INNER_N_MAX, p_min=0.0),
            eagle3_head=self.head,
            dflash_head=self.dflash,
            mtp_head=self.mtp,
            ngram=self.ngram,
            shared=self.shared_state(target.vocab.size) if name not in MODELS else None,
        )
        return build_strategies([name], setup)[0]

    def shared_state(self, vocab_size: int) -> SharedState:
        """The model-free strategies' shared state, made on first use."""
        if self.shared is None:
            self.shared = SharedState(self.ngram, list(PRIORITY), vocab_size)
        return self.shared

    def forked(self, passes: DraftPasses | None) -> DraftModels:
        """Drafters for another sequence of a batch: the draft model's own fork, the shared state
        shared; with `passes`, their model passes joining the batch's drafting rounds (a DFlash
        drafter, whose strategy keeps its own context cache, runs its block alone)."""
        draft = self.draft.fork() if self.draft is not None else None  # type: ignore[attr-defined]
        head: Any = self.head
        mtp: Any = self.mtp
        if passes is not None:
            draft = GatheredBackend(draft, passes) if draft is not None else None
            head = GatheredHead(head, passes) if head is not None else None
            mtp = GatheredHead(mtp, passes) if mtp is not None else None
        return DraftModels(draft, head, self.dflash, mtp, self.ngram, self.shared)


def replay_generation(trace: Trace, target: Backend, drafters: DraftModels) -> ReplayGeneration:
    """The generation that replays `trace` over `target` (iterate it, or run it in a batch)."""
    needed = replay_context(trace)
    if target.n_ctx < needed:
        raise ReplayError(f"trace {trace.name} needs a context of {needed}, the target has {target.n_ctx}")
    script = Script(trace, target)
    sampling = sampling_of(trace)
    verify = str(trace.meta.get("verify") or "match")
    classic = trace.meta.get("policy") == "classic"
    classic_n_max = int(trace.meta.get("draft_n_max") or CLASSIC_N_MAX) if classic else None
    chain = Chain(
        [
            ReplayDrafter(name, drafters.strategy(name, target, sampling, verify), script, classic_n_max)
            for name in strategies_of(trace)
        ]
    )
    # End of generation is the trace's to decide (`ReplayGeneration._stop_reason`): mapped ids
    # may be another of the target's end-of-generation ids.
    config = GenerationConfig(n_predict=recorded_n_predict(trace), verify=verify, ignore_eos=True)
    return ReplayGeneration(target, chain, ScriptedSampler(sampling), config, script.prompt, script=script)


@dataclass
class ReplayResult:
    """One replayed generation: its tokens beside the trace's (in the target's ids), its stats."""

    trace: Trace
    tokens: list[int]
    expected: list[int]
    stats: GenerationStats
    n_agreed: int  # steps whose real verification gave the trace's verdict (the prompt's pass too)
    n_inner_calls: int  # draft calls of the real drafters

    @property
    def n_steps(self) -> int:
        return len(self.trace.steps)


def result_of(generation: ReplayGeneration) -> ReplayResult:
    script = generation.script
    assert script is not None
    drafters = [s for s in generation.chain.strategies if isinstance(s, ReplayDrafter)]
    return ReplayResult(
        trace=script.trace,
        tokens=list(generation.tokens),
        expected=list(script.tokens),
        stats=generation.stats,
        n_agreed=generation.n_agreed,
        n_inner_calls=sum(drafter.n_inner_calls for drafter in drafters),
    )


def replay(trace: Trace, target: Backend, drafters: DraftModels) -> ReplayResult:
    """Replay one trace over `target` (its cache reused where it holds the prompt's start)."""
    generation = replay_generation(trace, target, drafters)
    for _ in generation:
        pass
    return result_of(generation)


def check_replay(result: ReplayResult) -> None:
    """Refuse a replay whose target passes, tokens per pass or tokens are not the recording's."""
    trace, stats = result.trace, result.stats
    if stats.n_passes != trace.n_passes or stats.tokens_per_pass != trace.tokens_per_pass:
        raise ReplayError(
            f"trace {trace.name}: replayed {stats.n_passes} passes at {stats.tokens_per_pass:.4f} "
            f"tokens/pass, recorded {trace.n_passes} at {trace.tokens_per_pass:.4f}"
        )
    if result.tokens != result.expected:
        raise ReplayError(f"trace {trace.name}: the replay emitted other tokens than the trace's")


@dataclass
class BatchSeats:
    """Where `replay_batch` runs its sequences: forks of the target, each with its drafters, and
    the rounds that batch their drafting models' passes (None where there are no models)."""

    seats: list[tuple[Backend, DraftModels]]
    passes: DraftPasses | None

    @classmethod
    def make(cls, target: Backend, drafters: DraftModels, count: int) -> BatchSeats:
        """`count` seats, made once: a timed batch then pays for no fork."""
        models = drafters.draft is not None or drafters.head is not None or drafters.mtp is not None
        passes = DraftPasses() if models else None
        drafters.shared_state(target.vocab.size)  # made before the forks, which share it
        fork = target.fork  # type: ignore[attr-defined]
        return cls([(fork(), drafters.forked(passes)) for _ in range(count)], passes)


def replay_batch(traces: Sequence[Trace], seats: BatchSeats) -> list[ReplayResult]:
    """Replay the traces as one batch, as many at once as there are seats, every step's rows in
    one target pass (`specdecode.scheduler.BatchEngine`, each sequence drafting as it would
    alone); a finished sequence's seat takes the next trace."""
    engine = BatchEngine(None, draft_passes=seats.passes, gate=False)
    generations: dict[int, ReplayGeneration] = {}

    def start(seat: tuple[Backend, DraftModels], index: int) -> Generation:
        generations[index] = replay_generation(traces[index], *seat)
        return generations[index]

    def done(index: int, entry: Entry) -> None:
        if entry.error is not None:
            raise entry.error

    engine.run(seats.seats, len(traces), start, done)
    return [result_of(generations[index]) for index in range(len(traces))]
