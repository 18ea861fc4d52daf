"""ngram-map-k and ngram-map-k4v (llama.cpp `common_ngram_map`, CLASSIC generation, §2.2 of the
reference): find an earlier occurrence of the key (the last n tokens, `last` included) and copy the
tokens that followed it.

Lookup: a 2^18-bucket table maps the 32-bit LCG hash of an n-gram to one history position (first
writer wins, no chaining); a hit counts if it is below L-n-m-1 and its window equals the key. A
start j is indexed once, when it becomes j <= L-n-m-1; a miss falls back to a descending scan of
the starts not indexed yet: those before the begin() prompt's end (< S-n-m) first, then those
after S. Starts S-n-m..S are not indexed in this generation (a reference quirk).
Each key found gets a record. map-k drafts min(m, n_accepted) tokens, n_accepted being the last
accepted length reported for the key, so drafts can only shrink. map-k4v waits for `min_hits`
lookups of the key, counts the (up to 4) distinct m-grams that followed the key, and drafts only if
the most frequent one is at least twice as frequent as the others together; it still copies the
tokens after the latest match, not the counted m-gram.

Example, n=2, m=3 (drafts need L >= 2n+m = 7): history [9, 1, 2, 3, 4, 5, 6, 7, 8, 1], last = 2.
The key is [1, 2]; nothing is indexed yet, so starts 4, 3, 2, 1 are scanned (position 0 never is)
and the key is found at 1: the draft is [3, 4, 5]. Starts 1..4 enter the table. If the target then
accepts only [3], the next draft for key [1, 2] has at most 1 token.

Speed: the reference is incremental except for its linear search of key records and the k4v
statistics scan from position 0; here a dict finds records by content and an n-gram -> starts index
finds the occurrences, both extended with the history, so a draft costs O(new tokens). The history
is mirrored: begin() compares the whole prompt with it; between begin() calls the history is
assumed to grow by appending, so draft() checks only its last 16 known tokens (a mismatch or a
shorter history triggers a resynchronisation).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdecode.drafts import Draft
from specdecode.strategies.ngram_simple import NgramMapConfig

N_BUCKETS = 1 << 18
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT: saturation of key_num and value_num
HASH_MULT = 2654435761
_MASK32 = 0xFFFFFFFF
_TAIL_CHECK = 16  # known history tokens compared to recognise an appended-to history


def ngram_hash(tokens: Sequence[int]) -> int:
    """The reference's 32-bit LCG over the tokens (bucket = hash % N_BUCKETS)."""
    h = 0
    for t in tokens:
        h = (h * HASH_MULT + (int(t) & _MASK32)) & _MASK32
    return h


@dataclass
class ValueSlot:
    value_idx: int = 0  # start of the m-gram in the history; 0 = unused
    value_num: int = 0
    n_accepted: int = 0


@dataclass
class KeyRecord:
    key_idx: int  # start of the key n-gram in the history
    values: list[ValueSlot]
    stat_idx: int = 0  # where the next k4v statistics scan starts
    key_num: int = 0  # lookups that hit this key


class _NgramStarts:
    """n-gram -> its start positions in increasing order, for the k4v statistics."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def add(self, tokens: list[int], lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self.starts.setdefault(tuple(tokens[i : i + self.n]), []).append(i)

    def remove(self, tokens: list[int], lo: int, hi: int) -> None:
        """Forget starts lo..hi-1, which are the latest ones of their lists."""
        for i in range(hi - 1, lo - 1, -1):
            key = tuple(tokens[i : i + self.n])
            self.starts[key].pop()
            if not self.starts[key]:
                del self.starts[key]

    def between(self, key: tuple[int, ...], lo: int, hi: int) -> list[int]:
        starts = self.starts.get(key, [])
        return starts[bisect_left(starts, lo) : bisect_right(starts, hi)]


class NgramMapStrategy:
    """One `common_ngram_map` (key_only=True: ngram-map-k, False: ngram-map-k4v)."""

    def __init__(self, config: NgramMapConfig, key_only: bool) -> None:
        self.config = config
        self.key_only = key_only
        self.name = "ngram-map-k" if key_only else "ngram-map-k4v"
        self.n_min = config.size_m  # CLASSIC chain: drafts shorter than size_m are dropped
        self.key_map = np.zeros(N_BUCKETS, dtype=np.uint32)  # bucket -> history start, 0 = empty
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.keys: list[KeyRecord] = []
        self._by_key: dict[tuple[int, ...], KeyRecord] = {}
        self._pending_end: float = math.inf  # smallest end of a record's incomplete key window
        self._tokens: list[int] = []
        self._starts = None if key_only else _NgramStarts(config.size_n)
        self._last: tuple[KeyRecord, int] | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        """If the history got shorter, forget what was indexed past the previous begin()."""
        n, m = self.config.size_n, self.config.size_m
        size = len(prompt)
        self._sync(prompt, check_all=True)
        cleanup = self.size_last_begin
        if cleanup > size:
            cleanup = size - n - m if size > n + m else 0
        if size < self.idx_last_check:
            self._cleanup(cleanup)
        self.idx_last_check = size
        self.size_last_begin = size

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        """n_max is left to the chain: a draft never exceeds size_m."""
        n, m = self.config.size_n, self.config.size_m
        self._last = None
        length = len(history)
        if length < 2 * n + m:
            return Draft()
        self.idx_last_check = length
        self._sync(history, check_all=False)
        key = [*self._tokens[length - n + 1 : length], int(last)]
        match_pos = self._lookup_and_index(key, length)
        if match_pos == 0:
            return Draft()
        record = self._record(key, match_pos)
        slot = 0 if self.key_only else self._choose_value(record, key, match_pos)
        if slot is None:
            return Draft()
        self._last = (record, slot)
        count = min(m, record.values[slot].n_accepted)
        return Draft(tokens=self._tokens[match_pos + n : match_pos + n + count])

    def accept(self, n_accepted: int) -> None:
        """The next draft from the same key/value has at most n_accepted tokens.

        The CLASSIC chain reports only n_accepted > 0; LATEST also reports 0, which disables the
        key (map-k) or value (map-k4v) until begin() cleans it up.
        """
        if self._last is not None:
            record, slot = self._last
            record.values[slot].n_accepted = n_accepted

    def end(self) -> None:
        """The index belongs to this generation's history; nothing outlives it."""

    # --- lookup and the key_map index ---

    def _lookup_and_index(self, key: list[int], length: int) -> int:
        """The match position (0 = none), then index the starts the scans covered."""
        n, m = self.config.size_n, self.config.size_m
        key_hash = ngram_hash(key)
        c = int(self.key_map[key_hash % N_BUCKETS])
        found = c if 0 < c < length - n - m - 1 and self._tokens[c : c + n] == key else 0
        spans = [(lo, self._window_hashes(lo, hi)) for lo, hi in self._scan_ranges(length)]
        for lo, hashes in spans:
            found = found or self._scan(lo, hashes, key, key_hash)
        for lo, hashes in spans:
            self._index(lo, hashes)
        self.key_map_last_idx = max(length - n - m - 1, self.key_map_last_idx)
        return found

    def _scan_ranges(self, length: int) -> list[tuple[int, int]]:
        """Inclusive start ranges, scanned from the top: before the prompt's end, then after it.

        The first range is clipped to complete windows (it only matters for a history shorter
        than the begin() prompt, where the reference would read past its end).
        """
        n, m = self.config.size_n, self.config.size_m
        last_idx, begin_size = self.key_map_last_idx, self.size_last_begin
        return [
            (last_idx + 1, min(begin_size - n - m - 1, length - n)),
            (max(begin_size, last_idx) + 1, length - n - m - 1),
        ]

    def _window_hashes(self, lo: int, hi: int) -> np.ndarray:
        """ngram_hash of the windows starting at lo..hi, vectorised over the starts."""
        count, n = hi - lo + 1, self.config.size_n
        if count <= 0:
            return np.zeros(0, dtype=np.uint32)
        tokens = (np.array(self._tokens[lo : hi + n], dtype=np.int64) & _MASK32).astype(np.uint32)
        hashes = np.zeros(count, dtype=np.uint32)
        for k in range(n):
            hashes *= np.uint32(HASH_MULT)  # wraps mod 2^32
            hashes += tokens[k : k + count]
        return hashes

    def _scan(self, lo: int, hashes: np.ndarray, key: list[int], key_hash: int) -> int:
        """The highest start whose window equals the key (0 = none)."""
        n = self.config.size_n
        for i in np.flatnonzero(hashes == np.uint32(key_hash))[::-1]:
            j = lo + int(i)
            if self._tokens[j : j + n] == key:
                return j
        return 0

    def _index(self, lo: int, hashes: np.ndarray) -> None:
        """Insert-if-empty, from the highest start down: per bucket the highest free start wins."""
        if not hashes.size:
            return
        buckets = (hashes % N_BUCKETS)[::-1]
        unique, first = np.unique(buckets, return_index=True)
        free = self.key_map[unique] == 0
        self.key_map[unique[free]] = lo + hashes.size - 1 - first[free]

    # --- key records and k4v statistics ---

    def _record(self, key: list[int], match_pos: int) -> KeyRecord:
        record = self._by_key.get(tuple(key))
        if record is None:
            m = self.config.size_m
            record = KeyRecord(match_pos, [ValueSlot(n_accepted=m) for _ in range(MAX_VALUES)])
            self.keys.append(record)
            self._by_key[tuple(key)] = record
        record.key_num = min(record.key_num + 1, MAX_VALUE_COUNT)
        return record

    def _choose_value(self, record: KeyRecord, key: list[int], match_pos: int) -> int | None:
        """k4v: the dominant value slot after counting new occurrences, None for no draft."""
        if record.key_num < self.config.min_hits:
            return None
        assert self._starts is not None
        # stat_idx..match_pos inclusive: match_pos is counted again next time (reference quirk).
        for i in self._starts.between(tuple(key), record.stat_idx, match_pos):
            slot = self._value_slot(record, i + self.config.size_n)
            if slot is not None:
                slot.value_num = min(slot.value_num + 1, MAX_VALUE_COUNT)
        record.stat_idx = match_pos
        counts = [slot.value_num for slot in record.values]
        best = counts.index(max(counts))
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return None
        return best

    def _value_slot(self, record: KeyRecord, start: int) -> ValueSlot | None:
        """The first slot that is free (claimed) or holds the m-gram at start; None if all 4 differ."""
        m = self.config.size_m
        value = self._tokens[start : start + m]
        for slot in record.values:
            if slot.value_idx == 0:
                slot.value_idx, slot.value_num, slot.n_accepted = start, 0, m
                return slot
            if self._tokens[slot.value_idx : slot.value_idx + m] == value:
                return slot
        return None

    def _cleanup(self, cleanup: int) -> None:
        """Drop index entries, keys and (k4v) values at or past `cleanup`."""
        self.key_map[self.key_map >= cleanup] = 0
        self.key_map_last_idx = max(cleanup - 1, 0)
        kept = []
        for record in self.keys:
            if record.key_idx >= cleanup:
                continue
            if not self.key_only:
                _drop_values(record.values, cleanup)
                if record.values[0].value_idx == 0:
                    continue
            kept.append(record)
        self.keys = kept
        self._reindex_records()

    def _reindex_records(self) -> None:
        """Rebuild n-gram -> record from the current history: the first record of equal content
        wins as in the reference's linear search; incomplete key windows wait for more tokens."""
        n = self.config.size_n
        self._by_key = {}
        self._pending_end = math.inf
        for record in self.keys:
            end = record.key_idx + n
            if end > len(self._tokens):
                self._pending_end = min(self._pending_end, end)
            else:
                self._by_key.setdefault(tuple(self._tokens[record.key_idx : end]), record)

    # --- the mirrored history ---

    def _sync(self, history: Sequence[int], check_all: bool) -> None:
        """Make the mirror equal to history, appending when history extends it."""
        tokens, known = self._tokens, len(self._tokens)
        checked = known if check_all else min(known, _TAIL_CHECK)
        tail = [int(t) for t in history[known - checked : known]]
        if len(history) >= known and tail == tokens[known - checked :]:
            self._extend(history[known:])
            return
        same = min(known, len(history))
        same = next((i for i, (a, b) in enumerate(zip(tokens, history, strict=False)) if a != int(b)), same)
        if self._starts is not None:
            n = self.config.size_n
            self._starts.remove(tokens, max(0, same - n + 1), known - n + 1)
        del tokens[same:]
        self._extend(history[same:])
        self._reindex_records()

    def _extend(self, new: Sequence[int]) -> None:
        known = len(self._tokens)
        self._tokens.extend(int(t) for t in new)
        if self._starts is not None:
            n = self.config.size_n
            self._starts.add(self._tokens, max(0, known - n + 1), len(self._tokens) - n + 1)
        if len(self._tokens) >= self._pending_end:
            self._reindex_records()


def _drop_values(values: list[ValueSlot], cleanup: int) -> None:
    """Delete slots at or past `cleanup`, shifting later ones left; the freed last slot keeps its
    n_accepted (only its index and count are cleared, as in the reference)."""
    i = 0
    while i < len(values):
        if values[i].value_idx >= cleanup:
            n_accepted = values[-1].n_accepted
            del values[i]
            values.append(ValueSlot(n_accepted=n_accepted))
        else:
            i += 1
