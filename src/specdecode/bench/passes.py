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
from typing import TYPE_CHECKING

from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.bench.machine import Machine, Stopwatch, dtype_of, machine_line
from specdecode.bench.report import stdout_console
from specdecode.defaults import resolve_models
from specdecode.errors import require

if TYPE_CHECKING:
    from rich.table import Table

ROWS = (1, 2, 3, 5, 9, 17)
PROMPT = (
    "import os\n\n\ndef read_lines(path):\n    with open(path) as handle:\n        return handle.read()\n" * 4
)


def pass_times(
    backend: HFBackend, rows: tuple[int, ...], reps: int, tree: bool = False
) -> dict[int, tuple[float, float]]:
    """Median wall-clock and median CPU seconds to evaluate T rows after the prompt, for each T
    in `rows`: a chain of T tokens, or (tree) a tree pass of T nodes, three children a node."""
    prompt = backend.tokenize(PROMPT)
    backend.truncate(0)
    backend.evaluate(prompt)
    cached = len(backend.tokens)
    times = {}
    for n in rows:
        parents = [-1, *((i - 1) // 3 for i in range(1, n))]
        samples = []
        for _ in range(reps + 2):  # two warm-up passes
            began = Stopwatch()
            if tree:
                backend.evaluate_tree(prompt[:n], parents)
            else:
                backend.evaluate(prompt[:n])
            samples.append(began.elapsed())
            backend.truncate(cached)
        walls, cpus = zip(*samples[2:], strict=True)
        times[n] = statistics.median(walls), statistics.median(cpus)
    return times


def run(args: argparse.Namespace) -> dict:
    """Time every configuration, print the tables and return what they show: the machine and,
    per model, backend, dtype and kind (chain or tree), each row count's times."""
    require("rich.console", "specdecode bench-passes")  # the bench extra: before any model loads
    target_dir, draft_dir = resolve_models(args.model, args.model_draft)
    configurations = [
        LoadOptions(dtype="float32", threads=args.threads, backend="hf"),
        LoadOptions(dtype="float32", threads=args.threads, backend=args.backend),
        LoadOptions(dtype=args.dtype, threads=args.threads, backend=args.backend),
    ]
    machine = Machine()
    measured: list[dict] = []
    dtypes: dict[str, str] = {}
    for label, directory in (("target", target_dir), ("draft", draft_dir)):
        if directory is None:
            continue
        seen = set()
        for options in configurations:
            backend = load_backend(directory, options)
            dtype = dtype_of(backend)
            if (type(backend), dtype) in seen:
                continue
            seen.add((type(backend), dtype))
            name = "native" if isinstance(backend, NativeBackend) else "hf"
            ran = dtypes.get(f"{label} {name}")
            dtypes[f"{label} {name}"] = dtype if ran is None else f"{ran}/{dtype}"
            chains = pass_times(backend, ROWS, args.reps)
            measured.append(_row(label, name, dtype, "chain", chains, chains[1][0]))
            if label == "target":
                trees = pass_times(backend, ROWS, args.reps, tree=True)
                measured.append(_row(label, name, dtype, "tree", trees, chains[1][0]))
    results = {"machine": machine.describe(dtypes), "rows": measured}
    print(machine_line(results["machine"]))  # plain: one line, however long
    console = stdout_console()
    for table in _tables(measured, args.threads):
        console.print(table)
    return results


def _row(label: str, backend: str, dtype: str, kind: str, times: dict, one_row: float) -> dict:
    """One configuration's figures; `one_row`: the wall seconds of its one-row chain pass."""
    passes = [
        {
            "rows": n,
            "ms": 1e3 * wall,
            "cpu_ms": 1e3 * cpu,
            "vs_one_row": wall / one_row,
            "tokens_per_second": n / wall,
            "tokens_per_cpu_second": n / cpu,
        }
        for n, (wall, cpu) in times.items()
    ]
    return {"model": label, "backend": backend, "dtype": dtype, "kind": kind, "passes": passes}


def _tables(measured: list[dict], threads: int) -> list[Table]:
    """The pass times (× the one-row pass), then the same as tokens per second and per CPU-second."""
    from rich.table import Table

    titles = (
        f"ms per forward pass of T rows or tree nodes, {threads} thread(s) (× the one-row pass)",
        "tok/s, tok/CPU-s: T over the pass's median wall-clock, CPU seconds",
    )
    cells = (
        lambda p: f"{p['ms']:.1f} ({p['vs_one_row']:.2f})",
        lambda p: f"{p['tokens_per_second']:.0f}, {p['tokens_per_cpu_second']:.0f}",
    )
    tables = []
    for title, cell in zip(titles, cells, strict=True):
        table = Table(title=title)
        for column in ("model", "backend", "dtype"):
            table.add_column(column)
        for n in ROWS:
            table.add_column(f"T={n}", justify="right")
        for row in measured:
            backend = row["backend"] + (" tree" if row["kind"] == "tree" else "")
            table.add_row(row["model"], backend, row["dtype"], *(cell(p) for p in row["passes"]))
        tables.append(table)
    return tables
