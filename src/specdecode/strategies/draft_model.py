"""Draft-model strategy: a small LM of the same vocabulary proposes the continuation.

llama.cpp's classic `draft` implementation: the draft keeps its own KV cache and reuses the
longest prefix it already evaluated, drafts the argmax, and stops at the first position
whose top-1 probability (softmax over the 10 largest logits, no temperature) is below p_min.
For rejection verification it samples from its own distribution instead and reports it.

With n_parallel > 1 it drafts a tree, llama.cpp's p_split scheme (examples/speculative): at
every node whose top-1 probability reaches p_min, the top candidate continues the branch and
each next candidate (ranks 1..7, while branches are left) whose probability exceeds p_split
opens a new one; a tree holds at most n_max nodes. All nodes of one depth are scored in one
tree pass of the draft model, so a prefix shared by branches is evaluated once. For rejection
verification the children of a node are drawn from the draft's distribution without
replacement, each reported with the distribution it was drawn from.

Under a policy's rule (`keep_drafting`, see `specdecode.policy`) the rule decides in place of
p_min which chain token is drafted, and whether the step that shows the next one runs (a
chain may end on a token the model never evaluated: its next call reads it, if kept, with
the rest of what was verified), and in trees in place of p_min and p_split which of a
node's candidates (ranks 0..7, still at most n_parallel branches and n_max nodes) become
nodes, from each candidate's rank probability: never from which token was drawn.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.backends import Backend, common_prefix, evaluate_continuation, uncached_tail
from specdecode.backends.batch import RowGroup, score_alone
from specdecode.backends.graph_draft import DEVICE_DRAFT_STEPS
from specdecode.config import DraftModelConfig
from specdecode.drafts import Draft, path_to
from specdecode.errors import SpecdecodeError
from specdecode.sampling import NO_TOKEN, Sampler, distribution
from specdecode.strategies.base import KeepDrafting
from specdecode.vocab import VocabTranslator

if TYPE_CHECKING:
    from specdecode.constraints import Constraint

CONFIDENCE_TOP_K = 10
SPLIT_RANKS = 8  # candidates a node may branch into: the top one and ranks 1..7 (llama.cpp)


def top1_confidence(logits: torch.Tensor) -> float:
    """Probability of the best token under a softmax over the 10 largest logits [V]."""
    return float(top_candidates(logits)[1][0])


def continue_draft(rule: KeepDrafting | None, depth: int, confidence: float, p_min: float) -> bool:
    """Draft the token at `depth` of this top-1 confidence? The policy's rule, else p_min's."""
    return confidence >= p_min if rule is None else rule(depth, confidence)


def look_further(rule: KeepDrafting | None, depth: int, n_max: int) -> bool:
    """Run the next draft step after the token at `depth`, to see the one after it? Not past
    n_max; classically always (p_min judges what it shows), else as the policy's rule says."""
    return depth < n_max and (rule is None or rule.further(depth))


def top_candidates(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The 10 best ids of logits [V], best first, with their probabilities under a softmax
    over those 10 logits (what p_min and p_split read)."""
    top = torch.topk(logits, min(CONFIDENCE_TOP_K, logits.shape[-1]))
    return top.indices.tolist(), torch.softmax(top.values.to(torch.float64), dim=0)


class DraftModelStrategy:
    name: ClassVar[str] = "draft"

    def __init__(
        self,
        backend: Backend,
        config: DraftModelConfig,
        *,
        target_vocab_size: int,
        translator: VocabTranslator | None = None,
        sampler: Sampler | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """sampler: given for rejection verification at temperature > 0 (draft by sampling).
        constraint: the generation's, whose masks a chain draft takes (a forbidden token is
        never proposed; a token the grammar forces has confidence 1)."""
        self.backend = backend
        self.constraint = constraint
        self.config = config
        self.n_min = config.n_min
        self.target_vocab_size = target_vocab_size
        self.translator = translator
        self.sampler = sampler if sampler is not None and not sampler.params.greedy else None
        self._window_start = 0
        self.keep_drafting: KeepDrafting | None = None  # set by a policy: replaces p_min
        if config.n_parallel > 1 and translator is not None:
            raise SpecdecodeError(
                "n_parallel > 1 (--draft-n-parallel) needs a draft of the target's vocabulary: tree nodes "
                "cannot be translated through text (replacements=, --spec-replace)"
            )

    def begin(self, prompt: Sequence[int]) -> None:
        self._window_start = 0

    def accept(self, n_accepted: int) -> None:
        """Nothing to do: the next draft call reuses whatever prefix of the cache still matches."""

    def end(self) -> None:
        """Nothing outlives the generation but the cache, which stays valid."""

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        n_max = min(n_max, self.config.n_max, self.backend.n_ctx - 1)
        if n_max < 1:
            return Draft()
        context = self._draft_context(history, last, n_max)
        if not context:
            return Draft()  # special tokens alone translate to no text: nothing to continue
        if self._drafts_on_device():
            return self._draft_on_device(context, n_max)
        logits = evaluate_continuation(self.backend, context)  # [V]
        if self.config.n_parallel > 1:
            try:
                return self._draft_tree(context, logits, n_max)
            finally:
                if self.constraint is not None:
                    self.constraint.rewind()
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidences: list[float] = []
        # Under a constraint, a draft of the target's vocabulary is masked as it is drafted (one
        # translated through text is cut by the chain instead).
        constraint = self.constraint if self.translator is None else None
        try:
            while len(tokens) < n_max:
                if constraint is not None and (logits := constraint.draft_logits(logits)) is None:
                    break  # the grammar is complete
                confidence = top1_confidence(logits)
                if not continue_draft(self.keep_drafting, len(tokens) + 1, confidence, self.config.p_min):
                    break
                token, row = self._pick(logits, [*context, *tokens])
                if token == NO_TOKEN or (self.translator is None and token >= self.target_vocab_size):
                    break  # the bias bans every token left, or the target cannot emit ids past its vocabulary
                tokens.append(token)
                rows.append(row)
                confidences.append(confidence)
                if constraint is not None:
                    constraint.push(token)
                if not look_further(self.keep_drafting, len(tokens), n_max):
                    break
                logits = self.backend.evaluate([token], logits_rows=1)[0]
        finally:
            if constraint is not None:
                constraint.rewind()
        return self._to_target(tokens, rows, confidences, n_max)

    def _drafts_on_device(self) -> bool:
        """A greedy chain without a grammar, on a draft backend that drafts on its device (the
        GPU's graph passes): its steps run there, several a call (`_draft_on_device`)."""
        return (
            self.sampler is None
            and self.constraint is None
            and self.config.n_parallel == 1
            and getattr(self.backend, "drafts_on_device", False)
        )

    def _draft_on_device(self, context: list[int], n_max: int) -> Draft:
        """The chain `draft` drafts, from the backend's device steps: the same argmax tokens and
        top-1 confidences, cut by the same rules (p_min or the policy's), read a call at a time."""
        tokens: list[int] = []
        confidences: list[float] = []
        for token, confidence in self._device_steps(context, n_max):
            depth = len(tokens) + 1
            if not continue_draft(self.keep_drafting, depth, confidence, self.config.p_min):
                break
            if self.translator is None and token >= self.target_vocab_size:
                break  # the target cannot emit ids past its vocabulary
            tokens.append(token)
            confidences.append(confidence)
            if not look_further(self.keep_drafting, depth, n_max):
                break
        return self._to_target(tokens, [None] * len(tokens), confidences, n_max)

    def _device_steps(self, context: list[int], n_max: int) -> Iterator[tuple[int, float]]:
        """(token, top-1 confidence) of each greedy step, DEVICE_DRAFT_STEPS a call; a call
        runs only when the draft asks for its first token, and the last evaluates nothing past
        n_max."""
        backend = self.backend
        tail = list(uncached_tail(backend, context))
        logits = score_alone(RowGroup(backend, tail, logits_rows=1, on_device=True))[0]
        drafted = 0
        while drafted < n_max:
            steps = min(DEVICE_DRAFT_STEPS, n_max - drafted)
            drafted += steps
            ids, confidences, logits = backend.draft_greedy(  # type: ignore[attr-defined]
                logits, steps, drafted < n_max, CONFIDENCE_TOP_K
            )
            yield from zip(ids, confidences, strict=True)

    def catch_up(self, history: Sequence[int], last: int, n_tokens: int) -> None:
        """Read up to `n_tokens` more of the context the next draft call would read (history +
        [last]) into the draft's cache, without drafting: a policy's catch-up after a long
        prompt or gap (`specdecode.chain`), a chunk a step. `last` is left to the draft call,
        which needs its logits."""
        context = self._draft_context(history, last, min(self.config.n_max, self.backend.n_ctx - 1))
        keep = common_prefix(self.backend.tokens, context)
        end = min(len(context) - 1, keep + n_tokens)
        if end > keep:
            self.backend.truncate(keep)
            self.backend.evaluate(context[keep:end], logits_rows=0)

    def _draft_tree(self, context: list[int], root_logits: torch.Tensor, n_max: int) -> Draft:
        """The p_split tree after `context` (whose logits are root_logits), at most n_max nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []
        confidences: list[float] = []
        reaches: list[float] = []  # each node's chance of being kept, by the policy's rule
        paths: list[list[int]] = []  # each node's tokens from the root down
        frontier: list[tuple[int, torch.Tensor]] = [(-1, root_logits)]  # (node, its logits)
        branches = 1
        main = -1  # the end of the top-1 branch: committed to the draft's cache at the end
        cached = 0  # nodes 0..cached-1 are a chain the draft's cache already holds
        for depth in range(n_max):
            new: list[int] = []
            for parent, logits in frontier:
                path = paths[parent] if parent >= 0 else []
                if self.constraint is not None and (logits := self.constraint.mask_at(path, logits)) is None:
                    continue  # the grammar is complete after this node
                if len(tokens) >= n_max:
                    continue
                probs = top_candidates(logits)[1]
                reach = reaches[parent] if parent >= 0 else 1.0
                child_reaches = self._child_reaches(probs, branches, reach, depth + 1, len(tokens))
                if not child_reaches:
                    continue
                picks = self._children(logits, [*context, *path], n_max - len(tokens), len(child_reaches) - 1)
                branches += max(0, len(picks) - 1)
                for rank, (token, row) in enumerate(picks):
                    tokens.append(token)
                    parents.append(parent)
                    rows.append(row)
                    confidences.append(float(probs[rank]))
                    reaches.append(child_reaches[rank])
                    paths.append([*path, token])
                    new.append(len(tokens) - 1)
                if parent == main and picks:
                    main = len(tokens) - len(picks)
            if not new or len(tokens) >= n_max or depth + 1 == n_max:
                break
            frontier = list(zip(new, self._score(new, tokens, parents, cached), strict=True))
            if branches == 1:  # no node has branched yet: the new node continues the cached chain
                cached = len(tokens)
        # Nodes before the first branch were cached as a chain would have; after it, the draft's
        # pending nodes are the tree's less those, and the top-1 branch stays cached.
        scored_main = main if main < len(tokens) - len(new) else parents[main]
        self.backend.commit([node - cached for node in path_to(parents, scored_main) if node >= cached])
        if not tokens or max(len(p) for p in paths) < self.n_min:
            return Draft()
        probs = torch.stack(rows) if self.sampler is not None else None  # [N, V]
        return Draft(tokens, probs, parents=parents, confidences=confidences).simplified()

    def _score(self, new: list[int], tokens: list[int], parents: list[int], cached: int) -> torch.Tensor:
        """The draft's logits [len(new), V] for the nodes of one depth: while the tree has one
        branch, an ordinary pass that caches the node (a chain's cost); then a tree pass, with
        the nodes cached so far as part of the prefix."""
        if len(new) == 1 and new[0] == cached:
            return self.backend.evaluate([tokens[new[0]]])
        return self.backend.evaluate_tree(
            [tokens[n] for n in new], [max(parents[n] - cached, -1) for n in new]
        )

    def _child_reaches(
        self, probs: torch.Tensor, branches: int, parent_reach: float, depth: int, nodes: int
    ) -> list[float]:
        """One entry per child a node gets, best rank first, from its candidates' probabilities
        `probs` (ranks 0..): classically the top one if it reaches p_min, then each next one
        above p_split while fewer than n_parallel branches exist; under a policy's rule, the
        candidates the rule finds worth it (entries: the chances it gives them), within the
        same branch limit. Classic entries are 1.0 (unused)."""
        rule, config = self.keep_drafting, self.config
        if rule is None and float(probs[0]) < config.p_min:
            return []
        reaches: list[float] = []
        for rank in range(min(SPLIT_RANKS, len(probs))):
            if rank > 0 and branches + rank > config.n_parallel:
                break
            if rule is None:
                if rank > 0 and float(probs[rank]) <= config.p_split:
                    break
                reaches.append(1.0)
                continue
            reach = rule.node(parent_reach, depth, float(probs[rank]), nodes + rank)
            if reach is None:
                break
            reaches.append(reach)
        return reaches

    def _children(
        self, logits: torch.Tensor, context: list[int], room: int, extra: int
    ) -> list[tuple[int, torch.Tensor | None]]:
        """A node's children: its 1 + extra best candidates (greedy drafting), or as many drawn
        from the draft's distribution without replacement, each with the distribution it was
        drawn from (sampled drafting). Ids the target cannot emit are skipped."""
        count = min(1 + extra, room)
        if self.sampler is None:
            ids, _ = top_candidates(logits)
            allowed = [token for token in ids if token < self.target_vocab_size and logits[token] > -math.inf]
            return [(token, None) for token in allowed][:count]
        probs = distribution(logits, self.sampler.params, context)[: self.target_vocab_size]  # [V]
        picks: list[tuple[int, torch.Tensor | None]] = []
        for _ in range(count):
            if float(probs.sum()) <= 0.0:
                break
            probs = probs / probs.sum()
            token = self.sampler.draw(probs)
            picks.append((token, probs))
            probs = probs.clone()
            probs[token] = 0.0
        return picks

    def _pick(self, logits: torch.Tensor, context: list[int]) -> tuple[int, torch.Tensor | None]:
        if self.sampler is None:
            return int(torch.argmax(logits)), None
        probs = distribution(logits, self.sampler.params, context)  # [V]
        return self.sampler.draw(probs), probs

    def _draft_context(self, history: Sequence[int], last: int, n_max: int) -> list[int]:
        """The draft's input: history + [last] in draft ids, cut to fit the draft's context.

        When the input outgrows the room (n_ctx - n_max) the window jumps forward by half the
        room, so the draft's cache is rebuilt once per half window rather than every step.
        """
        ids = [*history, last]
        if self.translator is not None:
            ids = self.translator.to_draft(ids)
        room = self.backend.n_ctx - n_max
        # `>=`: translated ids can shrink as the text grows (tokens merge), leaving the window
        # start at or past the end, with nothing in the window.
        if len(ids) - self._window_start > room or self._window_start >= len(ids):
            self._window_start = max(0, len(ids) - max(1, room // 2))
        return ids[self._window_start :]

    def _to_target(
        self, tokens: list[int], rows: list[torch.Tensor | None], confidences: list[float], n_max: int
    ) -> Draft:
        if self.translator is not None:
            # Probabilities over the draft's vocabulary do not carry over: verify as point masses.
            tokens, probs, kept_confidences = self.translator.to_target(tokens)[:n_max], None, None
        else:
            probs = torch.stack(rows) if tokens and self.sampler is not None else None  # [K, V]
            kept_confidences = confidences
        if len(tokens) < self.n_min:
            return Draft()
        return Draft(tokens, probs, confidences=kept_confidences)
