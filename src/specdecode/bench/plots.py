"""PNG plots of a benchmark: speed-up by task and system, acceptance by draft position, and
speed-up against --draft-max. Drawn with matplotlib's file-only backend (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from specdecode.bench.report import by_task


def speedup_by_task(rows: Sequence[dict], path: Path) -> Path:
    tasks = by_task(rows)
    systems = [row["system"] for row in next(iter(tasks.values())) if row["system"] != "plain"]
    width = 0.8 / max(1, len(systems))
    figure, axes = plt.subplots(figsize=(max(8, 1.6 * len(tasks) + 0.35 * len(systems)), 4.5))
    for i, system in enumerate(systems):
        values = [
            next((r["speedup_vs_plain"] for r in task_rows if r["system"] == system), 0.0)
            for task_rows in tasks.values()
        ]
        positions = [t + (i - (len(systems) - 1) / 2) * width for t in range(len(tasks))]
        axes.bar(positions, values, width, label=system)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(tasks)), list(tasks))
    axes.set_ylabel("speed-up over plain generation")
    axes.legend(fontsize="small", ncol=2)
    return _save(figure, path)


def acceptance_by_position(rows: Sequence[dict], path: Path) -> Path:
    """P(draft token i kept | the draft reached i), every task pooled, one line per system."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for system in dict.fromkeys(row["system"] for row in rows):
        accepted, drafted = _pooled_positions([row for row in rows if row["system"] == system])
        if drafted:
            rates = [a / d for a, d in zip(accepted, drafted, strict=True) if d]
            axes.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=system)
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance")
    axes.set_ylim(0, 1.02)
    axes.legend(fontsize="small")
    return _save(figure, path)


def _pooled_positions(rows: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Accepted and drafted counts per draft position, summed over rows (tasks)."""
    accepted: list[int] = []
    drafted: list[int] = []
    for row in rows:
        for pooled, counts in (
            (accepted, row.get("accepted_by_position", [])),
            (drafted, row.get("drafted_by_position", [])),
        ):
            pooled.extend([0] * (len(counts) - len(pooled)))
            for i, count in enumerate(counts):
                pooled[i] += count
    accepted.extend([0] * (len(drafted) - len(accepted)))
    return accepted, drafted


def speedup_vs_draft_max(sweep: Sequence[dict], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(6, 4))
    values = [row["draft_max"] for row in sweep]
    axes.plot(values, [row["speedup_vs_plain"] for row in sweep], marker="o", label="measured")
    axes.plot(values, [row["ideal_speedup"] for row in sweep], marker="x", linestyle="--", label="ideal S")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(values, [str(v) for v in values])
    axes.set_xlabel("--draft-max")
    axes.set_ylabel("speed-up over plain (completion)")
    axes.legend()
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
