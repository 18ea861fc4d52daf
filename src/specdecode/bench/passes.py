"""`specdecode bench-passes`: what a forward pass of T rows costs, per backend and dtype.

Speculative decoding pays off as far as a verify pass of k+1 rows costs little more than a
one-row pass, and a draft step little next to a target step. Both are properties of the
machine, the kernels and the forward, not of the models' quality, so this measures them
directly: after a prompt, the median time to evaluate T rows (then roll them back), for the
target and the draft, through transformers' forward in float32, through the backend
`--backend` chooses in float32, and through that backend in `--dtype` (by default: the native
forward, in bfloat16 where the CPU has native bf16 arithmetic). For the target, the same
backends also score token trees of T nodes in one tree pass (rows marked "tree"): a root
and its descendants, three children a node, which is what a verify pass of a tree costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.defaults import resolve_models

ROWS = (1, 2, 3, 5, 9, 17)
PROMPT = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as handle:\n        return handle.read()\n" * 4
)


def pass_times(backend: HFBackend, rows: tuple[int, ...], reps: int, tree: bool = False) -> dict[int, float]:
    """Median seconds to evaluate T rows after the prompt, for each T in `rows`: a chain of T
    tokens, or (tree) a tree pass of T nodes, three children a node."""
    prompt = backend.tokenize(PROMPT)
    backend.truncate(0)
    backend.evaluate(prompt)
    cached = len(backend.tokens)
    times = {}
    for n in rows:
        parents = [-1, *((i - 1) // 3 for i in range(1, n))]
        samples = []
        for _ in range(reps + 2):  # two warm-up passes
            start = time.perf_counter()
            if tree:
                backend.evaluate_tree(prompt[:n], parents)
            else:
                backend.evaluate(prompt[:n])
            samples.append(time.perf_counter() - start)
            backend.truncate(cached)
        times[n] = statistics.median(samples[2:])
    return times


def run(args: argparse.Namespace) -> None:
    from rich.console import Console  # the bench extra: before any model loads
    from rich.table import Table

    target_dir, draft_dir = resolve_models(args.model, args.model_draft)
    configurations = [
        LoadOptions(dtype="float32", threads=args.threads, backend="hf"),
        LoadOptions(dtype="float32", threads=args.threads, backend=args.backend),
        LoadOptions(dtype=args.dtype, threads=args.threads, backend=args.backend),
    ]
    table = Table(
        title=f"ms per forward pass of T rows or tree nodes, {args.threads} thread(s) (× the one-row pass)"
    )
    for column in ("model", "backend", "dtype"):
        table.add_column(column)
    for n in ROWS:
        table.add_column(f"T={n}", justify="right")
    for label, directory in (("target", target_dir), ("draft", draft_dir)):
        if directory is None:
            continue
        seen = set()
        for options in configurations:
            backend = load_backend(directory, options)
            if (type(backend), backend.model.dtype) in seen:
                continue
            seen.add((type(backend), backend.model.dtype))
            name = "native" if isinstance(backend, NativeBackend) else "hf"
            dtype = str(backend.model.dtype).removeprefix("torch.")
            times = pass_times(backend, ROWS, args.reps)
            table.add_row(
                label, name, dtype, *(f"{1e3 * times[n]:.1f} ({times[n] / times[1]:.2f})" for n in ROWS)
            )
            if label == "target":
                trees = pass_times(backend, ROWS, args.reps, tree=True)
                cells = [f"{1e3 * trees[n]:.1f} ({trees[n] / times[1]:.2f})" for n in ROWS]
                table.add_row(label, f"{name} tree", dtype, *cells)
    Console(width=120).print(table)
