"""`specdecode bench-draft`: how long the model-free strategies take to draft at a long history.

No model runs. A synthetic history (random tokens with copied spans, so that every strategy
finds matches) of --history tokens is given to begin(); then each call drafts, a simulated
verifier keeps up to 3 draft tokens, and one fresh token is appended, as in generation.
The per-call time must stay flat as the history grows: drafting costs O(new tokens). The
first call after begin() is shown apart: some strategies (ngram-cache, as in llama.cpp) index
the whole prompt then, a one-off cost like evaluating the prompt. Beside each mean wall-clock
time, the mean CPU time of this process in a call, which a busy machine's other processes
disturb less (see `bench.machine`).

The suffix strategy is timed again against process-wide stores of --suffix-store tokens (earlier
requests: a synthetic corpus in requests of 2048 tokens). There the generated text walks through
the corpus, so that every lookup finds occurrences there, and the simulated verifier keeps the
draft's tokens (up to 3) that equal the corpus's next ones.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from specdecode.bench.machine import Machine, Stopwatch, machine_line
from specdecode.config import SuffixConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import AVAILABLE, NgramSettings, SharedState, SpecSetup, build_strategies
from specdecode.strategies.suffix import BYTES_PER_TOKEN, SuffixStore

STORE_REQUEST = 2048  # tokens per synthetic request in a suffix store


def synthetic_history(length: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """Random tokens where every other block of 256 repeats an earlier block."""
    tokens = rng.integers(0, vocab, size=length)
    for start in range(512, length - 256, 512):
        source = int(rng.integers(0, start - 256))
        tokens[start : start + 256] = tokens[source : source + 256]
    return tokens.tolist()


def time_strategy(
    name: str,
    history: list[int],
    calls: int,
    rng: np.random.Generator,
    store: SuffixStore | None = None,
    text: list[int] | None = None,
) -> list[tuple[float, float]]:
    """Wall-clock and CPU seconds of each draft call over `calls` steps after begin(history).

    store: the suffix strategy's process-wide store. text: the tokens generated, in order (the
    verifier keeps draft tokens that equal its next ones); None: random tokens, the verifier
    keeping up to 3 of each draft."""
    shared = SharedState(NgramSettings(), [name])
    if store is not None:
        shared.suffix = store
    (strategy,) = build_strategies([name], SpecSetup(target=None, sampling=SamplingParams(), shared=shared))
    history = list(history)
    strategy.begin(history)
    timings = []
    position = 0
    for _ in range(calls):
        last = int(rng.integers(0, 4096)) if text is None else text[position]
        began = Stopwatch()
        draft = strategy.draft(history, last, 16)
        timings.append(began.elapsed())
        tokens = draft.first_branch().tokens[:3]
        if text is None:
            kept = tokens
        else:
            kept = _prefix_in(tokens, text[position + 1 : position + 1 + len(tokens)])
            position += 1 + len(kept)
        if kept:
            strategy.accept(len(kept))
        history.extend([last, *kept])
    return timings


def _prefix_in(tokens: list[int], following: list[int]) -> list[int]:
    """The leading tokens that equal `following`'s."""
    for i, (token, expected) in enumerate(zip(tokens, following, strict=False)):
        if token != expected:
            return tokens[:i]
    return tokens[: len(following)]


def suffix_store(tokens: int, vocab: int, rng: np.random.Generator) -> tuple[SuffixStore, list[int]]:
    """A store holding `tokens` of synthetic earlier requests, and their corpus."""
    corpus = synthetic_history(tokens, vocab, rng)
    store = SuffixStore(SuffixConfig(cache_mb=1 + tokens * BYTES_PER_TOKEN / 2**20))
    store.learn_many([corpus[i : i + STORE_REQUEST] for i in range(0, tokens, STORE_REQUEST)])
    return store, corpus


def run(args: argparse.Namespace) -> dict:
    """Time every model-free strategy, print a line each and return the machine and the figures."""
    rng = np.random.default_rng(args.seed)
    history = synthetic_history(args.history, args.vocab, rng)
    names = [name for name in AVAILABLE if name.startswith("ngram-") or name == "suffix"]
    machine = Machine()
    rows = [_row(name, *time_strategy(name, history, args.calls + 1, rng)) for name in names]
    for tokens in args.suffix_store:
        store, corpus = suffix_store(tokens, args.vocab, rng)
        start = int(rng.integers(0, tokens))  # the corpus from there on, again as needed:
        text = (corpus[start:] + corpus[:start]) * (1 + 4 * (args.calls + 1) // tokens)  # <= 4 a call
        timings = time_strategy("suffix", history, args.calls + 1, rng, store, text)
        row = _row(f"suffix@{tokens}", *timings)
        rows.append({**row, "store_tokens": store.n_tokens, "store_mb": store.nbytes / 2**20})
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
            + (
                f" | store {row['store_tokens']} tokens, {row['store_mb']:.1f} MB"
                if "store_mb" in row
                else ""
            )
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
