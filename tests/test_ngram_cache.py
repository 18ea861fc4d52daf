"""ngram-cache: update, drafting thresholds, the chain strategy and the cache file format.

Expected drafts are derived by hand from llama.cpp's rules (reference §2.4). Thresholds are
indexed by n-gram size: lax (context) 1-gram needs >= 2 sightings and 66%, 2-gram 2 and 50%,
3/4-gram 1 and 50%; strict (dynamic) 1-gram 4 and 75%, 2-gram 3 and 66%, 3/4-gram 2 and 66%.
Cases where two candidates tie are left out on purpose: llama.cpp then keeps the first in
`unordered_map` order, which Python dicts do not reproduce.
"""

from __future__ import annotations

import itertools
import os
import re
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.errors import SpecdecodeError
from specdecode.strategies.ngram_cache import (
    NgramCache,
    NgramCacheStrategy,
    draft_tokens,
    load,
    merge,
    save,
    update,
)

CYCLE = [1, 2, 3, 1, 2, 3, 1, 2]
INP = [7, 8, 9, 1]  # its suffixes: (7, 8, 9, 1), (8, 9, 1), (9, 1), (1,); static key (9, 1)


def first(context=None, dynamic=None, static=None, inp=INP) -> list[int]:
    """The first drafted token (as a list: [] when nothing is drafted)."""
    return draft_tokens(inp, 1, context or {}, dynamic or {}, static or {})


def test_update_counts_every_ngram_before_each_new_token():
    cache: NgramCache = {}
    update(cache, 1, 4, CYCLE, len(CYCLE))
    assert cache == {
        (1,): {2: 3},
        (2,): {3: 2},
        (3,): {1: 2},
        (1, 2): {3: 2},
        (2, 3): {1: 2},
        (3, 1): {2: 2},
        (1, 2, 3): {1: 2},
        (2, 3, 1): {2: 2},
        (3, 1, 2): {3: 1},
        (1, 2, 3, 1): {2: 2},
        (2, 3, 1, 2): {3: 1},
        (3, 1, 2, 3): {1: 1},
    }
    update(cache, 1, 2, [5, 6, 7], 1)  # only the n-grams ending just before the last token
    assert cache[(6,)] == {7: 1} and cache[(5, 6)] == {7: 1} and (5,) not in cache


def test_draft_continues_through_its_own_tokens_up_to_n_draft():
    context: NgramCache = {}
    update(context, 1, 4, CYCLE, len(CYCLE))
    assert draft_tokens(CYCLE, 5, context, {}, {}) == [3, 1, 2, 3, 1]
    assert draft_tokens(CYCLE, 8, context, {}, {}) == [3, 1, 2, 3, 1, 2, 3, 1]
    assert draft_tokens(CYCLE, 0, context, {}, {}) == []
    assert draft_tokens([2], 5, context, {}, {}) == []  # fewer than 2 tokens: no draft


LAX = [
    ((1,), {5: 2, 6: 1}, [5]),  # 200 >= 66 * 3
    ((1,), {5: 3, 6: 2}, []),  # 300 < 66 * 5
    ((1,), {5: 1}, []),  # one sighting < 2
    ((9, 1), {5: 2, 6: 1, 7: 1}, [5]),  # exactly 50%
    ((9, 1), {5: 2, 6: 1, 7: 1, 8: 1}, []),  # 40%
    ((9, 1), {5: 1}, []),  # one sighting < 2
    ((8, 9, 1), {5: 1}, [5]),  # one sighting is enough
    ((8, 9, 1), {5: 2, 6: 1, 7: 1, 8: 1, 9: 1}, []),  # 33%
    ((7, 8, 9, 1), {5: 1}, [5]),
    ((7, 8, 9, 1), {5: 1, 6: 2, 7: 1}, [6]),  # exactly 50%
]
STRICT = [
    ((1,), {5: 3, 6: 1}, [5]),  # exactly 75%
    ((1,), {5: 2, 6: 1}, []),  # 3 sightings < 4 (the lax context accepts it)
    ((1,), {5: 5, 6: 2}, []),  # 71% < 75%
    ((9, 1), {5: 2, 6: 1}, [5]),  # 200 >= 66 * 3
    ((9, 1), {5: 2}, []),  # 2 < 3
    ((8, 9, 1), {5: 2}, [5]),
    ((8, 9, 1), {5: 1}, []),  # 1 < 2
    ((7, 8, 9, 1), {5: 3, 6: 2}, []),  # 60% < 66%
]


@pytest.mark.parametrize(("key", "part", "expected"), LAX)
def test_lax_thresholds_of_the_context_cache(key, part, expected):
    assert first(context={key: part}) == expected


@pytest.mark.parametrize(("key", "part", "expected"), STRICT)
def test_strict_thresholds_of_the_dynamic_cache(key, part, expected):
    assert first(dynamic={key: part}) == expected


def test_longest_passing_ngram_wins_and_failures_fall_through():
    context = {(7, 8, 9, 1): {4: 1}, (1,): {5: 2}}
    assert first(context) == [4]
    context[(7, 8, 9, 1)] = {4: 2, 6: 1, 7: 1, 8: 1}  # 40%: fails, the 1-gram drafts
    assert first(context) == [5]
    # The context drafts first; the dynamic cache only when the context has nothing.
    assert first({(1,): {5: 2}}, dynamic={(1,): {6: 4}}) == [5]
    assert first({(1,): {5: 1}}, dynamic={(1,): {6: 4}}) == [6]


def test_static_counts_weight_the_choice():
    tie = {(9, 1): {5: 2, 6: 2}}  # without a static cache this is a tie: excluded
    assert first(tie, static={(9, 1): {6: 1}}) == [6]  # 2 * 100 beats 2 * 1
    assert first(tie, static={(9, 1): {5: 1}}) == [5]
    # The weight follows the static count: 1 * 200 beats 1 * 100.
    assert first({(8, 9, 1): {5: 1, 6: 1}}, static={(9, 1): {5: 1, 6: 2}}) == [6]
    # The static favourite is chosen even when it then fails the percentage: 3/7 < 50%, and the
    # static cache alone has too few sightings (1 < 2), so nothing is drafted instead of 5.
    assert first({(9, 1): {5: 4, 6: 3}}) == [5]
    assert first({(9, 1): {5: 4, 6: 3}}, static={(9, 1): {6: 1}}) == []


def test_static_cache_alone_is_the_last_resort():
    assert first(static={(9, 1): {5: 2, 6: 1, 7: 1}}) == [5]  # exactly 50%
    assert first(static={(9, 1): {5: 2, 6: 1, 7: 1, 8: 1}}) == []  # 40%
    assert first(static={(9, 1): {5: 1}}) == []  # 1 < 2
    assert first(static={(8, 9): {5: 3}}) == []  # the static key is the last 2 tokens
    # Its key moves along the draft: (9, 1) -> 5, then (1, 5) -> 6, then (5, 6) is unknown.
    static = {(9, 1): {5: 2}, (1, 5): {6: 2}}
    assert draft_tokens(INP, 8, {}, {}, static) == [5, 6]


# --------------------------------------------------------------------------- the chain strategy


def test_strategy_indexes_new_tokens_as_an_isolated_sequence():
    """llama.cpp's chain quirk: n-grams spanning old and new tokens are never counted, while
    lookup's incremental update(ctx, 1, 4, inp, 1) counts them, and drafts differ."""
    strategy = NgramCacheStrategy()
    assert (strategy.name, strategy.n_min) == ("ngram-cache", 0)
    strategy.begin([1, 2, 3])
    assert strategy.draft([1, 2, 3], 4, 16).tokens == []
    assert strategy.cache_size == 4
    strategy.draft([1, 2, 3, 4, 5, 6], 7, 16)  # indexes [5, 6, 7] alone
    assert (4,) not in strategy.context and (4, 5) not in strategy.context
    assert strategy.context[(5, 6)] == {7: 1}
    history = [1, 2, 3, 4, 5, 6, 7, 8, 2, 3]
    assert strategy.draft(history, 4, 16).tokens == []  # (2, 3, 4) was never counted
    correct: NgramCache = {}
    update(correct, 1, 4, [1, 2, 3, 4], 4)
    for end in range(5, len(history) + 2):
        update(correct, 1, 4, [*history, 4][:end], 1)
    assert draft_tokens([*history, 4], 8, correct, {}, {}) == [5, 6, 7, 8, 2, 3, 4, 5]


def test_strategy_context_survives_generations_and_drafts_are_capped_at_8():
    strategy = NgramCacheStrategy()
    strategy.draft([1, 2, 3] * 5, 1, 4)
    snapshot = {key: dict(part) for key, part in strategy.context.items()}
    strategy.begin([1, 2])
    draft = strategy.draft([1, 2], 3, 4)  # cache_size is never reset: nothing is re-indexed
    assert strategy.context == snapshot
    assert draft.tokens == [1, 2, 3, 1, 2, 3, 1, 2]  # 8 whatever n_max: the chain truncates
    assert draft.probs is None
    assert strategy.draft([], 5, 4).tokens == []


def test_end_merges_the_context_into_the_dynamic_cache_and_saves_it(tmp_path):
    dynamic: NgramCache = {(1,): {2: 5}}
    path = tmp_path / "dynamic.bin"
    strategy = NgramCacheStrategy(static={}, dynamic=dynamic, dynamic_path=path)
    strategy.draft([1, 2, 1], 2, 8)
    strategy.end()
    assert dynamic[(1,)] == {2: 7} and dynamic[(2,)] == {1: 1} and dynamic[(2, 1)] == {2: 1}
    assert load(path) == dynamic
    strategy.end()  # the context was merged once: a second end() adds nothing
    assert dynamic[(1,)] == {2: 7}


def test_end_without_a_path_or_statistics_writes_nothing(tmp_path):
    path = tmp_path / "dynamic.bin"
    NgramCacheStrategy(dynamic_path=path).end()  # nothing learnt: no (unloadable) empty file
    assert not path.exists()


def test_strategy_indexes_only_new_tokens(monkeypatch):
    """Drafting costs O(new tokens): after the first call, update() sees only what was added."""
    import specdecode.strategies.ngram_cache as module

    seen: list[int] = []
    real_update = module.update
    monkeypatch.setattr(
        module, "update", lambda c, lo, hi, inp, nnew: (seen.append(nnew), real_update(c, lo, hi, inp, nnew))
    )
    history = [(i * 7919) % 300 for i in range(4000)]
    strategy = NgramCacheStrategy()
    strategy.draft(history[:3000], history[3000], 16)
    assert seen == [3001]
    for end in range(3003, 3100, 3):
        strategy.draft(history[:end], history[end], 16)
    assert seen[1:] == [3] * len(seen[1:])  # the previous `last` and two accepted tokens, + `last`


# Records in no sorted order, sizes 2, 1, 3 and 4 (slots past the size hold -1), pairs unsorted.
HAND_BUILT = [
    ((7, 3, -1, -1), [(9, 4), (5, 1)]),
    ((4, -1, -1, -1), [(2, 6)]),
    ((8, 1, 6, -1), [(11, 1), (10, 2), (12, 3)]),
    ((1, 2, 3, 4), [(0, 7)]),
]


def pack(records) -> bytes:
    out = b""
    for ngram, pairs in records:
        out += struct.pack("<5i", *ngram, len(pairs))
        out += b"".join(struct.pack("<2i", token, count) for token, count in pairs)
    return out


def test_hand_built_file_loads_and_writes_back_byte_for_byte(tmp_path):
    path = tmp_path / "hand.bin"
    path.write_bytes(pack(HAND_BUILT))
    cache = load(path)
    assert cache == {
        (7, 3): {9: 4, 5: 1},
        (4,): {2: 6},
        (8, 1, 6): {11: 1, 10: 2, 12: 3},
        (1, 2, 3, 4): {0: 7},
    }
    assert list(cache[(7, 3)]) == [9, 5]  # pair order kept
    written = tmp_path / "written.bin"
    save({key: cache[key] for key in [(7, 3), (4,), (8, 1, 6), (1, 2, 3, 4)]}, written)
    assert written.read_bytes() == pack(HAND_BUILT)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=60), st.integers(1, 4), st.integers(1, 4))
def test_save_load_round_trip(tokens, a, b):
    cache: NgramCache = {}
    update(cache, min(a, b), max(a, b), tokens, len(tokens))
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "cache.bin"
        if not cache:
            with pytest.raises(SpecdecodeError, match="empty"):
                save(cache, path)
            return
        save(cache, path)
        assert load(path) == cache
        assert os.listdir(directory) == ["cache.bin"]


def test_merge_adds_counts_and_inserts_new_keys():
    target: NgramCache = {(1,): {2: 1, 3: 2}}
    other: NgramCache = {(1,): {3: 5, 4: 1}, (5, 6): {7: 2}}
    merge(target, other)
    assert target == {(1,): {2: 1, 3: 7, 4: 1}, (5, 6): {7: 2}}
    target[(5, 6)][7] += 1
    assert other[(5, 6)] == {7: 2}  # inserted parts are copies


def test_duplicates_keep_the_first_value(tmp_path):
    path = tmp_path / "dup.bin"
    path.write_bytes(pack([((7, 3, -1, -1), [(9, 4), (9, 8)]), ((7, 3, -1, -1), [(9, 100), (1, 1)])]))
    assert load(path) == {(7, 3): {9: 4}}


def test_every_cut_inside_a_record_is_an_error(tmp_path):
    """A cut between records leaves a valid shorter file: the format has no header to tell."""
    data = pack(HAND_BUILT)
    boundaries = list(itertools.accumulate(20 + 8 * len(pairs) for _, pairs in HAND_BUILT))
    path = tmp_path / "cut.bin"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        if cut in boundaries:
            assert len(load(path)) == boundaries.index(cut) + 1
            continue
        with pytest.raises(SpecdecodeError, match=re.escape(str(path)) + ".*(empty|offset)"):
            load(path)


@pytest.mark.parametrize(
    "records",
    [
        [((7, 3, -1, -1), [])],  # ntokens = 0
        [((-1, -1, -1, -1), [(1, 1)])],  # no token
        [((5, -1, 6, -1), [(1, 1)])],  # a gap
        [((-2, 3, -1, -1), [(1, 1)])],
        [((7, 3, -1, -1), [(1, 0)])],  # count 0
        [((7, 3, -1, -1), [(1, 2), (4, -3)])],
        [((7, 3, -1, -1), [(-5, 2)])],
    ],
)
def test_corrupt_records_are_errors(tmp_path, records):
    path = tmp_path / "bad.bin"
    path.write_bytes(pack(records))
    with pytest.raises(SpecdecodeError, match="offset"):
        load(path)


def test_negative_ntokens_is_an_error(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<5i", 7, 3, -1, -1, -1))
    with pytest.raises(SpecdecodeError, match="ntokens = -1"):
        load(path)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(SpecdecodeError, match="cannot read"):
        load(tmp_path / "absent.bin")


@pytest.mark.parametrize(
    "cache",
    [
        {},
        {(1,): {2: 0}},
        {(1, 2, 3, 4, 5): {2: 1}},
        {(1,): {}},
        {(1,): {-4: 1}},
        {(1,): {2: 2**31}},
        {(): {1: 1}},
    ],
)
def test_failed_save_leaves_the_existing_file_untouched(tmp_path, cache):
    path = tmp_path / "out.bin"
    path.write_bytes(pack(HAND_BUILT))
    with pytest.raises(SpecdecodeError):
        save(cache, path)
    assert path.read_bytes() == pack(HAND_BUILT)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_write_error_removes_the_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(SpecdecodeError, match="No space left"):
        save({(1,): {2: 1}}, path)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(SpecdecodeError, match="cannot write"):
        save({(1,): {2: 1}}, tmp_path / "no" / "dir.bin")
