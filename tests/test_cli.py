"""The `specdecode` command: output formats, the -md trap, and clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specdecode.cli import main
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Saved float64 target, a close draft, and a draft with a different vocabulary."""
    root = tmp_path_factory.mktemp("cli-models")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), init_std=0.5, seed=3)
    other_tokenizer = make_tokenizer(300, text="completely different text " * 50 + "with other merges")
    return (
        save_model(root / "target", target, tokenizer),
        save_model(root / "draft", perturbed_copy(target, 0.02), tokenizer),
        save_model(root / "other", make_llama(len(other_tokenizer), seed=4), other_tokenizer),
    )


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_equals_plain_generation(pair, capsys):
    target, draft, _ = pair
    common = ["-m", str(target), "-p", "def f(x):", "-n", "24", "--temp", "0", "--ignore-eos"]
    plain = run_json(capsys, *common, "--spec-type", "none")
    spec = run_json(
        capsys,
        *common,
        "-md",
        str(draft),
        "--draft-p-min",
        "0",
        "--draft-max",
        "6",
        "--spec-policy",
        "classic",
    )
    assert spec["tokens"] == plain["tokens"]
    assert spec["text"] == plain["text"]
    assert len(spec["tokens"]) == 24
    stats = spec["stats"]
    # -md without --spec-type enables the draft model (llama.cpp's silent trap avoided); the
    # classic policy runs it alone and on every step.
    assert [s["name"] for s in stats["strategies"]] == ["draft"]
    assert stats["totals"]["n_drafted"] > 0
    assert stats["tokens_per_pass"] > 1.0
    assert plain["stats"]["strategies"] == []


def test_m_alone_drafts_with_the_n_gram_chain_unless_classic_or_none(pair, capsys):
    """Without a draft model the adaptive default asks the model-free n-gram chain (output
    plain's); --spec-type none and --spec-policy classic (llama.cpp's behaviour) draft nothing."""
    target, _, _ = pair
    common = ["-m", str(target), "-p", "a b c d " * 4, "-n", "24", "--temp", "0", "--ignore-eos"]
    default = run_json(capsys, *common)
    assert [s["name"] for s in default["stats"]["strategies"]] == ["ngram-map-k4v", "ngram-mod"]
    for off in (["--spec-type", "none"], ["--spec-policy", "classic"]):
        plain = run_json(capsys, *common, *off)
        assert plain["stats"]["strategies"] == [] and plain["tokens"] == default["tokens"]


def test_seeded_sampling_is_reproducible_and_matches_plain(pair, capsys):
    target, draft, _ = pair
    common = [
        "-m",
        str(target),
        "-p",
        "import os",
        "-n",
        "16",
        "--temp",
        "0.8",
        "--seed",
        "7",
        "--ignore-eos",
    ]
    plain = run_json(capsys, *common, "--spec-type", "none")
    spec = run_json(capsys, *common, "-md", str(draft), "--draft-p-min", "0")
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"]["seed"] == 7


def test_plain_text_output_and_stats_block(pair, capsys):
    target, draft, _ = pair
    assert (
        main(["generate", "-m", str(target), "-md", str(draft), "-p", "x = 1", "-n", "8", "--temp", "0"]) == 0
    )
    captured = capsys.readouterr()
    assert "tokens per pass" in captured.err
    assert "strategy            draft:" in captured.err
    assert captured.out.strip() != "" or "generated" in captured.err


def test_stream_prints_the_same_text(pair, capsys):
    target, draft, _ = pair
    common = [
        "-m",
        str(target),
        "-md",
        str(draft),
        "-p",
        "def g():",
        "-n",
        "20",
        "--temp",
        "0",
        "--ignore-eos",
    ]
    expected = run_json(capsys, *common)["text"]
    assert main(["generate", "--stream", *common]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_prompt_file(pair, tmp_path, capsys):
    target, _, _ = pair
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("class A:\n")
    from_file = run_json(capsys, "-m", str(target), "-f", str(prompt), "-n", "5", "--temp", "0")
    inline = run_json(capsys, "-m", str(target), "-p", "class A:\n", "-n", "5", "--temp", "0")
    assert from_file["tokens"] == inline["tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "{missing}", "-p", "x"], "model directory not found"),
        (["-m", "{missing}.gguf", "--backend", "llama.cpp", "-p", "x"], "GGUF file not found"),
        (["-m", "{target}/config.json", "-p", "x"], "not a directory"),
        (["-m", "{target}"], "no prompt"),
        (["-m", "{target}", "-f", "{missing}"], "cannot read the prompt file"),
        (["-m", "{target}", "-p", "x " * 300, "-c", "64"], "context"),
        (["-m", "{target}", "-p", "x", "-n", "100", "-c", "32"], "exceeds the context size"),
        (["-m", "{target}", "-p", "x", "--spec-type", "ngram-bogus"], "unknown --spec-type"),
        (["-m", "{target}", "-p", "x", "--spec-type", "draft"], "needs a draft model"),
        (["-m", "{target}", "-md", "{other}", "-p", "x"], "--spec-replace"),
        (["-m", "{target}", "-p", "x", "--top-p", "0"], "top_p"),
        (["-m", "{target}", "-p", "x", "--draft-max", "0", "-md", "{draft}"], "--draft-max"),
        (["-m", "{target}", "-p", "x", "--device", "tpu"], "device"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(pair, tmp_path, capsys, args, message):
    target, draft, other = pair
    paths = {"target": target, "draft": draft, "other": other, "missing": tmp_path / "nowhere"}
    argv = ["generate", *(a.format(**paths) for a in args)]
    assert main(argv) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and message in error
    assert all(line.startswith("specdecode: ") for line in phases)  # start-up phases, if any ran


def test_translation_through_text_works_for_a_different_tokenizer(pair, capsys):
    target, _, other = pair
    common = ["-m", str(target), "-p", "def h(y):", "-n", "12", "--temp", "0", "--ignore-eos"]
    plain = run_json(capsys, *common, "--spec-type", "none")
    spec = run_json(
        capsys,
        *common,
        "-md",
        str(other),
        "--spec-replace",
        "    ",
        "\t",
        "--draft-p-min",
        "0",
        "--spec-policy",
        "classic",
    )
    assert spec["tokens"] == plain["tokens"]
    assert spec["stats"]["totals"]["n_drafted"] > 0


def test_lookup_caches_through_the_command_line(pair, tmp_path, capsys):
    target, _, _ = pair
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 30)
    static, dynamic = tmp_path / "static.bin", tmp_path / "dynamic.bin"
    assert main(["lookup", "create", "-m", str(target), "-f", str(corpus), "-lcs", str(static)]) == 0
    common = ["-m", str(target), "-p", "def f(x):\n    return", "-n", "30", "--temp", "0", "--ignore-eos"]
    plain = run_json(capsys, *common, "--spec-type", "none")
    cached = ["--spec-type", "ngram-cache", "-lcs", str(static), "-lcd", str(dynamic)]
    spec = run_json(capsys, *common, *cached)
    assert spec["tokens"] == plain["tokens"]
    assert [s["name"] for s in spec["stats"]["strategies"]] == ["ngram-cache"]
    saved = dynamic.read_bytes()
    assert len(saved) > 0  # the context statistics were merged in and saved
    again = run_json(capsys, *common, *cached)  # the second run reads and grows the dynamic cache
    assert again["tokens"] == plain["tokens"]
    assert len(dynamic.read_bytes()) >= len(saved)
    assert (
        main(["lookup", "stats", "-m", str(target), "-f", str(corpus), "-c", "64", "-lcs", str(static)]) == 0
    )
    assert "n_accept" in capsys.readouterr().out
    static.write_bytes(static.read_bytes()[:-3])  # truncated: refused, the dynamic file untouched
    before = dynamic.read_bytes()
    assert main(["generate", *common, *cached]) == 2
    assert "error: " in capsys.readouterr().err
    assert dynamic.read_bytes() == before


def test_one_file_under_two_names_is_refused_for_two_cache_files(pair, tmp_path, capsys):
    target, _, _ = pair
    suffix = tmp_path / "suffix.bin"
    suffix.write_bytes(b"")
    (tmp_path / "link.bin").symlink_to(suffix)
    (tmp_path / "hard.bin").hardlink_to(suffix)
    commands = (["generate", "-p", "x"], ["serve", "--port", "0"])  # serve reads the same flags
    for name in ("link.bin", "hard.bin"):
        files = ["--spec-suffix-file", str(suffix), "-lcd", str(tmp_path / name)]
        for command in commands:
            assert main([*command, "-m", str(target), "--spec-type", "ngram-cache,suffix", *files]) == 2
            error = capsys.readouterr().err.splitlines()[-1]
            assert error.startswith("error: -lcd/--lookup-cache-dynamic and --spec-suffix-file name the same")
    assert suffix.read_bytes() == b""


def test_bundled_pair_is_used_without_m(pair, tmp_path, monkeypatch, capsys):
    import shutil

    import specdecode.defaults

    target, draft, _ = pair
    models = tmp_path / "models"
    shutil.copytree(target, models / "target")
    shutil.copytree(draft, models / "draft")
    monkeypatch.setattr(specdecode.defaults, "BUNDLED", models)
    bundled = run_json(capsys, "-p", "def f(x):", "-n", "10", "--temp", "0", "--draft-p-min", "0")
    explicit = run_json(
        capsys, "-m", str(target), "-p", "def f(x):", "-n", "10", "--temp", "0", "--spec-type", "none"
    )
    assert bundled["tokens"] == explicit["tokens"]
    assert [s["name"] for s in bundled["stats"]["strategies"]] == ["ngram-map-k4v", "ngram-mod", "draft"]


def test_missing_bundled_pair_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    import specdecode.defaults

    monkeypatch.setattr(specdecode.defaults, "BUNDLED", tmp_path / "none")
    assert main(["generate", "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert "no default model pair" in err and "specdecode train" in err


def test_start_up_phases_are_said_on_stderr(pair, capsys):
    target, draft, _ = pair
    argv = ["generate", "-m", str(target), "-md", str(draft), "-p", "x = 1", "-n", "4", "--temp", "0"]
    assert main(argv) == 0
    phases = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdecode: ")]
    assert phases[:-1] == [
        f"specdecode: loading the target model from {target}",
        f"specdecode: loading the draft model from {draft}",
        "specdecode: timing the target's passes for the adaptive policy",
    ]
    assert re.fullmatch(r"specdecode: ready in \d+\.\d s", phases[-1])
