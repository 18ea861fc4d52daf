"""`specdecode bench-serve --http`: the parts that need no llama-server, and one real run of the
measurement against our own server on the tests' tiny GGUF file."""

from __future__ import annotations

import os
import sys
import time

import pytest

from specdecode.cli import main
from specdecode.compare.against_llama import level_row, markdown, percentile, solo_answers, summarize
from specdecode.compare.http_gap import Stream, gap_figures, gap_run, pauses
from specdecode.compare.http_servers import (
    Answer,
    System,
    build_systems,
    chosen,
    closed_loop,
    counterpart,
    process_cpu_seconds,
    running,
)
from specdecode.errors import SpecdecodeError


def test_process_cpu_seconds_reads_the_process_own_time_and_refuses_a_missing_one():
    before = process_cpu_seconds(os.getpid())
    began = time.process_time()
    while time.process_time() - began < 0.3:
        sum(range(1000))
    spent = process_cpu_seconds(os.getpid()) - before
    assert 0.2 <= spent <= 1.0  # clock ticks of 10 ms; this process only, no child
    with pytest.raises(SpecdecodeError, match="CPU time of process"):
        process_cpu_seconds(2**22 + 12345)  # above any pid_max: no such process


def test_systems_pair_plain_with_plain_and_draft_with_draft(tmp_path):
    target, draft, server = tmp_path / "t.gguf", tmp_path / "d.gguf", tmp_path / "llama-server"
    systems = build_systems(target, draft, server, 1, 16, 1024)
    assert [s.name for s in systems] == ["ours", "ours-spec", "llama", "llama-draft"]
    by_name = {s.name: s for s in systems}
    assert counterpart(by_name["ours"], systems).name == "llama"
    assert counterpart(by_name["ours-spec"], systems).name == "llama-draft"
    llama_draft = by_name["llama-draft"].argv(8123)
    assert llama_draft[:3] == [str(server), "-m", str(target)] and "8123" in llama_draft
    assert llama_draft[llama_draft.index("-c") + 1] == str(16 * 1024)  # llama-server splits -c among slots
    assert llama_draft[llama_draft.index("--spec-type") + 1] == "draft-simple"
    ours_spec = by_name["ours-spec"].argv(8124)
    assert ours_spec[ours_spec.index("-md") + 1] == str(draft) and "--spec-type" not in ours_spec
    assert (
        ours_spec[ours_spec.index("--threads") + 1] == "1" and ours_spec[ours_spec.index("-c") + 1] == "1024"
    )
    plain_only = build_systems(target, None, server, 1, 4, 512)
    assert [s.name for s in plain_only] == ["ours", "ours-spec", "llama"]
    spec = plain_only[1].argv(1)
    assert spec[spec.index("--spec-type") + 1] == "ngram-mod,ngram-map-k4v"
    assert counterpart(plain_only[1], plain_only) is None
    assert [s.name for s in chosen(systems, "llama, ours")] == ["ours", "llama"]


def test_rows_count_tokens_errors_and_answers_equal_to_solo_and_to_the_other_server():
    solo = {0: [1, 2, 3], 1: [4, 5, 6]}
    other = {0: [1, 2, 3], 1: [4, 5, 7]}  # the other server rounds prompt 1 differently
    answers = [
        Answer(0, [1, 2, 3], 1.0),
        Answer(1, [4, 5, 6], 2.0),
        Answer(1, [4, 5, 9], 3.0),  # differs from its solo answer
        Answer(0, [], 0.5, "HTTP 503: busy"),
    ]
    row = level_row("ours", 4, 0, answers, 2.0, 0.5, solo, other)
    assert row["requests"] == 4 and row["errors"] == 1 and row["error_sample"] == "HTTP 503: busy"
    assert row["tokens"] == 9 and row["latencies"] == [1.0, 2.0, 3.0]
    assert row["solo_equal"] == 2 and row["cross_equal"] == 1
    assert row["solo_differs"] == [[1, 2]]  # prompt 1, from its third token
    second = level_row("ours", 4, 1, answers[:2], 1.0, 0.25, solo, other)
    [summary] = summarize([row, second])
    assert summary["tokens"] == 15 and summary["rounds"] == 2 and summary["errors"] == 1
    assert summary["tokens_per_second"] == 15 / 3.0 and summary["tokens_per_cpu_second"] == 15 / 0.75
    assert summary["round_tokens_per_second"] == [4.5, 6.0]
    assert summary["solo_equal"] == 4 and summary["cross_equal"] == 2
    assert summary["p50_s"] == 2.0 and summary["p95_s"] == 3.0  # of 1, 1, 2, 2, 3: nearest rank
    table = markdown([summary], ["ours"], [4])
    assert "| ours | 5 tok/s, 20 tok/CPU-s, p50 2.00 s, p95 3.00 s, 1 errors, solo 4/5, cross 2/5 |" in table
    [alone] = summarize([level_row("llama", 1, 0, answers[:1], 1.0, 1.0, solo, None)])
    assert alone["cross_equal"] is None and "cross" not in markdown([alone], ["llama"], [1])


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.95) == 95.0
    assert percentile([7.0], 0.95) == 7.0


def test_a_gap_counts_steps_not_the_tokens_one_step_sent():
    # llama-server sends each accepted token as an event: a burst within 2 ms is one step
    assert pauses([0.0, 0.0005, 0.001, 0.1, 0.2]) == [(0.1, 0.1), (0.2, pytest.approx(0.1))]
    before = [0.1 * i for i in range(11)]  # steps of 100 ms up to 1.0 s
    stalled = Stream([*before, 1.6, 1.7])  # 600 ms without a token while the prompt was read
    steady = Stream([t + 0.05 for t in before] + [1.15, 1.25])
    figures = gap_figures([stalled, steady], sent=1.05, answered=1.5)
    assert figures["median_pause_s"] == pytest.approx(0.1) and figures["largest_gap_s"] == pytest.approx(0.6)
    assert figures["gap_passes"] == pytest.approx(6.0) and figures["prefill_wait_s"] == pytest.approx(0.45)
    assert figures["streams_ended_early"] == 0 and figures["stream_errors"] == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--http needs --target"),
        (["-m", "TARGET"], "not -m and -md"),
        (["--target", "TARGET", "--llama-server", "missing/llama-server"], "make llama-tools"),
        (["--target", "TARGET", "--draft", "no-draft.gguf"], "--draft no-draft.gguf is not a file"),
        (["--target", "TARGET", "--rounds", "0"], "must be >= 1"),
        (["--target", "TARGET", "--systems", "ours,llama-draft"], "unknown system 'llama-draft' for --http"),
    ],
)
def test_bad_flags_are_refused_before_any_server_starts(extra, message, tmp_path, capsys):
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    server = tmp_path / "llama-server"
    server.write_text("")
    argv = ["bench-serve", "--http", "--llama-server", str(server), "--out", str(tmp_path / "out")]
    assert main([*argv, *[str(target) if a == "TARGET" else a for a in extra]]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_real_server_answers_alike_alone_and_under_load(gguf_files, tmp_path):
    """Our server on the tiny GGUF file, measured as llama-server would be: ready on /health,
    its CPU time read, every concurrent answer its solo answer, a long prompt sent while four
    streams decode."""
    command = [
        sys.executable, "-m", "specdecode.cli", "serve", "-m", str(gguf_files["target.gguf"]),
        "--port", "{port}", "--threads", "1", "-np", "5", "-c", "512",
    ]  # fmt: skip
    prompts = ["def add(a, b):\n", "class Point:\n    def __init__(self", "import os\n\n", "for i in range("]
    with running([System("ours", "ours", False, tuple(command))], tmp_path / "logs") as [server]:
        solo = solo_answers(server, prompts, 8)
        assert all(len(tokens) == 8 for tokens in solo.values())
        cpu_before = server.cpu_seconds()
        answers = closed_loop(server.port, prompts, [0, 1, 2, 3, 3, 2, 1, 0], 4, 8)
        assert server.cpu_seconds() > cpu_before
        assert sorted(a.prompt for a in answers) == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(a.error is None and a.tokens == solo[a.prompt] for a in answers)
        gap = gap_run(server, prompts, list(range(5, 105)), 512)
    assert server.process.poll() is not None  # stopped on leaving the block
    assert gap["prompt_error"] is None and gap["prompt_tokens"] == 100 and not gap["stream_errors"]
    # The tiny model's steps may all fall within SAME_STEP of each other (no pause to measure):
    # the figures' arithmetic is checked on set times above; here, that the run went through.
    # Nor is streams_ended_early checked: a busy machine may let this process read a stream's
    # first 16 events only after the server has sent all 256 of its tokens.
    assert gap["prefill_wait_s"] > 0
    assert (tmp_path / "logs" / "ours.log").is_file()
