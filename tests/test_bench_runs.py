"""`specdecode bench` keeps every run as it finishes, and --quick stays small.

A quick bench is a first look in a few CPU-minutes: its plan is counted here without running
it. Ctrl-C (a KeyboardInterrupt in the middle of a generation) leaves the tables and files of
the runs done, and the files are written run by run, not at the end.
"""

from __future__ import annotations

import json

import pytest

from specdecode.api import Pipeline
from specdecode.bench.command import bench_tasks, settings
from specdecode.bench.names import TASK_NAMES
from specdecode.bench.report import static_comparison
from specdecode.bench.suite import plan_size
from specdecode.bench.systems import quick_system_names, system_names
from specdecode.cli import build_parser, main
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model

QUICK_MOST = 40  # generations a quick bench may plan, with every model (target, draft, head)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-runs-models")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), init_std=0.5, seed=3, max_positions=1024)
    draft = perturbed_copy(target, 0.02)
    return save_model(root / "target", target, tokenizer), save_model(root / "draft", draft, tokenizer)


def test_quick_plans_a_few_dozen_generations_where_every_system_would_plan_hundreds():
    args = build_parser().parse_args(["bench", "--quick"])
    chosen = settings(args)
    assert chosen["sweep"] == () and chosen["warm_once"] and chosen["n_predict"] == 32
    tasks = bench_tasks(args, chosen["prompts_per_task"])
    assert [task.name for task in tasks] == list(TASK_NAMES)
    sizes = chosen["runs"], chosen["warmup"], chosen["warm_once"]
    for has_draft in (True, False):
        for has_eagle3 in (True, False):
            names = quick_system_names(has_draft, include_hf=True, has_eagle3=has_eagle3)
            total, measured = plan_size(tasks, len(names), *sizes)
            # one measured run per task and system, and one warm-up round before the first prompt
            assert (total, measured) == ((len(tasks) + 1) * len(names), len(tasks) * len(names))
            assert total <= QUICK_MOST
    # the same settings over every system the bundled pair and head allow: 196 with the sweep
    every = system_names(has_draft=True, include_hf=True, has_eagle3=True)
    per_prompt_warmup = plan_size(tasks, len(every), chosen["runs"], chosen["warmup"])[0]
    assert per_prompt_warmup + 2 * 3 == 196


def test_quick_systems_are_plain_the_draft_the_default_and_hugging_faces_own():
    assert quick_system_names(has_draft=True, include_hf=True) == [
        "plain", "draft", "ngram-mod,ngram-map-k4v,draft@adaptive", "hf-plain", "hf-assisted",
    ]  # fmt: skip
    assert quick_system_names(has_draft=False, include_hf=True) == [
        "plain", "ngram-mod", "ngram-mod,ngram-map-k4v@adaptive", "hf-plain", "hf-prompt-lookup",
    ]  # fmt: skip
    assert quick_system_names(has_draft=True, include_hf=False, has_eagle3=True)[-1] == "eagle3"


def test_ctrl_c_leaves_the_tables_and_files_of_the_runs_done(pair, tmp_path, capsys, monkeypatch):
    target, draft = pair
    out = tmp_path / "out"
    out.mkdir()  # an earlier bench's results, which this one replaces from its start
    (out / "results.json").write_text('{"rows": ["an earlier bench"]}')
    argv = ["bench", "-m", str(target), "-md", str(draft), "--systems", "plain,ngram-mod", "--no-hf"]
    argv += ["--tasks", "completion,free", "--prompts-per-task", "1", "-n", "8", "--runs", "2"]
    argv += ["--warmup", "0", "--sweep", "0", "--out", str(out)]
    generate = Pipeline.generate
    calls = []
    seen_on_disk = []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # Ctrl-C during the fourth run: three are done
            lines = (out / "runs.jsonl").read_text().splitlines()
            results = json.loads((out / "results.json").read_text())
            seen_on_disk.append((len(lines), results["runs_measured"], len(results["rows"])))
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", interrupted)
    assert main(argv) == 130
    printed, said = capsys.readouterr()
    # each run was on disk as soon as it ended, before the bench stopped
    assert seen_on_disk == [(3, 3, 2)]
    assert "bench: stopped after 3 of 8 measured runs" in said
    assert "task: completion" in printed and "task: free" not in printed
    results = json.loads((out / "results.json").read_text())
    assert not results["complete"] and (results["runs_measured"], results["runs_planned"]) == (3, 8)
    # round 1: plain, ngram-mod; round 2 (rotated): ngram-mod, then Ctrl-C in plain's run
    assert {row["system"]: row["runs"] for row in results["rows"]} == {"plain": 1, "ngram-mod": 2}
    assert all(row["task"] == "completion" and row["exact_match_rate"] == 1.0 for row in results["rows"])
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["system"] for r in records] == ["plain", "ngram-mod", "ngram-mod"]
    assert all(len(r["tokens"]) == 8 and r["stats"]["n_generated"] == 8 for r in records)
    markdown = (out / "results.md").read_text()
    assert "partial: 3 of 8 measured runs" in markdown and "| ngram-mod |" in markdown
    assert "machine: " in markdown and set(results["machine"]) >= {"load_start", "load_end"}
    assert not list(out.glob("*.png")) and not list(out.glob("*.tmp"))


def test_a_finished_bench_says_so_and_a_failed_one_keeps_its_runs(pair, tmp_path, capsys, monkeypatch):
    target, _ = pair
    argv = ["bench", "-m", str(target), "--systems", "plain", "--no-hf", "--tasks", "completion,free"]
    argv += ["--prompts-per-task", "1", "-n", "6", "--runs", "1", "--warmup", "0", "--no-plots"]
    assert main([*argv, "--out", str(tmp_path / "done")]) == 0
    results = json.loads((tmp_path / "done" / "results.json").read_text())
    assert results["complete"] and results["runs_measured"] == 2
    assert "partial" not in (tmp_path / "done" / "results.md").read_text()
    assert "runs.jsonl" in capsys.readouterr().err
    generate = Pipeline.generate
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the machine went away")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", failing)
    with pytest.raises(RuntimeError):
        main([*argv, "--out", str(tmp_path / "failed")])
    assert len((tmp_path / "failed" / "runs.jsonl").read_text().splitlines()) == 1
    results = json.loads((tmp_path / "failed" / "results.json").read_text())
    assert not results["complete"] and [row["task"] for row in results["rows"]] == ["completion"]


def test_adaptive_comparison_reads_only_the_systems_a_partial_bench_ran():
    def row(task: str, system: str, speedup: float) -> dict:
        return {"task": task, "system": system, "family": "ours", "speedup_vs_plain": speedup}

    rows = [
        row("completion", "plain", 1.0),
        row("completion", "draft", 2.0),
        row("completion", "ngram-mod", 3.0),
        row("completion", "draft@adaptive", 2.5),
        row("free", "plain", 1.0),
        row("free", "draft", 1.5),
        row("free", "draft@adaptive", 1.2),  # ngram-mod has not run on free yet
    ]
    tasks = static_comparison(rows)["draft@adaptive"]["tasks"]
    assert tasks["free"]["best_any_system"] == "draft" and tasks["completion"]["best_any"] == 3.0
