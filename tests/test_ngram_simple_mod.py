"""Golden tests for ngram-simple and ngram-mod, from hand-built token sequences.

Expected drafts are worked out by hand from llama.cpp's algorithms (reference §2.1, §2.3);
a literal O(L) transcription of ngram-simple checks the indexed version on random texts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.errors import SpecdecodeError
from specdecode.strategies.ngram_mod import (
    EMPTY,
    MASK64,
    MULTIPLIER,
    POOL_SIZE,
    NgramModConfig,
    NgramModPool,
    NgramModStrategy,
)
from specdecode.strategies.ngram_simple import NgramMapConfig, NgramSimpleStrategy

# --------------------------------------------------------------------------- ngram-simple


def simple(n: int, m: int) -> NgramSimpleStrategy:
    strategy = NgramSimpleStrategy(NgramMapConfig(size_n=n, size_m=m))
    strategy.begin([])
    return strategy


def test_simple_copies_after_the_match():
    # pattern [5, 6] = h[-1:] + [last] occurs at j=1; m=3 tokens follow it
    assert simple(2, 3).draft([9, 5, 6, 7, 8, 4, 3, 2, 5], 6, 16).tokens == [7, 8, 4]


def test_simple_takes_the_most_recent_match():
    h = [9, 5, 6, 1, 1, 1, 5, 6, 2, 2, 2, 0, 5]
    assert simple(2, 3).draft(h, 6, 16).tokens == [2, 2, 2]


def test_simple_never_matches_position_0():
    h = [5, 6, 7, 8, 4, 3, 2, 1, 5]
    assert simple(2, 3).draft(h, 6, 16).tokens == []


@pytest.mark.parametrize(("length", "drafts"), [(6, False), (7, True)])
def test_simple_needs_more_than_n_plus_m_plus_1_tokens(length, drafts):
    # n=2, m=3: L <= 6 never drafts; at L = 7 the match at j=1 leaves L-(j+n) = 4 >= n tokens
    h = [9, 5, 6, 7, 8, 4, 5][:length]
    h[-1] = 5
    draft = simple(2, 3).draft(h, 6, 16).tokens
    assert (draft != []) == drafts
    if drafts:
        assert draft == [7, 8, 4]


def test_simple_drops_drafts_shorter_than_n():
    h = [0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 1, 2]
    # n=3: [1, 2, 3] matches at j=7 and only h[10:12] (2 tokens < n) follows
    assert simple(3, 4).draft(h, 3, 16).tokens == []
    # n=2: [2, 3] matches at j=8, the same 2 tokens follow, and 2 >= n
    assert simple(2, 4).draft(h, 3, 16).tokens == [1, 2]


def test_simple_classic_n_min_is_size_m():
    assert NgramSimpleStrategy(NgramMapConfig(size_n=12, size_m=48)).n_min == 48


def naive_simple(h: list[int], last: int, n: int, m: int) -> list[int]:
    """Literal transcription of the reference's scan."""
    length = len(h)
    if length <= n + m + 1:
        return []
    pattern = [*h[length - n + 1 :], last]
    for j in range(length - n - 1, 0, -1):
        if h[j : j + n] == pattern:
            copy_max = min(m, length - (j + n))
            return [] if copy_max < n else h[j + n : j + n + copy_max]
    return []


@settings(max_examples=60, deadline=None)
@given(
    text=st.lists(st.integers(0, 3), min_size=2, max_size=80),
    n=st.integers(1, 4),
    m=st.integers(1, 6),
    restart=st.integers(0, 80),
)
def test_simple_index_equals_the_scan(text, n, m, restart):
    strategy = simple(n, m)
    for length in range(1, len(text)):
        if length == restart:  # a new, shorter text without begin(): the index must notice
            strategy.draft(text[: length // 2], text[length // 2], 16)
        assert strategy.draft(text[:length], text[length], 16).tokens == naive_simple(
            text[:length], text[length], n, m
        )


# --------------------------------------------------------------------------- ngram-mod


def reference_slot(window: list[int]) -> int:
    h = 0
    for t in window:
        h = (h * MULTIPLIER + (t & 0xFFFFFFFFFFFFFFFF)) & MASK64
    return h % POOL_SIZE


def test_mod_hash_matches_the_reference_formula():
    pool = NgramModPool(3)
    for window in ([1, 2, 3], [0, 0, 0], [151_935, 7, 2**31 - 1], [-1, 5, 9]):
        assert pool.slot(window) == reference_slot(window)
    # the vectorised indexing agrees with the one-window hash, sign extension included
    tokens = [5, -1, 7, 2**31 - 1, 3, 8]
    pool.add(tokens, 0, 3)
    for i in range(3):
        assert pool.get(tokens[i : i + 3]) == tokens[i + 3]


def test_mod_last_writer_wins_and_counts_used_slots():
    pool = NgramModPool(2)
    pool.add([1, 2, 3, 1, 2, 4], 0, 4)  # windows (1,2)->3, (2,3)->1, (3,1)->2, (1,2)->4
    assert pool.get([1, 2]) == 4
    assert pool.used == 3
    pool.add([1, 2, 9], 0, 1)
    assert pool.get([1, 2]) == 9 and pool.used == 3
    pool.reset()
    assert pool.used == 0 and pool.get([1, 2]) == EMPTY


def mod(n: int, n_min: int, n_max: int) -> NgramModStrategy:
    return NgramModStrategy(NgramModConfig(n, n_min, n_max), NgramModPool(n))


def test_mod_follows_the_pool_from_the_last_n_tokens():
    strategy = mod(2, 1, 3)
    strategy.begin([7, 1, 2, 3, 4, 5, 1])  # indexes (7,1)->2 ... (4,5)->1
    # context [..., 1] + last 2 -> (1,2)->3, (2,3)->4, (3,4)->5: n_max 3 stops there
    assert strategy.draft([7, 1, 2, 3, 4, 5, 1], 2, 16).tokens == [3, 4, 5]


def test_mod_empty_before_n_min_gives_nothing_after_n_min_stops():
    # begin indexes (1,2)->3 and (2,3)->4; from [..., 1] + last 2 the pool gives 3, 4, then EMPTY
    strategy = mod(2, 3, 8)
    strategy.begin([1, 2, 3, 4])
    assert strategy.draft([1, 2, 3, 4, 1], 2, 16).tokens == []  # EMPTY at k=2 < n_min 3
    strategy = mod(2, 2, 8)
    strategy.begin([1, 2, 3, 4])
    assert strategy.draft([1, 2, 3, 4, 1], 2, 16).tokens == [3, 4]  # EMPTY at k=2 >= n_min: stop


def test_mod_indexes_lazily_every_32_tokens():
    strategy = mod(2, 1, 1)
    prompt = [100, 101, 102]
    strategy.begin(prompt)  # i_last = 1
    history = prompt + list(range(200, 232))  # L = 35: 1 + 32 < 35 -> index up to L - n
    assert strategy.draft(history[:33], 0, 16).tokens == []  # 1 + 32 = 33, not < 33: not indexed
    assert strategy.pool.get([200, 201]) == EMPTY
    strategy.draft(history, 0, 16)
    assert strategy.pool.get([200, 201]) == 202
    assert strategy.pool.get([230, 231]) == EMPTY  # the last window has no next token yet


def test_mod_resets_the_pool_when_a_quarter_is_used():
    strategy = mod(1, 1, 1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 2**31 - 1, size=POOL_SIZE // 4 + POOL_SIZE // 8).tolist()
    strategy.begin(prompt)
    assert strategy.pool.used == 0  # > 25 % occupied after indexing: emptied


def test_mod_resets_after_three_poor_drafts_in_a_row():
    strategy = mod(2, 2, 4)
    strategy.begin([1, 2, 3, 4, 5, 6])  # 4 windows -> 4 used slots
    history = [1, 2, 3, 4, 5, 6, 1]
    for _ in range(2):
        assert strategy.draft(history, 2, 16).tokens == [3, 4, 5, 6]
        strategy.accept(1)  # 1/4 < 0.5: low
        assert strategy.pool.used == 4
    strategy.draft(history, 2, 16)
    strategy.accept(2)  # exactly 0.5 is not low: the streak restarts
    for _ in range(2):
        strategy.draft(history, 2, 16)
        strategy.accept(1)
    assert strategy.pool.used == 4
    strategy.draft(history, 2, 16)
    strategy.accept(1)  # the third low draft in a row empties the pool
    assert strategy.pool.used == 0
    assert strategy.draft(history, 2, 16).tokens == []


def test_mod_pool_is_shared_across_generations():
    pool = NgramModPool(2)
    first = NgramModStrategy(NgramModConfig(2, 1, 2), pool)
    first.begin([4, 5, 6, 7])
    second = NgramModStrategy(NgramModConfig(2, 1, 2), pool)
    second.begin([9])
    assert second.draft([9, 9, 4], 5, 16).tokens == [6, 7]


def test_mod_config_and_pool_mismatch_are_refused():
    with pytest.raises(SpecdecodeError):
        NgramModConfig(n_match=0)
    with pytest.raises(SpecdecodeError):
        NgramModStrategy(NgramModConfig(n_match=3), NgramModPool(2))
