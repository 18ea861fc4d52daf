"""`specdecode eval`: how good a trained target/draft pair is on the held-out split.

Two numbers matter for a speculative pair: each model's perplexity on code it never saw
(is it a language model of Python at all?) and how often the target keeps the draft's
tokens on real completion prompts (does the draft make generation faster?). Both are
measured on the held-out files of `specdecode.train.corpus`, so they are never inflated by
text the models were trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specdecode.api import Pipeline
from specdecode.backends.hf import HFBackend
from specdecode.defaults import resolve_models
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import DraftModelConfig
from specdecode.train.corpus import corpus_files, encode_files, split_files, stdlib_root

CONTEXT_LINES = 4  # a prompt's file must have at least this many lines after the prompt


def perplexity(backend: HFBackend, tokens: np.ndarray, window: int = 512, max_tokens: int = 65536) -> float:
    """exp(mean NLL) of the first `max_tokens` tokens, in non-overlapping windows of `window`.

    Each window is one plain forward pass (no KV cache); its first token is context only, so
    a stream of T tokens in W windows predicts T - W of them.
    """
    if not 2 <= window <= backend.n_ctx:
        raise SpecdecodeError(f"window must be in [2, {backend.n_ctx}] (the model's context), not {window}")
    stream = np.asarray(tokens)[:max_tokens]
    if len(stream) < 2:
        raise SpecdecodeError("perplexity needs at least 2 tokens")
    total_nll, predicted = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, window):
            ids = torch.as_tensor(stream[start : start + window], dtype=torch.long, device=backend.device)
            logits = backend.model(input_ids=ids[None]).logits[0, :-1].double()
            nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
            total_nll += float(nll)
            predicted += len(ids) - 1
    return math.exp(total_nll / predicted)


def heldout_prompts(
    files: Sequence[Path], n_prompts: int = 16, prompt_lines: int = 12, seed: int = 0
) -> list[str]:
    """Up to `n_prompts` completion prompts of exactly `prompt_lines` lines, one per file.

    Files (sorted, then shuffled by `seed`) shorter than prompt_lines + 4 lines are skipped.
    A prompt starts at a `def` line chosen by `seed` among those with room for the prompt and
    4 more lines, or at the file's first line if there is none: a function header and the
    start of its body, the case where completion matters. A prompt ends with its last line's
    text, not with a newline: byte-level BPE merges a newline with the next line's indentation,
    so a prompt cut after the newline would end on a token boundary never seen in training.
    """
    if n_prompts < 1 or prompt_lines < 1:
        raise SpecdecodeError("n_prompts and prompt_lines must be >= 1")
    rng = random.Random(seed)
    ordered = sorted(files, key=str)
    rng.shuffle(ordered)
    prompts: list[str] = []
    for path in ordered:
        lines = read_text_file(path).split("\n")
        last_start = len(lines) - prompt_lines - CONTEXT_LINES
        if last_start < 0:
            continue
        starts = [i for i, line in enumerate(lines[: last_start + 1]) if line.lstrip().startswith("def ")]
        start = rng.choice(starts) if starts else 0
        prompts.append("\n".join(lines[start : start + prompt_lines]).rstrip())
        if len(prompts) == n_prompts:
            break
    if not prompts:
        raise SpecdecodeError(f"no held-out file has the {prompt_lines + CONTEXT_LINES} lines a prompt needs")
    return prompts


def acceptance(pipeline: Pipeline, prompts: Sequence[str], n_predict: int = 64) -> dict:
    """Greedy generation of every prompt; drafted/accepted tokens and target passes summed.

    A pipeline without a speculative strategy has no acceptance to measure: SpecdecodeError.
    """
    if not pipeline.spec_types:
        raise SpecdecodeError("eval needs a draft model for acceptance")
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict, ignore_eos=False)
    drafted = accepted = passes = step_tokens = generated = 0
    seconds = 0.0
    for prompt in prompts:
        stats = pipeline.generate(prompt, sampling, config).stats
        drafted += stats.totals.n_drafted
        accepted += stats.totals.n_accepted
        passes += stats.n_passes
        step_tokens += stats.n_step_tokens
        generated += stats.n_generated
        seconds += stats.t_generation
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_pass": step_tokens / passes if passes else 0.0,
        "prompts": len(prompts),
        "generated": generated,
        "tokens_per_second": generated / seconds if seconds > 0 else 0.0,
    }


def run_eval(args: argparse.Namespace) -> None:
    args.model, args.model_draft = resolve_models(args.model, args.model_draft)
    target = HFBackend.load(args.model)
    draft = HFBackend.load(args.model_draft) if args.model_draft is not None else None
    config = DraftModelConfig(args.draft_max, p_min=args.draft_p_min)
    pipeline = Pipeline(target, draft, draft_config=config)  # refuses a draft of another vocabulary
    root = args.corpus or stdlib_root()
    heldout = split_files(corpus_files(root), root)[1]
    if not heldout:
        raise SpecdecodeError(f"the corpus under {root} has no held-out files")
    tokens = encode_files(target.tokenizer, heldout)
    results: dict = {"heldout_files": len(heldout), "heldout_tokens": len(tokens)}
    results["scored_tokens"] = min(len(tokens), args.max_tokens)
    print(f"held-out: {len(heldout)} files, {len(tokens)} tokens, {results['scored_tokens']} scored")
    for role, backend in (("target", target), ("draft", draft)):
        if backend is not None:
            results[f"perplexity_{role}"] = perplexity(backend, tokens, args.window, args.max_tokens)
            print(f"perplexity {role} ({backend.name}): {results[f'perplexity_{role}']:.3f}")
    if draft is not None:
        prompts = heldout_prompts(heldout, args.prompts)
        results["acceptance"] = numbers = acceptance(pipeline, prompts, args.n_predict)
        print(
            f"acceptance: {100 * numbers['acceptance_rate']:.1f}% over {numbers['prompts']} prompts, "
            f"{numbers['tokens_per_pass']:.2f} tokens per target pass"
        )
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise SpecdecodeError(f"cannot write {args.json}: {exc}") from None
