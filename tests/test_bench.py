"""`specdecode bench`: the suite runs, writes what it promises, and its arithmetic is right.

Speed itself is never asserted here (the machine is noisy); the benchmark is a command.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re

import pytest

from specdecode.backends.hf import HFBackend
from specdecode.bench import drafting, passes
from specdecode.bench.command import answer_text
from specdecode.bench.machine import CPU_FLAGS, Machine, git_commit, machine_line
from specdecode.bench.metrics import ideal_speedup, solve_alpha, summarize
from specdecode.bench.names import AGENT_TASKS, ALL_TASKS, CHAT_TASKS, TASK_NAMES
from specdecode.bench.plots import _pooled_positions, acceptance_by_position
from specdecode.bench.suite import Measurement, rounds, run_suite
from specdecode.bench.systems import build_systems, quick_system_names
from specdecode.bench.tasks import Task, as_chats, build_tasks
from specdecode.chat import ChatPrompt
from specdecode.cli import build_parser, main
from specdecode.config import NgramModConfig
from specdecode.errors import SpecdecodeError
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats
from specdecode.strategies import DraftModelConfig, NgramSettings
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model

MACHINE_KEYS = {"cpu", "cpu_flags", "bf16", "threads", "dtypes", "load_start", "load_end", "date", "commit"}


def within_the_cores(cpu_seconds: float, seconds: float) -> bool:
    """CPU time spent, above zero and no more than every core busy for the wall-clock time (with
    room for the clocks' accounting)."""
    return 0 < cpu_seconds <= 1.1 * seconds * (os.cpu_count() or 1) + 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), init_std=0.5, seed=3, max_positions=1024)
    draft = perturbed_copy(target, 0.02)
    return save_model(root / "target", target, tokenizer), save_model(root / "draft", draft, tokenizer)


def test_quick_run_writes_json_markdown_and_plots_with_its_systems(pair, tmp_path, capsys):
    target, draft = pair
    out = tmp_path / "results"
    argv = ["bench", "--quick", "-m", str(target), "-md", str(draft), "-n", "12", "--out", str(out)]
    assert main([*argv, "--sweep", "2,8"]) == 0
    printed, progress = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    expected = quick_system_names(has_draft=True, include_hf=True)
    assert results["systems"] == expected
    assert expected == ["plain", "draft", "ngram-mod,ngram-map-k4v,draft@adaptive", "hf-plain", "hf-assisted"]
    assert results["complete"] and results["runs_measured"] == results["runs_planned"] == 5 * len(expected)
    rows = results["rows"]
    assert {(r["task"], r["system"]) for r in rows} == {(t, s) for t in TASK_NAMES for s in expected}
    for row in rows:
        assert row["tokens_per_second"] > 0 and row["runs"] == 1
        assert within_the_cores(row["cpu_seconds"], row["seconds"]), row
        assert row["tokens_per_cpu_second"] == 12 / row["cpu_seconds"]
        if row["family"] == "ours":  # greedy and seeded speculation change nothing
            assert row["exact_match_rate"] == 1.0, row
        elif row["task"] == "free-t1":  # Hugging Face's sampler draws other tokens
            assert row["exact_match_rate"] is None
    assert [s["draft_max"] for s in results["draft_max_sweep"]] == [2, 8]
    for name in ("speedup_by_task.png", "acceptance_by_position.png", "speedup_vs_draft_max.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "task: editing" in printed
    markdown = (out / "results.md").read_text()
    assert "| system | tok/s (min–max) | tok/CPU-s |" in markdown and "| hf-assisted |" in markdown
    assert machine_line(results["machine"]) in printed.splitlines() and "machine: " in markdown
    # stderr is no terminal here: one line per run (one warm-up round before the first prompt,
    # then measured runs, sweep included), no bar
    runs = [line for line in progress.splitlines() if line.startswith("bench: [")]
    total = (len(TASK_NAMES) + 1) * len(expected) + 2 * 3  # the sweep: plain and draft-max 2, 8
    assert len(runs) == total and runs[-1].startswith(f"bench: [{total}/{total}] task completion 1/1")
    assert runs[0].endswith("tok/s") and "system plain (warm-up)" in runs[0]
    assert sum("(warm-up)" in line for line in runs) == len(expected) + 3
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records].count("suite") == len(TASK_NAMES) * len(expected)
    assert [r["part"] for r in records].count("sweep") == 3
    assert all(len(r["tokens"]) == 12 and r["cpu_seconds"] > 0 for r in records)
    assert set(results["machine"]) >= MACHINE_KEYS and results["machine"]["cpu"] and results["date"]
    assert results["machine"]["dtypes"] == {"target": "float64", "draft": "float64"}


def test_hugging_face_greedy_generate_equals_our_plain_output(pair, tmp_path):
    target, draft = pair
    systems = "plain,ngram-simple+draft,hf-plain,hf-assisted"  # a chain's strategies joined by +
    argv = ["bench", "-m", str(target), "-md", str(draft), "--systems", systems]
    argv += [
        "-p",
        "def f(x):\n    return",
        "-n",
        "16",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
    ]
    assert main([*argv, "--sweep", "0", "--no-plots"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["plain", "ngram-simple,draft", "hf-plain", "hf-assisted"]
    assert all(r["exact_match_rate"] == 1.0 for r in rows)  # float64: no numeric ties
    assert not list(tmp_path.glob("*.png"))


def test_bad_arguments_are_refused(pair, tmp_path, capsys):
    target, _ = pair
    base = ["bench", "-m", str(target), "--out", str(tmp_path), "--quick"]
    assert main([*base, "--systems", "plain,draft"]) == 2  # no draft model given
    assert "unknown or unavailable system 'draft'" in capsys.readouterr().err
    assert main([*base, "--tasks", "poetry"]) == 2
    assert "unknown task 'poetry'" in capsys.readouterr().err
    assert main([*base, "-p", "x" * 3000, "-n", "8"]) == 2  # longer than the context
    assert "context" in capsys.readouterr().err
    assert main([*base, "--tasks", "editing,chat-edit"]) == 2  # a chat task without --chat
    assert "chat-edit is a chat model's task: add --chat" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_static_settings_run_as_systems_and_adaptive_ones_are_compared_with_them(pair, tmp_path, capsys):
    target, draft = pair
    argv = ["bench", "-m", str(target), "-md", str(draft), "--systems", "draft,draft@adaptive,ngram-mod"]
    argv += ["--static-grid", "0.3,0.75:2,16", "--tasks", "completion,free-t1", "--prompts-per-task", "1"]
    argv += ["-n", "12", "--runs", "1", "--warmup", "0", "--sweep", "0", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    # the run's own setting (0.75 / 16) is the classic system itself
    assert results["systems"] == [
        "plain", "ngram-mod", "draft", "draft@adaptive", "draft@0.3/2", "draft@0.3/16", "draft@0.75/2",
    ]  # fmt: skip
    assert all(row["exact_match_rate"] == 1.0 for row in results["rows"])
    comparison = results["static_comparison"]["draft@adaptive"]
    assert set(comparison["tasks"]) == {"completion", "free-t1"}
    speedups = {(r["task"], r["system"]): r["speedup_vs_plain"] for r in results["rows"]}
    completion = comparison["tasks"]["completion"]
    assert completion["best_static"] == max(
        speedups["completion", name] for name in results["systems"][2:] if name != "draft@adaptive"
    )
    assert completion["best_any"] == max(
        speedups["completion", name] for name in results["systems"][1:] if name != "draft@adaptive"
    )
    assert completion["classic"] == speedups["completion", "draft"]
    assert "draft@adaptive (x plain) against the classic settings" in capsys.readouterr().out


def test_static_settings_are_checked(pair, tmp_path, capsys):
    target, draft = pair
    base = ["bench", "-m", str(target), "-md", str(draft), "--quick", "--out", str(tmp_path)]
    assert main([*base, "--systems", "draft@fast/8"]) == 2
    assert "P/N" in capsys.readouterr().err
    assert main([*base, "--systems", "draft@1.5/8"]) == 2
    assert main([*base, "--systems", "nothing@0.3/8"]) == 2
    assert main([*base, "--static-grid", "0.3"]) == 2
    assert "--static-grid" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_tasks_come_from_held_out_files_and_are_deterministic():
    first, second = build_tasks(TASK_NAMES, 3), build_tasks(TASK_NAMES, 3)
    assert first == second
    by_name = {task.name: task for task in first}
    assert all(len(task.prompts) == 3 for task in first)
    assert all(p.startswith("# ") and p.endswith("# After:\n") for p in by_name["editing"].prompts)
    assert all(p.endswith('DOC = """') for p in by_name["extraction"].prompts)
    assert all(p.lstrip().startswith(("def ", "async def ")) for p in by_name["completion"].prompts)
    assert len({p for task in first for p in task.prompts}) == 12  # free-t1 samples free's prompts
    assert by_name["free-t1"].prompts == by_name["free"].prompts
    assert by_name["free-t1"].sampling(1) == SamplingParams(temperature=1.0, seed=1)
    assert by_name["free"].sampling(1).greedy
    with pytest.raises(SpecdecodeError, match="prompts per task"):
        build_tasks(["free"], 0)


def test_agent_and_chat_tasks_are_built_deterministically_and_apart_from_the_default_ones():
    tasks = build_tasks(ALL_TASKS, 2)
    assert tasks == build_tasks(ALL_TASKS, 2)
    by_name = {task.name: task for task in tasks}
    assert not set(AGENT_TASKS + CHAT_TASKS) & set(TASK_NAMES)  # run only when asked
    for name in AGENT_TASKS:  # sessions of three turns, the later ones asking to write it again
        task = by_name[name]
        assert [len(task.turns(i)) for i in range(2)] == [3, 3]
        assert all("again" in turn for i in range(2) for turn in task.turns(i)[1:])
    edit = by_name["agent-edit"].turns(0)
    assert "# Before:\n" in edit[0] and all(turn.endswith("# After:\n") for turn in edit)
    record = by_name["agent-records"].turns(1)[0]
    assert record.startswith("Record:\n{") and '"reviewed": false' in record
    for name in ("chat-edit", "chat-complete"):
        assert all("```python\ndef " in prompt for prompt in by_name[name].prompts)
    summarised, asked = by_name["chat-summarise"].prompts, by_name["chat-qa"].prompts
    assert all(p.startswith("Summarise this text") for p in summarised)
    assert not {p.split("\n\n", 1)[1] for p in summarised} & {p.rsplit("\n\n", 1)[0] for p in asked}
    assert by_name["chat-free"].prompts[0].startswith("What is the Python module `")
    # no function serves two tasks
    sources = [p for task in tasks if task.name not in ("free", "free-t1") for p in task.prompts]
    assert len(set(sources)) == len(sources)


def test_a_session_runs_its_turns_on_one_pipeline_with_its_own_answers(pair, exactness_log):
    """Each turn's prompt is the conversation so far, on one pipeline per session (its n-gram
    pool and KV cache kept between turns), and every turn's tokens equal plain generation's."""
    target = HFBackend.load(pair[0])
    ngram = NgramSettings(mod=NgramModConfig(n_match=4, n_min=1, n_max=16))
    systems = build_systems(["plain", "ngram-mod"], target, None, DraftModelConfig(), ngram)
    made = []
    for system in systems:
        system.make_pipeline = functools.partial(lambda make: made.append(1) or make(), system.make_pipeline)
    session = Task("agent", ("def f(x):\n    return x",), follow_ups=(("\n# again:\n", "\n# once more:\n"),))
    prompts: list[str] = []

    def encode(text: str) -> list[int]:
        prompts.append(text)
        return target.tokenize(text)

    decode = functools.partial(answer_text, target)
    measured = run_suite([session], systems, encode, 24, runs=1, warmup=0, decode=decode)
    assert [(m.system, m.turn) for m in measured] == [
        (s, t) for s in ("plain", "ngram-mod") for t in range(3)
    ]
    plain, ngram = measured[:3], measured[3:]
    assert prompts[:3] == prompts[3:]  # exact answers: the same prompts turn after turn
    assert prompts[1] == prompts[0] + decode(plain[0].tokens) + "\n# again:\n"
    assert prompts[2].startswith(prompts[1]) and prompts[2].endswith("\n# once more:\n")
    for ours, reference in zip(ngram, plain, strict=True):
        assert ours.tokens == reference.tokens
        exactness_log.record("bench/session", "ngram-mod", ours.stats)
    assert len(made) == 2  # one pipeline per session and system
    rows = summarize(measured)
    assert [r["exact_match_rate"] for r in rows] == [1.0, 1.0] and rows[1]["runs"] == 3
    with pytest.raises(SpecdecodeError, match="needs the answers' text"):
        run_suite([session], systems, encode, 4, runs=1, warmup=0)


def test_bench_runs_sessions_as_chats_and_counts_every_turn(pair, tmp_path, capsys):
    target, draft = pair
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")
    argv = ["bench", "-m", str(target), "-md", str(draft), "--systems", "plain,ngram-mod,draft"]
    argv += ["--tasks", "agent-records", "--prompts-per-task", "1", "-n", "8", "--runs", "1", "--warmup", "0"]
    argv += [
        "--chat",
        "--chat-template-file",
        str(template),
        "--no-plots",
        "--sweep",
        "0",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (turns,) = results["tasks"]["agent-records"]
    assert len(turns) == 3 and turns[0].startswith("Record:")
    assert [(r["system"], r["runs"], r["exact_match_rate"]) for r in results["rows"]] == [
        ("plain", 3, 1.0),
        ("ngram-mod", 3, 1.0),
        ("draft", 3, 1.0),
    ]
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: [")]
    assert len(progress) == 9 and progress[-1].startswith("bench: [9/9]") and "turn 3/3" in progress[-1]


def test_a_session_as_a_chat_renders_the_whole_conversation():
    tokenizer = make_tokenizer(320)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (task,) = as_chats(
        [Task("s", ("hi",), follow_ups=(("more",),))],
        lambda turns: ChatPrompt().text(tokenizer, turns, "test"),
    )
    assert task.prompt_text(0) == "<|user|>hi\n<|assistant|>"
    assert (
        task.conversation(["hi", "yes", "more"])
        == "<|user|>hi\n<|assistant|>yes\n<|user|>more\n<|assistant|>"
    )


def test_a_tasks_prompts_do_not_depend_on_the_other_tasks_asked():
    alone = build_tasks(["completion"], 2)[0]
    assert build_tasks(["extraction", "completion"], 2)[1] == alone
    assert build_tasks(["free", "completion", "editing"], 2)[1] == alone


def test_rounds_rotate_the_order_after_warm_up():
    plan = rounds(["a", "b", "c"], runs=3, warmup=1)
    assert plan == [
        (False, ["a", "b", "c"]),
        (True, ["a", "b", "c"]),
        (True, ["b", "c", "a"]),
        (True, ["c", "a", "b"]),
    ]
    with pytest.raises(SpecdecodeError):
        rounds(["a"], runs=0, warmup=0)


def test_ideal_speedup_inverts_the_expected_tokens_per_pass():
    for alpha in (0.0, 0.3, 0.8, 0.95):
        for gamma in (1, 4, 8):
            tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
            assert math.isclose(solve_alpha(tokens, gamma), alpha, abs_tol=1e-9)
            assert math.isclose(ideal_speedup(alpha, gamma, 0.0), tokens)
    # Leviathan et al.: alpha 0.8, gamma 4, c 0.1 gives about 2.4
    assert math.isclose(ideal_speedup(0.8, 4, 0.1), (1 - 0.8**5) / (0.2 * 1.4))
    assert ideal_speedup(1.0, 8, 0.0) == 9
    assert solve_alpha(1.0, 8) == 0.0
    # a verify pass that costs twice a plain step halves what drafting can give
    assert math.isclose(ideal_speedup(0.8, 4, 0.1, 2.0), (1 - 0.8**5) / (0.2 * 2.4))


def test_the_ideal_speedup_prices_the_verify_pass_as_measured_against_plain_steps():
    """On a CPU a pass of many rows costs more than one: long drafts must not look free."""

    def run(system: str, passes: int, t_verify: float, drafted: int, emitted: int) -> Measurement:
        stats = GenerationStats(
            n_passes=passes, n_step_tokens=emitted, t_verify=t_verify, t_generation=t_verify
        )
        stats.totals.n_drafts, stats.totals.n_drafted = passes if drafted else 0, drafted
        return Measurement("completion", 0, system, "ours", t_verify, t_verify, [0] * emitted, stats)

    plain = run("plain", 64, 0.64, 0, 64)  # 10 ms a step
    long = run("draft", 8, 0.16, 128, 64)  # 16 drafted a pass, verified in 20 ms: v = 2
    rows = {row["system"]: row for row in summarize([plain, long])}
    draft = rows["draft"]
    assert math.isclose(draft["pass_ratio"], 2.0) and draft["cost_ratio"] == 0.0
    assert math.isclose(draft["ideal_speedup"], draft["ideal_speedup_flat"] / 2)
    assert math.isclose(draft["ideal_speedup"], 8 / 2, rel_tol=1e-6)  # 8 tokens a pass, at 2 steps' cost
    assert rows["plain"].get("ideal_speedup") is None or rows["plain"]["draft_tokens_per_pass"] == 0


def test_summary_ratios_and_exact_match():
    def measurement(system: str, family: str, seconds: float, tokens: list[int]) -> Measurement:
        return Measurement("editing", 0, system, family, seconds, seconds / 2, tokens, None)

    rows = summarize(
        [
            measurement("plain", "ours", 2.0, [1, 2, 3, 4]),
            measurement("hf-plain", "hf", 4.0, [1, 2, 3, 4]),
            measurement("hf-prompt-lookup", "hf", 1.0, [1, 2, 3, 5]),
        ]
    )
    plain, hf, lookup = rows
    assert plain["tokens_per_second"] == 2.0 and plain["speedup_vs_hf_plain"] == 2.0
    assert plain["tokens_per_cpu_second"] == 4.0 and plain["cpu_seconds"] == 1.0
    assert lookup["speedup_vs_plain"] == 2.0 and lookup["speedup_vs_hf_plain"] == 4.0
    assert hf["exact_match_rate"] == 1.0 and lookup["exact_match_rate"] == 0.0


def test_systems_start_with_plain_whatever_the_order_asked(pair):
    target = HFBackend.load(pair[0])
    systems = build_systems(
        ["hf-plain", "ngram-simple", "plain"], target, None, DraftModelConfig(), NgramSettings()
    )
    assert [s.name for s in systems] == ["plain", "ngram-simple", "hf-plain"]


def test_any_chain_of_available_strategies_is_a_system(pair):
    target = HFBackend.load(pair[0])
    names = ["ngram-mod,ngram-map-k", "ngram-simple,ngram-mod@adaptive"]
    systems = build_systems(names, target, None, DraftModelConfig(), NgramSettings())
    assert [s.name for s in systems] == ["plain", *names]
    for refused in ("ngram-simple,draft", "ngram-mod,ngram-mod", "ngram-simple,bogus"):
        with pytest.raises(SpecdecodeError, match=f"unavailable system '{refused}'"):
            build_systems([refused], target, None, DraftModelConfig(), NgramSettings())


def test_acceptance_plot_pools_positions_where_late_positions_were_never_accepted(tmp_path):
    rows = [
        {"system": "draft", "accepted_by_position": [3], "drafted_by_position": [4, 2, 1]},
        {"system": "draft", "accepted_by_position": [1, 1], "drafted_by_position": [2, 2]},
    ]
    assert _pooled_positions(rows) == ([4, 1, 0], [6, 4, 1])
    path = acceptance_by_position(rows, tmp_path / "acceptance.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_every_run_of_ours_starts_cold(pair):
    """The ngram-mod pool of one run must not replay the previous run of the same prompt."""
    target = HFBackend.load(pair[0])
    (system,) = [
        s
        for s in build_systems(["plain", "ngram-mod"], target, None, DraftModelConfig(), NgramSettings())
        if s.name == "ngram-mod"
    ]
    prompt = target.tokenize("def f(x):\n    return x")
    first, second = system.run(prompt, 40), system.run(prompt, 40)
    assert first.tokens == second.tokens
    assert first.stats.totals.n_drafted == second.stats.totals.n_drafted


def test_bench_passes_times_every_row_count_for_target_and_draft(pair, capsys):
    target, draft = pair
    args = build_parser().parse_args(["bench-passes", "-m", str(target), "-md", str(draft), "--reps", "1"])
    results = passes.run(args)
    # float64 models: hf, and the native forward (auto dtype keeps float64 once, float32 once);
    # the target's tree passes through each of them too
    configurations = [(r["model"], r["backend"], r["dtype"], r["kind"]) for r in results["rows"]]
    target_ones = [("hf", "float32"), ("native", "float32"), ("native", "float64")]
    assert configurations == [
        *(("target", backend, dtype, kind) for backend, dtype in target_ones for kind in ("chain", "tree")),
        *(("draft", backend, dtype, "chain") for backend, dtype in target_ones),
    ]
    for row in results["rows"]:
        assert [p["rows"] for p in row["passes"]] == [1, 2, 3, 5, 9, 17]
        assert all(within_the_cores(p["cpu_ms"], p["ms"]) for p in row["passes"]), row
        speeds = [(p["tokens_per_cpu_second"], 1e3 * p["rows"] / p["cpu_ms"]) for p in row["passes"]]
        assert all(math.isclose(*speed) for speed in speeds)
    assert set(results["machine"]) >= MACHINE_KEYS
    assert results["machine"]["dtypes"] == {
        "target hf": "float32",
        "target native": "float32/float64",
        "draft hf": "float32",
        "draft native": "float32/float64",
    }
    printed = capsys.readouterr().out
    assert printed.startswith(machine_line(results["machine"]) + "\n") and "tok/CPU-s" in printed


def test_bench_draft_times_every_model_free_strategy_in_wall_and_cpu_time(capsys):
    argv = ["bench-draft", "--history", "2048", "--calls", "20", "--suffix-store", "5000"]
    results = drafting.run(build_parser().parse_args(argv))
    strategies = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix"]
    assert [row["strategy"] for row in results["rows"]] == [*strategies, "suffix@5000"]
    for row in results["rows"]:
        assert row["calls"] == 20 and within_the_cores(row["mean_cpu_ms"], row["mean_ms"]), row
    assert results["rows"][-1]["store_tokens"] == 5000 and results["rows"][-1]["store_mb"] > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == machine_line(results["machine"]) and "CPU ms" in printed[2]


def test_the_machine_block_says_what_ran_where_and_when():
    machine = Machine().describe({"target": "bfloat16"}, "cpu", row_invariant=True)
    assert MACHINE_KEYS | {"row_invariant"} <= set(machine) and machine["row_invariant"] is True
    assert set(machine["cpu_flags"]) == set(CPU_FLAGS) and machine["threads"] >= 1
    assert machine["commit"] is None or re.fullmatch("[0-9a-f]{40}", machine["commit"])
    assert machine["commit"] == git_commit()
    line = machine_line(machine)
    assert line.startswith(f"machine: {machine['cpu']} (") and "target bfloat16" in line
    assert "\n" not in line


def test_bench_serve_compares_threads_with_batching_and_checks_every_answer(pair, tmp_path, capsys):
    target, draft = pair
    out = tmp_path / "serve"
    argv = ["bench-serve", "-m", str(target), "-md", str(draft), "--concurrency", "1,3", "--requests", "1"]
    assert main([*argv, "-n", "6", "--prompts", "2", "--out", str(out), "--dtype", "float32"]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    systems = ["threads", "batched", "batched:draft", "batched:draft@adaptive", "batched:ngram-mod"]
    systems.append("batched:ngram-mod@adaptive")
    assert [(r["system"], r["concurrency"]) for r in rows] == [(s, c) for c in (1, 3) for s in systems]
    assert all(r["draft_tokens_per_step"] == 0 for r in rows if ":" not in r["system"])
    assert all(r["exact"] == r["requests"] and r["tokens"] == 6 * r["requests"] for r in rows)
    assert max(r["mean_batch"] for r in rows if r["system"] == "batched") > 1
    assert all(within_the_cores(r["cpu_seconds"], r["seconds"]) for r in rows)
    assert all(r["tokens_per_cpu_second"] == r["tokens"] / r["cpu_seconds"] for r in rows)
    assert set(results["machine"]) >= MACHINE_KEYS
    assert results["machine"]["dtypes"] == {"target": "float32", "draft": "float32"}
    markdown = (out / "serving.md").read_text()
    assert (out / "serving.png").is_file() and "C=3" in markdown and "tok/CPU-s" in markdown
    assert markdown.startswith("machine: ")
    assert main(["bench-serve", "-m", str(target), "--systems", "threads,fast", "--out", str(out)]) == 2
    assert "unknown system 'fast'" in capsys.readouterr().err
