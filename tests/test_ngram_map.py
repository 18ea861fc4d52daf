"""ngram-map-k / ngram-map-k4v: hand-derived golden drafts, the edge cases of reference §9.2, and
equivalence with a literal O(L) transcription of reference §2.2.

Drivers follow llama.cpp's lookup-stats: the history is a prefix of a ground truth; the longest
prefix of the draft that matches the truth is accepted (reported only if > 0, as the CLASSIC chain
does); then `last` and the accepted tokens join the history and the true next token becomes `last`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.drafts import Draft
from specdecode.strategies.ngram_map import NgramMapStrategy
from specdecode.strategies.ngram_simple import NgramMapConfig

BUCKETS = 1 << 18
MAX_COUNT = 16380


def lcg_hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 2654435761 + (t & 0xFFFFFFFF)) % 2**32
    return h


def bucket(tokens: Sequence[int]) -> int:
    return lcg_hash(tokens) % BUCKETS


def make(n: int, m: int, key_only: bool, min_hits: int = 1) -> NgramMapStrategy:
    return NgramMapStrategy(NgramMapConfig(size_n=n, size_m=m, min_hits=min_hits), key_only)


def run_rounds(
    strategy,
    truth: list[int],
    start: int,
    n_max: int = 99,
    report_zero: bool = False,
    skips: Sequence[int] = (0,),
    begin: bool = True,
):
    """Drafts per round over `truth` from the history truth[:start] (begun unless begin=False).

    skips[r % len(skips)] = k > 0: round r skips the strategy and the history grows by k tokens
    (as when a higher-priority strategy drafted); report_zero: also report 0 (LATEST).
    """
    history = list(truth[:start])
    if begin:
        strategy.begin(history)
    drafts = []
    for r in itertools.count():
        if len(history) + 1 >= len(truth):
            return drafts
        nxt = len(history) + 1
        if skips[r % len(skips)]:
            history.extend(truth[len(history) : min(len(history) + skips[r % len(skips)], len(truth) - 1)])
            continue
        draft = strategy.draft(history, truth[nxt - 1], n_max).tokens[:n_max]
        accepted = 0
        while (
            accepted < len(draft) and nxt + accepted < len(truth) and draft[accepted] == truth[nxt + accepted]
        ):
            accepted += 1
        if accepted > 0 or (report_zero and draft):
            strategy.accept(accepted)
        drafts.append(draft)
        history.extend(truth[len(history) : nxt + accepted])
    raise AssertionError("unreachable")


def records(strategy: NgramMapStrategy) -> list[tuple]:
    return [
        (r.key_idx, r.stat_idx, r.key_num, [(v.value_idx, v.value_num, v.n_accepted) for v in r.values])
        for r in strategy.keys
    ]


def key_map(strategy: NgramMapStrategy) -> dict[int, int]:
    nonzero = np.flatnonzero(strategy.key_map)
    return dict(zip(nonzero.tolist(), strategy.key_map[nonzero].tolist(), strict=True))


# --- golden drafts, derived by hand ---

# begin(prompt = TRUTH_K[:10]): the prompt's starts 1..4 are indexed at the first draft, 5..10
# never are (S-n-m..S); later starts j are indexed once j <= L-n-m-1.
TRUTH_K = [
    9,
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    1,
    2,
    3,
    4,
    5,
    0,
    1,
    2,
    3,
    4,
    0,
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    1,
    2,
    3,
    9,
    1,
    2,
    3,
    4,
    5,
]


def test_map_k_golden_drafts_and_shrinking_n_accepted():
    strategy = make(2, 3, key_only=True)
    assert run_rounds(strategy, TRUTH_K, 10) == [
        [3, 4, 5],  # key [1,2] found by the prompt scan at 1; all 3 accepted
        [],  # [5,0]: nothing indexed after 4 yet
        [],  # [0,1]
        [3, 4, 5],  # [1,2] via key_map -> 1; 2 accepted (n_accepted 3 -> 2)
        [],  # [4,0]
        [2, 3, 4],  # [0,1] found by the scan of the new region at 14
        [6, 7, 8],  # [4,5] via key_map -> 4; 2 accepted
        [],  # [7,1]
        [3, 4],  # [1,2]: min(m, 2) tokens; 1 accepted
        [],  # [3,9]
        [],  # [9,1] occurs only at 0, which is never matched
        [3],  # [1,2]: 1 token, never grows back
        [5, 6, 7],  # [3,4] via key_map -> 3, a new key
    ]
    assert records(strategy) == [
        (1, 0, 4, [(0, 0, 1), (0, 0, 3), (0, 0, 3), (0, 0, 3)]),
        (14, 0, 1, [(0, 0, 3)] * 4),
        (4, 0, 1, [(0, 0, 2), (0, 0, 3), (0, 0, 3), (0, 0, 3)]),
        (3, 0, 1, [(0, 0, 1), (0, 0, 3), (0, 0, 3), (0, 0, 3)]),
    ]
    assert sorted(key_map(strategy).values()) == [1, 2, 3, 4, 13, 14, 18, 24, 25, 26]
    assert (strategy.key_map_last_idx, strategy.size_last_begin, strategy.idx_last_check) == (28, 10, 34)


# Key [1,2] follows [3,4,5] at 1 and 11 and [6,7,8] at 6 in the prompt TRUTH_K4V[:22].
TRUTH_K4V = [0, 1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 1]
TRUTH_K4V += [2, 3, 4, 0, 1, 2, 6, 7, 8, 1, 2, 3, 4]


def test_map_k4v_golden_drafts_and_statistics():
    strategy = make(2, 3, key_only=False)
    assert run_rounds(strategy, TRUTH_K4V, 22) == [
        [3, 4, 5],  # match 11 (latest prompt occurrence); counts [2, 1]: exactly 2x -> drafts
        [],  # [4,0]
        [],  # [0,1]: only at 0
        [3, 4],  # match 11 again, counted again (double count): [3, 1]; n_accepted 2; none accepted
        [7, 8, 1],  # [2,6] via key_map -> 7, a new key with one value
        [3, 4],  # [1,2]: counts [4, 1]
    ]
    assert records(strategy) == [
        (11, 11, 3, [(3, 4, 2), (8, 1, 3), (0, 0, 3), (0, 0, 3)]),
        (7, 7, 1, [(9, 1, 3), (0, 0, 3), (0, 0, 3), (0, 0, 3)]),
    ]


# --- edge cases (reference §9.2) ---


def test_name_and_n_min():
    config = NgramMapConfig(size_n=3, size_m=7)
    assert (NgramMapStrategy(config, True).name, NgramMapStrategy(config, True).n_min) == ("ngram-map-k", 7)
    assert NgramMapStrategy(config, False).name == "ngram-map-k4v"


@pytest.mark.parametrize("key_only", [True, False])
def test_no_draft_below_2n_plus_m(key_only):
    # n=3, m=2: 2n+m = 8. At L=7 the key [1,2,3] at 1 would be a valid match, but L < 8.
    strategy = make(3, 2, key_only)
    assert strategy.draft([0, 1, 2, 3, 4, 1, 2], 3, 9).tokens == []
    assert (strategy.idx_last_check, key_map(strategy)) == (0, {})
    assert strategy.draft([0, 1, 2, 3, 4, 5, 1, 2], 3, 9).tokens == [4, 5]
    assert strategy.idx_last_check == 8


def test_prompt_tail_and_position_zero_never_match():
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # S = 12: starts 7..12 are never indexed
    strategy = make(2, 3, key_only=True)
    strategy.begin(prompt)
    assert strategy.draft([*prompt, 20, 21, 22, 0], 1, 9).tokens == []  # [0,1] at 0
    assert strategy.draft([*prompt, 20, 21, 22, 0, 1, 7], 8, 9).tokens == []  # [7,8] at 7: the gap
    assert strategy.draft([*prompt, 20, 21, 22, 0, 1, 7, 8, 3], 4, 9).tokens == [5, 6, 7]  # [3,4] at 3


def test_prompt_scan_comes_before_the_new_region():
    prompt = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25]  # S = 12: starts 1..6 are scanned first
    strategy = make(2, 3, key_only=True)
    strategy.begin(prompt)
    # The first draft comes late (as when a higher-priority strategy drafted until now):
    # [1,2] is both at 1 (prompt) and at 13 (new region, starts 13..19).
    history = [*prompt, 30, 1, 2, 6, 7, 8, 31, 32, 33, 34, 35, 36, 1]
    assert strategy.draft(history, 2, 9).tokens == [3, 4, 5]


def test_hash_collision_first_writer_wins_then_scans():
    x = [1, 2]
    # With n=2 the bucket is (a*M + b) mod 2^18: pick y = [3, b] in the same bucket as x.
    y = [3, (2 - 2 * 2654435761) % BUCKETS]
    assert x != y and bucket(x) == bucket(y)
    filler = [20, 21, 22, 23, 24, 25]
    prompt = [0, *x, 5, 6, 7, *y, 8, 9, 10, *filler, 1]  # S = 18; starts 1..12 get indexed
    strategy = make(2, 3, key_only=True)
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == [5, 6, 7]  # found by the prompt scan
    assert key_map(strategy)[bucket(x)] == 6  # y at 6 was indexed before x at 1 (descending)
    grown = [*prompt, 2, 30, 31, 32, 33, 34, 35, 1]
    assert strategy.draft(grown, 2, 9).tokens == []  # key_map -> y: window differs, no new x
    grown += [2, 11, 12, 13, 36, 37, 38, 39, 1]
    assert strategy.draft(grown, 2, 9).tokens == [11, 12, 13]  # x at 25, in the newly scanned region
    assert key_map(strategy)[bucket(x)] == 6


def test_hash_hit_must_be_older_than_n_plus_m_plus_1():
    history = [0, 9, 1, 2, 3, 4, 5, 1]  # L = 8: key [1,2] at 2 = L-n-m-1
    strategy = make(2, 3, key_only=True)
    assert strategy.draft(history, 2, 9).tokens == [3, 4, 5]  # found by the scan
    assert strategy.draft(history, 2, 9).tokens == []  # key_map -> 2, not < 2; nothing left to scan


def test_map_k_ignores_min_hits():
    prompt = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25, 1]
    strategy = make(2, 3, key_only=True, min_hits=3)
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == [3, 4, 5]


def test_k4v_min_hits():
    prompt = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25, 1]
    strategy = make(2, 3, key_only=False, min_hits=3)
    strategy.begin(prompt)
    assert [strategy.draft(prompt, 2, 9).tokens for _ in range(4)] == [[], [], [3, 4, 5], [3, 4, 5]]
    # Statistics start only at the third hit; then match_pos 1 is counted once per draft.
    assert records(strategy)[0][:3] == (1, 1, 4) and strategy.keys[0].values[0].value_num == 2


def k4v_prompt(values: list[list[int]]) -> list[int]:
    """[0] + ([1, 2] + value for each value) + filler + [1]: draft with last = 2."""
    prompt = [0]
    for value in values:
        prompt += [1, 2, *value]
    return [*prompt, 40, 41, 42, 43, 44, 45, 1]


A, B, C, D, E = [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([A, B, A, B, A, A], A),  # 4 == 2 * 2
        ([A, B, A, B, A], []),  # 3 == 2 * 2 - 1
        ([A, B, C, A, A, A], A),  # 4 == 2 * (1 + 1)
        ([A, B, C, A, A], []),  # 3 == 2 * (1 + 1) - 1
    ],
)
def test_k4v_dominance_boundary(values, expected):
    strategy = make(2, 3, key_only=False)
    prompt = k4v_prompt(values)
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == expected


def test_k4v_copies_after_latest_match_and_ignores_fifth_value():
    strategy = make(2, 3, key_only=False)
    prompt = k4v_prompt([A, B, C, D, E])
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == []  # four values, one each; E ignored
    assert [v.value_idx for v in strategy.keys[0].values] == [3, 8, 13, 18]
    strategy = make(2, 3, key_only=False)
    prompt = k4v_prompt([A] * 7 + [B, C, D, E])
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == E  # A dominates 7 to 3, E follows the match
    assert [v.value_num for v in strategy.keys[0].values] == [7, 1, 1, 1]


@pytest.mark.parametrize("key_only", [True, False])
def test_counters_saturate(key_only):
    prompt = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25, 1]
    strategy = make(2, 3, key_only)
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == [3, 4, 5]
    record = strategy.keys[0]
    record.key_num, record.values[0].value_num = MAX_COUNT - 1, MAX_COUNT - 1
    for _ in range(3):
        assert strategy.draft(prompt, 2, 9).tokens == [3, 4, 5]
    assert record.key_num == MAX_COUNT
    assert record.values[0].value_num == (MAX_COUNT - 1 if key_only else MAX_COUNT)


def test_latest_accept_zero_disables_key():
    prompt = [0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25, 1]
    strategy = make(2, 3, key_only=True)
    strategy.begin(prompt)
    assert strategy.draft(prompt, 2, 9).tokens == [3, 4, 5]
    strategy.accept(0)
    assert strategy.draft(prompt, 2, 9).tokens == []


def test_begin_cleanup_after_shorter_history():
    strategy = make(2, 3, key_only=True)
    run_rounds(strategy, TRUTH_K, 10)
    strategy.begin(TRUTH_K[:12])  # shorter than 34: cleanup at the previous begin size, 10
    assert sorted(key_map(strategy).values()) == [1, 2, 3, 4]
    assert [r[0] for r in records(strategy)] == [1, 4, 3]  # the key at 14 is gone
    assert (strategy.key_map_last_idx, strategy.size_last_begin, strategy.idx_last_check) == (9, 12, 12)
    history = [*TRUTH_K[:12], 30, 0, 1, 7, 7, 7, 20, 21, 22, 23, 0]
    assert strategy.draft(history, 1, 9).tokens == [7, 7, 7]  # [0,1] at 13 gets a new record
    assert [r[:3] for r in records(strategy)] == [(1, 0, 4), (4, 0, 1), (3, 0, 1), (13, 0, 1)]
    strategy.begin(TRUTH_K[:8])  # shorter than the last begin: cleanup at S-n-m = 3
    assert sorted(key_map(strategy).values()) == [1, 2]
    assert [r[0] for r in records(strategy)] == [1]
    assert strategy.key_map_last_idx == 2


def test_k4v_begin_cleanup_drops_values():
    filler = [20, 21, 22, 23, 24, 25, 1]
    kept, dropped = make(2, 3, key_only=False), make(2, 3, key_only=False)
    for strategy, head in ((kept, [0, 1, 2, 3, 4, 5]), (dropped, [0, 9, 9, 9, 9, 9])):
        prompt = [*head, 1, 2, 6, 7, 8, *filler]  # S = 18, key [1,2] matched at 6
        strategy.begin(prompt)
        strategy.draft(prompt, 2, 9)
        strategy.begin(prompt[:12])  # cleanup = 12 - 5 = 7: the value at 8 goes
    assert records(kept) == [(6, 6, 1, [(3, 1, 3), (0, 0, 3), (0, 0, 3), (0, 0, 3)])]
    assert records(dropped) == []  # its only value was in slot 0
    kept.keys[0].values[1].n_accepted = 1  # a freed slot may hold a stale n_accepted ...
    kept.draft([0, 1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 20, 21, 1], 2, 9)
    assert records(kept)[0][3][1] == (8, 1, 3)  # ... claiming it resets it to m


class CountingHistory(Sequence):
    """A history that counts the tokens read from it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.reads = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        item = self.tokens[index]
        self.reads += len(item) if isinstance(index, slice) else 1
        return item


@pytest.mark.parametrize("key_only", [True, False])
def test_draft_does_not_rescan_a_long_history(key_only, monkeypatch):
    rng = random.Random(0)
    tokens = [rng.randrange(4096) for _ in range(32_000)]
    for _ in range(200):  # repeated spans, so that drafts happen
        start = rng.randrange(len(tokens) - 64)
        tokens += tokens[start : start + rng.randrange(16, 64)]
    strategy = make(12, 48, key_only)
    hashed = []
    original = NgramMapStrategy._window_hashes
    monkeypatch.setattr(
        NgramMapStrategy,
        "_window_hashes",
        lambda self, lo, hi: hashed.append(hi - lo + 1) or original(self, lo, hi),
    )
    history = CountingHistory(tokens[:32_000])
    strategy.begin(history)
    strategy.draft(history, tokens[32_000], 99)
    hashed.clear()
    n_drafts = 0
    for _ in range(200):
        history.reads = 0
        history.tokens = tokens[: len(history.tokens) + 3]
        n_drafts += bool(strategy.draft(history, tokens[len(history.tokens)], 99).tokens)
        assert history.reads <= 16 + 3  # the tail check and the new tokens
    assert max(hashed) <= 3
    assert n_drafts > 0


# --- equivalence with a literal transcription of reference §2.2 ---


class NaiveMap:
    """Reference §2.2 step by step: linear key search, full scans, dict key_map."""

    def __init__(self, n: int, m: int, min_hits: int, key_only: bool) -> None:
        self.n, self.m, self.min_hits, self.key_only = n, m, min_hits, key_only
        self.key_map: dict[int, int] = {}
        self.key_map_last_idx = self.size_last_begin = self.idx_last_check = 0
        self.keys: list[list] = []  # [key_idx, stat_idx, key_num, [[value_idx, value_num, n_accepted]] * 4]
        self.last = None

    def begin(self, prompt):
        n, m, size = self.n, self.m, len(prompt)
        cleanup = self.size_last_begin
        if cleanup > size:
            cleanup = size - n - m if size > n + m else 0
        if size < self.idx_last_check:
            self.key_map = {b: i for b, i in self.key_map.items() if i < cleanup}
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            for k in range(len(self.keys) - 1, -1, -1):
                record = self.keys[k]
                if record[0] >= cleanup:
                    del self.keys[k]
                    continue
                if not self.key_only:
                    values = record[3]
                    for v in range(3, -1, -1):
                        if values[v][0] >= cleanup:
                            values[v:] = [*values[v + 1 :], [0, 0, values[3][2]]]
                    if values[0][0] == 0:
                        del self.keys[k]
        self.idx_last_check = self.size_last_begin = size

    def ranges(self, length):
        n, m = self.n, self.m
        if self.size_last_begin > n + m + 1:
            j = self.size_last_begin - n - m - 1
            while j > self.key_map_last_idx:
                yield j
                j -= 1
        j = length - n - m - 1
        while j > self.size_last_begin and j > self.key_map_last_idx:
            yield j
            j -= 1

    def draft(self, prompt, id_last):
        n, m = self.n, self.m
        self.last = None
        length = len(prompt)
        if length < 2 * n + m:
            return []
        self.idx_last_check = length
        key = [*prompt[length - n + 1 : length], id_last]
        match = self.lookup(prompt, key)
        if match == 0:
            return []
        record = next((r for r in self.keys if prompt[r[0] : r[0] + n] == key), None)
        if record is None:
            record = [match, 0, 0, [[0, 0, m] for _ in range(4)]]
            self.keys.append(record)
        record[2] = min(record[2] + 1, MAX_COUNT)
        if self.key_only:
            self.last = (record, 0)
            return prompt[match + n : match + n + min(m, record[3][0][2])]
        if record[2] < self.min_hits:
            return []
        self.count_values(prompt, key, record, match)
        counts = [slot[1] for slot in record[3]]
        best = counts.index(max(counts))
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return []
        self.last = (record, best)
        return prompt[match + n : match + n + min(m, record[3][best][2])]

    def lookup(self, prompt, key):
        n, m, length = self.n, self.m, len(prompt)
        match = 0
        c = self.key_map.get(bucket(key), 0)
        if c != 0 and c < length - n - m - 1 and prompt[c : c + n] == key:
            match = c
        if match == 0:
            match = next((j for j in self.ranges(length) if prompt[j : j + n] == key), 0)
        for j in list(self.ranges(length)):
            self.key_map.setdefault(bucket(prompt[j : j + n]), j)
        self.key_map_last_idx = max(length - n - m - 1, self.key_map_last_idx)
        return match

    def count_values(self, prompt, key, record, match):
        n, m = self.n, self.m
        for i in range(record[1], match + 1):
            if prompt[i : i + n] != key:
                continue
            v = i + n
            for slot in record[3]:
                if slot[0] == 0:
                    slot[:] = [v, 0, m]
                elif prompt[slot[0] : slot[0] + m] != prompt[v : v + m]:
                    continue
                slot[1] = min(slot[1] + 1, MAX_COUNT)
                break
        record[1] = match

    def accept(self, n_accepted):
        if self.last is not None:
            self.last[0][3][self.last[1]][2] = n_accepted


class Lockstep:
    """Drives the strategy and the naive map together, checking drafts and state at each call."""

    def __init__(self, n: int, m: int, min_hits: int, key_only: bool) -> None:
        self.fast, self.naive = make(n, m, key_only, min_hits), NaiveMap(n, m, min_hits, key_only)

    def check_state(self):
        fast, naive = self.fast, self.naive
        assert records(fast) == [(r[0], r[1], r[2], [tuple(v) for v in r[3]]) for r in naive.keys]
        assert (fast.key_map_last_idx, fast.size_last_begin, fast.idx_last_check) == (
            naive.key_map_last_idx,
            naive.size_last_begin,
            naive.idx_last_check,
        )

    def begin(self, prompt):
        self.fast.begin(prompt)
        self.naive.begin(list(prompt))
        self.check_state()
        assert key_map(self.fast) == self.naive.key_map

    def draft(self, history, last, n_max):
        expected = self.naive.draft(list(history), last)
        assert self.fast.draft(history, last, n_max).tokens == expected
        self.check_state()
        return Draft(expected)

    def accept(self, n_accepted):
        self.fast.accept(n_accepted)
        self.naive.accept(n_accepted)


def test_stale_records_after_a_different_prompt_first_record_wins():
    lockstep = Lockstep(1, 1, 1, key_only=True)
    lockstep.draft([0, 1, 9, 9, 9, 9], 1, 9)  # key [1] at 1
    lockstep.draft([0, 1, 9, 9, 9, 9, 1, 2, 9, 9, 9], 2, 9)  # key [2] at 7
    prompt = [0, 4, 3, 3, 3, 3, 3, 4, 3, 3, 4, 3, 3, 3, 3]  # longer: no cleanup; both keys now read [4]
    lockstep.begin(prompt)
    assert lockstep.draft(prompt, 4, 9).tokens == [3]  # [4] found at 10; the first record counts it
    assert [r[2] for r in records(lockstep.fast)] == [2, 1]


def test_key_window_cut_by_a_shorter_history_takes_the_new_content():
    lockstep = Lockstep(2, 1, 1, key_only=True)
    history = [0, 9, 9, 9, 9, 1, 2, 8, 7, 6, 1]
    assert lockstep.draft(history, 2, 9).tokens == [8]  # key [1,2] at 5
    lockstep.draft(history[:6], 7, 9)  # the record's window 5..6 is cut
    history = [*history[:6], 3, 5, 5, 5, 1, 3, 4, 4, 4, 4, 1]  # ... and now reads [1,3]
    assert lockstep.draft(history, 3, 9).tokens == [4]  # [1,3] at 10; the record at 5 counts it
    assert [r[:3] for r in records(lockstep.fast)] == [(5, 0, 2)]


@st.composite
def scenarios(draw):
    """Generations: each begun with a prompt that extends the previous history (no cleanup), is
    shorter than it (cleanup), or differs from it and is at least as long (stale content, no
    cleanup); then possibly rewound without begin() to a shorter, diverging history."""
    vocab = draw(st.integers(2, 5))
    tokens = st.lists(st.integers(0, vocab - 1), min_size=2, max_size=60)
    generations, previous = [], []
    for _ in range(draw(st.integers(1, 4))):
        mode = draw(st.sampled_from(["extend", "shrink", "replace"]))
        if mode == "extend":
            truth = previous + draw(tokens)
            start = draw(st.integers(max(len(previous) - 1, 0), len(truth) - 1))
        elif mode == "shrink":
            truth = previous[: draw(st.integers(0, len(previous)))] + draw(tokens)
            start = draw(st.integers(0, len(truth) - 1))
        else:
            truth = draw(tokens) + previous + draw(tokens)
            start = draw(st.integers(max(len(previous) - 1, 0), len(truth) - 1))
        rewind = draw(st.none() | st.integers(start, len(truth) - 1))
        rewound = None if rewind is None else truth[:rewind] + draw(tokens)
        skips = (*draw(st.lists(st.integers(0, 9), max_size=4)), 0)
        generations.append(
            (truth, start, rewind, rewound, (draw(st.integers(1, 6)), draw(st.booleans()), skips))
        )
        previous = truth if rewound is None else rewound
    return generations


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 3),
    m=st.integers(1, 4),
    min_hits=st.integers(1, 3),
    key_only=st.booleans(),
    generations=scenarios(),
)
def test_equivalent_to_literal_reference(n, m, min_hits, key_only, generations):
    lockstep = Lockstep(n, m, min_hits, key_only)
    for truth, start, rewind, rewound, (n_max, report_zero, skips) in generations:
        run_rounds(lockstep, truth, start, n_max, report_zero, skips)
        if rewound is not None:
            run_rounds(lockstep, rewound, rewind, n_max, report_zero, skips, begin=False)
        assert key_map(lockstep.fast) == lockstep.naive.key_map
