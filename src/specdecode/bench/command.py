"""`specdecode bench`: every strategy against plain generation and against Hugging Face, in one run.

specdecode bench --quick              # a first look: 5 systems, 1 prompt per task, a few CPU-minutes
specdecode bench --out bench-results  # the full suite: 3 prompts per task, 128 tokens, 3 runs
specdecode bench -m TARGET -md DRAFT --systems plain,draft,hf-plain,hf-assisted
specdecode bench -m TARGET -md DRAFT -me HEAD --systems plain,draft,eagle3 --tasks completion
specdecode bench --systems plain,draft,draft@adaptive   # a system's adaptive policy
specdecode bench --systems plain,draft,draft@adaptive --static-grid 0.3,0.5,0.75:4,8,16
specdecode bench --systems plain,draft,draft-tree --temp 0.8 --seed 1 --record-traces traces.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.backends.hf import HFBackend, LoadOptions
from specdecode.backends.load import is_gguf, load_backend, load_pytorch
from specdecode.bench.machine import Machine, dtype_of, machine_line
from specdecode.bench.metrics import summarize
from specdecode.bench.names import CHAT_TASKS
from specdecode.bench.record import RunLog
from specdecode.bench.report import (
    plot_title,
    policy_lines,
    policy_summary,
    print_tables,
    static_comparison,
    static_lines,
    stdout_console,
    sweep_lines,
    write_outputs,
)
from specdecode.bench.suite import plan_size, run_suite
from specdecode.bench.systems import (
    OursSystem,
    Run,
    System,
    build_systems,
    draft_max_systems,
    quick_system_names,
    static_grid,
    system_names,
    trace_facts,
)
from specdecode.bench.tasks import Task, as_chats, build_tasks, custom_task, with_sampling
from specdecode.bench.traces import TraceRecorder, check_trace_file, open_traces
from specdecode.chat import chat_from_args, encode_rendered
from specdecode.defaults import resolve_dflash, resolve_eagle3, resolve_models
from specdecode.errors import SpecdecodeError, read_text_file, require
from specdecode.generate import check_room
from specdecode.strategies import DraftModelConfig, NgramSettings, dflash_checkpoint
from specdecode.strategies.eagle3_checkpoint import load_head
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.mtp_checkpoint import has_mtp, load_mtp

if TYPE_CHECKING:
    from rich.console import Console

# (prompts per task, tokens per run, measured runs, warm-up rounds, --spec-draft-n-max sweep);
# quick also runs fewer systems (`quick_system_names`) and warms up before its first prompt only
MODES = {
    "quick": (1, 32, 1, 1, ()),
    "full": (3, 128, 3, 1, (1, 2, 4, 8, 16)),
}


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
        "warm_once": bool(args.quick),
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
        tasks = [custom_task(prompts)]
    else:
        tasks = build_tasks([name.strip() for name in args.tasks.split(",") if name.strip()], per_task)
    return with_sampling(tasks, args.temp, args.seed)


def trace_pair(args: argparse.Namespace) -> str:
    """The models' short name in acceptance traces: "bundled" for the bundled pair, else the
    target's file (or directory) name, and the draft's after a "+" (never a path)."""
    if args.model is None:
        return "bundled"

    def short(path: Path) -> str:
        return path.stem if path.suffix == ".gguf" else path.name

    return short(args.model) + (f"+{short(args.model_draft)}" if args.model_draft else "")


def load_models(
    args: argparse.Namespace, target_options: LoadOptions, draft_options: LoadOptions
) -> tuple[HFBackend, HFBackend | None, Eagle3Head | None]:
    """Target, draft and EAGLE-3 head (-me, or the bundled head with the bundled target, which
    --quick runs only when --systems names it)."""
    head = resolve_eagle3(args.model, args.model_eagle3)
    if args.quick and args.model_eagle3 is None and "eagle3" not in (args.systems or ""):
        head = None
    model, draft = resolve_models(args.model, args.model_draft)
    target = load_backend(model, target_options)
    draft_backend = None
    if (
        draft is not None
        and isinstance(target, HFBackend)
        and not is_gguf(draft)
        and draft_options.backend == "auto"
    ):
        # The target on PyTorch (a --dtype asked, or its rows differ on llama.cpp): the draft
        # directory joins it there, where Hugging Face's assisted generation can run it too
        draft_backend = load_pytorch(draft, draft_options)
    elif draft is not None:
        draft_backend = load_backend(draft, draft_options, "draft")  # where generate runs it
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
    chat = chat_from_args(args)
    if chat is None and (asked := [task.name for task in tasks if task.name in CHAT_TASKS]):
        raise SpecdecodeError(
            f"{asked[0]} is a chat model's task: add --chat (and --chat-template-file FILE for a "
            "model without a chat template), or run the plain-text tasks"
        )
    # the bench extra (rich, and matplotlib for the plots): missing, said before any model loads
    console = require("rich.console", "specdecode bench").Console(stderr=True)
    if not args.no_plots:
        require("matplotlib", "specdecode bench (without --no-plots)")
    if args.record_traces is not None:  # a missing directory, said before any model loads
        check_trace_file(args.record_traces)
    target, draft, eagle3 = load_models(args, target_options, draft_options)
    target_dir = resolve_models(args.model, args.model_draft)[0]  # its own MTP layers, if any
    mtp = load_mtp(target_dir, target) if target_dir.is_dir() and has_mtp(target_dir) else None
    dflash_dir = resolve_dflash(args.model, args.model_draft_dflash)
    if args.quick and args.model_draft_dflash is None and "dflash" not in (args.systems or ""):
        dflash_dir = None  # the bundled drafter: --quick runs it only when --systems names it
    dflash = dflash_checkpoint.load_head(dflash_dir, target) if dflash_dir is not None else None
    tokenize = target.tokenize
    if chat is not None:  # rendered and tokenized as generate --chat and the server do
        tasks = as_chats(tasks, lambda turns: chat.text(target.tokenizer, turns, target.name))
        tokenize = functools.partial(encode_rendered, target.tokenizer)
    names = (
        [name.strip().replace("+", ",") for name in args.systems.split(",")]
        if args.systems
        else (quick_system_names if args.quick else system_names)(
            draft is not None,
            include_hf=not args.no_hf and isinstance(target, HFBackend),  # not on llama.cpp's kernels
            has_eagle3=eagle3 is not None,
            has_mtp=mtp is not None,
            has_dflash=dflash is not None,
        )
    )
    if not args.systems and draft is not None and not isinstance(draft, HFBackend):
        names = [name for name in names if name != "hf-assisted"]  # a GGUF draft on llama.cpp
    names += static_grid(names, *grid_values(args.static_grid), draft_config)
    systems = build_systems(names, target, draft, draft_config, ngram, eagle3, mtp, dflash)
    for task in tasks:
        for index in range(len(task.prompts)):
            turns = task.turns(index)  # a session's answers are not known yet: n_predict each
            check_room(tokenize(task.conversation(turns)), chosen["n_predict"] * len(turns), target.n_ctx)
    sweep_systems = []
    if chosen["sweep"] and draft is not None and tasks[0].name in ("completion", "custom"):
        sweep_systems = [systems[0], *draft_max_systems(chosen["sweep"], target, draft, draft_config)]
    machine = Machine()
    decode = functools.partial(answer_text, target)
    results = {"settings": chosen, "machine": _machine(machine, target, draft, eagle3)}
    results |= {"systems": [s.name for s in systems], "date": machine.date}
    results["tasks"] = {
        t.name: [
            t.prompt_text(i) if len(t.turns(i)) == 1 else list(t.turns(i)) for i in range(len(t.prompts))
        ]
        for t in tasks
    }
    header = f"specdecode bench ({chosen['mode']}): {target.name} / {draft.name if draft else 'no draft'}"
    if eagle3 is not None:
        header += f" / EAGLE-3 head {args.model_eagle3.name if args.model_eagle3 else '(bundled)'}"
    if dflash is not None:
        header += f" / DFlash drafter {dflash_dir.name}"
    planned = plan_size(tasks, len(systems), chosen["runs"], chosen["warmup"], chosen["warm_once"])[1]
    stopped = False
    log = RunLog(args.out, results, f"{header}\n\n{machine_line(results['machine'])}", planned)
    with log, _traces(args, systems, tasks, target) as recorder:
        try:
            _measure(tasks, systems, sweep_systems, tokenize, decode, chosen, console, log, recorder)
        except KeyboardInterrupt:  # Ctrl-C: the tables and files of the runs done, then status 130
            stopped = True
    results["machine"] = _machine(machine, target, draft, eagle3)  # the load average after the runs
    log.header = f"{header}\n\n{machine_line(results['machine'])}"
    _report(args, header, systems, log, console, stopped)
    if stopped:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _traces(
    args: argparse.Namespace, systems: list[System], tasks: list[Task], target: HFBackend
) -> Iterator[TraceRecorder | None]:
    """With --record-traces: its file open to append to, and the systems of ours keeping their
    steps; else None."""
    if args.record_traces is None:
        yield None
        return
    ours = [system for system in systems if isinstance(system, OursSystem)]
    for system in ours:
        system.keep_steps = True
    facts = {system.name: trace_facts(system) or {} for system in ours}
    sessions = [task.name for task in tasks if task.follow_ups]
    with open_traces(args.record_traces) as out:
        vocab = target.vocab
        yield TraceRecorder(out, trace_pair(args), vocab.size, vocab.eog_ids, facts, sessions)


def _report(
    args: argparse.Namespace, header: str, systems: list[System], log: RunLog, console: Console, stopped: bool
) -> None:
    """The tables and files of the runs in `log`: all of them, or those done before Ctrl-C
    (`stopped`: said above the tables, and no plots)."""
    results = log.results
    rows = summarize(log.suite)
    sweep = [
        {"draft_max": int(row["system"].split()[-1]), **row}
        for row in summarize(log.sweep)
        if row["system"] != "plain"
    ]
    results |= {"rows": rows, "draft_max_sweep": sweep, **log.progress()}
    results["policies"] = {
        system.name: policy_summary(system.policy_models)
        for system in systems
        if getattr(system, "policy_models", None) is not None
    }
    console.print(header)
    print(machine_line(results["machine"]))
    if stopped:
        console.print(
            f"bench: stopped after {len(log.suite)} of {log.planned} measured runs: the tables show those"
        )
    print_tables(rows, stdout_console())
    for line in sweep_lines(sweep):
        print(line)
    for name, summary in results["policies"].items():
        print("\n".join(policy_lines(name, summary)))
    results["static_comparison"] = static_comparison(rows)
    for line in static_lines(results["static_comparison"]):
        print(line)
    written = [*write_outputs(args.out, results, rows, log.partial_header()), log.runs_path]
    if not args.no_plots and not stopped:
        written += _plots(rows, sweep, args.out, plot_title(header, results))
    console.print("wrote " + ", ".join(str(path) for path in written))


def answer_text(target: HFBackend, tokens: list[int]) -> str:
    """An answer as a session's next turn reads it: up to its first end-of-generation token
    (the bench generates past it, so that every system does the same work)."""
    end = next((i for i, token in enumerate(tokens) if token in target.vocab.eog_ids), len(tokens))
    return target.detokenize(tokens[:end])


def _measure(
    tasks: list[Task],
    systems: list[System],
    sweep_systems: list[System],
    tokenize: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    chosen: dict,
    console: Console,
    log: RunLog,
    recorder: TraceRecorder | None = None,
) -> None:
    """The main suite, then the draft-max sweep on the first task's prompts, with one progress
    display (see `_progress`), each measured run kept in `log` as it finishes (and the suite's
    traces by `recorder`)."""
    sizes = chosen["runs"], chosen["warmup"], chosen["warm_once"]
    total = plan_size(tasks, len(systems), *sizes)[0]
    if sweep_systems:
        total += plan_size(tasks[:1], len(sweep_systems), *sizes)[0]
    runs, warmup, warm_once = sizes
    with _progress(console, total) as advance:
        run_suite(
            tasks,
            systems,
            tokenize,
            chosen["n_predict"],
            runs,
            warmup,
            advance,
            decode,
            log.recorder("suite") if recorder is None else recorder.wrap(log.recorder("suite")),
            warm_once,
        )
        if sweep_systems:
            run_suite(
                tasks[:1],
                sweep_systems,
                tokenize,
                chosen["n_predict"],
                runs,
                warmup,
                advance,
                record=log.recorder("sweep"),
                warm_once=warm_once,
            )


@contextlib.contextmanager
def _progress(console: Console, total: int) -> Iterator[Callable[[str, Run], None]]:
    """What to call after each run: on a terminal, a bar that vanishes when the suite ends;
    elsewhere (a log, CI), one plain line per run on stderr, which a bar would not leave."""
    if not console.is_terminal:
        done = itertools.count(1)

        def line(label: str, run: Run) -> None:
            speed = len(run.tokens) / run.seconds
            print(f"bench: [{next(done)}/{total}] {label}: {speed:.1f} tok/s", file=sys.stderr, flush=True)

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description:<56}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("warming up", total=total)
        yield lambda label, run: progress.update(bar, advance=1, description=label)


def _plots(rows: list[dict], sweep: list[dict], out: Path, title: str) -> list[Path]:
    from specdecode.bench import plots  # matplotlib

    written = [
        plots.speedup_by_task(rows, out / "speedup_by_task.png", title),
        plots.acceptance_by_position(rows, out / "acceptance_by_position.png", title),
    ]
    if sweep:
        written.append(plots.speedup_vs_draft_max(sweep, out / "speedup_vs_draft_max.png", title))
    return written


def _machine(machine: Machine, target: HFBackend, draft: HFBackend | None, eagle3: Eagle3Head | None) -> dict:
    """The machine block, with the dtype each model ran in and whether the target's passes are
    row-invariant (native: by its plans; llama.cpp: probed)."""
    dtypes = {"target": dtype_of(target)}
    if draft is not None:
        dtypes["draft"] = dtype_of(draft)
    if eagle3 is not None:
        dtypes["eagle3"] = dtype_of(eagle3)
    return machine.describe(dtypes, str(target.device), row_invariant=getattr(target, "invariant", None))
