"""The baselines our plain decoding is put against: on the same model object, prompt and lengths,
greedy, batch 1, every token generated (random weights: no end of generation).

- the compiled loop (gpt-fast style), written here: a transformers `StaticCache`, the prompt in
  one forward, then a one-token step that returns its argmax on the device, compiled on CUDA
  with `torch.compile(mode="reduce-overhead", fullgraph=True)`: one CUDA graph a token and no
  host work besides, the strongest loop torch and transformers allow;
- transformers' `generate` with a static cache, whose forward transformers compiles on CUDA;
- transformers' `generate` with its dynamic cache and no compilation: mostly host overhead, the
  figure earlier reports compared with, kept so that they can be read against this one;
- transformers' assisted generation, the model drafting for itself: a feature comparison, not a
  speed bar (it cannot use a static cache: transformers#32946).

Compilation and warm-up are timed apart from the timed runs, and each figure is the median of
the repeats. `strongest_baseline` is what every other batch-1 figure is put against."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.generation.streamers import BaseStreamer

from specdecode.compare.gpu_models import Clock, Run, Timing, agreement
from specdecode.compare.gpu_roofline import decode_columns, plain_columns
from specdecode.compare.gpu_setup import ORACLE_DRAFT, ORACLE_SYSTEM, VS_PLAIN, WARMUP_TOKENS, Shape

COMPILED_LOOP = "compiled loop (gpt-fast style)"
STATIC_GENERATE = "transformers generate, static cache"
DYNAMIC_GENERATE = "transformers generate, dynamic cache (no compile)"
ASSISTED = "transformers assisted generation (itself; a feature comparison, dynamic cache)"
STRONG_BASELINES = (COMPILED_LOOP, STATIC_GENERATE)

# --------------------------------------------------------------------------- the strongest


def strongest_baseline(report_data: dict, shape_label: str) -> dict | None:
    """The speed row of the baseline with the most decode tokens/s on this shape, of the compiled
    loop and static-cache generate; the dynamic-cache row, with a "fallback" key saying so, only
    where neither ran; None where no baseline ran."""
    rows = [
        row
        for row in report_data["sections"].get("speed", {}).get("rows", [])
        if row.get("shape") == shape_label and row.get("decode tokens/s") is not None
    ]
    strong = [row for row in rows if row["system"] in STRONG_BASELINES]
    if strong:
        return max(strong, key=lambda row: row["decode tokens/s"])
    weak = next((row for row in rows if row["system"] == DYNAMIC_GENERATE), None)
    if weak is None:
        return None
    return {**weak, "fallback": "neither the compiled loop nor static-cache generate ran"}


def compare_with_strongest(run: Run, shape: Shape) -> None:
    """Put every batch-1 row of this shape against the strongest baseline ("x strongest
    baseline"), but the oracle's: a ceiling, put against our plain alone."""
    strongest = strongest_baseline(run.report.data, shape.label)
    if strongest is None:
        return
    if "fallback" in strongest:
        run.report.note(
            f"{shape.label}: x strongest baseline is x {DYNAMIC_GENERATE} ({strongest['fallback']})"
        )
    for row in run.report.data["sections"]["speed"].get("rows", []):
        if row["shape"] == shape.label and row.get("decode tokens/s") and row["system"] != ORACLE_SYSTEM:
            row["x strongest baseline"] = row["decode tokens/s"] / strongest["decode tokens/s"]
    run.report.write()


def add_baseline(
    run: Run, shape: Shape, system: str, timings: list[Timing], ours: list[int] | None, **extra: Any
) -> None:
    row = {"shape": shape.label, "mode": "-", "system": system, **plain_columns(run, shape, timings), **extra}
    if ours is not None:
        row[VS_PLAIN] = agreement(ours, timings[0].tokens)
    run.report.add("speed", row)


def warm_then_time(
    run: Run, measure: Callable[[], Timing], warm_up: Callable[[], Timing] | None = None
) -> tuple[float, list[Timing]]:
    """(seconds of a first, untimed run, `warm_up` or `measure` itself: compilation, graph
    capture, allocation), then the timed runs."""
    start = time.perf_counter()
    (warm_up or measure)()
    seconds = time.perf_counter() - start
    return seconds, [measure() for _ in range(run.sizes.speed_repeats)]


# --------------------------------------------------------------------------- the compiled loop


@dataclass(frozen=True)
class CacheInputs:
    """How this transformers' forward takes a cache: `cache=` from 5.2x on, `past_key_values=`
    before; `cache_position=` where the forward still takes one; `logits_to_keep` where it can
    skip the prompt's other rows' logits."""

    keyword: str
    with_cache_position: bool
    with_logits_to_keep: bool

    @classmethod
    def of(cls, model: PreTrainedModel) -> CacheInputs:
        parameters = inspect.signature(model.forward).parameters
        keyword = "cache" if "cache" in parameters else "past_key_values"
        return cls(keyword, "cache_position" in parameters, "logits_to_keep" in parameters)

    def __call__(self, cache: StaticCache, positions: torch.Tensor) -> dict[str, Any]:
        inputs: dict[str, Any] = {self.keyword: cache, "position_ids": positions[None], "use_cache": True}
        if self.with_cache_position:
            inputs["cache_position"] = positions
        if self.with_logits_to_keep:
            inputs["logits_to_keep"] = 1
        return inputs


def static_cache(model: PreTrainedModel, length: int) -> StaticCache:
    """A StaticCache of `length` positions for one sequence, by keyword (every recent version
    takes config= and max_cache_len=); batch size, device and dtype where this version asks
    for them (4.x allocates the cache when it is made)."""
    parameters = inspect.signature(StaticCache.__init__).parameters
    wanted: dict[str, Any] = {"max_batch_size": 1, "device": model.device, "dtype": model.dtype}
    if "max_batch_size" not in parameters:
        wanted["batch_size"] = 1
    return StaticCache(
        config=model.config,
        max_cache_len=length,
        **{name: value for name, value in wanted.items() if name in parameters},
    )


def decode_step(
    inputs: CacheInputs,
) -> Callable[[PreTrainedModel, torch.Tensor, torch.Tensor, StaticCache], torch.Tensor]:
    def decode_one_token(
        model: PreTrainedModel, token: torch.Tensor, cache_position: torch.Tensor, cache: StaticCache
    ) -> torch.Tensor:
        """One position's forward and its greedy token, left on the device: the host only
        launches (one CUDA graph, compiled)."""
        logits = model(token, **inputs(cache, cache_position)).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    return decode_one_token


class CompiledLoop:
    """gpt-fast's decoding loop over a transformers model: the prompt in one eager forward, then
    the compiled one-token step; the tokens stay on the device until the end."""

    def __init__(self, model: PreTrainedModel, length: int, compile_options: dict[str, Any] | None) -> None:
        self.model = model
        self.inputs = CacheInputs.of(model)
        self.cache = static_cache(model, length)
        step = decode_step(self.inputs)
        self.step = step if compile_options is None else torch.compile(step, **compile_options)

    @torch.no_grad()
    def generate(self, run: Run, prompt: list[int], new_tokens: int) -> Timing:
        self.cache.reset()  # in place: the captured graph keeps reading the same tensors
        ids = torch.tensor([prompt], device=run.device)
        clock = Clock(run)
        positions = torch.arange(len(prompt), device=run.device)
        logits = self.model(ids, **self.inputs(self.cache, positions)).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        clock.first_token()
        tokens = [token]
        position = torch.tensor([len(prompt)], device=run.device)
        for _ in range(new_tokens - 1):
            token = self.step(self.model, token, position, self.cache).clone()  # the graph reuses its output
            tokens.append(token)
            position += 1
        return clock.stop(torch.cat(tokens, dim=1)[0].tolist())


# How the step is compiled on CUDA, the first that compiles: gpt-fast's way; with graph breaks
# where a transformers version cannot be traced whole; CUDA graphs without inductor where
# inductor's kernels cannot be built (triton needs a C compiler for its launchers).
COMPILE_CHOICES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("torch.compile reduce-overhead, fullgraph", {"mode": "reduce-overhead", "fullgraph": True}),
    ("torch.compile reduce-overhead, with graph breaks", {"mode": "reduce-overhead"}),
    ("CUDA graphs without inductor (torch.compile backend cudagraphs)", {"backend": "cudagraphs"}),
)
NOT_COMPILED: tuple[tuple[str, dict[str, Any] | None], ...] = (("not compiled (cpu)", None),)


def compiled_loop_speed(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    """Compiled on CUDA only (a CPU run checks the check, and must stay fast), the first of
    COMPILE_CHOICES whose warm-up runs; the row says which, and why the ones before failed."""
    new = run.sizes.speed_tokens
    choices = COMPILE_CHOICES if run.device.type == "cuda" else NOT_COMPILED
    failed = []
    start = time.perf_counter()
    for index, (note, options) in enumerate(choices):
        loop = CompiledLoop(model, len(prompt) + new, options)
        try:
            loop.generate(run, prompt, new)  # compiles, then captures the graph
            break
        except Exception as exc:
            if index == len(choices) - 1:
                raise
            failed.append(f"{note}: {type(exc).__name__}: {str(exc)[:200]}")
            run.report.log(f"speed: {COMPILED_LOOP}: {failed[-1]}")
            torch._dynamo.reset()  # the failed compilation's state and graphs
    warm_up = time.perf_counter() - start
    timings = [loop.generate(run, prompt, new) for _ in range(run.sizes.speed_repeats)]
    extra: dict[str, Any] = {"compile + warm-up s": warm_up, "note": note}
    if failed:
        extra["failed before"] = failed
    add_baseline(run, shape, COMPILED_LOOP, timings, ours, **extra)


# --------------------------------------------------------------------------- transformers' generate


class FirstTokenMark(BaseStreamer):
    """Marks the clock when `generate` hands over its first new token (its first put is the
    prompt); every later put costs nothing. Where transformers defers its stop checks, a token
    reaches the streamer a step late: the time to the first token then holds one decode step
    more, and the decode rate is at most 1/tokens too kind to transformers."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.puts = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.clock.first_token()

    def end(self) -> None:
        """Nothing held back."""


def hf_generate(
    run: Run, model: PreTrainedModel, prompt: list[int], new_tokens: int, **options: Any
) -> Timing:
    ids = torch.tensor([prompt], device=run.device)
    settings: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,  # random weights: no end of generation
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": model.config.pad_token_id,
    }
    clock = Clock(run)
    out = model.generate(ids, streamer=FirstTokenMark(clock), **settings, **options)
    return clock.stop(out[0, len(prompt) :].tolist())


def static_generate_speed(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    """Warmed up with the same prompt length and tokens: other lengths would compile again."""
    new = run.sizes.speed_tokens
    warm_up, timings = warm_then_time(
        run, lambda: hf_generate(run, model, prompt, new, cache_implementation="static")
    )
    compiled = hasattr(model, "_compiled_call")  # where transformers keeps the forward it compiled
    note = "transformers compiled the forward" if compiled else f"not compiled ({run.device.type})"
    add_baseline(run, shape, STATIC_GENERATE, timings, ours, **{"compile + warm-up s": warm_up, "note": note})


def dynamic_generate_speed(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    """Warmed up on a few tokens: nothing is compiled."""
    new = run.sizes.speed_tokens
    warm_up, timings = warm_then_time(
        run,
        lambda: hf_generate(run, model, prompt, new),
        lambda: hf_generate(run, model, prompt, WARMUP_TOKENS),
    )
    add_baseline(run, shape, DYNAMIC_GENERATE, timings, ours, **{"compile + warm-up s": warm_up})


def assisted_speed(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    """The model assisting itself (ORACLE_DRAFT tokens a step, no confidence cut): one run, after
    the dynamic-cache baseline's (the same path) warmed it up."""
    with assistant_settings(model):
        timing = hf_generate(run, model, prompt, run.sizes.speed_tokens, assistant_model=model)
    row = {"shape": shape.label, "mode": "-", "system": ASSISTED, **decode_columns([timing])}
    if ours is not None:
        row[VS_PLAIN] = agreement(ours, timing.tokens)
    run.report.add("speed", row)


@contextmanager
def assistant_settings(model: PreTrainedModel) -> Iterator[None]:
    """The assistant's drafting settings (read from its generation config: the model's own)."""
    config = model.generation_config
    settings = {
        "num_assistant_tokens": ORACLE_DRAFT,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    saved = {name: getattr(config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def baselines(
    run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int], ours: list[int] | None
) -> None:
    """Strongest first (the section's budget may cut the rest); the shape's share of the
    budget may skip all but the compiled loop."""
    share = run.shape_share(shape, run.sizes.speed_budget)
    where = (run, shape, model, prompt, ours)
    run.report.attempt("speed", f"{shape.label} {COMPILED_LOOP}", compiled_loop_speed, *where)
    run.report.attempt(
        "speed", f"{shape.label} {STATIC_GENERATE}", static_generate_speed, *where, within=share
    )
    run.report.attempt(
        "speed", f"{shape.label} {DYNAMIC_GENERATE}", dynamic_generate_speed, *where, within=share
    )
    compare_with_strongest(run, shape)
