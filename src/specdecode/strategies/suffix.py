"""suffix: drafting from suffix statistics of this request and of earlier ones (SuffixDecoding,
arXiv 2411.04975; vLLM's `suffix` method).

Two indexes answer the same question, "where did the end of the current context occur before,
and what followed?": one per generation over its prompt and output (`LocalIndex`, extended as
tokens are accepted), and one per process over earlier generations' outputs (`SuffixStore`,
which learns a generation's output when it ends, shared by every generation of the process).

Both map the hash of every KEY-token window to the positions that followed it. A draft looks up
the context's last KEY tokens in both, takes the most recent CANDIDATES occurrences of each,
measures how far back each one matches the context (up to max_depth tokens, vectorised) and
keeps the occurrences of the longest match: the suffix-tree node SuffixDecoding would reach.
What followed those occurrences forms the continuation tree; each node's frequency is the share
of its parent's occurrences that continued with its token. Nodes are drafted best first (by the
frequency of their whole path) while their own frequency is at least min_prob, at most
factor x the matched length of them and max_nodes, at most max_depth deep; siblings come most
frequent first. A draft therefore costs O(CANDIDATES x max_depth), whatever the indexes hold,
and extending the local index O(1) per token.

Example with KEY = 3: after [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7], the key (5, 6, 7) occurred
twice before; both match 3 tokens back, one went on with 8, 1, the other with 9, 2: the draft is
a tree of two branches [8, 1] and [9, 2], each of frequency 1/2.

The process-wide index keeps its requests' tokens (a -1 between requests, so that no match
spans two) in one array, and sorts the windows' hashes for binary search: a main part, re-sorted
when the tail of requests learnt since grows past a quarter of it, and that tail, re-sorted at
every request. A generation reads a snapshot that is swapped whole, so drafting takes no lock;
learning takes the store's lock. Past `cache_mb` (about BYTES_PER_TOKEN a token), the oldest
requests are evicted. With a file (--spec-suffix-file) the store is read at start and written,
atomically, after every generation; the file holds the requests' tokens, the index is rebuilt.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specdecode.config import SuffixConfig
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError, write_atomically

KEY = 3  # tokens hashed to find occurrences: a shorter match drafts nothing
CANDIDATES = 256  # most recent occurrences read from each index per draft
MULTIPLIER = 6364136223846793005
MASK64 = (1 << 64) - 1
SEPARATOR = -1  # between requests in the store, and past a window's end
BYTES_PER_TOKEN = 20  # the store's token (int32) and its window's sorted hash and position (int64)
TAIL_MIN = 1 << 16  # the tail is merged into the main part past this many tokens and a quarter
_TAIL_CHECK = 16  # mirrored tokens compared to recognise an appended-to history

MAGIC = b"SPECDECODE-SUFFIX\n"
VERSION = 1
_HEADER = np.dtype([("version", "<u4"), ("vocab", "<u4"), ("requests", "<u8"), ("tokens", "<u8")])


def key_hash(window: Sequence[int]) -> int:
    """The hash of KEY tokens, as `window_hashes` computes it."""
    h = 0
    for token in window:
        h = (h * MULTIPLIER + token) & MASK64
    return h


def window_hashes(tokens: np.ndarray) -> np.ndarray:
    """The hash of tokens[i : i+KEY] for every i (uint64 arithmetic wraps: exactly mod 2^64)."""
    count = len(tokens) - KEY + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    ids = tokens.astype(np.int64).view(np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    for k in range(KEY):
        h = h * np.uint64(MULTIPLIER) + ids[k : k + count]
    return h


class SortedWindows:
    """The windows of tokens[start:stop], sorted by hash: where each window's next token is."""

    def __init__(self, tokens: np.ndarray, start: int, stop: int) -> None:
        hashes = window_hashes(tokens[start:stop])
        order = np.argsort(hashes, kind="stable")  # equal hashes stay in position order
        self.hashes = hashes[order]
        self.ends = order.astype(np.int64) + (start + KEY)

    @property
    def nbytes(self) -> int:
        return self.hashes.nbytes + self.ends.nbytes

    def find(self, h: int) -> np.ndarray:
        """The ends of the windows of hash h, oldest first."""
        key = np.uint64(h)
        lo = int(np.searchsorted(self.hashes, key, "left"))
        hi = int(np.searchsorted(self.hashes, key, "right"))
        return self.ends[max(lo, hi - CANDIDATES) : hi]


class Snapshot:
    """What a draft reads of the store: never changed once published."""

    def __init__(self, tokens: np.ndarray, main: SortedWindows, tail: SortedWindows) -> None:
        self.tokens = tokens
        self.main = main
        self.tail = tail

    def find(self, h: int) -> np.ndarray:
        return np.concatenate((self.main.find(h), self.tail.find(h)))[-CANDIDATES:]


def _empty_snapshot() -> Snapshot:
    tokens = np.zeros(0, dtype=np.int32)
    return Snapshot(tokens, SortedWindows(tokens, 0, 0), SortedWindows(tokens, 0, 0))


class SuffixStore:
    """The process-wide index of earlier requests (their outputs, each led in by the last
    max_depth tokens of its prompt), shared by every generation of a pipeline and its forks."""

    def __init__(self, config: SuffixConfig, path: Path | None = None, vocab_size: int | None = None) -> None:
        """path: the file read now (if it exists) and written after every request."""
        self.config = config
        self.path = path
        self.vocab_size = vocab_size
        self.lock = threading.Lock()  # learning only: drafts read `snapshot`
        self.snapshot = _empty_snapshot()
        self.lengths: list[int] = []  # each request's tokens, oldest first (its separator not counted)
        self._buffer = np.zeros(0, dtype=np.int32)  # tokens, with room to grow
        self._size = 0  # tokens in the buffer, separators included
        self._main_stop = 0  # tokens the main part covers
        if path is not None and path.exists():
            self._replace(read_requests(path, vocab_size))

    @property
    def n_requests(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return self._size - len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held: the tokens' buffer and both sorted parts."""
        snapshot = self.snapshot
        return self._buffer.nbytes + snapshot.main.nbytes + snapshot.tail.nbytes

    @property
    def budget_tokens(self) -> int:
        return int(self.config.cache_mb * 2**20) // BYTES_PER_TOKEN

    def learn(self, tokens: Sequence[int]) -> None:
        """Add a finished request's tokens, evict the oldest past the cap, save the file."""
        if not tokens or self.budget_tokens <= 0:
            return
        with self.lock:
            new = np.asarray(tokens, dtype=np.int32)
            if self.n_tokens + len(new) > self.budget_tokens:
                self._replace([*self._requests(), new])
            else:
                self._append(new)
            if self.path is not None:
                write_requests(self.path, self._requests(), self.vocab_size)

    def learn_many(self, requests: Sequence[Sequence[int]]) -> None:
        """Add finished requests at once, oldest first (one re-sort, where `learn` may take one
        for each)."""
        if self.budget_tokens <= 0:
            return
        with self.lock:
            self._replace([*self._requests(), *(np.asarray(r, dtype=np.int32) for r in requests if len(r))])
            if self.path is not None:
                write_requests(self.path, self._requests(), self.vocab_size)

    def _requests(self) -> list[np.ndarray]:
        out, start = [], 0
        for length in self.lengths:
            out.append(self._buffer[start : start + length])
            start += length + 1
        return out

    def _append(self, new: np.ndarray) -> None:
        stop = self._size + len(new) + 1
        if stop > len(self._buffer):  # a new buffer: published snapshots keep the old one
            buffer = np.empty(max(2 * len(self._buffer), stop, 1024), dtype=np.int32)
            buffer[: self._size] = self._buffer[: self._size]
            self._buffer = buffer
        self._buffer[self._size : stop - 1] = new
        self._buffer[stop - 1] = SEPARATOR
        self._size = stop
        self.lengths.append(len(new))
        tokens = self._buffer[:stop]
        main = self.snapshot.main
        if stop - self._main_stop > max(TAIL_MIN, self._main_stop // 4):
            main, self._main_stop = SortedWindows(tokens, 0, stop), stop
        self.snapshot = Snapshot(tokens, main, SortedWindows(tokens, self._main_stop, stop))

    def _replace(self, requests: list[np.ndarray]) -> None:
        """Hold these requests, less the oldest ones past the cap (down to 90% of it, so that
        eviction and its re-sort come once per tenth of the cap)."""
        budget = self.budget_tokens
        if sum(map(len, requests)) > budget:
            budget = int(0.9 * budget)
        kept, total = [], 0
        for request in reversed(requests):
            if total + len(request) > budget:
                break
            kept.append(request)
            total += len(request)
        kept.reverse()
        self.lengths = [len(request) for request in kept]
        parts = [piece for request in kept for piece in (request, [SEPARATOR])]
        self._buffer = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
        self._size = self._main_stop = len(self._buffer)
        tokens = self._buffer
        self.snapshot = Snapshot(tokens, SortedWindows(tokens, 0, self._size), SortedWindows(tokens, 0, 0))


class LocalIndex:
    """One generation's context (prompt and output) and its windows' hashes -> next positions."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.array = np.zeros(256, dtype=np.int32)  # the same tokens, for vectorised reads
        self.ends: dict[int, list[int]] = {}

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens = []
        self.ends = {}
        self.extend(tokens)

    def extend(self, new: Sequence[int]) -> None:
        known = len(self.tokens)
        self.tokens.extend(int(t) for t in new)
        size = len(self.tokens)
        if size > len(self.array):
            array = np.empty(max(2 * len(self.array), size), dtype=np.int32)
            array[:known] = self.array[:known]
            self.array = array
        self.array[known:size] = self.tokens[known:size]
        first = max(known + 1, KEY)  # the windows ending at first..size are new
        if size - first > 64:  # a prompt: hash vectorised
            hashes = window_hashes(self.array[first - KEY : size]).tolist()
        else:
            hashes = [key_hash(self.tokens[end - KEY : end]) for end in range(first, size + 1)]
        for end, h in zip(range(first, size + 1), hashes, strict=True):
            self.ends.setdefault(h, []).append(end)

    def sync(self, history: Sequence[int], last: int) -> None:
        """Make the mirror equal to history + [last], appending when that extends it (only its
        last known tokens are compared: between begin() calls a history only grows)."""
        known, size = len(self.tokens), len(history) + 1
        lo = known - min(known, _TAIL_CHECK)
        if size >= known:
            seen = list(history[lo:known]) if known < size else [*history[lo:], last]
            if seen == self.tokens[lo:]:
                self.extend([*history[known:], last] if known < size else [])
                return
        self.reset([*history, last])

    def find(self, h: int) -> np.ndarray:
        """The positions that followed earlier windows of hash h (not the context's own end)."""
        ends = self.ends.get(h, ())
        recent = ends[-CANDIDATES - 1 : -1] if ends and ends[-1] == len(self.tokens) else ends[-CANDIDATES:]
        return np.asarray(recent, dtype=np.int64)


def _occurrences(
    tokens: np.ndarray, ends: np.ndarray, context_back: np.ndarray, depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """For occurrences ending at `ends` in `tokens`: how many tokens back each one equals the
    context (context_back: the context's last tokens, newest first), and the `depth` tokens that
    followed each (SEPARATOR past the end)."""
    size = len(tokens)
    back = ends[:, None] - 1 - np.arange(len(context_back))
    before = np.where(back >= 0, tokens[np.clip(back, 0, None)], SEPARATOR)
    matched = np.cumprod(before == context_back, axis=1).sum(axis=1)
    ahead = ends[:, None] + np.arange(depth)
    after = np.where(ahead < size, tokens[np.clip(ahead, None, size - 1)], SEPARATOR)
    return matched, after


def continuation_tree(rows: list[list[int]], max_nodes: int, min_prob: float) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the best-first tree of what followed (rows, SEPARATOR-padded): a
    node's frequency is the share of its parent's rows that go on with its token; nodes are
    taken by the frequency of their path while their own is at least min_prob."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(1.0, -1, rows)]  # (path frequency, node, its rows), node's children not yet read
    candidates: list[tuple[float, int, int, list[list[int]]]] = []  # (path freq, parent, token, rows)
    depth_of = {-1: 0}
    while len(tokens) < max_nodes:
        for path, node, node_rows in frontier:
            depth = depth_of[node]
            groups: dict[int, list[list[int]]] = {}
            for row in node_rows:
                if depth < len(row) and row[depth] != SEPARATOR:
                    groups.setdefault(row[depth], []).append(row)
            for token, group in groups.items():
                share = len(group) / len(node_rows)
                if share >= min_prob:
                    candidates.append((path * share, node, token, group))
        if not candidates:
            break
        best = max(range(len(candidates)), key=lambda i: candidates[i][0])
        path, parent, token, group = candidates.pop(best)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        depth_of[node] = depth_of[parent] + 1
        frontier = [(path, node, group)]
    return tokens, parents


class SuffixStrategy:
    """One generation's suffix drafting: its own index, and the process-wide store."""

    name = "suffix"
    n_min = 1

    def __init__(self, config: SuffixConfig, store: SuffixStore | None = None) -> None:
        self.config = config
        self.store = store
        self.local = LocalIndex()
        self._prompt_size = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.local.reset(prompt)
        self._prompt_size = len(prompt)

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        local = self.local
        local.sync(history, last)
        context = local.tokens
        depth = min(self.config.max_depth, n_max)
        if len(context) < KEY or depth < 1:
            return Draft()
        h = key_hash(context[-KEY:])
        context_back = np.asarray(context[: -self.config.max_depth - 1 : -1], dtype=np.int32)
        sources = [(local.array[: len(context)], local.find(h))]
        if self.store is not None:
            snapshot = self.store.snapshot
            sources.append((snapshot.tokens, snapshot.find(h)))
        found = [_occurrences(tokens, ends, context_back, depth) for tokens, ends in sources if len(ends)]
        if not found:
            return Draft()
        matched = np.concatenate([m for m, _ in found])
        after = np.concatenate([a for _, a in found])
        longest = int(matched.max())
        if longest < KEY:
            return Draft()
        rows = after[matched == longest].tolist()
        max_nodes = min(self.config.max_nodes, max(1, int(self.config.factor * longest)))
        tokens, parents = continuation_tree(rows, max_nodes, self.config.min_prob)
        return Draft(tokens, parents=parents).simplified() if tokens else Draft()

    def accept(self, n_accepted: int) -> None:
        """The accepted tokens reach the index with the next draft's history."""

    def end(self) -> None:
        """The process-wide store learns this generation's output, led in by its prompt's end."""
        tokens = self.local.tokens
        if self.store is None or len(tokens) <= self._prompt_size:
            return
        self.store.learn(tokens[max(0, self._prompt_size - self.config.max_depth) :])


# --------------------------------------------------------------------------- files


def write_requests(path: Path, requests: list[np.ndarray], vocab_size: int | None) -> None:
    """Write atomically: a temporary file in the same directory replaces `path` once complete."""
    header = np.array([(VERSION, vocab_size or 0, len(requests), sum(map(len, requests)))], dtype=_HEADER)
    lengths = np.array([len(request) for request in requests], dtype="<i8")
    tokens = np.concatenate(requests).astype("<i4") if requests else np.zeros(0, dtype="<i4")
    data = MAGIC + header.tobytes() + lengths.tobytes() + tokens.tobytes()
    write_atomically(path, "suffix file", lambda file: file.write(data))


def read_requests(path: Path, vocab_size: int | None) -> list[np.ndarray]:
    """The requests a suffix file holds; a file that is not one, is cut or corrupt, or was made
    for another vocabulary raises SpecdecodeError."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecdecodeError(f"cannot read suffix file {path}: {exc.strerror or exc}") from None
    if not raw.startswith(MAGIC):
        raise SpecdecodeError(
            f"{path} is not a specdecode suffix file (written by suffix_file=, --spec-suffix-file)"
        )
    body = raw[len(MAGIC) :]
    if len(body) < _HEADER.itemsize:
        raise SpecdecodeError(f"invalid suffix file {path}: its header is cut short")
    header = np.frombuffer(body, dtype=_HEADER, count=1)[0]
    version, vocab, n_requests, n_tokens = (int(header[name]) for name in _HEADER.names)
    if version != VERSION:
        raise SpecdecodeError(f"suffix file {path} has version {version}; this version reads {VERSION}")
    if vocab and vocab_size and vocab != vocab_size:
        raise SpecdecodeError(
            f"suffix file {path} was made for a vocabulary of {vocab} ids, the target has {vocab_size} "
            "(another tokenizer?)"
        )
    expected = _HEADER.itemsize + 8 * n_requests + 4 * n_tokens
    if len(body) != expected:
        raise SpecdecodeError(
            f"invalid suffix file {path}: {len(body)} bytes after the magic, {expected} expected"
        )
    lengths = np.frombuffer(body, dtype="<i8", count=n_requests, offset=_HEADER.itemsize)
    tokens = np.frombuffer(body, dtype="<i4", count=n_tokens, offset=_HEADER.itemsize + 8 * n_requests)
    # each length checked before they are added, and added as Python ints: int64 sums wrap
    if (lengths <= 0).any() or (lengths > n_tokens).any() or sum(lengths.tolist()) != n_tokens:
        raise SpecdecodeError(f"invalid suffix file {path}: request lengths do not add up to its tokens")
    highest = int(tokens.max()) if n_tokens else 0
    if n_tokens and (int(tokens.min()) < 0 or (vocab_size is not None and highest >= vocab_size)):
        raise SpecdecodeError(f"invalid suffix file {path}: token ids outside the target's vocabulary")
    return list(np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1])) if n_requests else []
