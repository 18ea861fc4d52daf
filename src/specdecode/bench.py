"""`specdecode bench`: plain vs speculative generation on the same prompts, in one run.

Runs alternate (plain, speculative, plain, ...) after uncounted warm-up runs, so drift of a
noisy machine hits both sides alike. Generation lengths are fixed (end-of-generation tokens
are ignored) so both sides do the same work. Reported: generation tokens/s (median and
range), the speed-up ratio, acceptance, tokens per target pass, and whether the outputs are
identical (they must be, for greedy or `match` sampling with a fixed seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdecode.api import Pipeline, Result
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams

DEFAULT_PROMPTS = (
    'import os\nimport sys\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)


@dataclass
class PromptResult:
    prompt: str
    plain_tps: list[float] = field(default_factory=list)
    spec_tps: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    tokens_per_pass: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return statistics.median(self.spec_tps) / statistics.median(self.plain_tps)

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "plain_tokens_per_second": self.plain_tps,
            "spec_tokens_per_second": self.spec_tps,
            "speedup": self.speedup,
            "acceptance_rate": statistics.median(self.acceptance),
            "tokens_per_pass": statistics.median(self.tokens_per_pass),
            "identical": all(self.identical),
        }


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p", "--prompt", action="append", help="a prompt (repeatable; default: built-in code prompts)"
    )
    parser.add_argument("-f", "--file", action="append", help="a file whose text is one prompt (repeatable)")
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="tokens generated per run (64)")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per prompt and system (3)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="uncounted runs per prompt and system first (1)"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")


def bench_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    prompts.extend(read_text_file(name, "prompt file") for name in args.file or [])
    return prompts or list(DEFAULT_PROMPTS)


def run(args: argparse.Namespace, pipeline: Pipeline, sampling: SamplingParams) -> list[PromptResult]:
    if not pipeline.spec_types:
        raise SpecdecodeError("bench compares plain and speculative generation: give -md DIR or --spec-type")
    if args.runs < 1 or args.warmup < 0:
        raise SpecdecodeError("--runs must be >= 1 and --warmup >= 0")
    plain = Pipeline(pipeline.target)
    sampling = replace(sampling, seed=sampling.seed if sampling.seed is not None else 0)
    config = GenerationConfig(n_predict=args.n_predict, verify=args.verify, ignore_eos=True)
    results = []
    prompts = bench_prompts(args)
    for index, prompt in enumerate(prompts):
        result = PromptResult(prompt)
        for _ in range(args.warmup):
            plain.generate(prompt, sampling, config)
            pipeline.generate(prompt, sampling, config)
        for _ in range(args.runs):
            _record(
                result, plain.generate(prompt, sampling, config), pipeline.generate(prompt, sampling, config)
            )
        print(f"prompt {index + 1}/{len(prompts)}: {result.speedup:.2f}x", file=sys.stderr)
        results.append(result)
    print(format_table(results, pipeline.spec_types))
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in results], indent=2))
    return results


def _record(result: PromptResult, plain: Result, spec: Result) -> None:
    result.plain_tps.append(plain.stats.tokens_per_second)
    result.spec_tps.append(spec.stats.tokens_per_second)
    result.acceptance.append(spec.stats.totals.acceptance_rate)
    result.tokens_per_pass.append(spec.stats.tokens_per_pass)
    result.identical.append(plain.tokens == spec.tokens)


def format_table(results: list[PromptResult], spec_types: list[str]) -> str:
    header = (
        f"{'prompt':>6} | {'plain tok/s (min-max)':>22} | {'spec tok/s (min-max)':>22} | {'speed-up':>8} | "
        f"{'accept':>6} | {'tok/pass':>8} | identical"
    )
    lines = [f"speculation: {','.join(spec_types)}", header, "-" * len(header)]
    for i, r in enumerate(results, 1):
        lines.append(
            f"{i:>6} | {_spread(r.plain_tps):>22} | {_spread(r.spec_tps):>22} | {r.speedup:>7.2f}x | "
            f"{statistics.median(r.acceptance):>6.2f} | {statistics.median(r.tokens_per_pass):>8.2f} | "
            f"{'yes' if all(r.identical) else 'NO'}"
        )
    overall = statistics.median([r.speedup for r in results])
    lines.append(f"median speed-up over {len(results)} prompts: {overall:.2f}x")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
