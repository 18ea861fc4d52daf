"""The side-by-side benchmark with llama.cpp's own programs (`specdecode.compare.llama_tools`).

- What it reads from the programs' output: llama.cpp's own line formats, the generated text.
- Without the programs (`make llama-tools`) it says how to build them; with them, a short run
  on the tests' GGUF files gives both sides' figures and our speculative output equals plain.
- Chat runs on a GGUF pair: the programs' command lines, the prompt's tokens equal on both
  sides (BOS included once), and the table's arithmetic.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdecode.chat import ChatPrompt, encode, encode_rendered
from specdecode.compare import llama_chat, llama_programs, llama_tools
from specdecode.errors import SpecdecodeError
from specdecode.testing import make_tokenizer

pytest.importorskip("llama_cpp")

SPECULATIVE_SIMPLE_TAIL = """\
0.00.516.174 I encoded   12 tokens in    0.016 seconds, speed:  751.974 t/s
0.00.516.195 I decoded   65 tokens in    0.371 seconds, speed:  174.976 t/s
0.00.516.205 I
0.00.516.215 I n_draft   = 16
0.00.516.224 I n_predict = 65
0.00.516.234 I n_drafted = 31
0.00.516.244 I n_accept  = 26
0.00.516.254 I accept    = 83.871%
"""
COMPLETION_TAIL = """\
0.00.371.162 I common_perf_print:    sampling time =       3.69 ms
0.00.371.173 I common_perf_print: prompt eval time =      15.60 ms /    12 tokens (    1.30 ms per token)
0.00.371.174 I common_perf_print:        eval time =     292.58 ms /   127 runs   (    2.30 ms per token)
"""


def test_it_reads_llama_cpps_lines():
    decoded = llama_programs.DECODED.search(SPECULATIVE_SIMPLE_TAIL)
    assert (decoded[1], decoded[2]) == ("65", "0.371")
    assert llama_programs.DRAFTED.search(SPECULATIVE_SIMPLE_TAIL)[1] == "31"
    assert llama_programs.ACCEPTED.search(SPECULATIVE_SIMPLE_TAIL)[1] == "26"
    evaluated = llama_programs.EVAL.search(COMPLETION_TAIL)  # not the prompt's line
    assert (evaluated[1], evaluated[2]) == ("292.58", "127")
    assert llama_programs.SAMPLING.search(COMPLETION_TAIL)[1] == "3.69"


def test_it_compares_texts_up_to_llama_cpps_extra_token():
    stdout = "\n\n<|bos|>def f(x):\n    return x + 1\n\n\n"
    theirs = llama_programs.generated_text(stdout, "def f(x):")
    assert theirs.startswith("\n    return x + 1")
    assert llama_programs.same_text("\n    return x", theirs)
    assert not llama_programs.same_text("\n    return y", theirs)
    assert llama_programs.generated_text(stdout, "absent") == ""


def test_without_the_programs_it_says_how_to_build_them(tmp_path):
    with pytest.raises(SpecdecodeError, match="make llama-tools"):
        llama_programs.run_tool(tmp_path, "llama-lookup", [], llama_programs.DECODED)


TOOLS = llama_programs.DEFAULT_TOOLS
needs_tools = pytest.mark.skipif(
    not (TOOLS / "llama-speculative-simple").exists(),
    reason="llama.cpp's programs not built (make llama-tools)",
)


@needs_tools
def test_a_short_side_by_side_run(gguf_files, tmp_path):
    folder = tmp_path / "pair"
    (folder / "llama.cpp").mkdir(parents=True)
    for role in ("target", "draft"):
        (folder / "llama.cpp" / f"{role}.gguf").symlink_to(Path(gguf_files[f"{role}-q8_0.gguf"]))
    systems = tuple(s for s in llama_programs.SYSTEMS if s.name in ("plain", "draft"))
    results, invariant = llama_tools.measure_pair(folder, ["def wrap(text):"], 16, 1, TOOLS, systems)
    assert invariant  # Q8_0
    for side in ("ours", "llama.cpp"):
        assert results.rate("draft", side) > 0 and results.rate("plain", side) > 0
    assert results.same_as_plain["draft"] == [True]


VERBOSE_PROMPT = """\
0.03.899.115 I llama_completion: number of tokens in prompt = 3
0.03.899.117 I 151644 -> '<|im_start|>'
0.03.899.118 I   8948 -> 'user'
0.03.899.119 I    198 -> '
'
0.03.899.120 I    525 -> ' are'
"""
TEMPLATE_WITH_BOS = (
    "<|bos|>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_runs_give_llama_cpps_programs_the_settings_asked():
    systems = {s.name: s for s in llama_programs.chat_tool_systems()}
    assert list(systems) == [
        "llama-completion",
        "llama-speculative-simple 3/0",
        "llama-speculative-simple 8/0.5",
        "llama-speculative-simple 16/0.75",
        "llama-lookup",
    ]
    target, draft, prompt = Path("t.gguf"), Path("d.gguf"), Path("p.txt")
    for name, (n_max, p_min) in zip(
        list(systems)[1:4], [("3", "0.0"), ("8", "0.5"), ("16", "0.75")], strict=True
    ):
        arguments = llama_programs.tool_arguments(systems[name], target, draft, prompt, 64)
        assert arguments[arguments.index("--spec-type") + 1] == "draft-simple"  # not the default
        assert arguments[arguments.index("-md") + 1] == "d.gguf"
        assert arguments[arguments.index("--spec-draft-n-max") + 1] == n_max
        assert arguments[arguments.index("--spec-draft-p-min") + 1] == p_min
    completion = llama_programs.tool_arguments(systems["llama-completion"], target, draft, prompt, 64)
    assert {"-no-cnv", "--verbose-prompt", "--no-escape"} <= set(completion)
    for flag, value in (("-m", "t.gguf"), ("-f", "p.txt"), ("-n", "64"), ("-t", "1"), ("--temp", "0")):
        assert completion[completion.index(flag) + 1] == value


def test_llama_cpp_reads_the_same_prompt_tokens_as_ours():
    """A template that writes BOS: llama.cpp adds BOS itself, so its text goes without it."""
    tokenizer = make_tokenizer(320)
    text = ChatPrompt(template=TEMPLATE_WITH_BOS).text(tokenizer, "def f(x):", "test")
    assert text.startswith("<|bos|>")
    ours = encode_rendered(tokenizer, text)
    theirs = llama_programs.tool_prompt(text, tokenizer.bos_token, adds_bos=True)
    assert [tokenizer.bos_token_id, *encode(tokenizer, theirs, add_special=False)] == ours
    assert llama_programs.tool_prompt(text, tokenizer.bos_token, adds_bos=False) == text
    assert llama_programs.prompt_tokens(VERBOSE_PROMPT) == [151644, 8948, 198]
    with pytest.raises(SpecdecodeError, match="verbose-prompt"):
        llama_programs.prompt_tokens("no list")


def test_it_reads_each_programs_generated_tokens_and_times():
    systems = {s.name: s for s in llama_programs.chat_tool_systems()}
    assert llama_programs.tool_figures(systems["llama-completion"], COMPLETION_TAIL) == (127, 0.29627, 0, 0)
    figures = llama_programs.tool_figures(systems["llama-speculative-simple 3/0"], SPECULATIVE_SIMPLE_TAIL)
    assert figures == (65, 0.371, 31, 26)
    assert llama_programs.COLOUR.sub("", "\x1b[36mdef\x1b[37m f") == "def f"


def test_chat_rows_are_medians_over_rounds_of_sums_over_prompts():
    def tally(tokens, seconds, cpu_seconds, generation_seconds, drafted=0, accepted=0):
        return llama_programs.Tally(tokens, seconds, drafted, accepted, cpu_seconds, generation_seconds)

    tallies = {
        "plain": [tally(64, 4.0, 2.0, 3.2), tally(64, 2.0, 1.0, 1.6), tally(64, 8.0, 4.0, 6.4)],
        "llama-lookup": [tally(60, 6.0, 3.0, 2.0, 8, 4)] * 3,
    }
    rows = llama_chat.chat_rows(tallies, {"plain": [True] * 3, "llama-lookup": [True, False, True]})
    plain, lookup = rows
    assert (plain["side"], plain["tokens_per_second"], plain["tokens_per_cpu_second"]) == ("ours", 16.0, 32.0)
    assert plain["generation_tokens_per_second"] == 20.0 and plain["tokens"] == 192
    assert lookup["side"] == "llama.cpp" and (lookup["accepted"], lookup["drafted"]) == (12, 24)
    assert (lookup["same_as_plain"], lookup["prompts"]) == (2, 3)
    assert plain["generation_speedup"] == 1.0 and lookup["generation_speedup"] is None  # no llama-completion


def test_chat_figures_are_given_per_task_and_over_all_tasks(capsys):
    def tally(tokens, seconds, cpu_seconds):
        return llama_programs.Tally(tokens, seconds, cpu_seconds=cpu_seconds, generation_seconds=seconds)

    results = llama_chat.ChatResults(
        tallies={
            "chat-edit": {
                "plain": [tally(64, 2.0, 2.0), tally(64, 4.0, 4.0)],
                "llama-lookup": [tally(64, 1.0, 1.0)] * 2,
            },
            "chat-qa": {
                "plain": [tally(32, 2.0, 1.0), tally(32, 2.0, 1.0)],
                "llama-lookup": [tally(32, 4.0, 4.0)] * 2,
            },
        },
        agree={
            "chat-edit": {"plain": [True, True], "llama-lookup": [True, False]},
            "chat-qa": {"plain": [True, True], "llama-lookup": [True, True]},
        },
    )
    tallies, agree = results.total()
    assert [(t.tokens, t.seconds, t.cpu_seconds) for t in tallies["plain"]] == [
        (96, 4.0, 3.0),
        (96, 6.0, 5.0),
    ]
    assert agree["llama-lookup"] == [True, False, True, True]
    total = llama_chat.chat_rows(tallies, agree)
    by_task = {
        task: llama_chat.chat_rows(results.tallies[task], results.agree[task]) for task in results.tallies
    }
    assert [row["tokens_per_cpu_second"] for row in by_task["chat-edit"]] == [24.0, 64.0]  # medians of 32, 16
    assert [row["tokens_per_cpu_second"] for row in by_task["chat-qa"]] == [32.0, 8.0]
    assert [row["tokens_per_cpu_second"] for row in total] == [
        25.6,
        19.2,
    ]  # over the tasks' sums: lookup loses
    llama_chat.print_task_table(by_task, total)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(
        "| system | side | chat-edit tok/CPU-s (marginal) | chat-edit tok/s | chat-qa tok/CPU-s (marginal)"
    )
    assert lines[2] == "| plain | ours | 24.0 | 24.0 | 32.0 | 16.0 | 25.6 | 20.0 |"
    assert lines[3] == "| llama-lookup | llama.cpp | 64.0 | 64.0 | 8.0 | 8.0 | 19.2 | 19.2 |"


def test_marginal_rate_leaves_out_what_a_one_token_run_costs():
    """Loading, the prompt and the first token cost the same in a run of one token: the
    marginal rate is what the tokens past it cost, summed over prompts like the rest."""
    edit = llama_programs.Tally(129, 3.0, cpu_seconds=2.5)
    edit.add_baseline(1, 1.5)
    qa = llama_programs.Tally(65, 1.0, cpu_seconds=1.0)
    qa.add_baseline(2, 0.5)
    assert edit.marginal_cpu_rate == 128.0 and qa.marginal_cpu_rate == 126.0
    total = llama_chat.summed([edit, qa])
    assert (total.baseline_tokens, total.baseline_cpu_seconds) == (3, 2.0)
    assert total.marginal_cpu_rate == (128 + 63) / 1.5
    assert llama_programs.Tally(10, 1.0, cpu_seconds=0.0).marginal_cpu_rate == 0.0
    rows = llama_chat.chat_rows({"plain": [edit, edit, qa]}, {"plain": [True] * 3})
    assert rows[0]["marginal_tokens_per_cpu_second"] == 128.0  # the median over rounds


def test_it_takes_export_folders_or_a_gguf_pair(monkeypatch, capsys):
    for argv in ([], ["--target", "t.gguf"], ["folder", "--target", "t.gguf", "--draft", "d.gguf"]):
        monkeypatch.setattr(sys, "argv", ["llama_tools", *argv])
        with pytest.raises(SystemExit):
            llama_tools.main()
        assert "--target and --draft" in capsys.readouterr().err
    json_file = Path("missing-folder", "figures.json")
    monkeypatch.setattr(
        sys, "argv", ["llama_tools", "--target", "t.gguf", "--draft", "d.gguf", "--json", str(json_file)]
    )
    with pytest.raises(SystemExit):
        llama_tools.main()
    assert "--json: no folder missing-folder" in capsys.readouterr().err


@needs_tools
@pytest.mark.parametrize("templated", [True, False])
def test_a_short_chat_run_side_by_side(gguf_files, templated):
    """Both sides read the same prompt tokens (llama-completion's list is checked) and every
    system of ours starts as our plain answer does, through a chat template or raw (--raw);
    templated, also ours on weights not repacked, over two tasks."""
    chat = ChatPrompt(template=TEMPLATE_WITH_BOS) if templated else None
    target, draft = Path(gguf_files["target-q8_0.gguf"]), Path(gguf_files["draft-q8_0.gguf"])
    prompts = [("free", "def wrap(text):"), ("edit", "x = 1")] if templated else [("free", "def wrap(text):")]
    results = llama_chat.measure_chat(target, draft, prompts, 8, 1, TOOLS, chat, no_repack=templated)
    assert list(results.tallies) == [task for task, _ in prompts]
    ours = [
        *llama_chat.OURS_CHAT,
        *((name + " -nr" for name in llama_chat.OURS_CHAT[:2]) if templated else ()),
    ]
    rows = {row["system"]: row for row in llama_chat.chat_rows(*results.total())}
    assert set(rows) == {*ours, *(s.name for s in llama_programs.chat_tool_systems())}
    for row in rows.values():
        assert row["tokens"] > 0 and row["tokens_per_cpu_second"] > 0, row
    assert all(rows[name]["same_as_plain"] == len(prompts) and rows[name]["side"] == "ours" for name in ours)
