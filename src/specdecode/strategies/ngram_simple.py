"""ngram-simple (prompt lookup): copy what followed the most recent earlier occurrence of the
last n tokens (llama.cpp `common_ngram_simple_draft`).

With history h of length L and the newest token `last`, the pattern is h[L-n+1:] + [last].
The match is the latest start j in [1, L-n-1] with h[j:j+n] == pattern (position 0 is never
matched); the draft is h[j+n : j+n+min(m, L-j-n)], and nothing when that is shorter than n.

Example, n=2, m=3: h = [9, 5, 6, 7, 8, 4, 3, 2, 5], last = 6. The pattern [5, 6] occurs at
j=1, so the draft is h[3:6] = [7, 8, 4].

Instead of scanning the history at every call, an index maps each n-gram to its latest start
and grows with the history, so a draft costs O(new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.config import NgramMapConfig
from specdecode.drafts import Draft


class NgramSimpleStrategy:
    """Prompt lookup. In the classic chain its n_min is size_m: shorter drafts are dropped."""

    name = "ngram-simple"

    def __init__(self, config: NgramMapConfig = NgramMapConfig()) -> None:
        self.n = config.size_n
        self.m = config.size_m
        self.n_min = config.size_m
        self._seen_length = 0  # length of the history the index was built from
        self._seen_tail: list[int] = []  # its last n+1 tokens, to tell a continuation from a new text
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> latest start j >= 1
        self._next_start = 1  # first window start not indexed yet

    def begin(self, prompt: Sequence[int]) -> None:
        """Index the prompt now, so that drafting only ever indexes new tokens."""
        self._reset()
        self._index(prompt)

    def accept(self, n_accepted: int) -> None:
        """Stateless algorithm: nothing to learn from the outcome."""

    def end(self) -> None:
        """The index is rebuilt for the next text; nothing to keep."""

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        n, length = self.n, len(history)
        if length <= n + self.m + 1:
            return Draft()
        self._index(history)
        start = self._latest.get((*history[length - n + 1 :], last))
        if start is None:
            return Draft()
        copy_max = min(self.m, length - (start + n))
        if copy_max < n:
            return Draft()
        return Draft(list(history[start + n : start + n + copy_max]))

    def _index(self, history: Sequence[int]) -> None:
        """Index every window h[j:j+n] with 1 <= j <= L-n-1 (ending before the newest token)."""
        if not continues(history, self._seen_length, self._seen_tail):
            self._reset()
        for j in range(self._next_start, len(history) - self.n):
            self._latest[tuple(history[j : j + self.n])] = j
        self._next_start = max(self._next_start, len(history) - self.n)
        self._seen_length = len(history)
        self._seen_tail = list(history[-(self.n + 1) :])

    def _reset(self) -> None:
        self._seen_length = 0
        self._seen_tail = []
        self._latest = {}
        self._next_start = 1


def continues(history: Sequence[int], seen_length: int, seen_tail: Sequence[int]) -> bool:
    """Whether `history` extends the one seen before, judged by that one's last tokens: O(tail)."""
    if len(history) < seen_length:
        return False
    return list(history[seen_length - len(seen_tail) : seen_length]) == list(seen_tail)
