"""The GPU check's prefill section: the time to the first token of one long prompt (random ids),
our plain decoding per passes mode beside the compiled loop's prompt pass (static-cache
`generate`, the other strong baseline, is not timed here).

Why a section of its own: the other sections' backends hold N_CTX positions, too few for a
long prompt, so each mode here gets a backend whose context holds it. Its KV store and graphs
belong to an engine of that context size, which lives as long as the model: the section runs
last for each shape, and the model's release takes them. A warm-up run first grows the
backend's cache to the prompt and captures its passes, as a server's first long prompt would."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.api import Pipeline
from specdecode.compare.gpu_baselines import COMPILED_LOOP, CompiledLoop
from specdecode.compare.gpu_models import Run, Timing, agreement, make_backend, random_ids, timed_generation
from specdecode.compare.gpu_setup import PLAIN_SYSTEM, SEED, VS_PLAIN, Shape, release
from specdecode.compare.gpu_speed import GREEDY
from specdecode.generate import GenerationConfig

PREFILL_SEED = SEED + 3000
FIRST_TOKEN = GenerationConfig(n_predict=1, ignore_eos=True)
ROOM = 16  # context past the prompt
# The compiled loop runs its prompt in one eager forward over its static cache (only its
# one-token step is compiled), so its time to the first token needs no compilation.
LOOP_NOTE = "its prompt pass: one eager forward over a static cache, as the loop runs it (nothing compiled)"


def prefill(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Ours per mode, then the compiled loop's prompt pass, each as a part of its own."""
    prompt = random_ids(shape.vocab, run.sizes.ttft_prompt, PREFILL_SEED)
    ours = None
    for mode in run.timing_modes:
        where = (run, shape, model, tokenizer, mode, prompt)
        tokens = run.report.attempt("prefill", f"{shape.label} {mode} first token", ours_first_token, *where)
        ours = ours or tokens
        release()
    where_loop = (run, shape, model, prompt, ours)
    run.report.attempt("prefill", f"{shape.label} {COMPILED_LOOP} first token", loop_first_token, *where_loop)
    release()


def ours_first_token(
    run: Run,
    shape: Shape,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    mode: str,
    prompt: list[int],
) -> list[int]:
    """Our plain generation of one token after the prompt, on an empty cache each run; returns
    the token (the baseline's is put against it)."""
    backend = make_backend(model, tokenizer, mode, shape.label, n_ctx=len(prompt) + ROOM)
    pipe = Pipeline(backend)

    def once() -> Timing:
        backend.truncate(0)
        return timed_generation(run, [backend], partial(pipe.stream, prompt, GREEDY, FIRST_TOKEN))[1]

    timings = warmed_runs(run, once)
    add_row(run, shape, mode, PLAIN_SYSTEM, len(prompt), timings)
    return timings[-1].tokens


def loop_first_token(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    loop = CompiledLoop(model, len(prompt) + 1, None)  # no step is run: none is compiled
    timings = warmed_runs(run, partial(loop.generate, run, prompt, 1))
    extra = {"note": LOOP_NOTE}
    if ours is not None:
        extra[VS_PLAIN] = agreement(ours, timings[-1].tokens)
    add_row(run, shape, "-", COMPILED_LOOP, len(prompt), timings, **extra)


def warmed_runs(run: Run, measure: Callable[[], Timing]) -> list[Timing]:
    """The warm-up's timing, then the timed runs'."""
    return [measure() for _ in range(1 + run.sizes.speed_repeats)]


def add_row(
    run: Run, shape: Shape, mode: str, system: str, prompt: int, timings: list[Timing], **extra: str
) -> None:
    """The median time to the first token of the runs after the warm-up, with their range."""
    warm_up, timed = timings[0], timings[1:]
    firsts = [timing.first for timing in timed]
    median = statistics.median(firsts)
    row = {"shape": shape.label, "mode": mode, "system": system, "prompt tokens": prompt}
    row.update({"TTFT ms": 1e3 * median, "TTFT ms range": f"{1e3 * min(firsts):.1f}–{1e3 * max(firsts):.1f}"})
    row.update(
        {"runs": len(timed), "warm-up TTFT ms": 1e3 * warm_up.first, "prompt tokens/s": prompt / median}
    )
    run.report.add("prefill", {**row, **extra})
