"""PNG plots of a benchmark: speed-up by task and system, acceptance by draft position, and
speed-up against --spec-draft-n-max. Drawn with matplotlib's file-only backend (no display needed).

A full run compares some 18 systems: drawn on one axes they would need more colours than a
reader can tell apart. The systems are grouped by strategy family instead, one panel each (a
family of more than MAX_SERIES systems takes several), so that every panel's series have
colours and markers of their own; legends sit outside the axes, where they cover no data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specdecode.bench.report import by_task
from specdecode.bench.systems import ADAPTIVE, TREES, static_base

FAMILIES = ("plain", "n-gram", "draft model", "EAGLE-3", "DFlash", "MTP", "trees", "combined chains")
MAX_SERIES = 8  # series per panel: tab10 keeps them apart
COLOURS = plt.get_cmap("tab10").colors
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")  # lines that coincide still show each other's style


def strategy_family(system: str) -> str:
    """The family of a system, from its name. Hugging Face's systems join the family of what
    they run (prompt lookup is an n-gram strategy, assisted generation drafts with a model);
    a chain with a tree counts as a tree."""
    hugging_face = {"hf-plain": "plain", "hf-prompt-lookup": "n-gram", "hf-assisted": "draft model"}
    if system in hugging_face:
        return hugging_face[system]
    parts = static_base(system).removesuffix(ADAPTIVE).split(",")
    if any(part in TREES for part in parts):
        return "trees"
    if len(parts) > 1:
        return "combined chains"
    if parts[0].startswith("ngram-"):
        return "n-gram"
    if parts[0] == "eagle3":
        return "EAGLE-3"
    if parts[0] == "dflash":
        return "DFlash"
    if parts[0] == "mtp":
        return "MTP"
    return "draft model" if parts[0] == "draft" else "plain"


def panels(systems: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(title, systems) per panel: families in FAMILIES order, each cut into panels of at most
    MAX_SERIES systems."""
    grouped: dict[str, list[str]] = {family: [] for family in FAMILIES}
    for system in dict.fromkeys(systems):
        grouped[strategy_family(system)].append(system)
    result = []
    for family, members in grouped.items():
        count = math.ceil(len(members) / MAX_SERIES)
        for i in range(count):
            title = family if count == 1 else f"{family} ({i + 1}/{count})"
            result.append((title, members[i * MAX_SERIES : (i + 1) * MAX_SERIES]))
    return result


def speedup_figure(rows: Sequence[dict], title: str = "") -> Figure:
    """Grouped bars of each system's speed-up over plain generation per task, one panel per
    family; whiskers span the fastest and slowest run where systems ran more than once."""
    tasks = by_task(rows)
    measured = {(row["task"], row["system"]): row for row in rows if row["speedup_vs_plain"] is not None}
    groups = panels([row["system"] for row in rows if row["system"] != "plain"])
    figure, grid = _grid(len(groups), panel_width=max(4.0, 1.1 * len(tasks)))
    repeated = max((row["runs"] for row in rows), default=1) > 1
    for axes, (panel_title, systems) in zip(grid, groups, strict=False):
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            offset = (i - (len(systems) - 1) / 2) * width
            found = {t: measured[task, system] for t, task in enumerate(tasks) if (task, system) in measured}
            spread = [_run_spread(row) for row in found.values()] if repeated and found else None
            axes.bar(
                [t + offset for t in found],
                [row["speedup_vs_plain"] for row in found.values()],
                width,
                yerr=list(zip(*spread, strict=True)) if spread else None,
                capsize=2,
                color=COLOURS[i],
                label=system,
            )
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_xticks(range(len(tasks)), list(tasks))
        _finish_panel(axes, panel_title)
    for axes in grid[:: _columns(len(groups))]:
        axes.set_ylabel("speed-up over plain (×)")
    note = "median over runs, whiskers: slowest to fastest run" if repeated else "one run each"
    _title(figure, f"Speed-up over plain generation by strategy family ({note})", title)
    return figure


def _run_spread(row: dict) -> tuple[float, float]:
    """How far below and above the median speed-up the slowest and fastest runs lie."""
    speedup, median = row["speedup_vs_plain"], row["tokens_per_second"]
    low = speedup * row["tokens_per_second_min"] / median
    high = speedup * row["tokens_per_second_max"] / median
    return speedup - low, high - speedup


def acceptance_figure(rows: Sequence[dict], title: str = "") -> Figure:
    """P(draft token i kept | the draft reached i), every task pooled, one line per system of
    ours that drafted, one panel per family."""
    rates: dict[str, tuple[list[int], list[float]]] = {}
    for system in dict.fromkeys(row["system"] for row in rows):
        accepted, drafted = _pooled_positions([row for row in rows if row["system"] == system])
        kept = [(i + 1, a / d) for i, (a, d) in enumerate(zip(accepted, drafted, strict=True)) if d]
        if kept:
            rates[system] = ([position for position, _ in kept], [rate for _, rate in kept])
    groups = panels(list(rates))
    longest = max((positions[-1] for positions, _ in rates.values()), default=1)
    figure, grid = _grid(len(groups), panel_width=max(4.0, 0.3 * longest))
    for axes, (panel_title, systems) in zip(grid, groups, strict=False):
        for i, system in enumerate(systems):
            positions, values = rates[system]
            axes.plot(
                positions,
                values,
                color=COLOURS[i],
                marker=MARKERS[i],
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                markersize=5,
                fillstyle="none",  # hollow: markers at the same point stay visible
                label=system,
            )
        axes.set_xlabel("draft position")
        axes.set_xlim(0.5, longest + 0.5)  # the same positions in every panel
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.set_ylim(0, 1.02)
        _finish_panel(axes, panel_title)
    for axes in grid[:: _columns(len(groups))]:
        axes.set_ylabel("acceptance")
    _title(figure, "Acceptance by draft position (every task pooled)", title)
    return figure


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


def draft_max_figure(sweep: Sequence[dict], title: str = "") -> Figure:
    """The draft strategy's measured speed-up at each --spec-draft-n-max, beside the ideal S(α, γ, c)
    its measured acceptance and costs allow."""
    figure, axes = plt.subplots(figsize=(8, 4.5), layout="constrained")
    values = [row["draft_max"] for row in sweep]
    measured = [row["speedup_vs_plain"] for row in sweep]
    repeated = any(row["runs"] > 1 for row in sweep)
    spread = list(zip(*(_run_spread(row) for row in sweep), strict=True)) if repeated else None
    axes.errorbar(values, measured, yerr=spread, capsize=3, marker="o", color=COLOURS[0], label="measured")
    ideal = [row["ideal_speedup"] for row in sweep]
    axes.plot(values, ideal, marker="x", linestyle="--", color=COLOURS[1], label="ideal S(α, γ, c)")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(values, [str(v) for v in values])
    axes.set_xlabel("--spec-draft-n-max")
    axes.set_ylabel("speed-up over plain (×)")
    _finish_panel(axes, "draft model, first task's prompts")
    note = "median over runs, whiskers: slowest to fastest run" if repeated else "one run each"
    _title(figure, f"Speed-up against the draft length cap ({note})", title)
    return figure


def speedup_by_task(rows: Sequence[dict], path: Path, title: str = "") -> Path:
    return _save(speedup_figure(rows, title), path)


def acceptance_by_position(rows: Sequence[dict], path: Path, title: str = "") -> Path:
    return _save(acceptance_figure(rows, title), path)


def speedup_vs_draft_max(sweep: Sequence[dict], path: Path, title: str = "") -> Path:
    return _save(draft_max_figure(sweep, title), path)


def _columns(count: int) -> int:
    return 1 if count <= 1 else 2


def _grid(count: int, panel_width: float) -> tuple[Figure, list[Axes]]:
    """A figure of `count` panels (at least one), two per row, each with room on its right for
    its legend, all on one y scale; the grid's unused cells are removed."""
    columns = _columns(count)
    rows = max(1, math.ceil(count / columns))
    figure, grid = plt.subplots(
        rows,
        columns,
        figsize=(columns * (panel_width + 3.2), 1.0 + 3.0 * rows),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    cells = list(grid.flat)
    for unused in cells[max(count, 1) :]:
        unused.remove()
    return figure, cells[: max(count, 1)]


def _finish_panel(axes: Axes, title: str) -> None:
    axes.set_title(title, loc="left", fontsize="medium")
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)


def _title(figure: Figure, what: str, subtitle: str) -> None:
    figure.suptitle(what + (f"\n{subtitle}" if subtitle else ""), fontsize="medium")


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
