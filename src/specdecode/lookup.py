"""The n-gram cache tools of llama.cpp's lookup examples: create, merge and stats (§5.4, §7).

- create (`llama-lookup-create`): the static cache of a corpus, every 2-gram and what
  followed it. The tokens [0, 5, 6, 7, 5, 6, 8] (0 = BOS) give (0, 5) -> {6: 1},
  (5, 6) -> {7: 1, 8: 1}, (6, 7) -> {5: 1} and (7, 5) -> {6: 1}.
- merge (`llama-lookup-merge`): the sum of several cache files, written to another.
- stats (`llama-lookup-stats`): how well ngram-cache drafts on a text, with no model.
  The text is cut into chunks of n_ctx tokens; each chunk is replayed from its first
  token as if generated: the caches draft up to n_draft tokens, drafted tokens are kept
  while they equal the text's next tokens, then the text's next token is appended as the
  target's own. The context cache starts empty for each chunk, learns every appended
  token, and is added into the dynamic cache after the chunk.

`run_create`, `run_merge` and `run_stats` run `specdecode lookup create|merge|stats` (whose flags
are in `specdecode.cli.lookup_flags`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from specdecode.backends.gguf_files import load_gguf_tokenizer
from specdecode.backends.hf import load_tokenizer
from specdecode.backends.load import is_gguf
from specdecode.defaults import resolve_models
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.strategies.ngram_cache import (
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    NgramCache,
    draft_tokens,
    load,
    merge,
    save,
    update,
)


@dataclass(frozen=True)
class LookupStats:
    """Counters of `stats`, named as llama-lookup-stats prints them; times in seconds."""

    n_draft: int  # the draft length asked for
    n_predict: int  # tokens replayed: n_ctx per simulated chunk
    n_drafted: int
    n_accept: int
    t_draft_flat: float  # loading the caches (measured by the caller)
    t_draft: float  # drafting and updating the context cache

    @property
    def accept_rate(self) -> float:
        return _ratio(self.n_accept, self.n_drafted)


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids as the model sees a prompt: BOS if its tokenizer adds one, special tokens parsed."""
    return list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])


def create(tokenizer: PreTrainedTokenizerBase, text: str) -> NgramCache:
    """The static cache of a text: 2-grams only."""
    tokens = tokenize(tokenizer, text)
    cache: NgramCache = {}
    update(cache, NGRAM_STATIC, NGRAM_STATIC, tokens, len(tokens))
    return cache


def merge_files(inputs: Sequence[Path], output: Path) -> NgramCache:
    """Load inputs[0], add the counts of the others, save to `output`.

    Every input is read before anything is written, so a bad input leaves `output` as it was.
    """
    if not inputs:
        raise SpecdecodeError("lookup merge needs at least one input cache")
    merged = load(inputs[0])
    for path in inputs[1:]:
        merge(merged, load(path))
    save(merged, output)
    return merged


def stats(
    tokens: Sequence[int],
    n_ctx: int,
    n_draft: int,
    static: NgramCache | None = None,
    dynamic: NgramCache | None = None,
    t_draft_flat: float = 0.0,
) -> LookupStats:
    """Simulate ngram-cache drafting over `tokens` (see the module docstring).

    Only chunks with more tokens after them are replayed (llama.cpp's
    `i_start + n_ctx < n_input`). `dynamic` is updated in place with every chunk's context.
    """
    if n_ctx < 1 or n_draft < 0:
        raise SpecdecodeError(f"lookup stats needs n_ctx >= 1 and n_draft >= 0 (got {n_ctx}, {n_draft})")
    if len(tokens) <= n_ctx:
        raise SpecdecodeError(
            f"the text has {len(tokens)} tokens: lookup stats needs more than n_ctx = {n_ctx} "
            "(a chunk is replayed only when tokens follow it)"
        )
    static = {} if static is None else static
    dynamic = {} if dynamic is None else dynamic
    n_drafted = n_accept = n_chunks = 0
    t_draft = 0.0
    for start in range(0, len(tokens) - n_ctx, n_ctx):
        drafted, accepted, seconds = _replay_chunk(tokens[start : start + n_ctx], n_draft, static, dynamic)
        n_drafted, n_accept, t_draft = n_drafted + drafted, n_accept + accepted, t_draft + seconds
        n_chunks += 1
    return LookupStats(n_draft, n_chunks * n_ctx, n_drafted, n_accept, t_draft_flat, t_draft)


def _replay_chunk(
    chunk: Sequence[int], n_draft: int, static: NgramCache, dynamic: NgramCache
) -> tuple[int, int, float]:
    """(drafted, accepted, seconds spent drafting and updating) for one chunk."""
    context: NgramCache = {}
    out = [chunk[0]]
    drafted = accepted = 0
    seconds = 0.0
    while len(out) < len(chunk):
        start = time.perf_counter()
        draft = draft_tokens(out, n_draft, context, dynamic, static)
        seconds += time.perf_counter() - start
        drafted += len(draft)
        for token in draft:
            if len(out) == len(chunk) or token != chunk[len(out)]:
                break
            accepted += 1
            seconds += _push(out, token, context)
        if len(out) < len(chunk):  # the target's own token
            seconds += _push(out, chunk[len(out)], context)
    merge(dynamic, context)
    return drafted, accepted, seconds


def _push(out: list[int], token: int, context: NgramCache) -> float:
    """Append a token and count the n-grams it ends; the seconds the update took."""
    out.append(token)
    start = time.perf_counter()
    update(context, NGRAM_MIN, NGRAM_MAX, out, 1)
    return time.perf_counter() - start


def _ratio(a: float, b: float) -> float:
    """a / b with C float semantics for b == 0 (nan or inf), as llama.cpp prints them."""
    if b:
        return a / b
    return float("nan") if a == 0 else float("inf")


def format_stats(result: LookupStats) -> str:
    """The summary lines of llama-lookup-stats (names padded to 12 characters)."""
    us = result.t_draft * 1e6
    fields = (
        ("n_draft", f"{result.n_draft}"),
        ("n_predict", f"{result.n_predict}"),
        ("n_drafted", f"{result.n_drafted}"),
        ("t_draft_flat", f"{result.t_draft_flat * 1e3:.2f} ms"),
        (
            "t_draft",
            f"{result.t_draft * 1e3:.2f} ms, {_ratio(us, result.n_drafted):.2f} us per token, "
            f"{_ratio(result.n_drafted, us * 1e-6):.2f} tokens per second",
        ),
        ("n_accept", f"{result.n_accept}"),
        ("accept", f"{100 * result.accept_rate:.3f}%"),
    )
    return "\n".join(f"{name:<12} = {value}" for name, value in fields)


# --------------------------------------------------------------------------- command line


def run_create(args: argparse.Namespace) -> None:
    output = args.lookup_cache_static
    if output.exists() and args.file.exists() and os.path.samefile(output, args.file):
        raise SpecdecodeError(f"-lcs {output} is the same file as the corpus -f: it would be overwritten")
    cache = create(model_tokenizer(args.model), read_text_file(args.file, "text file"))
    if not cache:
        raise SpecdecodeError(f"{args.file} is too short: fewer than 3 tokens, so no 2-gram has a follower")
    save(cache, args.lookup_cache_static)
    print(f"{len(cache)} 2-grams -> {args.lookup_cache_static}", file=sys.stderr)


def model_tokenizer(model: Path | None) -> PreTrainedTokenizerBase:
    """The tokenizer of -m (a model directory or a GGUF file), the bundled target's without -m."""
    target, _ = resolve_models(model, None)
    return load_gguf_tokenizer(target) if is_gguf(target) else load_tokenizer(target)


def run_merge(args: argparse.Namespace) -> None:
    if len(args.files) < 2:
        raise SpecdecodeError("lookup merge needs input caches and then the output: IN [IN ...] OUT")
    *inputs, output = args.files
    merged = merge_files(inputs, output)
    print(f"{len(inputs)} caches, {len(merged)} n-grams -> {output}", file=sys.stderr)


def run_stats(args: argparse.Namespace) -> None:
    tokens = tokenize(model_tokenizer(args.model), read_text_file(args.file, "text file"))
    start = time.perf_counter()
    static = load(args.lookup_cache_static) if args.lookup_cache_static else None
    dynamic = None
    if args.lookup_cache_dynamic and args.lookup_cache_dynamic.exists():  # absent: start empty
        dynamic = load(args.lookup_cache_dynamic)
    loaded = time.perf_counter() - start
    print(format_stats(stats(tokens, args.ctx_size, args.draft_max, static, dynamic, t_draft_flat=loaded)))
