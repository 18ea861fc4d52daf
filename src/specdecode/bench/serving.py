"""`specdecode bench-serve`: throughput and latency of concurrent requests, per engine.

A closed loop of C clients, each sending its next request as soon as its last one is answered
(greedy, code-completion prompts from the held-out corpus), for C = 1, 2, 4, ... Systems:

- `threads`: plain generation, one thread and one fork per request, each running its own
  target passes: how a server without batching serves (the weights are read once per
  request per step);
- `batched`: plain generation through the `BatchEngine`: one target pass a step for every
  running request;
- `batched:STRATEGIES`: batched speculation with that chain (e.g. `batched:draft`,
  `batched:ngram-mod`), drafts shortened under load by the `LoadRule`;
- `batched:STRATEGIES@adaptive`: the same chain under the adaptive policy, which prices each
  draft at what its rows add to the batch's pass (its models learn across the runs at one
  concurrency, as a server's would across requests).
- `separate`, `separate:STRATEGIES`: as `batched`, over forks that keep contexts of their
  own where the backend could share one (llama.cpp: one `llama_decode` per sequence a step
  instead of one for all, see `LlamaCppBackend.forks`): what sharing a context brings.

For each concurrency, every system runs back to back, so that the ratios printed compare runs
made minutes apart at most on a machine whose load drifts. Every answer of every system is
checked against the `threads` answer to the same request (all must be plain greedy output).
Clients, engine and passes all run as threads of this process, so its own CPU time (see
`bench.machine`) is the whole cost of a run: no child process to account for.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.api import Pipeline
from specdecode.backends.gather import DraftPasses
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.bench.machine import Machine, Stopwatch, dtype_of, machine_line
from specdecode.bench.systems import ADAPTIVE
from specdecode.bench.tasks import build_tasks
from specdecode.defaults import resolve_models
from specdecode.errors import SpecdecodeError, require
from specdecode.generate import Generation, GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.scheduler import BatchEngine, Entry, LoadRule
from specdecode.strategies import DraftModelConfig

if TYPE_CHECKING:
    from rich.table import Table

GREEDY = SamplingParams(temperature=0)
BATCHED = ("batched", "separate")  # the systems that run the BatchEngine
SERVE_SYSTEMS = (
    "threads,batched,batched:draft,batched:draft@adaptive,batched:ngram-mod,batched:ngram-mod@adaptive"
)


@dataclass
class Level:
    """One system at one concurrency."""

    system: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    cpu_seconds: float  # this process's: clients, engine and torch all run in it, as threads
    latencies: list[float]
    exact: int  # answers equal to the `threads` answer to the same request
    mean_batch: float  # sequences per target pass (1 for threads)
    drafted: float = 0.0  # draft tokens a sequence's step, over all requests

    def row(self) -> dict:
        ordered = sorted(self.latencies)
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens / self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "tokens_per_cpu_second": self.tokens / self.cpu_seconds,
            "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "draft_tokens_per_step": self.drafted,
            "exact": self.exact,
            "mean_batch": self.mean_batch,
        }


def run(args: argparse.Namespace) -> None:
    """`specdecode bench-serve` (without --http): its defaults, then every system at every
    concurrency."""
    args.systems = args.systems or SERVE_SYSTEMS
    args.concurrency = args.concurrency or "1,2,4,8,16,32"
    args.prompts = 16 if args.prompts is None else args.prompts
    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    for name in systems:
        if name not in ("threads", *BATCHED) and not name.startswith(tuple(f"{b}:" for b in BATCHED)):
            raise SpecdecodeError(
                f"unknown system {name!r} (threads, batched, separate, or either :STRATEGIES)"
            )
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.requests < 1:
        raise SpecdecodeError("concurrencies and --requests must be >= 1")
    # the bench extra (rich, matplotlib for the plot): missing, said before any model loads
    console = require("rich.console", "specdecode bench-serve").Console()
    require("matplotlib", "specdecode bench-serve")
    model, draft_dir = resolve_models(args.model, args.model_draft)
    options = LoadOptions(
        device=args.device, dtype=args.dtype, threads=args.threads, n_ctx=args.ctx_size or 0
    )
    target = load_backend(model, options)
    draft = load_backend(draft_dir, options) if draft_dir is not None else None
    prompts = [target.tokenize(p) for p in build_tasks(["completion"], args.prompts)[0].prompts]
    config = GenerationConfig(n_predict=args.n_predict, ignore_eos=True)
    draft_config = DraftModelConfig(n_max=args.draft_max, p_min=args.draft_p_min)
    rule = LoadRule.timed(target.fork())
    dtypes = {"target": dtype_of(target)} | ({"draft": dtype_of(draft)} if draft is not None else {})
    machine = Machine()
    console.print(
        f"target {model}  draft {draft_dir}  device {args.device}  {args.n_predict} tokens a request"
    )
    rows: list[dict] = []
    for concurrency in levels:
        requests = [prompts[i % len(prompts)] for i in range(concurrency * args.requests)]
        reference: list[list[int]] | None = None
        for name in systems:
            # A fresh pipeline per run: what the n-gram pools learned from the same prompts at
            # another concurrency must not count here.
            pipeline = _pipeline(name, target, draft, draft_config)
            level, answers = _measure(name, pipeline, requests, concurrency, config, rule)
            if reference is None:
                reference = answers
            level.exact = sum(a == b for a, b in zip(answers, reference, strict=True))
            rows.append(level.row())
            console.print(_line(rows[-1]))
    described = machine.describe(dtypes, args.device)
    print(machine_line(described))  # plain: one line, however long
    console.print(_table(rows, systems, levels))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"machine": described, "rows": rows, "args": _jsonable(vars(args))}, indent=2)
    )
    (args.out / "serving.md").write_text(machine_line(described) + "\n\n" + markdown(rows, systems, levels))
    plot = _plot(rows, systems, args.out / "serving.png")
    console.print(f"wrote {args.out / 'results.json'}, {args.out / 'serving.md'}, {plot}")


def _pipeline(name: str, target, draft, draft_config: DraftModelConfig) -> Pipeline:
    spec = name.partition(":")[2]
    adaptive = spec.endswith(ADAPTIVE)
    spec = spec.removesuffix(ADAPTIVE)
    spec_types = [s for s in spec.replace("+", ",").split(",") if s] if spec else []
    return Pipeline(
        target,
        draft if "draft" in spec_types else None,
        spec_types=spec_types,
        draft_config=draft_config,
        spec_policy="adaptive" if adaptive else "classic",
    )


def _measure(
    name: str,
    pipeline: Pipeline,
    requests: list[list[int]],
    concurrency: int,
    config: GenerationConfig,
    rule: LoadRule,
) -> tuple[Level, list[list[int]]]:
    if name == "threads":
        return _threads(name, [pipeline.fork() for _ in range(concurrency)], requests, config)
    models = pipeline.draft is not None or pipeline.eagle3 is not None or pipeline.mtp is not None
    passes = DraftPasses() if models else None
    if name.startswith("separate"):
        seats = [pipeline.fork(passes) for _ in range(concurrency)]
    else:
        seats = pipeline.forks(concurrency, passes)
    classic = pipeline.spec_types and pipeline.policy_models is None
    models = pipeline.policy_models
    engine = BatchEngine(
        rule if classic else None,
        draft_passes=passes,
        gate=bool(pipeline.spec_types),
        costs=models.costs if models is not None else None,
    )
    return _batched(name, engine, seats, requests, config)


def _threads(
    name: str, seats: list[Pipeline], requests: list[list[int]], config: GenerationConfig
) -> tuple[Level, list[list[int]]]:
    """One thread per client, each with its own fork, generating request after request."""
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(requests)):
        todo.put(index)
    answers: list[list[int]] = [[] for _ in requests]
    latencies: list[float] = []
    lock = threading.Lock()

    def client(seat: Pipeline) -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            result = seat.generate(requests[index], GREEDY, config)
            with lock:
                latencies.append(time.perf_counter() - start)
                answers[index] = result.tokens

    began = Stopwatch()
    workers = [threading.Thread(target=client, args=(seat,)) for seat in seats]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds, cpu_seconds = began.elapsed()
    tokens = sum(len(a) for a in answers)
    return Level(name, len(seats), len(requests), tokens, seconds, cpu_seconds, latencies, 0, 1.0), answers


def _batched(
    name: str, engine: BatchEngine, seats: list[Pipeline], requests: list[list[int]], config: GenerationConfig
) -> tuple[Level, list[list[int]]]:
    """The batch engine over one seat per client; a finished request's seat takes the next."""
    passes: list[int] = []
    engine.on_pass = lambda record: passes.append(record.sequences)
    answers: list[list[int]] = [[] for _ in requests]
    began: dict[int, float] = {}
    latencies: list[float] = []
    drafted = steps = 0

    def start(seat: Pipeline, index: int) -> Generation:
        began[index] = time.perf_counter()
        return seat.stream(requests[index], GREEDY, config)

    def done(index: int, entry: Entry) -> None:
        if entry.error is not None:
            raise entry.error
        nonlocal drafted, steps
        latencies.append(time.perf_counter() - began[index])
        answers[index] = entry.generation.tokens
        drafted += entry.generation.stats.totals.n_drafted
        steps += entry.generation.stats.n_passes

    first = Stopwatch()
    engine.run(seats, len(requests), start, done)
    seconds, cpu_seconds = first.elapsed()
    tokens = sum(len(a) for a in answers)
    mean_batch = sum(passes) / len(passes) if passes else 0.0
    per_step = drafted / steps if steps else 0.0  # -n 1: the prompt's pass makes every token
    level = Level(
        name, len(seats), len(requests), tokens, seconds, cpu_seconds, latencies, 0, mean_batch, per_step
    )
    return level, answers


def _line(row: dict) -> str:
    return (
        f"C={row['concurrency']:<3d} {row['system']:<22s} {row['tokens_per_second']:8.1f} tok/s  "
        f"{row['tokens_per_cpu_second']:8.1f} tok/CPU-s  "
        f"p50 {row['p50_s']:6.2f} s  p99 {row['p99_s']:6.2f} s  batch {row['mean_batch']:5.2f}  "
        f"drafted {row['draft_tokens_per_step']:5.2f}/step  exact {row['exact']}/{row['requests']}"
    )


def _by(rows: list[dict]) -> dict[tuple[str, int], dict]:
    return {(row["system"], row["concurrency"]): row for row in rows}


def _grid(rows: list[dict], systems: list[str], levels: list[int], cell) -> list[tuple[str, list[str]]]:
    """Per system, cell(row, ratio) at each concurrency; ratio: tokens/s against the system's
    baseline (None for the first system)."""
    index = _by(rows)
    grid = []
    for position, name in enumerate(systems):
        cells = []
        for c in levels:
            row = index[(name, c)]
            base = None if position == 0 else index[(_baseline(systems, position), c)]
            cells.append(
                cell(row, None if base is None else row["tokens_per_second"] / base["tokens_per_second"])
            )
        grid.append((name, cells))
    return grid


def _baseline(systems: list[str], position: int) -> str:
    """Batched plain is what batched speculation must beat; batched plain must beat threads."""
    if systems[position].startswith("batched:") and "batched" in systems:
        return "batched"
    return systems[0]


def _table(rows: list[dict], systems: list[str], levels: list[int]) -> Table:
    from rich.table import Table

    table = Table(title="tok/s, tok/CPU-s (p50 latency s) by concurrency; x: tok/s vs its baseline")
    table.add_column("system")
    for c in levels:
        table.add_column(f"C={c}", justify="right")

    def cell(row: dict, ratio: float | None) -> str:
        text = f"{row['tokens_per_second']:.0f}, {row['tokens_per_cpu_second']:.0f} ({row['p50_s']:.2f})"
        return text if ratio is None else f"{text} {ratio:.2f}x"

    for name, cells in _grid(rows, systems, levels, cell):
        table.add_row(name, *cells)
    return table


def markdown(rows: list[dict], systems: list[str], levels: list[int]) -> str:
    def cell(row: dict, ratio: float | None) -> str:
        text = (
            f"{row['tokens_per_second']:.0f} tok/s, {row['tokens_per_cpu_second']:.0f} tok/CPU-s, "
            f"p50 {row['p50_s']:.2f} s, p99 {row['p99_s']:.2f} s"
        )
        return text if ratio is None else f"{text}, **{ratio:.2f}x**"

    lines = ["| system | " + " | ".join(f"C={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in _grid(rows, systems, levels, cell)]
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], systems: list[str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in systems:
        mine = sorted((r for r in rows if r["system"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [r["tokens_per_second"] for r in mine], marker="o", label=name)
        right.plot(xs, [r["p50_s"] for r in mine], marker="o", label=name)
    for axis, label in ((left, "tokens/s"), (right, "p50 latency (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _jsonable(values: dict) -> dict:
    return {
        key: str(value) if isinstance(value, Path) else value
        for key, value in values.items()
        if key != "handler"
    }
