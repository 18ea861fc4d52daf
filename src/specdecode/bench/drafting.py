"""`specdecode bench-draft`: how long the model-free strategies take to draft at a long history.

No model runs. A synthetic history (random tokens with copied spans, so that every strategy
finds matches) of --history tokens is given to begin(); then each call drafts, a simulated
verifier keeps up to 3 draft tokens, and one fresh token is appended, as in generation.
The per-call time must stay flat as the history grows: drafting costs O(new tokens). The
first call after begin() is shown apart: some strategies (ngram-cache, as in llama.cpp) index
the whole prompt then, a one-off cost like evaluating the prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specdecode.sampling import SamplingParams
from specdecode.strategies import AVAILABLE, NgramSettings, SharedState, SpecSetup, build_strategies


def synthetic_history(length: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """Random tokens where every other block of 256 repeats an earlier block."""
    tokens = rng.integers(0, vocab, size=length)
    for start in range(512, length - 256, 512):
        source = int(rng.integers(0, start - 256))
        tokens[start : start + 256] = tokens[source : source + 256]
    return tokens.tolist()


def time_strategy(name: str, history: list[int], calls: int, rng: np.random.Generator) -> list[float]:
    """Seconds per draft call over `calls` steps after begin(history)."""
    shared = SharedState(NgramSettings(), [name])
    (strategy,) = build_strategies([name], SpecSetup(target=None, sampling=SamplingParams(), shared=shared))
    history = list(history)
    strategy.begin(history)
    timings = []
    for _ in range(calls):
        last = int(rng.integers(0, 4096))
        start = time.perf_counter()
        draft = strategy.draft(history, last, 16)
        timings.append(time.perf_counter() - start)
        kept = min(len(draft.tokens), 3)
        if kept:
            strategy.accept(kept)
        history.extend([last, *draft.tokens[:kept]])
    return timings


def run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    history = synthetic_history(args.history, args.vocab, rng)
    names = [name for name in AVAILABLE if name.startswith("ngram-")]
    print(f"history {args.history} tokens, {args.calls} draft calls per strategy")
    print(f"{'strategy':>14} | {'mean ms':>8} | {'p99 ms':>8} | {'max ms':>8} | {'first call ms':>13}")
    for name in names:
        first, *rest = time_strategy(name, history, args.calls + 1, rng)
        timings = sorted(rest)
        p99 = timings[min(len(timings) - 1, int(0.99 * len(timings)))]
        mean = statistics.fmean(timings)
        worst = timings[-1]
        print(f"{name:>14} | {1e3 * mean:8.4f} | {1e3 * p99:8.4f} | {1e3 * worst:8.4f} | {1e3 * first:13.3f}")
