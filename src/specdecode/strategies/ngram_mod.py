"""ngram-mod: a hashed pool of "n tokens -> next token", shared by every generation
(llama.cpp `common_ngram_mod`, PR #19164).

The pool has 4,194,304 int32 entries. The n tokens before position i (n = n_match, 24) hash
with a 64-bit multiplicative hash, h = h * 6364136223846793005 + t (mod 2^64), to a slot that
stores the token at i: last writer wins, collisions are not detected. Drafting starts from
the last n tokens and follows the pool token by token: at least n_min (48) tokens or nothing,
at most n_max (64).

Example with n=2: after indexing [1, 2, 3, 1, 2, 4], slot(1, 2) holds 4 (the later write), so
from context [..., 1, 2] the draft follows 4, then slot(2, 4), and so on until a slot is empty.

The pool is shared across generations and sequences, so what one request wrote helps the
next. It is emptied when more than a quarter of it is used at begin(), and after three
drafts in a row kept less than half of their tokens (the classic thresholds; the newer
generation uses 5 drafts below a quarter).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdecode.config import NgramModConfig
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError

POOL_SIZE = 4 * 1024 * 1024
EMPTY = -1
MULTIPLIER = 6364136223846793005
MASK64 = (1 << 64) - 1
LAZY_INDEX_STEP = 32  # the newest tokens are indexed only once this many have piled up
RESET_OCCUPANCY = 0.25
LOW_ACCEPTANCE = 0.5  # classic; newer: 0.25
LOW_STREAK = 3  # classic; newer: 5


class NgramModPool:
    """The shared hash table: slot(window of n tokens) -> the token that followed it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.entries = np.full(POOL_SIZE, EMPTY, dtype=np.int32)
        self.used = 0

    @property
    def occupancy(self) -> float:
        return self.used / POOL_SIZE

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def slot(self, window: Sequence[int]) -> int:
        h = 0
        for token in window:
            h = (h * MULTIPLIER + token) & MASK64
        return h % POOL_SIZE

    def get(self, window: Sequence[int]) -> int:
        return int(self.entries[self.slot(window)])

    def add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """For every i in [start, stop): slot(tokens[i:i+n]) <- tokens[i+n], in order."""
        if stop <= start:
            return
        ids = np.asarray(tokens[start : stop + self.n], dtype=np.int64).view(np.uint64)
        count = stop - start
        h = np.zeros(count, dtype=np.uint64)
        for k in range(self.n):  # uint64 arithmetic wraps: exactly mod 2^64
            h = h * np.uint64(MULTIPLIER) + ids[k : k + count]
        slots = (h % np.uint64(POOL_SIZE)).astype(np.int64)
        values = ids[self.n : self.n + count].view(np.int64).astype(np.int32)
        # The last write to a slot wins: keep each slot's last occurrence.
        last = count - 1 - np.unique(slots[::-1], return_index=True)[1]
        self.used += int((self.entries[slots[last]] == EMPTY).sum())
        self.entries[slots[last]] = values[last]


class NgramModStrategy:
    name = "ngram-mod"

    def __init__(self, config: NgramModConfig, pool: NgramModPool) -> None:
        if pool.n != config.n_match:
            raise SpecdecodeError("the ngram-mod pool was built for another n-match")
        self.config = config
        self.n_min = config.n_min
        self.pool = pool
        self.n = config.n_match
        self._i_last = 0  # next history index not yet hashed
        self._n_draft_last = 0
        self._n_low = 0  # consecutive drafts with low acceptance (kept across generations)

    def begin(self, prompt: Sequence[int]) -> None:
        self._i_last = 0
        self._n_draft_last = 0
        if len(prompt) < self.n:
            return
        self.pool.add(prompt, 0, len(prompt) - self.n)
        self._i_last = len(prompt) - self.n
        if self.pool.occupancy > RESET_OCCUPANCY:
            self.pool.reset()

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self._n_draft_last = 0
        length = len(history)
        if length < self.n:
            return Draft()
        if self._i_last + LAZY_INDEX_STEP < length:
            self.pool.add(history, self._i_last, length - self.n)
            self._i_last = length - self.n
        buffer = [*history[length - self.n + 1 :], last]
        for k in range(self.config.n_max):
            token = self.pool.get(buffer[k : k + self.n])
            if token == EMPTY:
                if k < self.config.n_min:
                    return Draft()
                break
            buffer.append(token)
        self._n_draft_last = len(buffer) - self.n
        return Draft(buffer[self.n :])

    def end(self) -> None:
        """The pool lives on in its owner (shared by every generation); nothing else to keep."""

    def accept(self, n_accepted: int) -> None:
        if self._n_draft_last == 0:
            return
        if n_accepted / self._n_draft_last >= LOW_ACCEPTANCE:
            self._n_low = 0
            return
        self._n_low += 1
        if self._n_low >= LOW_STREAK:
            self.pool.reset()
            self._n_low = 0
            self._i_last = 0
