"""`specdecode bench-draft`: how long the model-free strategies take to draft at a long history.

No model runs. A synthetic history (random tokens with copied spans, so that every strategy
finds matches) of --history tokens is given to begin(); then each call drafts, a simulated
verifier keeps up to 3 draft tokens, and one fresh token is appended, as in generation.
The per-call time must stay flat as the history grows: drafting costs O(new tokens). The
first call after begin() is shown apart: some strategies (ngram-cache, as in llama.cpp) index
the whole prompt then, a one-off cost like evaluating the prompt. Beside each mean wall-clock
time, the mean CPU time of this process in a call, which a busy machine's other processes
disturb less (see `bench.machine`).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from specdecode.bench.machine import Machine, Stopwatch, machine_line
from specdecode.sampling import SamplingParams
from specdecode.strategies import AVAILABLE, NgramSettings, SharedState, SpecSetup, build_strategies


def synthetic_history(length: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """Random tokens where every other block of 256 repeats an earlier block."""
    tokens = rng.integers(0, vocab, size=length)
    for start in range(512, length - 256, 512):
        source = int(rng.integers(0, start - 256))
        tokens[start : start + 256] = tokens[source : source + 256]
    return tokens.tolist()


def time_strategy(
    name: str, history: list[int], calls: int, rng: np.random.Generator
) -> list[tuple[float, float]]:
    """Wall-clock and CPU seconds of each draft call over `calls` steps after begin(history)."""
    shared = SharedState(NgramSettings(), [name])
    (strategy,) = build_strategies([name], SpecSetup(target=None, sampling=SamplingParams(), shared=shared))
    history = list(history)
    strategy.begin(history)
    timings = []
    for _ in range(calls):
        last = int(rng.integers(0, 4096))
        began = Stopwatch()
        draft = strategy.draft(history, last, 16)
        timings.append(began.elapsed())
        kept = min(len(draft.tokens), 3)
        if kept:
            strategy.accept(kept)
        history.extend([last, *draft.tokens[:kept]])
    return timings


def run(args: argparse.Namespace) -> dict:
    """Time every model-free strategy, print a line each and return the machine and the figures."""
    rng = np.random.default_rng(args.seed)
    history = synthetic_history(args.history, args.vocab, rng)
    names = [name for name in AVAILABLE if name.startswith("ngram-")]
    machine = Machine()
    rows = [_row(name, *time_strategy(name, history, args.calls + 1, rng)) for name in names]
    results = {"machine": machine.describe({}), "rows": rows}
    print(machine_line(results["machine"]))
    print(f"history {args.history} tokens, {args.calls} draft calls per strategy")
    print(
        f"{'strategy':>14} | {'mean ms':>8} | {'CPU ms':>8} | {'p99 ms':>8} | {'max ms':>8} | "
        f"{'first call ms':>13}"
    )
    for row in rows:
        print(
            f"{row['strategy']:>14} | {row['mean_ms']:8.4f} | {row['mean_cpu_ms']:8.4f} | "
            f"{row['p99_ms']:8.4f} | {row['max_ms']:8.4f} | {row['first_call_ms']:13.3f}"
        )
    return results


def _row(name: str, first: tuple[float, float], *rest: tuple[float, float]) -> dict:
    """A strategy's figures: the first call apart, then the mean, p99 and worst of the others."""
    walls = sorted(wall for wall, _ in rest)
    return {
        "strategy": name,
        "calls": len(rest),
        "mean_ms": 1e3 * statistics.fmean(walls),
        "mean_cpu_ms": 1e3 * statistics.fmean(cpu for _, cpu in rest),
        "p99_ms": 1e3 * walls[min(len(walls) - 1, int(0.99 * len(walls)))],
        "max_ms": 1e3 * walls[-1],
        "first_call_ms": 1e3 * first[0],
        "first_call_cpu_ms": 1e3 * first[1],
    }
