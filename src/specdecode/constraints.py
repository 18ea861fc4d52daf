"""Constrained generation: a grammar, JSON schema or regex decides which tokens may come next.

The grammar engine is llguidance (the Rust matcher behind Guidance, llama.cpp's
`--grammar` with `%llguidance` and vLLM's `guidance` backend): it compiles GBNF, Lark, JSON
schemas and regexes against the target's tokenizer, computes the allowed set of one position
in microseconds to a few hundred, and rolls its state back by any number of tokens, which is
what verification needs.

A `Constraint` is made per generation. It is one more stage in front of the sampler, the
same in plain and speculative generation: every logits row the sampler reads is first masked
with the matcher's state after the tokens before that row, so a constrained speculative run
samples from exactly the distributions a constrained plain run does.

- Verification (`mask_rows`): one matcher walk down the draft (a chain, or a tree depth first)
  gives the mask of every row of the pass; the walk is rolled back afterwards, and only the
  tokens the step emits are committed (`advance`).
- Drafting: drafts are cut at their first forbidden token (`prune`; a tree loses the subtrees
  below a forbidden node); a drafting model masks its own logits as it drafts, a chain
  (`push`, `draft_logits`) or a tree (`mask_at` each node's path), and `rewind`s after, so a
  token the grammar forbids is never proposed, and where the grammar allows a single token
  its top-1 confidence is 1. `forced` lists the tokens the grammar allows alone,
  drafted for free by the `forced` strategy.

Masks computed for a position are kept until the constraint advances, so the masks a drafting
model asked for are not computed again when the same positions are verified.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.drafts import Draft, path_to
from specdecode.errors import SpecdecodeError
from specdecode.grammars import (
    ConstraintSpec,
    compile_constraint,
    engine,
    grammar_tokenizer,
    one_line,
    parser_limits,
)

if TYPE_CHECKING:
    import llguidance

__all__ = ["Constraint", "ConstraintSpec", "compile_constraint", "grammar_tokenizer"]


class Constraint:
    """A matcher over one generation's output, with the masks verification and drafting need.

    The committed state follows the emitted tokens (`advance`); drafting and mask walks move a
    scratch path on top of it (`push`) and always return to it (`rewind`)."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        """grammar: from `compile_constraint`; vocab_size: rows of the target's logits."""
        self._matcher = engine().LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if self._matcher.is_error():
            raise SpecdecodeError(f"invalid grammar: {one_line(self._matcher.get_error())}")
        self.vocab_size = vocab_size
        self._path: list[int] = []  # scratch tokens pushed on the committed state
        self._masks: dict[tuple[int, ...], torch.Tensor | None] = {}  # scratch path -> allowed [V]
        self.t_mask = 0.0  # seconds spent in the matcher (masks, walks, commits)
        self.n_masks = 0

    @classmethod
    def for_backend(cls, spec: ConstraintSpec, backend) -> Constraint:
        """A constraint over `backend`'s (the target's) tokenizer."""
        tokenizer = grammar_tokenizer(backend.tokenizer, backend.vocab.size, backend.vocab.eos_id)
        return cls(compile_constraint(spec, tokenizer), tokenizer, backend.vocab.size)

    # ------------------------------------------------------------------ committed state

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (end of generation)."""
        return self._matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Commit one emitted token."""
        assert not self._path, "rewind the scratch path first"
        start = time.perf_counter()
        ok = self._matcher.consume_token(token)
        self._masks.clear()
        self.t_mask += time.perf_counter() - start
        assert ok, f"token {token} is not allowed here: {self._matcher.get_error()}"

    # ------------------------------------------------------------------ scratch path

    def push(self, token: int) -> bool:
        """Move the scratch state along token; False (and no move) if the grammar forbids it."""
        start = time.perf_counter()
        ok = self._matcher.try_consume_tokens([token]) == 1
        self.t_mask += time.perf_counter() - start
        if ok:
            self._path.append(token)
        return ok

    def rewind(self, n: int | None = None) -> None:
        """Undo the last n pushed tokens (all of them when None)."""
        n = len(self._path) if n is None else n
        if n:
            start = time.perf_counter()
            self._matcher.rollback(n)
            del self._path[len(self._path) - n :]
            self.t_mask += time.perf_counter() - start

    def allowed(self) -> torch.Tensor | None:
        """The tokens allowed at the scratch state, bool [V]; None when the grammar is done
        (stopped), where no row is sampled for output."""
        key = tuple(self._path)
        if key not in self._masks:
            start = time.perf_counter()
            mask = None
            if not self._matcher.is_stopped():
                bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
                allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
                mask = torch.from_numpy(allowed)
                if len(allowed) < self.vocab_size:  # logits past the tokenizer: never allowed
                    mask = torch.cat([mask, torch.zeros(self.vocab_size - len(allowed), dtype=torch.bool)])
            self._masks[key] = mask
            self.n_masks += 1
            self.t_mask += time.perf_counter() - start
        return self._masks[key]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the scratch state forbids at -inf (a new tensor)."""
        allowed = self.allowed()
        if allowed is None:
            return logits
        n = min(len(allowed), logits.shape[-1])
        out = logits.clone()
        out[:n].masked_fill_(~allowed[:n], float("-inf"))
        out[n:] = float("-inf")
        return out

    def mask_at(self, path: Sequence[int], logits: torch.Tensor) -> torch.Tensor | None:
        """A drafting model's logits [V] for the node after `path` (tokens from the committed
        state), masked there; the scratch path moves to `path` (rewind it when done drafting).
        None where the path is forbidden or the grammar is complete after it."""
        common = 0
        while common < min(len(self._path), len(path)) and self._path[common] == path[common]:
            common += 1
        self.rewind(len(self._path) - common)
        for token in path[common:]:
            if not self.push(token):
                return None
        return self.draft_logits(logits)

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """A drafting model's logits [V] masked at the scratch state; None where the grammar is
        complete, so that drafting stops."""
        return None if self.allowed() is None else self.mask(logits)

    # ------------------------------------------------------------------ drafts

    def mask_rows(self, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        """Each row of a verify pass [N+1, V] masked with the state after its path: row 0 after
        the committed tokens, row i + 1 after node i. One walk down the draft, rolled back."""
        out = logits.clone()
        out[0] = self.mask(logits[0])
        parents = draft.parent_list()
        stack: list[int] = []  # the nodes of the scratch path
        for node in range(len(draft.tokens)):
            if self._goto(stack, path_to(parents, node), draft.tokens):
                out[node + 1] = self.mask(logits[node + 1])
            # else: a node below a forbidden one, never reached by verification (masked samples
            # are never forbidden tokens); pruned drafts have none.
        self.rewind()
        return out

    def prune(self, draft: Draft) -> Draft:
        """The draft without its forbidden nodes: a chain cut at the first, a tree without the
        subtrees below each. Drafted probabilities stay with their nodes."""
        if not draft.tokens:
            return draft
        if draft.is_chain:
            start = time.perf_counter()
            n = self._matcher.validate_tokens(list(draft.tokens))
            self.t_mask += time.perf_counter() - start
            return draft if n == len(draft.tokens) else draft.truncated(n)
        parents = draft.parent_list()
        keep: list[int] = []
        kept: set[int] = set()
        stack: list[int] = []
        for node, parent in enumerate(parents):
            if (parent < 0 or parent in kept) and self._goto(stack, path_to(parents, node), draft.tokens):
                keep.append(node)
                kept.add(node)
        self.rewind()
        return draft if len(keep) == len(draft.tokens) else draft.subset(keep).simplified()

    def _goto(self, stack: list[int], path: list[int], tokens: Sequence[int]) -> bool:
        """Move the scratch path (nodes `stack`, updated) to the tree path `path`: rewind to
        the common prefix, then push the rest; False at a node the grammar forbids."""
        common = 0
        while common < min(len(stack), len(path)) and stack[common] == path[common]:
            common += 1
        self.rewind(len(stack) - common)
        del stack[common:]
        for node in path[common:]:
            if not self.push(tokens[node]):
                return False
            stack.append(node)
        return True

    def forced(self, n_max: int) -> list[int]:
        """Up to n_max tokens the grammar allows alone from the committed state on."""
        start = time.perf_counter()
        tokens = self._matcher.compute_ff_tokens()[:n_max]
        self.t_mask += time.perf_counter() - start
        return tokens
