"""`specdecode bench-serve --http`: `specdecode serve` beside llama-server, over HTTP, on the same
GGUF files.

    make llama-tools      # builds llama-server (with llama.cpp's other programs) into build/llama-tools
    specdecode bench-serve --http --target T.gguf [--draft D.gguf] [--gap]

Both servers are started here as child processes on free ports, one thread each (`--threads`),
as many slots as the highest concurrency, and stopped at the end (also on an error or Ctrl-C).
Systems, each its own server process, all up for the whole run:

- `ours`: `specdecode serve` without speculation;
- `ours-spec`: our default speculation (with a draft: the adaptive policy over the draft and the
  n-gram chain `BESIDE_A_DRAFT`; without one, that n-gram chain alone);
- `llama`: llama-server without speculation;
- `llama-draft`: llama-server with the draft (`-md --spec-type draft-simple`, its own defaults),
  only when a draft is given.

Every request is llama-server's `POST /completion` (both servers speak it): the held-out
code-completion prompts (`bench.tasks`) as text, greedy, `ignore_eos`, `cache_prompt` off (no
server reuses a cached prefix), the answer's token ids asked back. Before the runs, each prompt
is sent alone to each server: its solo answer (and the servers' warm-up). Then, for each
concurrency C, a closed loop of C clients (each sends its next request once its last is
answered) runs on each system in turn, the order rotated each round, so that the systems
compared at one C run minutes apart at most on a machine whose load drifts.

Clocks: wall-clock tokens/s of the loop, and tokens per CPU-second of the server process
itself: user + system time of it and of its waited-for children, read from /proc/PID/stat
(utime, stime, cutime, cstime) just before and after the loop. The clients run in this process
and are not counted. Exactness: each answer against the same server's solo answer to the same
prompt (must be equal: greedy output does not depend on what else runs), and against the other
server's solo answer (reported only: different kernels may round a near-tie differently).

`--gap`: 4 streams decode (streaming /completion) while a long prompt (`--gap-tokens` of
held-out code, sent as token ids) arrives on a fifth slot; per server, the largest pause between
two events of the running streams from the prompt's arrival until its answer, in seconds and in
decode passes (over the median pause of the streams before the prompt arrived).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.bench import serving
from specdecode.bench.machine import Machine, machine_line
from specdecode.bench.tasks import build_tasks
from specdecode.compare.http_gap import GAP_STREAMS, gap_line, gap_markdown, gap_run, long_prompt
from specdecode.compare.http_servers import (
    Answer,
    Server,
    System,
    build_systems,
    chosen,
    closed_loop,
    complete,
    counterpart,
    running,
)
from specdecode.errors import SpecdecodeError, require

if TYPE_CHECKING:
    from rich.table import Table

HTTP_LEVELS = "1,4,8,16"
HTTP_PROMPTS = 8


def level_row(
    system: str,
    concurrency: int,
    round_index: int,
    answers: list[Answer],
    seconds: float,
    cpu_seconds: float,
    solo: dict[int, list[int]],
    other_solo: dict[int, list[int]] | None,
) -> dict:
    """One system's loop at one concurrency: its clocks, latencies and exactness counts."""
    good = [a for a in answers if a.error is None]
    tokens = sum(len(a.tokens) for a in good)
    return {
        "system": system,
        "concurrency": concurrency,
        "round": round_index,
        "requests": len(answers),
        "errors": len(answers) - len(good),
        "error_sample": next((a.error for a in answers if a.error is not None), None),
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "latencies": [a.seconds for a in good],
        "solo_equal": sum(a.tokens == solo.get(a.prompt) for a in good),
        "solo_differs": [
            [a.prompt, first_difference(a.tokens, solo[a.prompt])] for a in good if a.tokens != solo[a.prompt]
        ],
        "cross_equal": None
        if other_solo is None
        else sum(a.tokens == other_solo.get(a.prompt) for a in good),
    }


def first_difference(tokens: list[int], expected: list[int]) -> int:
    """The position of the first token that differs (the shorter length if one is a prefix)."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
        min(len(tokens), len(expected)),
    )


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (the value below which `fraction` of them lie)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def summarize(rows: list[dict]) -> list[dict]:
    """Per system and concurrency, over the rounds: tokens over summed seconds (each clock), the
    latencies pooled, the counts summed; each round's tokens/s kept beside."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["concurrency"]), []).append(row)
    summary = []
    for (system, concurrency), group in groups.items():
        tokens = sum(r["tokens"] for r in group)
        seconds = sum(r["seconds"] for r in group)
        cpu = sum(r["cpu_seconds"] for r in group)
        latencies = [value for r in group for value in r["latencies"]]
        crosses = [r["cross_equal"] for r in group]
        summary.append(
            {
                "system": system,
                "concurrency": concurrency,
                "rounds": len(group),
                "requests": sum(r["requests"] for r in group),
                "errors": sum(r["errors"] for r in group),
                "tokens": tokens,
                "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                "tokens_per_cpu_second": tokens / cpu if cpu > 0 else 0.0,
                "round_tokens_per_second": [r["tokens"] / r["seconds"] for r in group if r["seconds"] > 0],
                "p50_s": percentile(latencies, 0.50),
                "p95_s": percentile(latencies, 0.95),
                "solo_equal": sum(r["solo_equal"] for r in group),
                "cross_equal": None if None in crosses else sum(crosses),
            }
        )
    return summary


def exact_cell(row: dict) -> str:
    """`solo n/N`, and `cross n/N` where the other server has a counterpart."""
    answered = row["requests"] - row["errors"]
    text = f"solo {row['solo_equal']}/{answered}"
    return text if row["cross_equal"] is None else f"{text}, cross {row['cross_equal']}/{answered}"


def table(summary: list[dict], systems: list[str], levels: list[int]) -> Table:
    from rich.table import Table

    grid = Table(
        title="tok/s, tok/server-CPU-s, p50/p95 latency s; errors; answers equal to solo / other server's"
    )
    grid.add_column("system")
    for c in levels:
        grid.add_column(f"C={c}", justify="right")
    index = {(r["system"], r["concurrency"]): r for r in summary}
    for name in systems:
        cells = []
        for c in levels:
            row = index[(name, c)]
            cells.append(
                f"{row['tokens_per_second']:.0f}, {row['tokens_per_cpu_second']:.0f}, "
                f"{row['p50_s']:.2f}/{row['p95_s']:.2f}\n"
                + (f"[red]{row['errors']} errors[/red] " if row["errors"] else "")
                + exact_cell(row)
            )
        grid.add_row(name, *cells)
    return grid


def markdown(summary: list[dict], systems: list[str], levels: list[int]) -> str:
    index = {(r["system"], r["concurrency"]): r for r in summary}
    lines = ["| system | " + " | ".join(f"C={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
    for name in systems:
        cells = []
        for c in levels:
            row = index[(name, c)]
            errors = f", {row['errors']} errors" if row["errors"] else ""
            cells.append(
                f"{row['tokens_per_second']:.0f} tok/s, {row['tokens_per_cpu_second']:.0f} tok/CPU-s, "
                f"p50 {row['p50_s']:.2f} s, p95 {row['p95_s']:.2f} s{errors}, {exact_cell(row)}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_bench_serve(args: argparse.Namespace) -> None:
    """`specdecode bench-serve`'s handler: with --http this comparison, else bench's own
    benchmark of threads against batching in this process."""
    if args.http:
        args.threads = 1 if args.threads is None else args.threads
        run(args)
        return
    serving.run(args)


def run(args: argparse.Namespace) -> None:
    """The whole comparison: servers up, solo answers, the loops, the gap run, the report."""
    levels = [int(c) for c in (args.concurrency or HTTP_LEVELS).split(",")]
    check_args(args, levels)
    console = require("rich.console", "specdecode bench-serve").Console()
    slots = max(*levels, GAP_STREAMS + 1 if args.gap else 1)
    ctx = args.ctx_size or (args.gap_tokens + 512 if args.gap else 1024)
    systems = chosen(
        build_systems(args.target, args.draft, args.llama_server, args.threads, slots, ctx), args.systems
    )
    names = [s.name for s in systems]
    prompts = list(build_tasks(["completion"], args.prompts or HTTP_PROMPTS)[0].prompts)
    machine = Machine()
    console.print(
        f"target {args.target}  draft {args.draft}  {args.n_predict} tokens a request, {slots} slots"
    )
    rows: list[dict] = []
    gaps: list[dict] = []
    with running(systems, args.out / "logs") as servers:
        solo = {s.system.name: solo_answers(s, prompts, args.n_predict) for s in servers}
        for concurrency in levels:
            order = [i % len(prompts) for i in range(max(concurrency * args.requests, len(prompts)))]
            for round_index in range(args.rounds):
                turn = round_index % len(servers)
                for server in servers[turn:] + servers[:turn]:
                    other = counterpart(server.system, systems)
                    cpu_before, began = server.cpu_seconds(), time.perf_counter()
                    answers = closed_loop(server.port, prompts, order, concurrency, args.n_predict)
                    seconds, cpu = time.perf_counter() - began, server.cpu_seconds() - cpu_before
                    row = level_row(
                        server.system.name, concurrency, round_index, answers, seconds, cpu,
                        solo[server.system.name], None if other is None else solo[other.name],
                    )  # fmt: skip
                    rows.append(row)
                    print(progress_line(row), flush=True)  # plain: one line each, however long
        if args.gap:
            ids = long_prompt(servers[0].port, args.gap_tokens)
            for server in servers:
                gaps.append(gap_run(server, prompts, ids, ctx))
                print(gap_line(gaps[-1]), flush=True)
    summary = summarize(rows)
    speculation = speculation_exact(solo, systems)
    described = machine.describe(
        {}, "cpu", threads=args.threads, systems={s.name: list(s.command) for s in systems}
    )
    print(machine_line(described))
    console.print(table(summary, names, levels))
    for line in speculation:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": described,
        "summary": summary,
        "rows": rows,
        "gap": gaps,
        "speculation_exact": speculation,
        "solo": solo,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "handler"},
    }
    (args.out / "http.json").write_text(json.dumps(result, indent=2))
    text = machine_line(described) + "\n\n" + markdown(summary, names, levels)
    if gaps:
        text += "\n" + gap_markdown(gaps)
    (args.out / "http.md").write_text(text)
    console.print(f"wrote {args.out / 'http.json'}, {args.out / 'http.md'}")


def check_args(args: argparse.Namespace, levels: list[int]) -> None:
    """The flags' mistakes, before any server starts."""
    if args.model is not None or args.model_draft is not None:
        raise SpecdecodeError("--http takes the GGUF files as --target and --draft, not -m and -md")
    if args.target is None:
        raise SpecdecodeError("--http needs --target FILE.gguf (the GGUF file both servers load)")
    for label, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not path.is_file():
            raise SpecdecodeError(f"{label} {path} is not a file")
    if not args.llama_server.is_file():
        raise SpecdecodeError(
            f"{args.llama_server} is missing: build llama-server with `make llama-tools` "
            "(or give its path with --llama-server)"
        )
    if any(c < 1 for c in levels) or args.requests < 1 or args.rounds < 1 or args.threads < 1:
        raise SpecdecodeError("concurrencies, --requests, --rounds and --threads must be >= 1")
    if args.gap and args.gap_tokens < 16:
        raise SpecdecodeError("--gap-tokens must be >= 16")


def solo_answers(server: Server, prompts: list[str], n_predict: int) -> dict[int, list[int]]:
    """Each prompt sent alone: the answer every concurrent one must equal."""
    answers = {}
    for index, prompt in enumerate(prompts):
        answer = complete(server.port, index, prompt, n_predict, 600.0)
        if answer.error is not None:
            raise SpecdecodeError(
                f"{server.system.name} failed a solo request: {answer.error}\n{server.tail()}"
            )
        answers[index] = answer.tokens
    return answers


def speculation_exact(solo: dict[str, dict[int, list[int]]], systems: list[System]) -> list[str]:
    """Whether each speculative server's solo answers equal its own plain server's."""
    lines = []
    for system in systems:
        plain = next((s for s in systems if s.side == system.side and not s.speculative), None)
        if system.speculative and plain is not None:
            mine, theirs = solo[system.name], solo[plain.name]
            same = sum(mine[i] == theirs[i] for i in mine)
            lines.append(f"{system.name} solo answers equal to {plain.name}'s: {same}/{len(mine)}")
    return lines


def progress_line(row: dict) -> str:
    rate = row["tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0
    per_cpu = row["tokens"] / row["cpu_seconds"] if row["cpu_seconds"] > 0 else 0.0
    cross = "" if row["cross_equal"] is None else f" cross {row['cross_equal']}"
    return (
        f"C={row['concurrency']:<3d} round {row['round']} {row['system']:<12s} {rate:8.1f} tok/s "
        f"{per_cpu:8.1f} tok/CPU-s  errors {row['errors']}  solo {row['solo_equal']}/{row['requests']}{cross}"
    )
