"""The GPU check's timings: what a pass costs by its rows (the passes section) and batch-1 decode
tokens/s (the speed section): our plain decoding against the roofline and the strongest baseline
(`gpu_baselines`), the oracle ceiling and self-draft speculation, batches, and the share of a
decode the GPU idles."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.api import Pipeline
from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.chain import Chain
from specdecode.compare.gpu_baselines import ASSISTED, assisted_speed, baselines, compare_with_strongest
from specdecode.compare.gpu_models import (
    Run,
    Timing,
    agreement,
    busy_seconds,
    make_backend,
    median_seconds,
    random_ids,
    reset_busy,
    timed_generation,
    truncate_all,
)
from specdecode.compare.gpu_roofline import decode_columns, measure_bandwidth, plain_columns
from specdecode.compare.gpu_setup import (
    ORACLE_DRAFT,
    ORACLE_SYSTEM,
    PLAIN_SYSTEM,
    SEED,
    VS_PLAIN,
    WARMUP_TOKENS,
    Shape,
    release,
)
from specdecode.drafts import Draft
from specdecode.generate import Generation, GenerationConfig
from specdecode.sampling import Sampler, SamplingParams
from specdecode.strategies import DraftModelConfig

# --------------------------------------------------------------------------- pass costs


def pass_costs(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Mode by mode, the first whatever the shape's share of the budget: each shape gets one."""
    share = run.shape_share(shape, run.sizes.passes_budget)
    for index, mode in enumerate(run.timing_modes):
        label = f"{shape.label} {mode}"
        where = (run, shape, model, tokenizer, mode)
        run.report.attempt("passes", label, pass_costs_mode, *where, within=share if index else None)
        release()


def pass_costs_mode(
    run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mode: str
) -> None:
    """t(rows) of one sequence after a cached prefix (`evaluate`), then of several sequences'
    rows in one pass (forks, `evaluate_groups`); each pass is rolled back after it is timed."""
    sizes = run.sizes
    backend = make_backend(model, tokenizer, mode, shape.label)
    ids = random_ids(shape.vocab, sizes.prefix + max(sizes.rows), SEED)
    prefix, probe = ids[: sizes.prefix], ids[sizes.prefix :]
    backend.evaluate(prefix, logits_rows=1)
    one_row = 0.0

    def add(call: str, sequences: int, rows: int, timing: tuple[float, float]) -> None:
        seconds, first = timing
        row = {"shape": shape.label, "mode": mode, "call": call, "sequences": sequences, "rows each": rows}
        row.update({"ms": 1e3 * seconds, "x one row": seconds / one_row, "first call ms": 1e3 * first})
        run.report.add("passes", row)

    for rows in sizes.rows:
        timing = median_seconds(
            run, partial(backend.evaluate, probe[:rows]), partial(backend.truncate, len(prefix))
        )
        one_row = one_row or timing[0]
        add("evaluate", 1, rows, timing)
    forks = [backend.fork() for _ in range(max(sizes.sequences))]
    probes = []
    for index, fork in enumerate(forks):
        ids = random_ids(shape.vocab, sizes.prefix + max(sizes.sequence_rows), SEED + 1 + index)
        fork.evaluate(ids[: sizes.prefix], logits_rows=1)
        probes.append(ids[sizes.prefix :])
    for count in sizes.sequences:
        for rows in sizes.sequence_rows:
            groups = [
                RowGroup(fork, probe[:rows]) for fork, probe in zip(forks[:count], probes, strict=False)
            ]
            reset = partial(truncate_all, forks[:count], sizes.prefix)
            add("evaluate_groups", count, rows, median_seconds(run, partial(evaluate_groups, groups), reset))


# --------------------------------------------------------------------------- end-to-end speed


class OracleDrafter:
    """Drafts the target's own greedy continuation, known from a plain run: where the passes
    give verify rows plain's bits, every draft is kept, so the run shows the speed our
    per-step overhead allows at this draft length (a `Strategy`)."""

    name = "oracle"
    n_min = 0

    def __init__(self, sequence: list[int], length: int) -> None:
        self.sequence = sequence  # prompt + plain's output
        self.length = length

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to set up: the continuation is known."""

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        at = len(history) + 1
        if at > len(self.sequence) or self.sequence[at - 1] != last:
            return Draft()
        return Draft(tokens=self.sequence[at : at + min(self.length, n_max)])

    def accept(self, n_accepted: int) -> None:
        """Nothing to learn."""

    def end(self) -> None:
        """Nothing to keep."""


def speed(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """The most important figures first, so that the budget cuts the rest: our plain decode and
    its oracle ceiling per mode, the baselines (the compiled loop first), then, within the
    shape's share of the budget, self-draft, batches and transformers' assisted generation."""
    report = run.report
    share = run.shape_share(shape, run.sizes.speed_budget)
    if run.bandwidth is None:
        report.attempt("speed", "memory bandwidth", measure_bandwidth, run)
    prompt = random_ids(shape.vocab, run.sizes.speed_prompt, SEED)
    backends, plains = {}, {}
    for mode in run.timing_modes:
        label = f"{shape.label} {mode}"
        backend = report.attempt(
            "speed", f"{label} backend", make_backend, model, tokenizer, mode, shape.label
        )
        if backend is None:
            continue
        backends[mode] = backend
        plains[mode] = report.attempt(
            "speed", f"{label} plain", plain_speed, run, shape, mode, backend, prompt
        )
        if plains[mode] is not None:
            report.attempt(
                "speed", f"{label} oracle", oracle_speed, run, shape, mode, backend, prompt, plains[mode]
            )
    ours = next((plain["tokens"] for plain in plains.values() if plain is not None), None)
    baselines(run, shape, model, prompt, ours)
    for mode, backend in backends.items():
        label, where = f"{shape.label} {mode}", (run, shape, mode, backend)
        if plains[mode] is not None:
            report.attempt(
                "speed", f"{label} self-draft", self_draft_speed, *where, prompt, plains[mode], within=share
            )
        report.attempt("speed", f"{label} batches", batch_speed, *where, within=share)
    report.attempt(
        "speed", f"{shape.label} {ASSISTED}", assisted_speed, run, shape, model, prompt, ours, within=share
    )
    compare_with_strongest(run, shape)
    del backends
    release()


def timed(run: Run, backend: Backend, call: Callable[[], Any]) -> tuple[Any, float, float | None]:
    """(call's result, its seconds, the share of them the GPU idled: None where the backend
    does not measure its GPU time)."""
    reset_busy(backend)
    run.sync()
    start = time.perf_counter()
    result = call()
    run.sync()
    seconds = time.perf_counter() - start
    busy = busy_seconds(backend)
    return result, seconds, None if busy is None else 1.0 - busy / seconds


def repeated(
    run: Run, backend: Backend, start: Callable[[], Generation], resets: Sequence[Backend]
) -> tuple[Generation, list[Timing]]:
    """The timed repeats of a generation, each after `resets` are emptied (each evaluates its
    prompt, as every baseline's does); the last generation, for its stats."""
    timings = []
    for _ in range(run.sizes.speed_repeats):
        truncate_all(resets, 0)
        generation, timing = timed_generation(run, [backend], start)
        timings.append(timing)
    return generation, timings


def median_idle(timings: list[Timing]) -> float | None:
    idle = [timing.idle for timing in timings if timing.idle is not None]
    return statistics.median(idle) if idle else None


def greedy_config(run: Run, tokens: int | None = None) -> GenerationConfig:
    return GenerationConfig(n_predict=tokens or run.sizes.speed_tokens, ignore_eos=True)


GREEDY = SamplingParams(temperature=0.0)


def plain_speed(run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int]) -> dict:
    """Our plain decoding; returns its row (the oracle drafts its output)."""
    pipe = Pipeline(backend)
    pipe.generate(prompt, GREEDY, greedy_config(run, WARMUP_TOKENS))
    _, timings = repeated(run, backend, partial(pipe.stream, prompt, GREEDY, greedy_config(run)), [backend])
    row = {"shape": shape.label, "mode": mode, "system": PLAIN_SYSTEM, **plain_columns(run, shape, timings)}
    row["GPU idle"] = median_idle(timings)
    run.report.add("speed", row)
    return {**row, "tokens": timings[0].tokens}


def oracle_speed(run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict) -> None:
    oracle = OracleDrafter([*prompt, *plain["tokens"]], ORACLE_DRAFT)

    def generation(tokens: int) -> Generation:
        return Generation(backend, Chain([oracle]), Sampler(GREEDY), greedy_config(run, tokens), list(prompt))

    for _ in generation(2 * ORACLE_DRAFT + 2):  # warm-up: one full-length step at least
        pass
    result, timings = repeated(run, backend, partial(generation, run.sizes.speed_tokens), [backend])
    report_speculation(run, shape, mode, ORACLE_SYSTEM, result, timings, plain, "ceiling x our plain")


def self_draft_speed(
    run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict
) -> None:
    """The target as its own draft model, drafting ORACLE_DRAFT tokens a step (no p_min cut)."""
    drafting = DraftModelConfig(n_max=ORACLE_DRAFT, p_min=0.0)
    pipe = Pipeline(backend, backend.fork(), spec_types=["draft"], draft_config=drafting)
    pipe.generate(prompt, GREEDY, greedy_config(run, 2 * ORACLE_DRAFT + 2))
    start = partial(pipe.stream, prompt, GREEDY, greedy_config(run))
    result, timings = repeated(run, backend, start, [backend, pipe.draft])
    report_speculation(run, shape, mode, "ours draft model (itself)", result, timings, plain, "x ours plain")


def report_speculation(
    run: Run,
    shape: Shape,
    mode: str,
    system: str,
    result: Generation,
    timings: list[Timing],
    plain: dict,
    ratio: str,
) -> None:
    stats = result.stats
    row = {"shape": shape.label, "mode": mode, "system": system, **decode_columns(timings)}
    row[ratio] = row["decode tokens/s"] / plain["decode tokens/s"]
    row["tokens/pass"] = stats.tokens_per_pass
    row["accepted"] = stats.totals.acceptance_rate
    row["GPU idle"] = median_idle(timings)
    row[VS_PLAIN] = agreement(plain["tokens"], result.tokens)
    run.report.add("speed", row)


def batch_speed(run: Run, shape: Shape, mode: str, backend: Backend) -> None:
    """Plain decoding of several sequences sharing each pass: tokens/s of them all."""
    pipe = Pipeline(backend)
    for count in run.sizes.batches:
        # The warm-up's prompts differ from the timed run's, which so evaluates its prompts.
        warmup, prompts = (
            [random_ids(shape.vocab, run.sizes.speed_prompt, seed + index) for index in range(count)]
            for seed in (SEED + 1000, SEED + 2000)
        )
        batch = partial(pipe.generate_batch, sampling=GREEDY, max_sequences=count, load_rule=False)
        batch(warmup, config=greedy_config(run, WARMUP_TOKENS))
        results, seconds, idle = timed(run, backend, partial(batch, prompts, config=greedy_config(run)))
        tokens = sum(len(result.tokens) for result in results)
        row = {"shape": shape.label, "mode": mode, "system": f"ours batch of {count}", "tokens": tokens}
        row.update({"tokens/s": tokens / seconds, "GPU idle": idle})
        run.report.add("speed", row)
