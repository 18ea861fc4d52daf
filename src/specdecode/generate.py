"""The generation loop: draft -> verify in one target pass -> accept -> roll back -> repeat.

The loop knows the target backend, a `Chain` of strategies and a `Sampler`; it never names
a strategy. Plain generation is the same loop with an empty chain: every step then scores
one token, so plain and speculative generation share every line that decides a token.

State per step: `history` = ids in the target's cache, `last` = the newest token, not yet
in it. A step scores `last` and the draft's nodes in one pass: a chain as the rows
[last, d0, ..., d(k-1)] at positions len(history)..., then keeps positions
< len(history) + 1 + n_accepted; a tree as a tree pass rooted at `last`, then commits the
accepted path. Verification walks either from the root, so the loop treats both alike.

A step is two halves around the target pass: `plan` drafts and names the rows to score,
`finish` verifies them and keeps what was accepted. `step` runs both around a pass of its own;
the batch engine (`specdecode.scheduler`) runs every sequence's `plan`, one pass for all of
their rows, then every `finish`, so a sequence decides its tokens with the same lines alone or
in a batch. The prompt enters the cache a chunk at a time (`prefill_step`) for the same reason.

Under a constraint (`specdecode.constraints`) every logits row is masked with the grammar's
state before the sampler reads it, in plain and speculative steps alike, and each emitted
token advances that state; a complete grammar ends the generation ("grammar"). A row that allows
no token (the logit bias bans every token the grammar allows) ends it too ("no allowed token").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.backends import Backend, common_prefix
from specdecode.backends.batch import RowGroup, score_alone
from specdecode.chain import Chain
from specdecode.constraints import Constraint
from specdecode.costs import ALONE, PassLoad, PassShare
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.sampling import NO_TOKEN, Sampler, reduce_rows, reducible
from specdecode.stats import GenerationStats
from specdecode.text import TextAssembler
from specdecode.verdicts import generation_verdicts
from specdecode.verify import VERIFY_MODES, Verdict, verify_match, verify_rejection

# A normalizer may merge characters before tokenizing (NFC/NFKC compose up to 3 into one).
NORMALIZER_SLACK = 4


@dataclass(frozen=True)
class GenerationConfig:
    """When a generation ends, and how drafts are verified.

    n_predict: the most tokens to generate (-1: until end of generation or a full context);
    `Pipeline.generate` also takes it as max_new_tokens (Hugging Face's name) or max_tokens (vLLM's).
    stop: strings that end the text (cut before them); a single string is one stop string.
    verify: "match" (the tokens plain generation would draw) or "rejection" (rejection sampling).
    ignore_eos: go on past end-of-generation tokens.
    context_shift: at a full context, drop n_discard tokens after the first n_keep (-1: the
    prompt's; a leading BOS is kept besides) and go on, as llama.cpp's --context-shift does
    (n_discard 0: half of those after n_keep); the kept tokens are scored again where they now
    stand. Without it a full context ends the generation."""

    n_predict: int = 128
    stop: tuple[str, ...] = ()
    verify: str = "match"
    ignore_eos: bool = False
    context_shift: bool = False
    n_keep: int = 0
    n_discard: int = 0

    def __post_init__(self) -> None:
        # A string is a sequence of characters: unwrapped, "\n\n" would stop at every "\n".
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(text, str) for text in stop):
            raise SpecdecodeError(f"stop strings must be strings, not {stop!r}")
        object.__setattr__(self, "stop", stop)  # a tuple whatever sequence was given: hashable, fixed
        if self.verify not in VERIFY_MODES:
            raise SpecdecodeError(
                f"unknown verify mode {self.verify!r} (choose from {', '.join(VERIFY_MODES)})"
            )
        if self.n_predict == 0 or self.n_predict < -1:
            raise SpecdecodeError("n_predict must be >= 1, or -1 for no limit")
        if self.n_keep < -1 or self.n_discard < 0:
            raise SpecdecodeError("n_keep must be >= -1 and n_discard >= 0")


@dataclass
class Chunk:
    """What one step added: tokens (ids) and the text that became safe to show."""

    tokens: list[int]
    text: str
    n_drafted: int = 0
    n_accepted: int = 0
    strategy: str | None = None
    # The target's logits rows the tokens were chosen from ([len(tokens), V], a grammar's mask
    # applied), for a generation that keeps them (`Generation.keep_logits`): what token
    # probabilities are reported from.
    logits: torch.Tensor | None = None
    # Where each token's share of `text` ends (the text its arrival made safe to show, the
    # last token's with what its stop flushed); text past the last end came with no token.
    ends: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """A step between drafting and verification: the draft and the target rows that score it."""

    draft: Draft
    rows: RowGroup
    t_draft: float = 0.0  # seconds its drafting took


@dataclass
class Generation:
    """One generation. Iterate it for `Chunk`s; afterwards read tokens, text and stats."""

    target: Backend
    chain: Chain
    sampler: Sampler
    config: GenerationConfig
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    constraint: Constraint | None = None
    keep_logits: bool = False  # each Chunk carries its tokens' logits rows
    # Told every step's draft and verdict (the prompt's pass: an empty draft), as acceptance
    # traces record them (`specdecode.bench.traces`).
    on_step: Callable[[Draft, Verdict], None] | None = None

    def __post_init__(self) -> None:
        check_room(self.prompt, -1 if self.config.context_shift else self.config.n_predict, self.target.n_ctx)
        self._text = TextAssembler(self.target, self.config.stop)
        self.stats.seed = self.sampler.seed
        self.stats.n_prompt = len(self.prompt)
        self.stats.strategies = self.chain.stats
        self._history: list[int] = []  # the ids in the target's cache, once the prompt is in
        self._prefilled: int | None = None  # prompt tokens in the cache (None: not started)
        self._start = 0.0
        self._closed = False

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def prefilled(self) -> int:
        """Prompt tokens in the target's cache so far."""
        return self._prefilled or 0

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is still (partly) outside the target's cache."""
        return self._prefilled is None or self._prefilled < len(self.prompt)

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while (chunk := self.prefill_step()) is None:
                pass
            yield chunk
            while not self.stats.stop_reason:
                chunk = self.step()
                if chunk.tokens or chunk.text:
                    yield chunk
        finally:  # also when the consumer stops early (a client gone): strategies still persist
            self.close()

    def prefill_step(self) -> Chunk | None:
        """Evaluate the next chunk (the backend's batch size) of the prompt the cache does not
        hold yet, in a pass of its own; after the last one, begin the chain and return the first
        token's Chunk.

        The chunks are those one `evaluate` call over the uncached prompt makes, so a prompt
        fed a chunk at a time (between other sequences' steps) leaves the very cache that one
        call leaves."""
        rows = self.prefill_rows()
        return self.prefill_done(rows, score_alone(rows))

    def prefill_rows(self, limit: int | None = None) -> RowGroup:
        """The rows of the next prompt chunk, for a pass the caller runs (`prefill_done` then
        takes their logits). The chunk is the one `prefill_step` scores, or, given a `limit`,
        at most that many rows of it where that changes no bit (`exact_chunk_rows`): a
        backend whose rows are not invariant to their pass's size keeps whole chunks."""
        if self._prefilled is None:
            self._start = time.perf_counter()
            self._prefilled = reusable_prompt_prefix(self.target, self.prompt)
            self.target.truncate(self._prefilled)
        size = solo_chunk_rows(self.target, len(self.prompt))
        if limit is not None and limit < size and self.exact_prompt_cuts:
            size = max(1, limit)
        chunk = self.prompt[self._prefilled : self._prefilled + size]
        final = self._prefilled + len(chunk) == len(self.prompt)
        return RowGroup(self.target, chunk, logits_rows=1 if final else 0, on_device=final and self.on_device)

    @property
    def on_device(self) -> bool:
        """Whether the target's rows are reduced where its pass ran (`reduce_rows`), so that only
        their candidates come to the host: a target that can keep its logits there, and
        settings whose reduced rows sample as the full ones (`reducible`), with no grammar to
        mask the rows nor logits to keep."""
        return (
            getattr(self.target, "logits_on_device", False)
            and self.constraint is None
            and not self.keep_logits
            and reducible(self.sampler.params, self.target.vocab.size)
        )

    @property
    def exact_prompt_cuts(self) -> bool:
        """Whether the prompt's chunks may be cut below a solo run's, and share passes with
        other rows, leaving every bit of the cache as the solo run leaves it."""
        size = solo_chunk_rows(self.target, len(self.prompt))
        return exact_chunk_rows(self.target, size) >= size

    def prefill_done(self, rows: RowGroup, logits: torch.Tensor) -> Chunk | None:
        """The chunk `rows` is in the cache (its pass gave `logits`); after the last one, begin
        the chain and return the first token's Chunk."""
        self._prefilled = (self._prefilled or 0) + len(rows)
        if self._prefilled < len(self.prompt):
            return None
        self.chain.begin(self.prompt)
        self.stats.t_prompt = time.perf_counter() - self._start
        self._history = list(self.prompt)
        if rows.on_device:  # only the row's candidates come to the host
            first = reduce_rows(logits, self.sampler.params)[0]
        else:
            first = logits[0] if self.constraint is None else self.constraint.mask(logits[0])
        token = self.sampler.sample(first, self._history)
        if self.on_step is not None:
            self.on_step(Draft(), Verdict([token], []))
        return self._emit([token], Draft(), 0, None if rows.on_device else first[None])

    def step(self, max_draft: int | None = None) -> Chunk:
        """One draft -> verify -> accept round in a pass of its own."""
        plan = self.plan(max_draft)
        if plan is None:
            return self.final_chunk()
        start = time.perf_counter()
        logits = score_alone(plan.rows)
        return self.finish(plan, logits, time.perf_counter() - start)

    def plan(self, max_draft: int | None = None, load: PassLoad = ALONE) -> StepPlan | None:
        """Draft, and say which rows the target must score: [last, *draft]. None when the
        context is full (the generation has stopped). max_draft caps the draft's nodes (0: a
        plain step), as a batch under load asks; `load`: what else the pass will hold."""
        history, last = self._history, self.tokens[-1]
        if len(history) + 1 > self.target.n_ctx:
            if not (self.config.context_shift and self._shift_context()):
                self.stats.stop_reason = "context"
                return None
            history = self._history
        room = self.target.n_ctx - len(history) - 1  # cache entries for draft nodes
        depth = min(room, self._remaining() - 1)  # tokens a step may still accept
        if max_draft is not None:
            room, depth = min(room, max_draft), min(depth, max_draft)
        # llama.cpp: drafts kept to the pass sizes whose rows its probe found bit-identical
        exact_room = getattr(self.target, "draft_room", None)
        cap = exact_room() if exact_room is not None and self.chain else None
        binds = cap is not None and cap < depth
        if cap is not None:
            self.stats.draft_cap = max(self.stats.draft_cap or 0, cap)
            room, depth = min(room, cap), min(depth, cap)
        start = time.perf_counter()
        remaining = min(self._remaining(), self.target.n_ctx - len(history))  # a catch-up's spread
        draft = Draft()
        if self.chain and depth > 0:
            draft = self.chain.draft(history, last, depth, room, load, remaining)
        if binds and len(draft.tokens) >= cap:  # the cap cut it short (or, at 0, left it out)
            self.stats.n_capped += 1
        if not getattr(self.target, "takes_trees", True):
            # A target that scores chains only verifies a tree's preferred path: each of its
            # nodes is its parent's first child, drawn from the full q its row carries.
            draft = draft.first_branch()
        t_draft = time.perf_counter() - start
        self.stats.t_draft += t_draft
        self.target.truncate(len(history))
        parents = None if draft.is_chain else [-1, *(p + 1 for p in draft.parent_list())]
        rows = RowGroup(self.target, [last, *draft.tokens], parents, on_device=self.on_device)
        return StepPlan(draft, rows, t_draft)

    def finish(
        self, plan: StepPlan, logits: torch.Tensor, t_pass: float, share: PassShare | None = None
    ) -> Chunk:
        """Verify the plan's draft against the target's logits [N+1, V] (from a pass of
        t_pass seconds, shared with a batch: `share`), keep what was accepted, and emit the
        step's tokens."""
        start = time.perf_counter()
        history, draft = self._history, plan.draft
        last = plan.rows.ids[0]
        if self.constraint is not None:
            logits = self.constraint.mask_rows(draft, logits)
        if plan.rows.on_device:  # only each row's candidates come to the host
            logits = reduce_rows(logits, self.sampler.params)
        verdict = self._verify(draft, logits, [*history, last])
        if self.on_step is not None:
            self.on_step(draft, verdict)
        self._keep(history, last, draft, verdict.path)
        self.stats.t_verify += t_pass + time.perf_counter() - start
        n_accepted = len(verdict.path)
        self.stats.n_passes += 1
        self.stats.n_step_tokens += len(verdict.emitted)
        if self.chain:  # also after a plain step: the adaptive policy learns from it
            self.chain.accept(draft, n_accepted, t_pass, verdict.emitted, verdict.path, share)
        if draft.tokens:
            self.stats.totals.record(len(draft.tokens), draft.depth, n_accepted)
        # emitted[0] was chosen from row 0 (`last`), each later token from its parent node's row
        rows = logits[[0, *(node + 1 for node in verdict.path)]] if self.keep_logits else None
        return self._emit(verdict.emitted, draft, n_accepted, rows)

    def _shift_context(self) -> bool:
        """llama.cpp's context shift (see `GenerationConfig`): the cache keeps the first n_keep
        tokens, the tokens after the n_discard dropped are evaluated again after them (no RoPE
        shift: the cache then holds what a fresh evaluation of the kept tokens gives). False
        where nothing can be dropped."""
        history, n_ctx = self._history, self.target.n_ctx
        n_keep = len(self.prompt) if self.config.n_keep < 0 else self.config.n_keep
        bos = self.target.vocab.bos_id
        n_keep = min(n_ctx - 4, n_keep + (bos is not None and self.prompt[0] == bos))
        n_left = len(history) - n_keep
        n_discard = min(self.config.n_discard or n_left // 2, n_left - 1)
        if n_discard < 1:
            return False
        tail = history[n_keep + n_discard :]
        self.target.truncate(n_keep)
        size = solo_chunk_rows(self.target, len(tail))
        for at in range(0, len(tail), size):
            score_alone(RowGroup(self.target, tail[at : at + size], logits_rows=0))
        self._history = [*history[:n_keep], *tail]
        self.stats.n_context_shifts += 1
        return True

    def final_chunk(self) -> Chunk:
        """The text held back (an unfinished character, a possible stop string's start), once
        the generation stopped outside `_emit` (a full context)."""
        return Chunk([], self._text.finish())

    def close(self) -> None:
        """End the generation (idempotent): its stop reason is set ("abandoned" if it had
        none) and the strategies' end() runs."""
        if self._closed:
            return
        self._closed = True
        started = self._start or time.perf_counter()
        self.stats.t_generation = time.perf_counter() - started - self.stats.t_prompt
        if self.constraint is not None:
            self.stats.t_grammar, self.stats.n_masks = self.constraint.t_mask, self.constraint.n_masks
        self.stats.stop_reason = self.stats.stop_reason or "abandoned"
        self.stats.verdicts = generation_verdicts(self.stats, self.chain)
        self.chain.end()

    def _keep(self, history: list[int], last: int, draft: Draft, path: list[int]) -> None:
        """Make `history` and the target's cache hold last and the accepted nodes."""
        if draft.is_chain:
            self.target.truncate(len(history) + 1 + len(path))
        else:
            self.target.commit([0, *(node + 1 for node in path)])
        history.append(last)
        history.extend(draft.tokens[node] for node in path)

    def _verify(self, draft: Draft, logits, context: Sequence[int]) -> Verdict:
        """context: every token before the first verified position (history + [last])."""
        # Under a grammar, end of generation is the grammar's to allow: it ends the step.
        ignore_eos = self.config.ignore_eos and self.constraint is None
        eog = frozenset() if ignore_eos else self.target.vocab.eog_ids
        if self.config.verify == "rejection":
            return verify_rejection(draft, logits, self.sampler, context, eog)
        return verify_match(draft, logits, self.sampler, context, eog)

    def _emit(
        self, emitted: list[int], draft: Draft, n_accepted: int, rows: torch.Tensor | None = None
    ) -> Chunk:
        """Append tokens one by one, stopping exactly where plain generation would; `rows`: the
        logits rows the tokens were chosen from (kept when `keep_logits`)."""
        kept: list[int] = []
        text = ""
        ends: list[int] = []
        for token in emitted:
            if token == NO_TOKEN:  # its row allowed none: the logit bias bans all a grammar allows
                self.stats.stop_reason = "no allowed token"
                text += self._text.finish()
                break
            kept.append(token)
            self.tokens.append(token)
            self.stats.n_generated += 1
            text += self._text.push(token)
            ends.append(len(text))
            if self.constraint is not None:
                self.constraint.advance(token)
            self.stats.stop_reason = self._stop_reason(token)
            if self.stats.stop_reason:
                text += self._text.finish()
                ends[-1] = len(text)
                break
        # a copy: a backend may reuse the buffer its rows are views of in its next pass
        kept_rows = rows[: len(kept)].clone() if self.keep_logits and rows is not None else None
        return Chunk(kept, text, len(draft.tokens), n_accepted, draft.strategy, kept_rows, ends)

    def _stop_reason(self, token: int) -> str:
        """Why the text ends after token ("" where it goes on). A stop string that the token
        completing the grammar also completes is the reason: it cut the text."""
        if token in self.target.vocab.eog_ids and (not self.config.ignore_eos or self.constraint is not None):
            return "eos"
        if self._text.stopped:
            return "stop string"
        if self.constraint is not None and self.constraint.stopped:
            return "grammar"
        if self._remaining() <= 0:
            return "n_predict"
        return ""

    def _remaining(self) -> int:
        if self.config.n_predict < 0:
            return self.target.n_ctx
        return self.config.n_predict - len(self.tokens)


def reusable_prompt_prefix(target: Backend, prompt: Sequence[int]) -> int:
    """How many of the prompt's tokens the target's cache may keep: the longest cached prefix,
    less the last prompt token (evaluated in any case, since its logits are needed), less what a
    backend whose rows depend on their pass's shape cannot reuse bit for bit (its
    `reusable_prefix`, e.g. `LlamaCppBackend.reusable_prefix`)."""
    cached = min(common_prefix(target.tokens, prompt), len(prompt) - 1)
    reusable = getattr(target, "reusable_prefix", None)
    return cached if reusable is None else reusable(cached, len(prompt))


def solo_chunk_rows(target: Backend, prompt_length: int) -> int:
    """The rows of each prompt chunk of a solo run: the backend's batch size."""
    return getattr(target, "n_batch", prompt_length)


def exact_chunk_rows(target: Backend, solo: int) -> int:
    """Up to how many rows a prompt chunk gets a solo run's bits in a pass of any size and
    company (0: none; a solo run's chunks have `solo` rows). The native backend's rows are
    invariant in passes of up to `max_pass_rows`; llama.cpp's in the passes its probe vouches
    for (`vouched_rows`), or in any where exactness was given up. A solo chunk longer than that
    limit was scored in a pass whose rows are not invariant: only that very pass reproduces it,
    so such prompts keep whole chunks, as do backends that promise nothing (transformers')."""
    if getattr(target, "row_invariant", False):
        limit = int(target.max_pass_rows)  # type: ignore[attr-defined]
    elif hasattr(target, "vouched_rows"):
        vouched = target.vouched_rows  # type: ignore[attr-defined]
        limit = solo if vouched is None else int(vouched)
    else:
        return 0
    return limit if solo <= limit else 0


def chars_per_token(entries: Iterable[str | None]) -> int:
    """The most characters of text one token can stand for, from the vocabulary's entries (as
    stored; None for an id without one): no token covers more characters than its entry holds
    (byte-level and SentencePiece entries spell out at least the text they stand for), times
    what a normalizer may merge."""
    return max((len(entry) for entry in entries if entry), default=1) * NORMALIZER_SLACK


def check_text_room(n_chars: int, per_token: int, n_predict: int, n_ctx: int) -> None:
    """`check_room` for a prompt's text before it is tokenized (a text of megabytes takes
    gigabytes to tokenize): refuse a
    text of `n_chars` characters whose fewest possible tokens (`per_token` characters each, see
    `chars_per_token`) leave no room in the context for `n_predict` tokens (<= 0: for one)."""
    least = -(-n_chars // per_token)
    if least >= n_ctx:
        raise SpecdecodeError(
            f"the prompt is {n_chars} characters, so at least {least} tokens, but the context holds "
            f"only {n_ctx}"
        )
    if n_predict > 0 and least + n_predict > n_ctx:
        raise SpecdecodeError(
            f"prompt ({n_chars} characters, so at least {least} tokens) + n_predict ({n_predict}) "
            f"exceeds the context size ({n_ctx}); lower -n or raise -c"
        )


def check_room(prompt: Sequence[int], n_predict: int, n_ctx: int) -> None:
    """Refuse, before any work, a prompt that leaves no room for the requested tokens."""
    if not prompt:
        raise SpecdecodeError("the prompt is empty (it produced no tokens)")
    if len(prompt) >= n_ctx:
        raise SpecdecodeError(f"the prompt is {len(prompt)} tokens, but the context holds only {n_ctx}")
    if n_predict > 0 and len(prompt) + n_predict > n_ctx:
        raise SpecdecodeError(
            f"prompt ({len(prompt)} tokens) + n_predict ({n_predict}) exceeds the context size ({n_ctx}); "
            "lower -n or raise -c"
        )
