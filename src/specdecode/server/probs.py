"""Token probabilities in answers, and logit biases in requests.

Probabilities are read from the target's logits rows each token was chosen from (carried by
the generation's chunks), so reporting them changes no token: llama-server's `n_probs`
(`completion_probabilities`, log-probabilities of the row's softmax, or with
`post_sampling_probs` the probabilities the sampler drew from), and OpenAI's `logprobs` on
chat (`logprobs.content`) and on completions (the legacy `tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from specdecode.chat import encode
from specdecode.sampling import SamplingParams, candidates
from specdecode.server.errors import APIError
from specdecode.server.schemas import LogitBias
from specdecode.server.tokens import decode
from specdecode.text import INCOMPLETE

TOKEN_ID = re.compile(r"-?[0-9]+")  # a logit_bias key that names a token id (ASCII digits only)


@dataclass(frozen=True)
class Alternative:
    id: int
    text: str
    value: float  # a log-probability, or a probability after sampling

    def native(self, key: str) -> dict[str, Any]:
        return {"id": self.id, "token": self.text, "bytes": list(self.text.encode()), key: self.value}


class Pieces:
    """The text each token of an answer adds to it, so that the entries' texts add up to the
    answer's: each token is decoded after the few before it (a byte-level piece alone may be
    half a character), and a token that ends inside a character adds "" while the one that
    completes it adds the character."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] give the context the next text is cut from
        self._read = 0

    def push(self, tokenizer: PreTrainedTokenizerBase, token: int) -> str:
        self.ids.append(token)
        before = decode(tokenizer, self.ids[self._prefix : self._read], True)
        new = decode(tokenizer, self.ids[self._prefix :], True)[len(before) :]
        if new.endswith(INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new


@dataclass(frozen=True)
class Scored:
    """One generated token, its value and the row's `n` best tokens (best first)."""

    token: Alternative
    top: list[Alternative]


def score(
    tokenizer: PreTrainedTokenizerBase,
    rows: torch.Tensor,
    tokens: Sequence[int],
    history: Sequence[int],
    n: int,
    pieces: Pieces,
    sampling: SamplingParams | None = None,
) -> list[Scored]:
    """Each token's entry from its logits row (rows: [len(tokens), V]), its text from `pieces`
    (the alternatives' are decoded alone). Without `sampling`, log-probabilities of the row's
    softmax; with it, the probabilities that sampling drew the token from (penalties over
    `history`, the tokens before the first, and the logit bias included), where only the
    candidates it kept are listed."""
    scored = []
    context = list(history)
    for token, row in zip(tokens, rows.detach().to("cpu", torch.float64), strict=True):
        if sampling is None:
            values = torch.log_softmax(row, dim=0)
            top_values, top_ids = torch.topk(values, min(n, values.shape[0]))
            listed = list(zip(top_ids.tolist(), top_values.tolist(), strict=True))
            own, floor = float(values[token]), -math.inf
        else:
            ids, probs = candidates(row, sampling, context)
            dense = dict(zip(ids.tolist(), probs.tolist(), strict=True))
            listed = sorted(dense.items(), key=lambda pair: (-pair[1], pair[0]))[:n]
            own, floor = dense.get(token, 0.0), 0.0
        # tokens a grammar or a bias of -inf keeps out have no probability to show
        top = [Alternative(i, decode(tokenizer, [i]), v) for i, v in listed if v > floor]
        scored.append(Scored(Alternative(token, pieces.push(tokenizer, token), own), top))
        context.append(token)
    return scored


def native(scored: Sequence[Scored], post_sampling: bool) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities."""
    key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")
    return [{**entry.token.native(key), top_key: [alt.native(key) for alt in entry.top]} for entry in scored]


def chat_logprobs(scored: Sequence[Scored]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [...], "refusal": null}."""

    def one(alt: Alternative) -> dict[str, Any]:
        return {"token": alt.text, "logprob": alt.value, "bytes": list(alt.text.encode())}

    content = [{**one(entry.token), "top_logprobs": [one(alt) for alt in entry.top]} for entry in scored]
    return {"content": content, "refusal": None}


def legacy_logprobs(scored: Sequence[Scored], offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs`; `offset`: where the first token's text starts in the
    completion's text."""
    offsets = []
    for entry in scored:
        offsets.append(offset)
        offset += len(entry.token.text)
    return {
        "tokens": [entry.token.text for entry in scored],
        "token_logprobs": [entry.token.value for entry in scored],
        "top_logprobs": [best_by_text(entry.top) for entry in scored],
        "text_offset": offsets,
    }


def best_by_text(alternatives: Sequence[Alternative]) -> dict[str, float]:
    """Text -> value, best first: where tokens share a text (halves of characters all show as
    U+FFFD) the best one's value stands."""
    best: dict[str, float] = {}
    for alt in alternatives:
        best.setdefault(alt.text, alt.value)
    return best


def within_text(scored: Sequence[Scored], n_chars: int) -> list[Scored]:
    """The first entries whose texts all lie within the next `n_chars` characters of the
    answer: a token whose text a stop string cut (or is held back for one) is left out, as is
    a token of a character not yet complete there (its text is "")."""
    kept, offset = [], 0
    for entry in scored:
        end = offset + len(entry.token.text)
        if end > n_chars or end == offset == n_chars:
            break
        kept.append(entry)
        offset = end
    return kept


def with_text(entry: Scored, more: str) -> Scored:
    """The entry with `more` text added to its token's."""
    return replace(entry, token=replace(entry.token, text=entry.token.text + more))


# ---------------------------------------------------------------------- logit_bias


def logit_bias(
    tokenizer: PreTrainedTokenizerBase, spec: LogitBias, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from OpenAI's {"id": bias} or llama-server's [[id or text, bias]]
    (a text biases each of its tokens; a bias of false keeps the token out). A key of ASCII
    digits is a token id, any other a text, as in llama-server ("²" and "--5" are texts). A
    bias that keeps every token out is refused: nothing could be generated."""
    items = list(spec.items()) if isinstance(spec, dict) else [tuple(pair) for pair in spec]
    pairs: list[tuple[int, float]] = []
    for item in items:
        if len(item) != 2:
            raise APIError(400, "logit_bias pairs are [token id or text, bias]", param="logit_bias")
        key, bias = item
        value = _bias_value(bias)
        pairs.extend((token, value) for token in _bias_ids(tokenizer, key, vocab_size))
    if len({token for token, bias in pairs if bias == -math.inf}) >= vocab_size:
        raise APIError(400, "logit_bias keeps every token out", param="logit_bias")
    return tuple(pairs)


def _bias_value(bias: object) -> float:
    """A bias: a finite number, or false (-inf)."""
    if bias is False:
        return -math.inf
    if not isinstance(bias, bool) and isinstance(bias, int | float):
        try:
            value = float(bias)
        except OverflowError:  # an integer past float's range
            value = math.inf
        if math.isfinite(value):
            return value
    message = f"logit_bias values must be finite numbers or false, not {bias!r:.40}"
    raise APIError(400, message, param="logit_bias")


def _bias_ids(tokenizer: PreTrainedTokenizerBase, key: object, vocab_size: int) -> list[int]:
    """The token ids a logit_bias key names: itself (an id, or ASCII digits), or a text's tokens."""
    if isinstance(key, str) and TOKEN_ID.fullmatch(key):
        # more digits than any id has: past the vocabulary (and past int()'s digit limit)
        ids = [int(key) if len(key) <= len(str(vocab_size)) + 1 else vocab_size]
    elif isinstance(key, int) and not isinstance(key, bool):
        ids = [key]
    elif isinstance(key, str):
        ids = encode(tokenizer, key, False, False)
    else:
        raise APIError(400, f"logit_bias keys are token ids or texts, not {key!r:.40}", param="logit_bias")
    if not all(0 <= token < vocab_size for token in ids):
        raise APIError(400, f"logit_bias token ids must be in 0..{vocab_size - 1}", param="logit_bias")
    return ids
