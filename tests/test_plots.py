"""The benchmark's plots stay readable with every system of a full run: systems grouped by
strategy family into panels of at most MAX_SERIES series, each series its own colour (and, for
lines, marker), legends outside the axes, a title saying where and when, and whiskers where
the systems ran more than once."""

from __future__ import annotations

import random

import matplotlib.pyplot as plt
import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure

from specdecode.bench.names import TASK_NAMES
from specdecode.bench.plots import (
    MAX_SERIES,
    acceptance_figure,
    draft_max_figure,
    panels,
    speedup_by_task,
    speedup_figure,
    strategy_family,
)
from specdecode.bench.systems import system_names

SYSTEMS = system_names(has_draft=True, include_hf=True, has_eagle3=True)
TITLE = "specdecode bench (full): target / draft\nSome CPU, 8 threads, 2026-01-02"


def synthetic_rows(systems: list[str], runs: int = 3) -> list[dict]:
    """Rows shaped as `metrics.summarize` makes them, with made-up numbers."""
    rng = random.Random(0)
    rows = []
    for task in TASK_NAMES:
        plain = 20.0
        for system in systems:
            speed = plain if system == "plain" else plain * rng.uniform(0.6, 3.0)
            row = {
                "task": task,
                "system": system,
                "family": "hf" if system.startswith("hf-") else "ours",
                "runs": runs,
                "tokens_per_second": speed,
                "tokens_per_second_min": speed * 0.9,
                "tokens_per_second_max": speed * 1.05,
                "speedup_vs_plain": speed / plain,
            }
            if system != "plain" and not system.startswith("hf-"):
                drafted = [100 - 6 * i for i in range(rng.randint(4, 16))]
                row["drafted_by_position"] = drafted
                row["accepted_by_position"] = [int(d * rng.uniform(0.3, 0.9)) for d in drafted]
            rows.append(row)
    return rows


def series_colour(handle) -> str:
    """The colour of a legend entry: a bar group's, an error-bar line's or a line's."""
    if isinstance(handle, BarContainer):
        return to_hex(handle.patches[0].get_facecolor())
    if isinstance(handle, ErrorbarContainer):
        return to_hex(handle.lines[0].get_color())
    return to_hex(handle.get_color())


def check_readable(figure: Figure) -> list[Axes]:
    """Every panel: at most MAX_SERIES series, each of its own colour, and a legend wholly
    outside the axes; the figure's title says where the numbers come from. Returns the panels."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    assert TITLE.splitlines()[1] in figure.get_suptitle()
    panels_drawn = figure.get_axes()
    for axes in panels_drawn:
        handles, labels = axes.get_legend_handles_labels()
        assert 0 < len(labels) <= MAX_SERIES
        assert len({series_colour(handle) for handle in handles}) == len(handles)
        legend = axes.get_legend().get_window_extent(renderer)
        box = axes.get_window_extent(renderer)
        assert legend.x0 >= box.x1 or legend.y1 <= box.y0, "the legend overlaps its axes"
    return panels_drawn


def test_every_system_has_a_family_and_families_are_what_a_reader_expects():
    variants = ["draft@adaptive", "draft@0.3/4", "ngram-mod@adaptive"]
    families = {system: strategy_family(system) for system in [*SYSTEMS, *variants]}
    assert families["plain"] == families["hf-plain"] == "plain"
    assert {families[s] for s in ("ngram-simple", "ngram-cache", "hf-prompt-lookup")} == {"n-gram"}
    assert families["draft"] == families["hf-assisted"] == families["draft@adaptive"] == "draft model"
    assert families["draft@0.3/4"] == "draft model" and families["eagle3"] == "EAGLE-3"
    assert families["ngram-mod@adaptive"] == "n-gram"
    assert families["ngram-simple,eagle3-tree"] == families["draft-tree"] == "trees"
    assert families["ngram-mod,ngram-map-k4v,draft"] == "combined chains"


def test_a_family_larger_than_a_panel_takes_several():
    grid = [f"draft@{p}/{n}" for p in (0.3, 0.5, 0.75) for n in (2, 4, 8, 16)]
    titles = [(title, len(systems)) for title, systems in panels(["draft", *grid])]
    assert titles == [("draft model (1/2)", 8), ("draft model (2/2)", 5)]


def test_speedup_plot_of_a_full_run_has_readable_panels_with_whiskers(tmp_path):
    rows = synthetic_rows(SYSTEMS)
    path = speedup_by_task(rows, tmp_path / "speedup.png", TITLE)
    assert path.read_bytes()[:4] == b"\x89PNG"
    figure = speedup_figure(rows, TITLE)
    axes_list = check_readable(figure)
    shown = [label for axes in axes_list for label in axes.get_legend_handles_labels()[1]]
    assert sorted(shown) == sorted(s for s in SYSTEMS if s != "plain")  # each system once
    bars = axes_list[0].containers
    assert any(container.errorbar is not None for container in bars if isinstance(container, BarContainer))
    plt.close(figure)


def test_speedup_plot_of_single_runs_draws_no_whiskers():
    figure = speedup_figure(synthetic_rows(SYSTEMS, runs=1), TITLE)
    bars = [c for axes in figure.get_axes() for c in axes.containers if isinstance(c, BarContainer)]
    assert bars and all(container.errorbar is None for container in bars)
    assert "one run each" in figure.get_suptitle()
    plt.close(figure)


def test_acceptance_plot_shows_every_drafting_system_with_its_own_colour_and_marker():
    figure = acceptance_figure(synthetic_rows(SYSTEMS), TITLE)
    axes_list = check_readable(figure)
    drafting = [s for s in SYSTEMS if s != "plain" and not s.startswith("hf-")]
    lines = [line for axes in axes_list for line in axes.get_lines()]
    assert sorted(line.get_label() for line in lines) == sorted(drafting)
    for axes in axes_list:
        markers = [line.get_marker() for line in axes.get_lines()]
        assert len(set(markers)) == len(markers)
    plt.close(figure)


@pytest.mark.parametrize("runs", [1, 3])
def test_draft_max_plot_has_a_title_and_its_legend_outside(runs):
    sweep = [
        {"draft_max": n, "runs": runs, "speedup_vs_plain": 1 + n / 10, "ideal_speedup": 1.2 + n / 8}
        | {"tokens_per_second": 10.0, "tokens_per_second_min": 9.0, "tokens_per_second_max": 11.0}
        for n in (1, 2, 4, 8, 16)
    ]
    figure = draft_max_figure(sweep, TITLE)
    check_readable(figure)
    assert bool(figure.get_axes()[0].containers[0].has_yerr) == (runs > 1)
    plt.close(figure)


def test_a_run_where_nothing_drafted_still_gets_an_acceptance_plot():
    figure = acceptance_figure(synthetic_rows(["plain", "hf-plain"]), TITLE)
    assert len(figure.get_axes()) == 1 and not figure.get_axes()[0].get_lines()
    plt.close(figure)
