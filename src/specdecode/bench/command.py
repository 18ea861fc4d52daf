"""`specdecode bench`: every strategy against plain generation and against Hugging Face, in one run.

specdecode bench --quick              # the bundled pair, 1 prompt per task, under 2 minutes
specdecode bench --out bench-results  # the full suite: 3 prompts per task, 128 tokens, 3 runs
specdecode bench -m TARGET -md DRAFT --systems plain,draft,hf-plain,hf-assisted
specdecode bench -m TARGET -md DRAFT -me HEAD --systems plain,draft,eagle3 --tasks completion
specdecode bench --systems plain,draft,draft@adaptive   # a system's adaptive policy
specdecode bench --systems plain,draft,draft@adaptive --static-grid 0.3,0.5,0.75:4,8,16
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.backends.load import load_backend
from specdecode.bench.metrics import summarize
from specdecode.bench.report import (
    policy_lines,
    policy_summary,
    print_tables,
    static_comparison,
    static_lines,
    sweep_lines,
    write_outputs,
)
from specdecode.bench.suite import Measurement, rounds, run_suite
from specdecode.bench.systems import System, build_systems, draft_max_systems, static_grid, system_names
from specdecode.bench.tasks import TASK_NAMES, Task, build_tasks, custom_task
from specdecode.defaults import resolve_eagle3, resolve_models
from specdecode.errors import SpecdecodeError, read_text_file, require
from specdecode.generate import check_room
from specdecode.strategies import DraftModelConfig, NgramSettings
from specdecode.strategies.eagle3_checkpoint import load_head
from specdecode.strategies.eagle3_head import Eagle3Head

if TYPE_CHECKING:
    from rich.console import Console

# (prompts per task, tokens per run, measured runs, warm-up rounds, --draft-max sweep)
MODES = {
    "quick": (1, 32, 1, 1, (2, 8)),
    "full": (3, 128, 3, 1, (1, 2, 4, 8, 16)),
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` with its own flags; the caller adds the model and n-gram flags it shares
    with `generate`, and the handler."""
    parser = subparsers.add_parser(
        "bench",
        help="every strategy vs plain generation and vs Hugging Face generate, interleaved, in one run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("benchmark")
    group.add_argument("--quick", action="store_true", help="1 prompt per task, 32 tokens, 1 run")
    group.add_argument("--tasks", default=",".join(TASK_NAMES), help="comma-separated tasks")
    group.add_argument(
        "--systems",
        help="comma-separated systems, a chain's strategies joined by + (ngram-simple+draft), "
        "@adaptive after a chain for the adaptive policy (draft@adaptive); default: all that the "
        "models allow, with the classic policy",
    )
    group.add_argument("--no-hf", action="store_true", help="leave Hugging Face's generate out")
    group.add_argument("-p", "--prompt", action="append", help="your own prompt (repeatable): a custom task")
    group.add_argument("-f", "--file", action="append", help="a file whose text is one custom prompt")
    group.add_argument("--prompts-per-task", type=int, help="prompts per task (quick 1, full 3)")
    group.add_argument("-n", "--n-predict", type=int, help="tokens generated per run (quick 32, full 128)")
    group.add_argument("--runs", type=int, help="measured runs per prompt and system (quick 1, full 3)")
    group.add_argument("--warmup", type=int, help="uncounted rounds per prompt first (1)")
    group.add_argument("--draft-max", type=int, default=16, help="max draft tokens")
    group.add_argument("--draft-min", type=int, default=0, help="drop drafts shorter than this")
    group.add_argument("--draft-p-min", type=float, default=0.75, help="draft confidence to keep drafting")
    group.add_argument(
        "--draft-n-parallel", type=int, default=4, help="draft-tree systems: most branches (4)"
    )
    group.add_argument(
        "--draft-p-split", type=float, default=0.1, help="draft-tree systems: probability that opens a branch"
    )
    group.add_argument(
        "--draft-tree-tokens", type=int, default=8, help="eagle3-tree systems: nodes per dynamic tree (8)"
    )
    group.add_argument(
        "--draft-tree-topk", type=int, default=4, help="eagle3-tree systems: nodes expanded per depth (4)"
    )
    group.add_argument(
        "--sweep",
        help="comma-separated --draft-max values for the sweep (quick 2,8; full 1,2,4,8,16; 0: none)",
    )
    group.add_argument(
        "--static-grid",
        metavar="P,...:N,...",
        help="also run every classic system that drafts with a model at each --draft-p-min P x "
        "--draft-max N (as NAME@P/N), and report each adaptive system against the best of them",
    )
    group.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="directory for JSON, Markdown, PNG"
    )
    group.add_argument("--no-plots", action="store_true", help="write no PNG files")
    return parser


def settings(args: argparse.Namespace) -> dict:
    """The run's sizes: the mode's defaults, overridden by explicit flags."""
    per_task, n_predict, runs, warmup, sweep = MODES["quick" if args.quick else "full"]
    chosen = {
        "mode": "quick" if args.quick else "full",
        "prompts_per_task": args.prompts_per_task or per_task,
        "n_predict": args.n_predict or n_predict,
        "runs": args.runs or runs,
        "warmup": warmup if args.warmup is None else args.warmup,
        "sweep": sweep if args.sweep is None else _int_list(args.sweep),
    }
    if chosen["n_predict"] < 1:
        raise SpecdecodeError("-n must be >= 1")
    return chosen


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SpecdecodeError(f"--sweep takes comma-separated integers, not {text!r}") from None
    if any(v < 0 for v in values):
        raise SpecdecodeError("--sweep values must be >= 1 (or 0 for no sweep)")
    return tuple(v for v in values if v > 0)


def grid_values(text: str | None) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """--static-grid "0.3,0.5:4,8" -> ((0.3, 0.5), (4, 8)); empty without the flag."""
    if text is None:
        return (), ()
    p_text, colon, n_text = text.partition(":")
    try:
        p_mins = tuple(float(v) for v in p_text.split(",") if v.strip())
        draft_maxes = tuple(int(v) for v in n_text.split(",") if v.strip())
    except ValueError:
        p_mins = draft_maxes = ()
    if not colon or not p_mins or not draft_maxes:
        raise SpecdecodeError(f"--static-grid takes P,...:N,... (e.g. 0.3,0.75:4,16), not {text!r}")
    return p_mins, draft_maxes


def bench_tasks(args: argparse.Namespace, per_task: int) -> list[Task]:
    prompts = list(args.prompt or []) + [read_text_file(name, "prompt file") for name in args.file or []]
    if prompts:
        return [custom_task(prompts)]
    return build_tasks([name.strip() for name in args.tasks.split(",") if name.strip()], per_task)


def load_models(
    args: argparse.Namespace, target_options: LoadOptions, draft_options: LoadOptions
) -> tuple[HFBackend, HFBackend | None, Eagle3Head | None]:
    """Target, draft and EAGLE-3 head (-me, or the bundled head with the bundled target)."""
    head = resolve_eagle3(args.model, args.model_eagle3)
    model, draft = resolve_models(args.model, args.model_draft)
    target = load_backend(model, target_options)
    draft_backend = load_backend(draft, draft_options) if draft is not None else None
    return target, draft_backend, load_head(head, target) if head is not None else None


def run_bench(
    args: argparse.Namespace,
    draft_config: DraftModelConfig,
    ngram: NgramSettings,
    target_options: LoadOptions,
    draft_options: LoadOptions,
) -> None:
    """The suite; the drafting and n-gram settings and loading options come from the flags,
    read as generate reads them (the tree systems' defaults are bench's own)."""
    chosen = settings(args)
    tasks = bench_tasks(args, chosen["prompts_per_task"])
    # the bench extra (rich, and matplotlib for the plots): missing, said before any model loads
    console = require("rich.console", "specdecode bench").Console(stderr=True)
    if not args.no_plots:
        require("matplotlib", "specdecode bench (without --no-plots)")
    target, draft, eagle3 = load_models(args, target_options, draft_options)
    names = (
        [name.strip().replace("+", ",") for name in args.systems.split(",")]
        if args.systems
        else system_names(
            draft is not None,
            include_hf=not args.no_hf and isinstance(target, HFBackend),  # not on llama.cpp's kernels
            has_eagle3=eagle3 is not None,
        )
    )
    names += static_grid(names, *grid_values(args.static_grid), draft_config)
    systems = build_systems(names, target, draft, draft_config, ngram, eagle3)
    for task in tasks:
        for prompt in task.prompts:
            check_room(target.tokenize(prompt), chosen["n_predict"], target.n_ctx)
    sweep_systems = []
    if chosen["sweep"] and draft is not None and tasks[0].name in ("completion", "custom"):
        sweep_systems = [systems[0], *draft_max_systems(chosen["sweep"], target, draft, draft_config)]
    measurements, sweep = _measure(tasks, systems, sweep_systems, target, chosen, console)
    rows = summarize(measurements)
    results = {"settings": chosen, "machine": _machine(target), "systems": [s.name for s in systems]}
    results |= {"tasks": {t.name: list(t.prompts) for t in tasks}, "rows": rows, "draft_max_sweep": sweep}
    results["policies"] = {
        system.name: policy_summary(system.policy_models)
        for system in systems
        if getattr(system, "policy_models", None) is not None
    }
    header = f"specdecode bench ({chosen['mode']}): {target.name} / {draft.name if draft else 'no draft'}"
    if eagle3 is not None:
        header += f" / EAGLE-3 head {args.model_eagle3.name if args.model_eagle3 else '(bundled)'}"
    console.print(header)
    print_tables(rows, _stdout_console())
    for line in sweep_lines(sweep):
        print(line)
    for name, summary in results["policies"].items():
        print("\n".join(policy_lines(name, summary)))
    results["static_comparison"] = static_comparison(rows)
    for line in static_lines(results["static_comparison"]):
        print(line)
    written = write_outputs(args.out, results, rows, header)
    if not args.no_plots:
        written += _plots(rows, sweep, args.out)
    console.print("wrote " + ", ".join(str(path) for path in written))


def _measure(
    tasks: list[Task],
    systems: list[System],
    sweep_systems: list[System],
    target: HFBackend,
    chosen: dict,
    console: Console,
) -> tuple[list[Measurement], list[dict]]:
    """The main suite, then the draft-max sweep on the first task's prompts, with one progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    per_prompt = len(rounds(systems, chosen["runs"], chosen["warmup"])) * len(systems)
    total = per_prompt * sum(len(t.prompts) for t in tasks)
    if sweep_systems:
        sweep_rounds = len(rounds(sweep_systems, chosen["runs"], chosen["warmup"]))
        total += sweep_rounds * len(sweep_systems) * len(tasks[0].prompts)
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("warming up", total=total)

        def advance(label: str) -> None:
            progress.update(bar, advance=1, description=label)

        measured = run_suite(
            tasks, systems, target.tokenize, chosen["n_predict"], chosen["runs"], chosen["warmup"], advance
        )
        sweep_measured = (
            run_suite(
                tasks[:1],
                sweep_systems,
                target.tokenize,
                chosen["n_predict"],
                chosen["runs"],
                chosen["warmup"],
                advance,
            )
            if sweep_systems
            else []
        )
    sweep = [
        {"draft_max": int(row["system"].split()[-1]), **row}
        for row in summarize(sweep_measured)
        if row["system"] != "plain"
    ]
    return measured, sweep


def _stdout_console() -> Console:
    """The tables' console: a terminal's own width, or wide enough for every column in a file."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _plots(rows: list[dict], sweep: list[dict], out: Path) -> list[Path]:
    from specdecode.bench import plots  # matplotlib

    written = [
        plots.speedup_by_task(rows, out / "speedup_by_task.png"),
        plots.acceptance_by_position(rows, out / "acceptance_by_position.png"),
    ]
    if sweep:
        written.append(plots.speedup_vs_draft_max(sweep, out / "speedup_vs_draft_max.png"))
    return written


def _machine(target: HFBackend) -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "row_invariant": getattr(target, "invariant", None),  # native: by its plans; llama.cpp: probed
    }
