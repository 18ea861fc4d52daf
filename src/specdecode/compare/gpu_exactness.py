"""The GPU check's exactness section: the bundled pair's outputs, per dtype and passes mode,
against plain generation, and the kernels' rounding that a greedy difference is measured
against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.api import Pipeline, Result
from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.backends.hf import load_tokenizer
from specdecode.compare.gpu_models import Run, first_difference, make_backend
from specdecode.compare.gpu_setup import (
    BATCH_ROUNDING_ROWS,
    NGRAM,
    NGRAM_TYPES,
    PROMPTS,
    ROUNDING_ROWS,
    SEED,
    TOLERANCE,
    TREE_BRANCHES,
    VERIFY_ROWS,
    release,
)
from specdecode.defaults import bundled_pair
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams, candidates, reduce_rows
from specdecode.strategies import DraftModelConfig


def exactness(run: Run) -> None:
    """Mode by mode (the invariant one, slowest on a GPU, last: the budget may skip it), each
    dtype: the pairs are small enough to keep loaded."""
    tokenizer = load_tokenizer(bundled_pair()[0])
    pairs = {}
    for dtype in run.dtypes:
        name = str(dtype).removeprefix("torch.")
        pairs[name] = run.report.attempt(
            "exactness", f"load the bundled pair in {name}", load_pair, run, dtype
        )
    for mode in run.exact_modes:
        for name, pair in pairs.items():
            if pair is not None:
                run.report.attempt("exactness", f"{name} {mode}", exactness_mode, run, *pair, tokenizer, mode)
    del pairs
    release()
    run.report.attempt("exactness", "rows reduced on the device", reduction, run)


# Sampling settings the device reduction is checked under: greedy, llama.cpp's defaults, narrow
# candidate sets, and a logit bias (a token pushed up, one banned).
REDUCTION_SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "defaults at 0.8": SamplingParams(temperature=0.8),
    "top-k 5, top-p 0.5": SamplingParams(temperature=1.5, top_k=5, top_p=0.5, min_p=0.0),
    "bias": SamplingParams(temperature=0.8, logit_bias={7: 4.0, 11: float("-inf")}),
}
REDUCTION_PASSES = 20  # random passes of VERIFY_ROWS rows per setting
REDUCTION_VOCAB = 128_256  # Llama 3's vocabulary


def reduction(run: Run) -> None:
    """Rows reduced where the pass ran (`reduce_rows`: the argmax or the top-k on the device)
    against the whole rows on the host: the candidates and probabilities each gives the
    sampler, bit for bit, over random rows whose bfloat16 values tie often."""
    generator = torch.Generator().manual_seed(SEED)
    for name, params in REDUCTION_SETTINGS.items():
        rows = identical = 0
        for _ in range(REDUCTION_PASSES):
            logits = (3 * torch.randn(VERIFY_ROWS, REDUCTION_VOCAB, generator=generator)).bfloat16().float()
            reduced = reduce_rows(logits.to(run.device), params)
            for row, host in zip(reduced, logits, strict=True):
                got, want = candidates(row, params, []), candidates(host, params, [])
                identical += torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                rows += 1
        run.report.add("exactness", {"sampling": name, "rows": rows, "identical": identical}, "reduction")


def load_pair(run: Run, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedModel]:
    target_dir, draft_dir = bundled_pair()
    return tuple(  # type: ignore[return-value]
        AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
        .to(run.device)
        .eval()
        for directory in (target_dir, draft_dir)
    )


def exactness_mode(
    run: Run,
    target_model: PreTrainedModel,
    draft_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    mode: str,
) -> None:
    report, sizes = run.report, run.sizes
    dtype = str(target_model.dtype).removeprefix("torch.")
    target = make_backend(target_model, tokenizer, mode, "target")
    draft = make_backend(draft_model, tokenizer, mode, "draft")
    prompts = [target.tokenize(text) for text in PROMPTS[: sizes.prompts]]
    config = GenerationConfig(n_predict=sizes.new_tokens, verify="match", ignore_eos=True)
    count = len(prompts)
    samplings = {
        "greedy": [SamplingParams(temperature=0.0)] * count,
        "seeded": [SamplingParams(temperature=0.8, seed=SEED + index) for index in range(count)],
    }
    plain = Pipeline(target)
    spec = {"dtype": dtype, "mode": mode}
    rounding: float | None = None
    for sampling, params in samplings.items():
        reference = [plain.generate(ids, p, config).tokens for ids, p in zip(prompts, params, strict=True)]
        if sampling == "greedy":
            worst = report.attempt(
                "exactness", f"{dtype} {mode} rounding", rounding_error, target, prompts, reference
            )
            if worst is not None:
                report.add("exactness", {**spec, **worst}, "rounding")
                rounding = max(worst.values())
        for case, generate in cases(target, draft).items():
            label = f"{dtype} {mode} {sampling} {case}"
            results = report.attempt("exactness", label, generate, prompts, params, config)
            if results is None:
                continue
            row = compare(target, prompts, reference, results, sampling == "greedy", rounding)
            report.add("exactness", {**spec, "sampling": sampling, "case": case, **row})


Generate = Callable[[list[list[int]], list[SamplingParams], GenerationConfig], list[Result]]


def cases(target: Backend, draft: Backend) -> dict[str, Generate]:
    """Each way of generating whose output must equal plain generation's."""

    def singly(pipe: Pipeline) -> Generate:
        def generate(prompts, params, config):
            return [pipe.generate(ids, p, config) for ids, p in zip(prompts, params, strict=True)]

        return generate

    def batched(pipe: Pipeline) -> Generate:
        def generate(prompts, params, config):
            return pipe.generate_batch(prompts, params, config, max_sequences=len(prompts))

        return generate

    tree = DraftModelConfig(n_parallel=TREE_BRANCHES)
    return {
        "draft chain": singly(Pipeline(target, draft, spec_types=["draft"])),
        "draft tree": singly(Pipeline(target, draft, spec_types=["draft"], draft_config=tree)),
        "n-gram": singly(Pipeline(target, spec_types=list(NGRAM_TYPES), ngram=NGRAM)),
        "batch plain": batched(Pipeline(target)),
        "batch draft chain": batched(Pipeline(target, draft, spec_types=["draft"])),
    }


def compare(
    target: Backend,
    prompts: list[list[int]],
    reference: list[list[int]],
    results: list[Result],
    greedy: bool,
    rounding: float | None,
) -> dict:
    """Outputs identical to plain's; for each that is not, where it first differs and plain's
    top-2 logit margin there; greedy: whether every difference is within the kernels' rounding."""
    differences = []
    for index, (prompt, plain, result) in enumerate(zip(prompts, reference, results, strict=True)):
        position = first_difference(plain, result.tokens)
        if position is not None:
            margin = top2_margin(plain_logits(target, prompt, plain, position))
            differences.append({"prompt": index, "position": position, "margin": margin})
    passes = sum(result.stats.n_passes for result in results)
    row: dict[str, Any] = {
        "identical": f"{len(results) - len(differences)}/{len(results)}",
        "tokens/pass": sum(result.stats.n_step_tokens for result in results) / max(passes, 1),
        "drafted": sum(result.stats.totals.n_drafted for result in results),
        "accepted": sum(result.stats.totals.n_accepted for result in results),
        "differences": differences,
    }
    if not differences:
        row["verdict"] = "exact"
    elif not greedy:
        row["verdict"] = "differs (sampled: no tolerance)"
    elif rounding is None:
        row["verdict"] = "differs (rounding not measured)"
    elif all(d["margin"] <= TOLERANCE * rounding for d in differences):
        row["verdict"] = "within rounding"
    else:
        row["verdict"] = "OUTSIDE rounding"
    return row


def plain_logits(target: Backend, prompt: list[int], tokens: list[int], position: int) -> torch.Tensor:
    """The logits plain generation chose tokens[position] from: the prompt's pass, then one-row
    passes over the tokens before it."""
    target.truncate(0)
    logits = target.evaluate(prompt, logits_rows=1)[0]
    for token in tokens[:position]:
        logits = target.evaluate([token])[0]
    return logits


def top2_margin(logits: torch.Tensor) -> float:
    best = torch.topk(logits.double(), 2).values
    return float(best[0] - best[1])


def rounding_error(target: Backend, prompts: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """The largest |logit difference| between a row of a verify pass (a chain, a tree, several
    sequences' rows) and the one-row pass of plain generation at the same position."""
    alone = []  # per prompt: one-row logits after each of the reference's first tokens
    for prompt, tokens in zip(prompts, reference, strict=True):
        target.truncate(0)
        target.evaluate(prompt, logits_rows=1)
        alone.append(torch.stack([target.evaluate([token])[0] for token in tokens[: max(ROUNDING_ROWS)]]))
    worst = {"chain": 0.0, "tree": 0.0, "batch": 0.0}
    for prompt, tokens, rows_alone in zip(prompts, reference, alone, strict=True):
        target.truncate(0)
        target.evaluate(prompt, logits_rows=1)
        for rows in ROUNDING_ROWS:
            if rows > len(rows_alone):
                continue
            target.truncate(len(prompt))
            chain = target.evaluate(tokens[:rows])
            target.truncate(len(prompt))
            tree = target.evaluate_tree(tokens[:rows], list(range(-1, rows - 1)))
            worst["chain"] = max(worst["chain"], largest_difference(chain, rows_alone[:rows]))
            worst["tree"] = max(worst["tree"], largest_difference(tree, rows_alone[:rows]))
    forks = [target.fork() for _ in prompts]
    for fork, prompt in zip(forks, prompts, strict=True):
        fork.evaluate(prompt, logits_rows=1)
    for rows in BATCH_ROUNDING_ROWS:
        groups = [RowGroup(fork, tokens[:rows]) for fork, tokens in zip(forks, reference, strict=True)]
        for logits, rows_alone in zip(evaluate_groups(groups), alone, strict=True):
            worst["batch"] = max(worst["batch"], largest_difference(logits, rows_alone[:rows]))
        for fork, prompt in zip(forks, prompts, strict=True):
            fork.truncate(len(prompt))
    target.truncate(0)
    return worst


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
