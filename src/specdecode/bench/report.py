"""The benchmark's outputs: a table per task in the terminal (rich), Markdown and JSON files.

Columns, for each system on a task:
  tok/s      generated tokens per second end to end, median over runs (min–max)
  tok/CPU-s  generated tokens per CPU-second of this process (all its threads), median over runs
  ×plain     speed-up over our plain generation;  ×HF: over Hugging Face's plain `generate`
  accept     accepted / drafted tokens;  tok/pass: tokens emitted per target pass
  nodes/pass draft tokens verified per target pass (a tree's nodes count each)
  ideal S    S(α, γ, c, v) from the measured α, γ, draft cost c and verify-pass cost v, both
             relative to plain's step on the task (see `metrics`; chains only);  of S: measured / ideal
  d/v/o %    share of generation time spent drafting / verifying (target passes) / elsewhere
  exact      share of runs whose tokens equal our plain output (greedy, or sampled with the
             same seed; Hugging Face's sampler is not compared)
Below a task's table, a note for each system that drafted little or nothing there, or had its
drafts held short, says why (`verdict_notes`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.bench.systems import ADAPTIVE, static_base
from specdecode.errors import SpecdecodeError
from specdecode.policy import PolicyModels

if TYPE_CHECKING:
    from rich.console import Console

COLUMNS = (
    "system",
    "tok/s (min–max)",
    "tok/CPU-s",
    "×plain",
    "×HF",
    "accept",
    "tok/pass",
    "nodes/pass",
    "ideal S",
    "of S",
    "d/v/o %",
    "exact",
)


def _number(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def cells(row: dict) -> list[str]:
    drafted = row.get("draft_tokens_per_pass", 0) > 0
    speculative = {key: row.get(key) if drafted else None for key in ("acceptance_rate", "tokens_per_pass")}
    ideal = row.get("ideal_speedup") if drafted else None
    nodes = row.get("draft_tokens_per_pass") if drafted else None
    shares = (
        f"{100 * row['share_draft']:.0f}/{100 * row['share_verify']:.0f}/{100 * row['share_other']:.0f}"
        if "share_draft" in row
        else "—"
    )
    return [
        row["system"],
        f"{row['tokens_per_second']:.1f} "
        f"({row['tokens_per_second_min']:.1f}–{row['tokens_per_second_max']:.1f})",
        f"{row['tokens_per_cpu_second']:.1f}",
        _number(row["speedup_vs_plain"], ".2f"),
        _number(row["speedup_vs_hf_plain"], ".2f"),
        _number(speculative["acceptance_rate"], ".2f"),
        _number(speculative["tokens_per_pass"], ".2f"),
        _number(nodes, ".2f"),
        _number(ideal, ".2f"),
        _number(row.get("fraction_of_ideal") if ideal else None, ".0%"),
        shares,
        _number(row["exact_match_rate"], ".0%"),
    ]


def by_task(rows: Sequence[dict]) -> dict[str, list[dict]]:
    tasks: dict[str, list[dict]] = {}
    for row in rows:
        tasks.setdefault(row["task"], []).append(row)
    return tasks


def print_tables(rows: Sequence[dict], console: Console) -> None:
    from rich.table import Table

    for task, task_rows in by_task(rows).items():
        table = Table(title=f"task: {task}", title_justify="left")
        for i, column in enumerate(COLUMNS):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in task_rows:
            table.add_row(*cells(row))
        console.print(table)
        for note in verdict_notes(task_rows):
            console.print(f"note: {note}", markup=False, highlight=False)


def verdict_notes(rows: Sequence[dict]) -> list[str]:
    """Why a system drafted little or nothing, or had its drafts held short, on a task (its
    last run's `specdecode.verdicts`): a footnote to the table, so that a speed-up of 1.00x
    with nothing drafted says why."""
    return [f"{row['system']}: {verdict['text']}" for row in rows for verdict in row.get("verdicts", [])]


def stdout_console() -> Console:
    """The tables' console: a terminal's own width, or wide enough for every column in a file."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def markdown(rows: Sequence[dict], header: str) -> str:
    lines = [header, ""]
    for task, task_rows in by_task(rows).items():
        lines += [f"### {task}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cells(row)) + " |" for row in task_rows]
        notes = verdict_notes(task_rows)
        lines += ["", *(f"- {note}" for note in notes)] if notes else []
        lines.append("")
    return "\n".join(lines)


def plot_title(header: str, results: dict) -> str:
    """The plots' subtitle: what ran, on which machine, and when, so that a plot read apart from
    its run still says where its numbers come from."""
    machine = results["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {machine['threads']} threads"
    return f"{header}\n{where}, {results['date']}"


def sweep_lines(sweep: Sequence[dict]) -> list[str]:
    """The draft-max sweep: one line per value."""
    return [
        f"--spec-draft-n-max {row['draft_max']:>2}: {row['speedup_vs_plain']:.2f}x over plain, "
        f"{row['tokens_per_pass']:.2f} tokens per pass, acceptance {row['acceptance_rate']:.2f}"
        for row in sweep
    ]


def policy_summary(models: PolicyModels) -> dict:
    """What an adaptive system chose (runs, by strategy and draft length) and how the pass costs
    timed at load compare with the passes it ran."""
    choices: dict[str, dict[int, int]] = {}
    for (strategy, length), count in sorted(models.choices.items()):
        choices.setdefault(strategy, {})[length] = count
    return {"choices": choices, "cost_fit": models.costs.fit()}


def policy_lines(name: str, summary: dict) -> list[str]:
    """Readable lines of `policy_summary`: the choice histogram, then the cost fit (the model at
    the end of a run of several tasks has forgotten the first ones' passes: what it predicted
    when each pass ran is the fit the policy acted on)."""
    lines = [f"{name}: steps by strategy and draft length"]
    for strategy, lengths in summary["choices"].items():
        cells = ", ".join(f"{length}: {count}" for length, count in sorted(lengths.items()))
        lines.append(f"  {strategy:<14} {sum(lengths.values()):5d} steps  ({cells})")
    fit = [
        f"T={row['rows']}"
        + (f"/S={row['sequences']}" if row["sequences"] > 1 else "")
        + f" {row['measured_ms']:.1f}/{row['predicted_ms']:.1f}/{row['model_ms']:.1f}"
        + ("" if row["timed_ms"] is None else f"/{row['timed_ms']:.1f}")
        for row in summary["cost_fit"]
    ]
    lines.append(
        "  ms per pass of T rows (of S sequences), measured mean / predicted when run / cost model at the end"
        + " / timed at load: "
        + ", ".join(fit)
    )
    return lines


def static_comparison(rows: Sequence[dict]) -> dict[str, dict]:
    """Each adaptive system X@adaptive against, per task (speed-ups over plain): X with the
    run's classic settings, the best of X's static settings run (X and X@P/N), and the best
    classic system of ours of any strategy; then the means over tasks of adaptive / classic
    and adaptive / best static."""
    speedups = {(row["task"], row["system"]): row["speedup_vs_plain"] for row in rows}
    classic = [
        row["system"]
        for row in rows
        if row["family"] == "ours" and row["system"] != "plain" and not row["system"].endswith(ADAPTIVE)
    ]
    comparison: dict[str, dict] = {}
    for adaptive in dict.fromkeys(row["system"] for row in rows if row["system"].endswith(ADAPTIVE)):
        base = adaptive.removesuffix(ADAPTIVE)
        tasks = {}
        for task in dict.fromkeys(row["task"] for row in rows):
            ran = [n for n in classic if speedups.get((task, n)) is not None]  # a partial bench: not all
            if base not in ran or speedups.get((task, adaptive)) is None:
                continue
            own = max((n for n in ran if static_base(n) == base), key=lambda n: speedups[task, n])
            best = max(ran, key=lambda n: speedups[task, n])
            tasks[task] = {
                "adaptive": speedups[task, adaptive],
                "classic": speedups[task, base],
                "best_static": speedups[task, own],
                "best_static_system": own,
                "best_any": speedups[task, best],
                "best_any_system": best,
            }
        if tasks:
            count = len(tasks)
            comparison[adaptive] = {
                "tasks": tasks,
                "mean_vs_classic": sum(t["adaptive"] / t["classic"] for t in tasks.values()) / count,
                "mean_vs_best_static": sum(t["adaptive"] / t["best_static"] for t in tasks.values()) / count,
                "mean_vs_best_any": sum(t["adaptive"] / t["best_any"] for t in tasks.values()) / count,
            }
    return comparison


def static_lines(comparison: dict[str, dict]) -> list[str]:
    """Readable lines of `static_comparison`, one per adaptive system and task."""
    lines = []
    for adaptive, summary in comparison.items():
        lines.append(f"{adaptive} (x plain) against the classic settings and the best static ones:")
        for task, t in summary["tasks"].items():
            lines.append(
                f"  {task:<11} {t['adaptive']:.2f}x; classic {t['classic']:.2f}x "
                f"({t['adaptive'] / t['classic']:.2f}); best static {t['best_static_system']} "
                f"{t['best_static']:.2f}x ({t['adaptive'] / t['best_static']:.0%}); best of all "
                f"{t['best_any_system']} {t['best_any']:.2f}x ({t['adaptive'] / t['best_any']:.0%})"
            )
        lines.append(
            f"  mean over tasks: {summary['mean_vs_classic']:.2f}x classic, "
            f"{summary['mean_vs_best_static']:.0%} of its best static, "
            f"{summary['mean_vs_best_any']:.0%} of the best of all"
        )
    return lines


def write_outputs(out_dir: Path, results: dict, rows: Sequence[dict], header: str) -> list[Path]:
    """results.json (everything) and results.md (the tables) in out_dir, each replaced whole
    (a bench rewrites them after every run: an interrupted write leaves the previous ones)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out_dir / "results.json", out_dir / "results.md"
        _replace(json_path, json.dumps(results, indent=1) + "\n")
        text = markdown(rows, header)
        if results.get("draft_max_sweep"):
            text += "\n### speed-up vs --spec-draft-n-max (draft, completion)\n\n"
            text += "\n".join(f"- {line}" for line in sweep_lines(results["draft_max_sweep"])) + "\n"
        for name, summary in results.get("policies", {}).items():
            text += "\n```\n" + "\n".join(policy_lines(name, summary)) + "\n```\n"
        if results.get("static_comparison"):
            text += "\n```\n" + "\n".join(static_lines(results["static_comparison"])) + "\n```\n"
        _replace(md_path, text)
    except OSError as exc:
        raise SpecdecodeError(f"cannot write the results into {out_dir}: {exc}") from None
    return [json_path, md_path]


def _replace(path: Path, text: str) -> None:
    """Write a file through a temporary beside it, renamed over it: readers see all or nothing."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
