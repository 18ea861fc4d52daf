"""The generation loop: draft -> verify in one target pass -> accept -> roll back -> repeat.

The loop knows the target backend, a `Chain` of strategies and a `Sampler`; it never names
a strategy. Plain generation is the same loop with an empty chain: every step then scores
one token, so plain and speculative generation share every line that decides a token.

State per step: `history` = ids in the target's cache, `last` = the newest token, not yet
in it. A step scores `last` and the draft's nodes in one pass: a chain as the rows
[last, d0, ..., d(k-1)] at positions len(history)..., then keeps positions
< len(history) + 1 + n_accepted; a tree as a tree pass rooted at `last`, then commits the
accepted path. Verification walks either from the root, so the loop treats both alike.

Under a constraint (`specdecode.constraints`) every logits row is masked with the grammar's
state before the sampler reads it, in plain and speculative steps alike, and each emitted
token advances that state; a complete grammar ends the generation ("grammar").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from specdecode.backends import Backend, evaluate_continuation
from specdecode.chain import Chain
from specdecode.constraints import Constraint
from specdecode.errors import SpecdecodeError
from specdecode.sampling import Sampler
from specdecode.stats import GenerationStats
from specdecode.strategies import Draft
from specdecode.text import TextAssembler
from specdecode.verify import VERIFY_MODES, Verdict, verify_match, verify_rejection


@dataclass(frozen=True)
class GenerationConfig:
    n_predict: int = 128  # -1: until end of generation or a full context
    stop: tuple[str, ...] = ()
    verify: str = "match"
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise SpecdecodeError(
                f"unknown verify mode {self.verify!r} (choose from {', '.join(VERIFY_MODES)})"
            )
        if self.n_predict == 0 or self.n_predict < -1:
            raise SpecdecodeError("n_predict must be >= 1, or -1 for no limit")


@dataclass
class Chunk:
    """What one step added: tokens (ids) and the text that became safe to show."""

    tokens: list[int]
    text: str
    n_drafted: int = 0
    n_accepted: int = 0
    strategy: str | None = None


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

    def __post_init__(self) -> None:
        check_room(self.prompt, self.config.n_predict, self.target.n_ctx)
        self._text = TextAssembler(self.target, self.config.stop)
        self.stats.seed = self.sampler.seed
        self.stats.n_prompt = len(self.prompt)
        self.stats.strategies = self.chain.stats

    @property
    def text(self) -> str:
        return self._text.text

    def __iter__(self) -> Iterator[Chunk]:
        start = time.perf_counter()
        logits = evaluate_continuation(self.target, self.prompt)  # [V]
        self.chain.begin(self.prompt)
        self.stats.t_prompt = time.perf_counter() - start
        history = list(self.prompt)
        try:
            if self.constraint is not None:
                logits = self.constraint.mask(logits)
            yield self._emit([self.sampler.sample(logits, history)], Draft(), 0)
            while not self.stats.stop_reason:
                chunk = self._step(history)
                if chunk.tokens or chunk.text:
                    yield chunk
        finally:  # also when the consumer stops early (a client gone): strategies still persist
            self.stats.t_generation = time.perf_counter() - start - self.stats.t_prompt
            if self.constraint is not None:
                self.stats.t_grammar, self.stats.n_masks = self.constraint.t_mask, self.constraint.n_masks
            self.stats.stop_reason = self.stats.stop_reason or "abandoned"
            self.chain.end()

    def _step(self, history: list[int]) -> Chunk:
        """One draft -> verify -> accept round; extends `history` with the kept tokens."""
        last = self.tokens[-1]
        if len(history) + 1 > self.target.n_ctx:
            self.stats.stop_reason = "context"
            return Chunk([], self._text.finish())
        room = self.target.n_ctx - len(history) - 1  # cache entries for draft nodes
        depth = min(room, self._remaining() - 1)  # tokens a step may still accept
        t0 = time.perf_counter()
        draft = self.chain.draft(history, last, depth, room) if self.chain and depth > 0 else Draft()
        t1 = time.perf_counter()
        self.target.truncate(len(history))
        logits = self._score(last, draft)  # [N+1, V]
        t_pass = time.perf_counter() - t1
        if self.constraint is not None:
            logits = self.constraint.mask_rows(draft, logits)
        verdict = self._verify(draft, logits, [*history, last])
        self._keep(history, last, draft, verdict.path)
        self.stats.t_draft += t1 - t0
        self.stats.t_verify += time.perf_counter() - t1
        n_accepted = len(verdict.path)
        self.stats.n_passes += 1
        self.stats.n_step_tokens += len(verdict.emitted)
        if self.chain:  # also after a plain step: the adaptive policy learns from it
            self.chain.accept(draft, n_accepted, t_pass, verdict.emitted)
        if draft.tokens:
            self.stats.totals.record(len(draft.tokens), draft.depth, n_accepted)
        return self._emit(verdict.emitted, draft, n_accepted)

    def _score(self, last: int, draft: Draft):
        """One target pass over `last` and the draft's nodes: logits [N+1, V]."""
        if draft.is_chain:
            return self.target.evaluate([last, *draft.tokens])
        return self.target.evaluate_tree([last, *draft.tokens], [-1, *(p + 1 for p in draft.parent_list())])

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

    def _emit(self, emitted: list[int], draft: Draft, n_accepted: int) -> Chunk:
        """Append tokens one by one, stopping exactly where plain generation would."""
        kept: list[int] = []
        text = ""
        for token in emitted:
            kept.append(token)
            self.tokens.append(token)
            self.stats.n_generated += 1
            text += self._text.push(token)
            if self.constraint is not None:
                self.constraint.advance(token)
            self.stats.stop_reason = self._stop_reason(token)
            if self.stats.stop_reason:
                text += self._text.finish()
                break
        return Chunk(kept, text, len(draft.tokens), n_accepted, draft.strategy)

    def _stop_reason(self, token: int) -> str:
        if token in self.target.vocab.eog_ids and (not self.config.ignore_eos or self.constraint is not None):
            return "eos"
        if self.constraint is not None and self.constraint.stopped:
            return "grammar"
        if self._text.stopped:
            return "stop string"
        if self._remaining() <= 0:
            return "n_predict"
        return ""

    def _remaining(self) -> int:
        if self.config.n_predict < 0:
            return self.target.n_ctx
        return self.config.n_predict - len(self.tokens)


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
