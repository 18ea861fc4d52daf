"""The lookup tools: create, merge, stats (llama-lookup-stats' simulated verifier) and their
argparse handlers (`specdecode lookup ...`, registered by specdecode.cli.lookup_flags.add_lookup_parser).

Expected counters are derived by hand from the rules in the reference (§5.4); ties between
draft candidates never occur in these token lists.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

import pytest

from specdecode.cli import handler
from specdecode.cli.lookup_flags import add_lookup_parser
from specdecode.errors import SpecdecodeError
from specdecode.lookup import (
    LookupStats,
    create,
    format_stats,
    merge_files,
    stats,
    tokenize,
)
from specdecode.strategies.ngram_cache import NgramCache, load, save, update

CYCLE12 = [1, 2, 3] * 4


class FixedTokenizer:
    """Returns the same ids for any text, as a Hugging Face tokenizer call does."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, text: str, add_special_tokens: bool, verbose: bool) -> dict:
        return {"input_ids": self.ids}


def test_create_counts_2grams_only():
    cache = create(FixedTokenizer([0, 5, 6, 7, 5, 6, 8]), "any text")
    assert cache == {(0, 5): {6: 1}, (5, 6): {7: 1, 8: 1}, (6, 7): {5: 1}, (7, 5): {6: 1}}


def test_create_tokenizes_with_bos(tokenizer):
    text = "def f(x):\n    return x + 1\n" * 3
    ids = tokenize(tokenizer, text)
    assert ids[0] == tokenizer.bos_token_id
    expected = Counter(zip(ids, ids[1:], ids[2:], strict=False))
    cache = create(tokenizer, text)
    assert {(a, b, c): cache[(a, b)][c] for a, b, c in expected} == expected


def test_stats_one_chunk_by_hand():
    """Chunk [1,2,3]*4: nothing is drafted until out = [1,2,3,1,2,3]; then the 3-gram (1,2,3) and
    the 4-grams continue the cycle for 8 tokens, of which the 6 left in the chunk are kept."""
    result = stats([*CYCLE12, 9], 12, 8)
    assert (result.n_draft, result.n_predict, result.n_drafted, result.n_accept) == (8, 12, 8, 6)
    assert result.t_draft > 0 and result.t_draft_flat == 0.0


def test_stats_second_chunk_drafts_from_the_dynamic_cache():
    """Chunk 2 starts with an empty context, but the dynamic cache (chunk 1's counts, strict
    thresholds) drafts [3,1,2,3,1,2,3,1] from out = [1, 2]: all 8 kept. Then the context drafts
    8 more from 11 tokens, 1 kept. Totals: 8 + 16 drafted, 6 + 9 accepted."""
    dynamic: NgramCache = {}
    result = stats([*CYCLE12, *CYCLE12, 9], 12, 8, dynamic=dynamic)
    assert (result.n_predict, result.n_drafted, result.n_accept) == (24, 24, 15)
    assert dynamic[(1, 2)] == {3: 8}  # both chunks' contexts, merged in place


def test_stats_static_cache_drafts_from_the_start():
    """The static 2-grams of the chunk draft [3,1,2,3,1,2,3,1] at out = [1, 2] (8 kept),
    then the context drafts 8 from 11 tokens (1 kept)."""
    static: NgramCache = {}
    update(static, 2, 2, CYCLE12, len(CYCLE12))
    result = stats([*CYCLE12, 9], 12, 8, static=static)
    assert (result.n_drafted, result.n_accept) == (16, 9)


def test_stats_replays_only_chunks_followed_by_more_tokens():
    """llama.cpp loops while i_start + n_ctx < n_input but prints n_predict = n_input - n_input % n_ctx;
    here n_predict is what was replayed, so the two differ when n_input is a multiple of n_ctx."""
    assert stats([*CYCLE12, *CYCLE12], 12, 8).n_predict == 12  # llama.cpp prints 24
    assert stats([*CYCLE12, *CYCLE12, 1], 12, 8).n_predict == 24  # = 25 - 25 % 12
    with pytest.raises(SpecdecodeError, match="needs more than n_ctx = 12"):
        stats(CYCLE12, 12, 8)
    with pytest.raises(SpecdecodeError, match="n_ctx >= 1"):
        stats(CYCLE12, 0, 8)


def test_format_stats_matches_llama_lookup_stats():
    text = format_stats(LookupStats(8, 24, 24, 15, t_draft_flat=0.0015, t_draft=0.0024))
    assert text.splitlines() == [
        "n_draft      = 8",
        "n_predict    = 24",
        "n_drafted    = 24",
        "t_draft_flat = 1.50 ms",
        "t_draft      = 2.40 ms, 100.00 us per token, 10000.00 tokens per second",
        "n_accept     = 15",
        "accept       = 62.500%",
    ]
    empty = format_stats(LookupStats(8, 12, 0, 0, 0.0, 0.0))
    assert "accept       = nan%" in empty and math.isnan(LookupStats(8, 12, 0, 0, 0, 0).accept_rate)


def test_merge_files_adds_counts(tmp_path):
    a, b, out = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "out.bin"
    save({(1,): {2: 1}, (3, 4): {5: 2}}, a)
    save({(1,): {2: 4, 7: 1}, (6, 6, 6): {1: 1}}, b)
    merge_files([a, b], out)
    assert load(out) == {(1,): {2: 5, 7: 1}, (3, 4): {5: 2}, (6, 6, 6): {1: 1}}


def test_merge_files_with_a_bad_input_leaves_the_output_untouched(tmp_path):
    a, bad, out = tmp_path / "a.bin", tmp_path / "bad.bin", tmp_path / "out.bin"
    save({(1,): {2: 1}}, a)
    bad.write_bytes(a.read_bytes()[:-3])
    out.write_bytes(b"previous result")
    for inputs in ([a, bad], [bad, a], [a, tmp_path / "absent.bin"]):
        with pytest.raises(SpecdecodeError, match=r"bad\.bin|absent\.bin"):
            merge_files(inputs, out)
        assert out.read_bytes() == b"previous result"


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("lookup-model")
    tokenizer.save_pretrained(directory)
    return directory


def run(*argv: str | Path) -> None:
    parser = argparse.ArgumentParser()
    add_lookup_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lookup", *map(str, argv)])
    handler(args.handler)(args)


def test_create_and_stats_commands(model_dir, tokenizer, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 40, encoding="utf-8")
    static = tmp_path / "static.bin"
    run("create", "-m", model_dir, "-f", text, "-lcs", static)
    assert load(static) == create(tokenizer, text.read_text(encoding="utf-8"))
    run("stats", "-m", model_dir, "-f", text, "-c", "64", "-lcs", static, "-lcd", tmp_path / "new.bin")
    lines = dict(line.split(" = ", 1) for line in capsys.readouterr().out.splitlines())
    n_input = len(tokenize(tokenizer, text.read_text(encoding="utf-8")))
    assert int(lines["n_draft     "]) == 16  # llama.cpp classic default --draft-max
    assert int(lines["n_predict   "]) == 64 * len(range(0, n_input - 64, 64))
    assert int(lines["n_accept    "]) > 0
    assert not (tmp_path / "new.bin").exists()  # stats never writes the dynamic cache


def test_merge_command(tmp_path, capsys):
    a, b, out = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "out.bin"
    save({(1,): {2: 1}}, a)
    save({(1,): {2: 2}}, b)
    run("merge", a, b, out)
    assert load(out) == {(1,): {2: 3}}
    assert "2 caches" in capsys.readouterr().err
    with pytest.raises(SpecdecodeError, match=r"IN \[IN \.\.\.\] OUT"):
        run("merge", a)


def test_command_errors_are_clear(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("short", encoding="utf-8")
    with pytest.raises(SpecdecodeError, match="model directory not found"):
        run("create", "-m", tmp_path / "nope", "-f", text, "-lcs", tmp_path / "s.bin")
    with pytest.raises(SpecdecodeError, match="cannot load the tokenizer"):
        run("create", "-m", tmp_path, "-f", text, "-lcs", tmp_path / "s.bin")
    with pytest.raises(SpecdecodeError, match="cannot read the text file"):
        run("create", "-m", model_dir, "-f", tmp_path / "absent.txt", "-lcs", tmp_path / "s.bin")
    with pytest.raises(SpecdecodeError, match="needs more than n_ctx"):
        run("stats", "-m", model_dir, "-f", text)
    (tmp_path / "bad.bin").write_bytes(b"\x01\x00")
    with pytest.raises(SpecdecodeError, match=r"bad\.bin"):
        run("stats", "-m", model_dir, "-f", text, "-c", "2", "-lcs", tmp_path / "bad.bin")
