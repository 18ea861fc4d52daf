"""The GPU check's replay section: speculation's speed at the real models' shapes, under the
acceptance real pairs showed on a CPU (the protocol of the reference's gpu.md, section 3.2).

Random weights accept nothing, and no real model of these shapes reaches the device. So the
acceptance comes from traces recorded with real pairs (`specdecode.bench.traces`, the set in
acceptance_traces.jsonl.gz next to this module), replayed through random-weight targets of the
check's shapes with the drafters at their real shapes (`specdecode.bench.replay`): a draft
model of the 1B shape for the 8B target, an EAGLE-3 head of the target's width, a DFlash
drafter of the published 8B drafters' shape (5 layers of the target's width, blocks of 16), an
MTP layer (one decoder layer of the target's shape), the model-free strategies' own code.
Every pass runs; only the accept decisions and the emitted ids come from the traces, so tokens
per pass are the recorded ones, which each row checks.

Per (pair, strategy, task, temperature) a row: tokens/s and ms/token, the step split (draft,
verify, host), the GPU's idle share, the speed-up over our plain decoding and over the
strongest baseline the check measured, and the cost model's predicted speed-up beside the
measured one. Then batches of replayed sequences sharing each pass. First, a calibration: the
bundled pair generates for real on the device while its trace is recorded, and the trace is
replayed through the same models: the two speeds should agree within CALIBRATION_GOAL.

Timing: the section's budget is shared out over the shapes in the run's order, each shape's
groups first (temperature 0 before 0.8, draft model, EAGLE-3, DFlash, MTP, ngram-mod, suffix
first), its
batches (smaller ones first) in the share's last BATCH_SHARE; past a share, what is left is
skipped and listed.
Replays run in the run's first timing mode (fixed on a GPU, whose passes give plain's bits).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.api import Pipeline
from specdecode.backends import Backend
from specdecode.backends.hf import load_tokenizer
from specdecode.backends.load import native_backend
from specdecode.bench.replay import (
    BatchSeats,
    DraftModels,
    ReplayResult,
    check_replay,
    replay,
    replay_batch,
    replay_context,
    replay_generation,
    result_of,
    strategies_of,
)
from specdecode.bench.traces import Trace, read_traces, record_steps
from specdecode.compare.gpu_baselines import strongest_baseline
from specdecode.compare.gpu_exactness import load_pair
from specdecode.compare.gpu_models import (
    DFLASH_BLOCK,
    DFLASH_LAYERS,
    Run,
    Timing,
    gpu_seconds,
    make_backend,
    random_dflash,
    random_head,
    random_model,
    random_mtp,
    start_gpu_timing,
    timed_generation,
    truncate_all,
)
from specdecode.compare.gpu_setup import N_CTX, PLAIN_SYSTEM, PROMPTS, SHAPES, Shape, release
from specdecode.costs import CostModel, calibrate
from specdecode.defaults import bundled_pair
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies.dflash_head import DFlashHead
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.mtp_head import MtpLayer

SECTION = "replay"
REPLAY_BUDGET = 150.0  # seconds of the section on a GPU, both shapes
TRACES = Path(__file__).with_name("acceptance_traces.jsonl.gz")
TRACES_PER_GROUP = 1  # a trace per (pair, strategy, task, temperature): the budget reaches more groups
BUNDLED = "bundled"  # the bundled pair's name in the trace headers
STRATEGY_ORDER = ("draft", "eagle3", "dflash", "mtp", "ngram-mod", "suffix")  # what the budget reaches first
TREE = " tree"  # marks a group of tree traces: "draft tree", "eagle3 tree"
BATCH_SHARE = 0.3  # of each shape's share of the budget: its batches
BATCH_STEPS = 16  # steps of each trace a batch replays: a batch of 32 whole traces takes half a minute
WARMUP_STEPS = 4  # steps of each replayed before a batch is timed (its passes' graphs are captured)
HIDDEN_STATE_STRATEGIES = ("eagle3", "dflash", "mtp")  # their targets record hidden states
TINY_DRAFTER = Shape("tiny drafter", 32, 1, 2, 1, 64, 512, True)  # the tiny target's, on a CPU
# The target's label -> its draft model's shape; the 1B target has none (no smaller Llama 3).
DRAFTER_SHAPES = {SHAPES["8b"].label: SHAPES["1b"], SHAPES["tiny"].label: TINY_DRAFTER}
CALIBRATION_PROMPTS = {True: 1, False: 2}  # by --quick
CALIBRATION_REPS = 3  # at most: fewer where the run's sizes repeat timings fewer times
CALIBRATION_GOAL = 0.05  # |replayed / real - 1| of the bundled pair's tokens/s


def replay_section(
    run: Run,
    shape: Shape,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    traces_path: Path = TRACES,
) -> None:
    """The replay section for one shape (the calibration too, at the run's first call)."""
    report = run.report
    section = report.data["sections"][SECTION]
    tried = [*section["skipped"], *(error["where"] for error in section["errors"])]
    if "calibration" not in section and "calibration" not in tried:
        report.attempt(SECTION, "calibration", calibration, run)
        release()
    if not traces_path.is_file():
        report.note(f"replay: no trace set at {traces_path}: {shape.label} was not replayed")
        return
    traces = report.attempt(SECTION, f"{shape.label} read traces", read_traces, traces_path)
    if not traces:
        return
    mode = run.timing_modes[0]
    where = (run, shape, model, tokenizer, mode, traces)
    models = report.attempt(SECTION, f"{shape.label} {mode} target", ShapeModels, *where)
    if models is None:
        return
    groups = grouped(traces)
    skipped = [key for key in groups if drafts(key[1]) and models.drafter_shape is None]
    if skipped:
        why = f"skipped: no Llama 3 shape smaller than {shape.label}'s to draft for it"
        report.add(SECTION, {"shape": shape.label, "mode": mode, "strategy": "draft", "drafter": why})
    budget = report.budgets[SECTION]
    share = run.shape_share(shape, None if math.isinf(budget) else budget)
    groups_within = None if share is None else share - BATCH_SHARE * budget / len(run.shapes)
    for key in sorted(set(groups) - set(skipped), key=group_order):
        label = f"{shape.label} {' '.join(map(str, key))}"
        report.attempt(SECTION, label, replay_group, run, models, key, groups[key], within=groups_within)
    strategies = sorted({key[1] for key in groups if key not in skipped and not key[3]}, key=strategy_rank)
    for count in run.sizes.batches:  # every strategy's smaller batches before any larger one
        for strategy in strategies:
            greedy = [t for key, group in groups.items() if key[1] == strategy and not key[3] for t in group]
            label = f"{shape.label} {strategy} batch of {count}"
            report.attempt(SECTION, label, replay_batches, run, models, strategy, greedy, count, within=share)
    del models
    release()


# --------------------------------------------------------------------------- groups


Key = tuple[str, str, str, float]  # (pair, strategy, task, temperature)


def grouped(traces: Sequence[Trace]) -> dict[Key, list[Trace]]:
    groups: dict[Key, list[Trace]] = {}
    for trace in traces:
        spec = trace.meta.get("spec") or ",".join(strategies_of(trace)) or "none"
        spec = spec if isinstance(spec, str) else ",".join(spec)
        key = (
            str(trace.meta.get("pair", "?")),
            spec + TREE if trace.meta.get("tree") else spec,
            str(trace.meta.get("task", "?")),
            float(trace.meta.get("temperature") or 0.0),
        )
        groups.setdefault(key, []).append(trace)
    return groups


def names_of(strategy: str) -> list[str]:
    """A group's strategies (comma-separated, TREE-marked for trees)."""
    return strategy.removesuffix(TREE).split(",")


def drafts(strategy: str) -> bool:
    """Whether a group's strategies include a draft model."""
    return "draft" in names_of(strategy)


def heads(drafters: DraftModels) -> bool:
    """Whether a head drafts (an EAGLE-3 head, a DFlash drafter, an MTP layer): modules whose
    kernels the GPU-time helpers do not see."""
    return any(model is not None for model in (drafters.head, drafters.dflash, drafters.mtp))


def strategy_rank(strategy: str) -> tuple[int, bool, str]:
    """Chains before trees, each in STRATEGY_ORDER."""
    name = strategy.removesuffix(TREE)
    rank = STRATEGY_ORDER.index(name) if name in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return (rank, strategy != name, strategy)


def group_order(key: Key) -> tuple:
    """Greedy before sampled, then the real pair before the bundled one (whose greedy outputs
    repeat a line, every strategy's easy case), then the strategies in their order."""
    pair, strategy, task, temperature = key
    return (temperature, pair == BUNDLED, strategy_rank(strategy), task, pair)


# --------------------------------------------------------------------------- models


class ShapeModels:
    """What one shape's replays run on, made when first needed and kept for its groups: the
    target (a fork of it for each drafter reading hidden states, whose passes then record them),
    the draft model, the EAGLE-3 head, the DFlash drafter, the MTP layer, and the cost model
    timed on them."""

    def __init__(
        self,
        run: Run,
        shape: Shape,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        mode: str,
        traces: Sequence[Trace],
    ) -> None:
        self.run, self.shape, self.model, self.mode = run, shape, model, mode
        self.drafter_shape = DRAFTER_SHAPES.get(shape.label)
        self.tokenizer = tokenizer
        # One context for all: N_CTX, or what the longest trace needs, in whole blocks.
        needed = max(replay_context(trace) for trace in traces)
        self.n_ctx = max(N_CTX, -(-needed // 128) * 128)
        self.target = native_backend(model, tokenizer, passes=mode, n_ctx=self.n_ctx, name=shape.label)
        self._hidden_targets: dict[str, Backend] = {}  # by the strategy reading hidden states
        self._draft: Backend | None = None
        self._head: Eagle3Head | None = None
        self._dflash: DFlashHead | None = None
        self._mtp: MtpLayer | None = None
        self._costs: CostModel | None = None
        self.warm: set[str] = set()  # strategies whose passes have run once (graphs captured)

    def target_for(self, strategy: str) -> Backend:
        reader = next((name for name in names_of(strategy) if name in HIDDEN_STATE_STRATEGIES), None)
        if reader is None:
            return self.target
        if reader not in self._hidden_targets:
            self._hidden_targets[reader] = self.target.fork()  # type: ignore[attr-defined]
        return self._hidden_targets[reader]

    def drafters(self, strategy: str) -> DraftModels:
        names = names_of(strategy)
        return DraftModels(
            draft=self.draft() if drafts(strategy) else None,
            head=self.head() if "eagle3" in names else None,
            dflash=self.dflash() if "dflash" in names else None,
            mtp=self.mtp() if "mtp" in names else None,
        )

    def draft(self) -> Backend:
        if self._draft is None:
            assert self.drafter_shape is not None, "the caller skips draft-model groups without a drafter"
            model = random_model(self.drafter_shape, self.run.device)
            self._draft = native_backend(
                model, self.tokenizer, passes=self.mode, n_ctx=self.n_ctx, name=self.drafter_shape.label
            )
        return self._draft

    def head(self) -> Eagle3Head:
        if self._head is None:
            self._head = random_head(self.shape, self.model, self.run.device)
        return self._head

    def dflash(self) -> DFlashHead:
        if self._dflash is None:
            self._dflash = random_dflash(self.shape, self.model, self.run.device)
        return self._dflash

    def mtp(self) -> MtpLayer:
        if self._mtp is None:
            self._mtp = random_mtp(self.shape, self.model, self.run.device)
        return self._mtp

    def costs(self) -> CostModel:
        """The cost model the adaptive policy would price steps by: the target's passes timed
        now, and the draft model's step once there is one."""
        if self._costs is None or (self._draft is not None and "draft" not in self._costs.draft_calls):
            models = {"draft": self._draft} if self._draft is not None else None
            self._costs = calibrate(self.target, store=False, drafts=models)  # leaves the caches empty
        return self._costs

    def drafter_name(self, strategy: str) -> str:
        if drafts(strategy):
            return f"draft model, {self.drafter_shape.label} shape"  # type: ignore[union-attr]
        names = names_of(strategy)
        if "eagle3" in names:
            return f"EAGLE-3 head, width {self.shape.hidden}"
        if "dflash" in names:
            return (
                f"DFlash drafter, {DFLASH_LAYERS} layers of width {self.shape.hidden}, block {DFLASH_BLOCK}"
            )
        if "mtp" in names:
            return f"MTP layer, width {self.shape.hidden}"
        return "host code"


# --------------------------------------------------------------------------- timing


@dataclass
class Totals:
    """Timed replays summed: their tokens, seconds and step split."""

    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0  # after each first token
    decode_seconds: float = 0.0
    idle_seconds: float | None = 0.0
    passes: int = 0
    step_tokens: int = 0
    t_draft: float = 0.0
    t_verify: float = 0.0

    def add(self, result: ReplayResult, timing: Timing) -> None:
        check_replay(result)
        stats = result.stats
        self.tokens += len(result.tokens)
        self.seconds += timing.seconds
        self.decode_tokens += len(result.tokens) - 1
        self.decode_seconds += timing.seconds - timing.first
        idle = None if timing.idle is None or self.idle_seconds is None else timing.idle * timing.seconds
        self.idle_seconds = None if idle is None else self.idle_seconds + idle  # type: ignore[operator]
        self.passes += stats.n_passes
        self.step_tokens += stats.n_step_tokens
        self.t_draft += stats.t_draft
        self.t_verify += stats.t_verify

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first over the seconds after it (None: no token after the first)."""
        return self.decode_tokens / self.decode_seconds if self.decode_tokens else None

    def row(self) -> dict[str, Any]:
        steps = max(1, self.passes)
        return {
            "replayed tokens/pass": self.step_tokens / steps,
            "tokens/s": self.tokens / self.seconds,
            "decode tokens/s": self.decode_rate,
            "ms/token": 1e3 / self.decode_rate if self.decode_rate else None,
            "draft ms/step": 1e3 * self.t_draft / steps,
            "verify ms/step": 1e3 * self.t_verify / steps,
            "host ms/step": 1e3 * max(0.0, self.decode_seconds - self.t_draft - self.t_verify) / steps,
            "GPU idle": None if self.idle_seconds is None else self.idle_seconds / self.seconds,
        }


# --------------------------------------------------------------------------- one group


def replay_group(run: Run, models: ShapeModels, key: Key, traces: list[Trace]) -> None:
    pair, strategy, task, temperature = key
    chosen = traces[:TRACES_PER_GROUP]
    target, drafters = models.target_for(strategy), models.drafters(strategy)
    measured = [target, *([drafters.draft] if drafters.draft is not None else [])]
    costs = models.costs()
    if strategy not in models.warm:  # the first replay of a strategy captures its passes' graphs
        truncate_all(measured, 0)
        replay(chosen[0], target, drafters)
        models.warm.add(strategy)
    totals = Totals()
    for trace in chosen:
        truncate_all(measured, 0)
        generation = replay_generation(trace, target, drafters)
        _, timing = timed_generation(run, measured, generation)
        if heads(drafters):  # a head's kernels are not timed: the idle share is unknown
            timing = replace(timing, idle=None)
        totals.add(result_of(generation), timing)
    steps = [step for trace in chosen for step in trace.steps[1:]]
    drafting = [step for step in steps if step.drafted]
    row: dict[str, Any] = {
        "shape": models.shape.label,
        "mode": models.mode,
        "pair": pair,
        "strategy": strategy,
        "task": task,
        "temperature": temperature,
        "drafter": models.drafter_name(strategy),
        "traces": len(chosen),
        "recorded tokens/pass": sum(len(step.emitted) for step in steps) / max(1, len(steps)),
    }
    row.update(totals.row())
    row["mean draft length"] = sum(len(step.draft) for step in drafting) / max(1, len(drafting))
    row["acceptance"] = sum(step.accepted for step in drafting) / max(1, sum(len(s.draft) for s in drafting))
    row.update(against_plain(run, models.shape, models.mode, row["decode tokens/s"]))
    model = "draft" if drafters.draft is not None else None
    row["predicted x plain (cost model)"] = predicted_speedup(costs, chosen, model, totals)
    run.report.add(SECTION, row)


def against_plain(run: Run, shape: Shape, mode: str, decode_rate: float | None) -> dict[str, Any]:
    """A decode rate over our plain decoding's (the speed section's, same shape and mode) and
    over the strongest baseline's the check measured (`gpu_baselines`), where they ran."""
    out: dict[str, Any] = {"x ours plain": None, "x strongest baseline": None, "baseline": None}
    if not decode_rate:
        return out
    plain = speed_row(run, shape, mode, PLAIN_SYSTEM)
    if plain is not None:
        out["x ours plain"] = decode_rate / plain["decode tokens/s"]
    baseline = strongest_baseline(run.report.data, shape.label)
    if baseline is not None:
        out["x strongest baseline"] = decode_rate / baseline["decode tokens/s"]
        out["baseline"] = baseline["system"] + (" (fallback)" if "fallback" in baseline else "")
    return out


def speed_row(run: Run, shape: Shape, mode: str, system: str) -> dict[str, Any] | None:
    """The speed section's row of `system` on this shape and mode, where it ran."""
    rows = run.report.data["sections"].get("speed", {}).get("rows", [])
    return next(
        (r for r in rows if (r["shape"], r["mode"], r["system"]) == (shape.label, mode, system)), None
    )


def predicted_speedup(costs: CostModel, traces: Sequence[Trace], model: str | None, totals: Totals) -> float:
    """The speed-up over plain decoding that the project's cost model (`specdecode.costs`)
    predicts for these traces' steps: each a verify pass of its draft's rows plus its drafting,
    against a one-row pass per token. A draft model's calls are priced by its timed step (the
    recorded depth, one step more under the classic chain, plus the tokens it reads first);
    other drafting (a head, model-free code) at the replays' measured drafting seconds a step.
    Host work is left out on both sides, as the model leaves it out."""
    plain = spec = 0.0
    drafting = totals.t_draft / max(1, totals.passes)
    for trace in traces:
        classic = trace.meta.get("policy") == "classic"
        missed = len(trace.prompt)  # the model's first call reads the prompt
        for step in trace.steps[1:]:
            plain += len(step.emitted) * costs.pass_time(1)
            spec += costs.pass_time(1 + len(step.draft))
            if model is None:
                spec += drafting
            elif step.drafted or classic:
                spec += costs.draft_time(model, step.to_draft().depth + classic, missed)
                missed = 0
            missed += len(step.emitted)
    return plain / spec if spec else 0.0


# --------------------------------------------------------------------------- batches


def replay_batches(run: Run, models: ShapeModels, strategy: str, traces: list[Trace], count: int) -> None:
    """`count` sequences sharing each pass, replaying the first BATCH_STEPS steps of the greedy
    traces of a strategy (interleaved across tasks, repeated where there are fewer than
    `count`); tokens/s of them all, prompts included, as the speed section's batch rows."""
    target, drafters = models.target_for(strategy), models.drafters(strategy)
    by_task: dict[str, list[Trace]] = {}
    for trace in traces:
        by_task.setdefault(str(trace.meta.get("task")), []).append(trace)
    mixed = [t for turn in zip_longest(*by_task.values()) for t in turn if t is not None]
    chosen = [mixed[index % len(mixed)] for index in range(count)]
    seats = BatchSeats.make(target, drafters, count)
    backends = [backend for backend, _ in seats.seats]
    backends += [d.draft for _, d in seats.seats if d.draft is not None]
    replay_batch([replace(trace, steps=trace.steps[: 1 + WARMUP_STEPS]) for trace in chosen], seats)
    chosen = [replace(trace, steps=trace.steps[: 1 + BATCH_STEPS]) for trace in chosen]
    truncate_all(backends, 0)
    start_gpu_timing(backends)
    run.sync()
    start = time.perf_counter()
    results = replay_batch(chosen, seats)
    run.sync()
    seconds = time.perf_counter() - start
    busy = None if heads(drafters) else gpu_seconds(backends)
    for result in results:
        check_replay(result)
    plain = speed_row(run, models.shape, models.mode, f"ours batch of {count}")
    tokens = sum(len(result.tokens) for result in results)
    row: dict[str, Any] = {
        "shape": models.shape.label,
        "mode": models.mode,
        "strategy": strategy,
        "drafter": models.drafter_name(strategy),
        "sequences": count,
        "traces": len({trace.name for trace in chosen}),
        "recorded tokens/pass": sum(t.tokens_per_pass * t.n_passes for t in chosen)
        / sum(t.n_passes for t in chosen),
        "replayed tokens/pass": sum(r.stats.n_step_tokens for r in results)
        / sum(r.stats.n_passes for r in results),
        "tokens/s": tokens / seconds,
        "GPU idle": None if busy is None else 1.0 - busy / seconds,
        "x ours plain batch": tokens / seconds / plain["tokens/s"] if plain else None,
    }
    run.report.add(SECTION, row, "batches")


# --------------------------------------------------------------------------- calibration


def calibration(run: Run) -> None:
    """The bundled pair (real weights) on the device: draft chains generating for real while
    their trace is recorded, then the trace replayed through the same models, each timed as the
    speed section times a batch-1 decode. Greedy, so every repetition records the same trace;
    the medians of the alternated repetitions are compared."""
    quick = bool(run.report.data["settings"].get("quick"))
    dtype, mode = run.dtypes[0], run.timing_modes[0]
    target_model, draft_model = load_pair(run, dtype)
    tokenizer = load_tokenizer(bundled_pair()[0])
    target = make_backend(target_model, tokenizer, mode, "target")
    draft = make_backend(draft_model, tokenizer, mode, "draft")
    pipe = Pipeline(target, draft, spec_types=["draft"])
    config = GenerationConfig(n_predict=run.sizes.speed_tokens, ignore_eos=True)
    drafters = DraftModels(draft=draft)
    for index, text in enumerate(PROMPTS[: CALIBRATION_PROMPTS[quick]]):
        prompt = target.tokenize(text)
        record(run, pipe, prompt, config)  # the warm-up: graphs are captured
        runs = [
            real_and_replayed(run, pipe, prompt, config, drafters)
            for _ in range(min(CALIBRATION_REPS, run.sizes.reps))
        ]
        trace, agreed = runs[-1][0], runs[-1][3]
        real = statistics.median(each[1] for each in runs)
        replayed = statistics.median(each[2] for each in runs)
        gap = replayed / real - 1.0
        row = {"dtype": str(dtype).removeprefix("torch."), "mode": mode, "prompt": index}
        row.update(
            {
                "tokens/pass": trace.tokens_per_pass,
                "real decode tokens/s": real,
                "replayed decode tokens/s": replayed,
                "gap": gap,
                f"within {100 * CALIBRATION_GOAL:.0f}%": abs(gap) <= CALIBRATION_GOAL,
                "steps the target decided as recorded": f"{agreed}/{len(trace.steps)}",
            }
        )
        run.report.add(SECTION, row, "calibration")


def real_and_replayed(
    run: Run, pipe: Pipeline, prompt: list[int], config: GenerationConfig, drafters: DraftModels
) -> tuple[Trace, float, float, int]:
    """A real generation timed while its trace is recorded, then the trace replayed through the
    same models: the trace, the two decode tokens/s, and the steps the target decided as recorded."""
    backends = [pipe.target, pipe.draft]
    truncate_all(backends, 0)  # type: ignore[arg-type]
    trace, timing = record(run, pipe, prompt, config)
    truncate_all(backends, 0)  # type: ignore[arg-type]
    generation = replay_generation(trace, pipe.target, drafters)
    _, replayed = timed_generation(run, backends, generation)  # type: ignore[arg-type]
    result = result_of(generation)
    check_replay(result)
    return trace, timing.decode_rate, replayed.decode_rate, result.n_agreed


def record(run: Run, pipe: Pipeline, prompt: list[int], config: GenerationConfig) -> tuple[Trace, Timing]:
    """A real generation of the pipeline (classic draft chains, greedy), timed, as its trace."""
    generation = pipe.stream(prompt, SamplingParams(temperature=0.0), config)
    steps = record_steps(generation)
    _, timing = timed_generation(run, [pipe.target, pipe.draft], generation)  # type: ignore[list-item]
    meta = {
        "pair": "bundled",
        "spec": "draft",
        "task": "calibration",
        "temperature": 0.0,
        "n_predict": config.n_predict,
        "policy": "classic",
        "draft_n_max": pipe.draft_config.n_max,
    }
    vocab = pipe.target.vocab
    return Trace("bundled/calibration", list(prompt), vocab.size, sorted(vocab.eog_ids), steps, meta), timing
