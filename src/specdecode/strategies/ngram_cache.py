"""ngram-cache: drafting from counted n-gram statistics (llama.cpp `common/ngram-cache`, §2.4).

A cache maps an n-gram (1 to 4 token ids) to how often each token followed it. Three
caches are consulted for every draft token, first success wins:

- context (the tokens of this generation), with lax thresholds;
- dynamic (statistics of earlier generations), with strict thresholds;
- static (2-grams of a large corpus, `lookup create`), alone as the last resort.

In the first two, the longest n-gram (4 down to 1) whose best follower passes the size's
sample-size and percentage thresholds gives the token; the best follower maximises
count x (100 x static count, or 1 if the static 2-gram never saw it).

Worked example: indexing [1, 2, 3, 1, 2, 3, 1, 2] maps the 4-gram (2, 3, 1, 2) to {3: 1}.
A 4-gram needs one sighting and 50% in the lax thresholds, so from that history the
context cache drafts 3, then 1 (from (3, 1, 2, 3)), then 2, 3, ... up to n_draft tokens.

Candidates are scanned in dict (insertion) order and the first of equal scores wins, as
llama.cpp keeps the first in its `unordered_map` order; the two orders differ, so drafts
in tie cases are not reproduced bit for bit.

Files (§7) are a headerless concatenation of little-endian int32 records:
`ngram[4] (-1 padded), ntokens, ntokens x (token, count)`.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError, write_atomically

NgramCache: TypeAlias = dict[tuple[int, ...], dict[int, int]]

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
N_DRAFT = 8  # the chain's fixed draft length for ngram-cache
# Thresholds indexed by n-gram size - 1: longer n-grams need fewer sightings.
LAX_MIN_SAMPLE, LAX_MIN_PERCENT = (2, 2, 1, 1), (66, 50, 50, 50)
STRICT_MIN_SAMPLE, STRICT_MIN_PERCENT = (4, 3, 2, 2), (75, 66, 66, 66)
_HEADER = NGRAM_MAX + 1  # int32s before the pairs: the n-gram slots and ntokens
_INT32_MAX = 2**31 - 1
_EMPTY: dict[int, int] = {}


def update(cache: NgramCache, nmin: int, nmax: int, inp: Sequence[int], nnew: int) -> None:
    """Count, for sizes nmin..nmax, the n-grams ending just before each of the last nnew tokens."""
    size = len(inp)
    for s in range(nmin, nmax + 1):
        for i in range(max(size - nnew, s), size):
            part = cache.setdefault(tuple(inp[i - s : i]), {})
            part[inp[i]] = part.get(inp[i], 0) + 1


def _try_primary(
    cache: NgramCache,
    seq: list[int],
    part_static: dict[int, int],
    min_sample: tuple[int, ...],
    min_percent: tuple[int, ...],
) -> int | None:
    """The best follower of the longest suffix n-gram that passes its thresholds."""
    for s in range(min(NGRAM_MAX, len(seq)), NGRAM_MIN - 1, -1):
        part = cache.get(tuple(seq[-s:]))
        if not part:
            continue
        best, best_score, best_count, total = None, 0, 0, 0
        for token, count in part.items():
            score = count * (100 * part_static[token] if token in part_static else 1)
            if score > best_score:
                best, best_score, best_count = token, score, count
            total += count
        if total >= min_sample[s - 1] and 100 * best_count >= min_percent[s - 1] * total:
            return best
    return None


def _try_static(part: dict[int, int]) -> int | None:
    """The most frequent follower of the static 2-gram, with the lax 2-gram thresholds."""
    best, best_count, total = None, 0, 0
    for token, count in part.items():
        if count > best_count:
            best, best_count = token, count
        total += count
    i = NGRAM_STATIC - 1
    if total >= LAX_MIN_SAMPLE[i] and 100 * best_count >= LAX_MIN_PERCENT[i] * total:
        return best
    return None


def draft_tokens(
    inp: Sequence[int], n_draft: int, nc_context: NgramCache, nc_dynamic: NgramCache, nc_static: NgramCache
) -> list[int]:
    """Up to n_draft tokens continuing inp (whose last element is the newest token).

    Only the last 4 tokens of inp matter, so the cost does not depend on its length.
    Sizes longer than the available sequence are skipped (llama.cpp reads out of bounds).
    """
    if len(inp) < NGRAM_STATIC:
        return []
    seq = list(inp[-NGRAM_MAX:])
    start = len(seq)
    while len(seq) - start < n_draft:
        static_key = tuple(seq[-NGRAM_STATIC:])
        part_static = nc_static.get(static_key, _EMPTY)
        token = _try_primary(nc_context, seq, part_static, LAX_MIN_SAMPLE, LAX_MIN_PERCENT)
        if token is None:
            token = _try_primary(nc_dynamic, seq, part_static, STRICT_MIN_SAMPLE, STRICT_MIN_PERCENT)
        if token is None:
            token = _try_static(part_static)
        if token is None:
            break
        seq.append(token)
    return seq[start:]


def merge(target: NgramCache, other: NgramCache) -> None:
    """Add the counts of `other` into `target`, inserting n-grams and tokens it lacks."""
    for key, part in other.items():
        mine = target.get(key)
        if mine is None:
            target[key] = dict(part)
            continue
        for token, count in part.items():
            mine[token] = mine.get(token, 0) + count


# --------------------------------------------------------------------------- files


def _error(path: Path, offset: int, what: str) -> SpecdecodeError:
    return SpecdecodeError(f"invalid n-gram cache {path}: {what} at byte offset {offset}")


def _record_starts(ints: np.ndarray, n_bytes: int, path: Path) -> np.ndarray:
    """Int32 index of every record; records chain through their ntokens, so this walk is serial."""
    view, n, starts, pos = memoryview(ints), len(ints), [], 0
    while pos + _HEADER <= n:
        ntokens = view[pos + NGRAM_MAX]
        if ntokens <= 0:
            raise _error(path, 4 * (pos + NGRAM_MAX), f"ntokens = {ntokens} (must be > 0)")
        end = pos + _HEADER + 2 * ntokens
        if end > n:
            raise _error(path, 4 * pos, f"record of {ntokens} pairs truncated (file has {n_bytes} bytes)")
        starts.append(pos)
        pos = end
    rest = n_bytes - 4 * pos
    if rest >= 4 * NGRAM_MAX:
        raise _error(path, 4 * pos, "record truncated after its n-gram (no ntokens)")
    if rest:  # llama.cpp silently ignores this tail; a cut file deserves an error
        raise _error(path, 4 * pos, f"trailing partial n-gram header of {rest} bytes")
    return np.asarray(starts, dtype=np.int64)


def _check_records(
    heads: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
    starts: np.ndarray,
    pairs: np.ndarray,
    path: Path,
) -> None:
    """Canonical n-grams (1-4 ids >= 0, then -1), tokens >= 0 and counts > 0; else name the offset."""
    used = heads >= 0
    canonical = used[:, 0] & ((heads == -1) | used).all(1) & ~((heads[:, :-1] == -1) & used[:, 1:]).any(1)
    for bad, positions, what in (
        (~canonical, starts, "bad n-gram (1-4 ids >= 0, then -1 padding)"),
        (tokens < 0, pairs, "negative token id"),
        (counts <= 0, pairs + 1, "count <= 0"),
    ):
        if bad.any():
            raise _error(path, 4 * int(positions[np.argmax(bad)]), what)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Building millions of dicts and tuples triggers many useless cyclic-GC passes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load(path: str | Path, vocab_size: int | None = None) -> NgramCache:
    """Read a cache file; any truncation or invalid value raises SpecdecodeError, and so does an
    id from `vocab_size` on (a cache made with another tokenizer: a drafted id past the target's
    vocabulary would index past its embedding).

    Records and pairs may come in any order; a repeated n-gram or token keeps its first value.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecdecodeError(f"cannot read n-gram cache {path}: {exc.strerror or exc}") from None
    if not raw:
        raise SpecdecodeError(f"invalid n-gram cache {path}: the file is empty")
    ints = np.frombuffer(raw, dtype="<i4", count=len(raw) // 4).astype(np.int32, copy=False)
    starts = _record_starts(ints, len(raw), path)
    ntokens = ints[starts + NGRAM_MAX].astype(np.int64)
    bounds = np.concatenate(([0], np.cumsum(ntokens)))
    record = np.repeat(np.arange(len(starts)), ntokens)
    pairs = starts[record] + _HEADER + 2 * (np.arange(bounds[-1]) - bounds[record])
    heads, tokens, counts = ints[starts[:, None] + np.arange(NGRAM_MAX)], ints[pairs], ints[pairs + 1]
    _check_records(heads, tokens, counts, starts, pairs, path)
    highest = max(int(heads.max()), int(tokens.max()))
    if vocab_size is not None and highest >= vocab_size:
        raise SpecdecodeError(
            f"n-gram cache {path} holds token id {highest}, past the target's vocabulary of {vocab_size} "
            "ids (a cache made with another tokenizer?)"
        )
    with _gc_paused():
        return _build(heads, ntokens, tokens, counts)


def _first_wins(items: Iterable[tuple[int, Any]]) -> dict:
    """Like dict(items), but a repeated key keeps its first value (C++ `emplace`)."""
    out: dict = {}
    for key, value in items:
        out.setdefault(key, value)
    return out


def _build(heads: np.ndarray, ntokens: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> NgramCache:
    """The cache from checked records: list conversions and comprehensions, no per-record numpy."""
    pairs = zip(tokens.tolist(), counts.tolist(), strict=True)
    parts = [dict(itertools.islice(pairs, n)) for n in ntokens.tolist()]
    if sum(map(len, parts)) < len(tokens):  # a token repeated inside a record
        pairs = zip(tokens.tolist(), counts.tolist(), strict=True)
        parts = [_first_wins(itertools.islice(pairs, n)) for n in ntokens.tolist()]
    sizes = (heads >= 0).sum(axis=1)
    cache: NgramCache = {}
    for size in range(NGRAM_MIN, NGRAM_MAX + 1):  # n-grams of different sizes never collide
        rows = np.flatnonzero(sizes == size).tolist()
        keys = zip(*heads[rows, :size].T.tolist(), strict=True)
        cache.update(_first_wins(zip(keys, (parts[row] for row in rows), strict=True)))
    return cache


def _columns(cache: NgramCache) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(-1 padded n-grams, ntokens, tokens, counts) as int64 arrays; raises unless each fits the
    format and loads back (1-4 ids >= 0, int32 values, counts > 0, at least one pair)."""
    keys, parts = list(cache), list(cache.values())
    try:
        sizes = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
        ntokens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        if sizes.min() < NGRAM_MIN or sizes.max() > NGRAM_MAX or ntokens.min() < 1:
            raise ValueError("every key must be 1-4 token ids with at least one follower")
        heads = np.array([(*k, *(-1,) * (NGRAM_MAX - len(k))) for k in keys], dtype=np.int64)
        total = int(ntokens.sum())
        tokens = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=total)
        counts = np.fromiter(itertools.chain.from_iterable(p.values() for p in parts), np.int64, total)
    except (OverflowError, TypeError, ValueError) as exc:
        raise SpecdecodeError(f"not a valid n-gram cache: {exc}") from None
    ids_ok = ((heads >= 0) == (np.arange(NGRAM_MAX) < sizes[:, None])).all() and tokens.min() >= 0
    if not ids_ok or counts.min() < 1 or max(heads.max(), tokens.max(), counts.max()) > _INT32_MAX:
        raise SpecdecodeError("not a valid n-gram cache: ids must be int32 >= 0 and counts in 1..2^31-1")
    return heads, ntokens, tokens, counts


def _encode(cache: NgramCache) -> np.ndarray:
    """The file's little-endian int32s, records in the cache's order."""
    if not cache:
        raise SpecdecodeError("an empty n-gram cache cannot be saved (an empty file is not a valid cache)")
    heads, ntokens, tokens, counts = _columns(cache)
    n, total = len(heads), len(tokens)
    out = np.empty(_HEADER * n + 2 * total, dtype="<i4")
    starts = _HEADER * np.arange(n) + 2 * (np.cumsum(ntokens) - ntokens)
    out[starts[:, None] + np.arange(NGRAM_MAX)] = heads
    out[starts + NGRAM_MAX] = ntokens
    pairs = _HEADER * (np.repeat(np.arange(n), ntokens) + 1) + 2 * np.arange(total)
    out[pairs], out[pairs + 1] = tokens, counts
    return out


def save(cache: NgramCache, path: str | Path) -> None:
    """Write atomically: a temporary file in the same directory replaces `path` only when complete,
    so on any failure an existing file is left as it was."""
    path = Path(path)
    data = _encode(cache)
    write_atomically(path, "n-gram cache", data.tofile)


# --------------------------------------------------------------------------- strategy


class NgramCacheStrategy:
    """The classic chain's ngram-cache (`common_speculative_state_ngram_cache`).

    The context cache is never cleared and `cache_size` never reset, even across
    generations; begin and accept do nothing. Drafts are always up to 8 tokens (the
    chain cuts them to the step's budget). The static and dynamic caches are used as
    given, not copied.
    """

    name = "ngram-cache"
    n_min = 0

    def __init__(
        self,
        static: NgramCache | None = None,
        dynamic: NgramCache | None = None,
        dynamic_path: Path | None = None,
    ) -> None:
        """dynamic_path: where end() saves the dynamic cache (-lcd); None keeps it in memory."""
        self.static: NgramCache = {} if static is None else static
        self.dynamic: NgramCache = {} if dynamic is None else dynamic
        self.dynamic_path = dynamic_path
        self.context: NgramCache = {}
        self.cache_size = 0  # tokens of history + [last] already indexed

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        if self.cache_size < len(history) + 1:
            new = [*history[self.cache_size :], last]
            # llama.cpp quirk, kept on purpose: the new tokens are indexed as a sequence of
            # their own, so n-grams that span older history and the new tokens are never counted.
            update(self.context, NGRAM_MIN, NGRAM_MAX, new, len(new))
            self.cache_size = len(history) + 1
        tail = [*history[-(NGRAM_MAX - 1) :], last]
        return Draft(draft_tokens(tail, N_DRAFT, self.context, self.dynamic, self.static))

    def accept(self, n_accepted: int) -> None:
        pass

    def end(self) -> None:
        """Merge the context statistics into the dynamic cache and save it atomically, as
        `llama-lookup` does at exit (the llama.cpp server never saves it). The context is then
        emptied, so a later end() does not add the same statistics twice."""
        merge(self.dynamic, self.context)
        self.context = {}
        if self.dynamic_path is not None and self.dynamic:
            save(self.dynamic, self.dynamic_path)
