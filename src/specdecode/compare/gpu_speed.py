"""The GPU check's timings: what a pass costs by its rows (the passes section) and end-to-end
tokens/s (the speed section): our plain decoding against transformers' `generate`, the oracle
and self-draft speculation, batches, and the share of a decode the GPU idles."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.api import Pipeline
from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.chain import Chain
from specdecode.compare.gpu_models import (
    Run,
    agreement,
    busy_seconds,
    make_backend,
    median_seconds,
    random_ids,
    reset_busy,
)
from specdecode.compare.gpu_setup import ORACLE_DRAFT, ORACLE_SYSTEM, SEED, WARMUP_TOKENS, Shape, release
from specdecode.drafts import Draft
from specdecode.generate import Generation, GenerationConfig
from specdecode.sampling import Sampler, SamplingParams
from specdecode.strategies import DraftModelConfig

# --------------------------------------------------------------------------- pass costs


def pass_costs(run: Run, shape: Shape, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    for mode in run.timing_modes:
        run.report.attempt(
            "passes", f"{shape.label} {mode}", pass_costs_mode, run, shape, model, tokenizer, mode
        )
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


def truncate_all(backends: Sequence[Backend], length: int) -> None:
    for backend in backends:
        backend.truncate(length)


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
    report = run.report
    prompt = random_ids(shape.vocab, run.sizes.speed_prompt, SEED)
    hf_tokens = report.attempt("speed", f"{shape.label} transformers", hf_speed, run, shape, model, prompt)
    for mode in run.timing_modes:
        label = f"{shape.label} {mode}"
        backend = report.attempt(
            "speed", f"{label} backend", make_backend, model, tokenizer, mode, shape.label
        )
        if backend is None:
            continue
        where = (run, shape, mode, backend)
        plain = report.attempt("speed", f"{label} plain", plain_speed, *where, prompt, hf_tokens)
        if plain is not None:
            report.attempt("speed", f"{label} oracle", oracle_speed, *where, prompt, plain)
            report.attempt("speed", f"{label} self-draft", self_draft_speed, *where, prompt, plain)
        report.attempt("speed", f"{label} batches", batch_speed, *where)
        del backend
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


def speed_row(shape: Shape, mode: str, system: str, tokens: int, seconds: float, **extra: Any) -> dict:
    return {"shape": shape.label, "mode": mode, "system": system, "tokens/s": tokens / seconds, **extra}


def hf_speed(run: Run, shape: Shape, model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' `generate`, plain and assisted by the model itself (ORACLE_DRAFT tokens a
    step, no confidence cut); returns the plain greedy output."""
    new = run.sizes.speed_tokens
    hf_generate(run, model, prompt, WARMUP_TOKENS, assisted=False)
    tokens, seconds = hf_generate(run, model, prompt, new, assisted=False)
    run.report.add("speed", speed_row(shape, "-", "transformers generate", new, seconds))
    with assistant_settings(model):
        hf_generate(run, model, prompt, WARMUP_TOKENS, assisted=True)
        assisted, seconds = hf_generate(run, model, prompt, new, assisted=True)
    row = speed_row(shape, "-", "transformers assisted (itself)", new, seconds)
    row["vs plain's output"] = agreement(tokens, assisted)
    run.report.add("speed", row)
    return tokens


@torch.inference_mode()
def hf_generate(
    run: Run, model: PreTrainedModel, prompt: list[int], new_tokens: int, assisted: bool
) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=run.device)
    options: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,  # random weights: no end of generation
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": model.config.pad_token_id,
    }
    if assisted:
        options["assistant_model"] = model
    run.sync()
    start = time.perf_counter()
    out = model.generate(ids, **options)
    run.sync()
    return out[0, len(prompt) :].tolist(), time.perf_counter() - start


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


def greedy_config(run: Run, tokens: int | None = None) -> GenerationConfig:
    return GenerationConfig(n_predict=tokens or run.sizes.speed_tokens, ignore_eos=True)


GREEDY = SamplingParams(temperature=0.0)


def plain_speed(
    run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], hf_tokens: list[int] | None
) -> dict:
    """Our plain decoding; returns its row (the oracle drafts its output)."""
    pipe = Pipeline(backend)
    pipe.generate(prompt, GREEDY, greedy_config(run, WARMUP_TOKENS))
    backend.truncate(0)  # the timed run evaluates its prompt, as transformers' does
    result, seconds, idle = timed(run, backend, partial(pipe.generate, prompt, GREEDY, greedy_config(run)))
    row = speed_row(shape, mode, "ours plain", len(result.tokens), seconds, **{"GPU idle": idle})
    if hf_tokens is not None:
        row["vs transformers' output"] = agreement(hf_tokens, result.tokens)
    run.report.add("speed", row)
    return {**row, "tokens": result.tokens}


def oracle_speed(run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict) -> None:
    oracle = OracleDrafter([*prompt, *plain["tokens"]], ORACLE_DRAFT)

    def generate(tokens: int) -> Generation:
        generation = Generation(
            backend, Chain([oracle]), Sampler(GREEDY), greedy_config(run, tokens), list(prompt)
        )
        for _ in generation:
            pass
        return generation

    generate(2 * ORACLE_DRAFT + 2)  # warm-up: one full-length step at least
    backend.truncate(0)
    generation, seconds, idle = timed(run, backend, partial(generate, run.sizes.speed_tokens))
    report_speculation(run, shape, mode, ORACLE_SYSTEM, generation, seconds, idle, plain)


def self_draft_speed(
    run: Run, shape: Shape, mode: str, backend: Backend, prompt: list[int], plain: dict
) -> None:
    """The target as its own draft model, drafting ORACLE_DRAFT tokens a step (no p_min cut)."""
    drafting = DraftModelConfig(n_max=ORACLE_DRAFT, p_min=0.0)
    pipe = Pipeline(backend, backend.fork(), spec_types=["draft"], draft_config=drafting)
    pipe.generate(prompt, GREEDY, greedy_config(run, 2 * ORACLE_DRAFT + 2))
    truncate_all([backend, pipe.draft], 0)
    result, seconds, idle = timed(run, backend, partial(pipe.generate, prompt, GREEDY, greedy_config(run)))
    report_speculation(run, shape, mode, "ours draft model (itself)", result, seconds, idle, plain)


def report_speculation(
    run: Run,
    shape: Shape,
    mode: str,
    system: str,
    result: Any,
    seconds: float,
    idle: float | None,
    plain: dict,
) -> None:
    stats = result.stats
    row = speed_row(shape, mode, system, len(result.tokens), seconds)
    row["x ours plain"] = row["tokens/s"] / plain["tokens/s"]
    row["tokens/pass"] = stats.tokens_per_pass
    row["accepted"] = stats.totals.acceptance_rate
    row["GPU idle"] = idle
    row["vs plain's output"] = agreement(plain["tokens"], result.tokens)
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
        row = speed_row(shape, mode, f"ours batch of {count}", tokens, seconds, **{"GPU idle": idle})
        run.report.add("speed", row)
