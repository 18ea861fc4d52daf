"""Response bodies: OpenAI's completion and chat objects, whole or as stream chunks, with
`usage` and llama-server's `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms,
cache_n, draft_n, draft_n_accepted and the per-token and per-second rates); and
llama-server's own /completion bodies."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdecode.generate import Chunk
from specdecode.stats import GenerationStats

Logprobs = dict[str, Any] | None  # a choice's `logprobs` (see `specdecode.server.probs`)

# A complete grammar ends the output as end-of-generation would, and so does a position where
# the logit bias bans every token the grammar allows.
FINISH_REASONS = {
    "eos": "stop",
    "grammar": "stop",
    "no allowed token": "stop",
    "stop string": "stop",
    "n_predict": "length",
    "context": "length",
}
STOP_TYPES = {
    "eos": "eos",
    "grammar": "eos",
    "no allowed token": "eos",
    "stop string": "word",
    "n_predict": "limit",
    "context": "limit",
}


def finish_reason(stats: GenerationStats) -> str:
    return FINISH_REASONS.get(stats.stop_reason, "stop")


def usage(*choices: GenerationStats) -> dict[str, int]:
    """The prompt once, and every choice's tokens (`n` > 1 makes several of one prompt)."""
    n_prompt, n_generated = choices[0].n_prompt, sum(stats.n_generated for stats in choices)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_generated,
        "total_tokens": n_prompt + n_generated,
    }


def timings(stats: GenerationStats, n_cached: int) -> dict[str, float | int]:
    """llama-server's timings; prompt_n counts the prompt tokens evaluated, cache_n those
    the slot's cache already held."""
    prompt_ms, predicted_ms = 1e3 * stats.t_prompt, 1e3 * stats.t_generation
    prompt_n = stats.n_prompt - n_cached
    return {
        "cache_n": n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": stats.n_generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_generated if stats.n_generated else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.totals.n_drafted,
        "draft_n_accepted": stats.totals.n_accepted,
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class TextCompletion:
    """POST /v1/completions bodies."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(
        self, text: str, finish: str | None, index: int = 0, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta(
        self, text: str | None, finish: str | None, index: int = 0, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        return self.choice(text or "", finish, index, logprobs)

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        return None


class ChatCompletion:
    """POST /v1/chat/completions bodies: a stream opens with a role-only delta, as OpenAI's do."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(
        self, text: str, finish: str | None, index: int = 0, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def delta(
        self, text: str | None, finish: str | None, index: int = 0, logprobs: Logprobs = None
    ) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": "", "refusal": None}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


@dataclass(frozen=True)
class Answer:
    """One finished choice of an OpenAI answer."""

    text: str
    stats: GenerationStats
    logprobs: Logprobs = None


class Reply:
    """The bodies of one response; every chunk of a stream shares its id and creation time.

    include_usage (OpenAI's stream_options): every chunk carries `usage: null` and a last
    chunk with no choices carries the usage; without it a stream has no usage."""

    def __init__(
        self,
        kind: TextCompletion | ChatCompletion,
        model: str,
        fingerprint: str,
        include_usage: bool = False,
    ) -> None:
        self.kind = kind
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def whole(self, answers: Sequence[Answer], n_cached: int) -> dict[str, Any]:
        """The answer with its choices in order; timings are the first choice's."""
        choices = [
            self.kind.choice(answer.text, finish_reason(answer.stats), index, answer.logprobs)
            for index, answer in enumerate(answers)
        ]
        return {
            **self._head(self.kind.object),
            "choices": choices,
            "usage": usage(*(answer.stats for answer in answers)),
            "timings": timings(answers[0].stats, n_cached),
        }

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        choice = self.kind.opening(index)
        return None if choice is None else self._chunk([choice])

    def chunk(self, text: str, index: int = 0, logprobs: Logprobs = None) -> dict[str, Any]:
        return self._chunk([self.kind.delta(text, None, index, logprobs)])

    def last_chunk(self, stats: GenerationStats, n_cached: int, index: int = 0) -> dict[str, Any]:
        """The end of the choice: finish_reason, and llama-server's timings."""
        chunk = self._chunk([self.kind.delta(None, finish_reason(stats), index)])
        return {**chunk, "timings": timings(stats, n_cached)}

    def usage_chunk(self, *choices: GenerationStats) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(*choices)}

    def progress_chunk(self, progress: dict[str, Any]) -> dict[str, Any]:
        """llama-server's prompt_progress, in a chunk without choices."""
        return {**self._chunk([]), "prompt_progress": progress}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(self.kind.chunk_object), "choices": choices}
        return {**chunk, "usage": None} if self.include_usage else chunk

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


def stopping_word(text: str, full_text: str, stops: Sequence[str]) -> str:
    """The stop string that ended a generation: the one that follows the kept text in the
    whole decoded output."""
    rest = full_text[len(text) :]
    return next((stop for stop in stops if rest.startswith(stop)), "")


def per_token(chunk: Chunk) -> list[Chunk]:
    """A step's chunk as one chunk per token, each with its share of the text and its logits
    row, as llama-server streams /completion (text that came with no token goes with the last;
    a chunk of no token stays whole)."""
    if not chunk.tokens:
        return [chunk]
    pieces, start = [], 0
    for index, (token, end) in enumerate(zip(chunk.tokens, chunk.ends, strict=True)):
        if index == len(chunk.tokens) - 1:
            end = len(chunk.text)
        rows = chunk.logits[index : index + 1] if chunk.logits is not None else None
        pieces.append(Chunk([token], chunk.text[start:end], logits=rows, ends=[end - start]))
        start = end
    return pieces


def native_chunk(text: str, tokens: list[int], slot: int) -> dict[str, Any]:
    """One event of a /completion stream."""
    return {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot}


def native_whole(
    text: str,
    tokens: list[int],
    stats: GenerationStats,
    *,
    n_cached: int,
    slot: int,
    model: str,
    prompt: str,
    stopping: str,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """llama-server's /completion answer (the last event of a stream, with the text already
    sent, has content ""); `prompt`: the prompt's ids decoded, special tokens shown."""
    return {
        "index": 0,
        "content": text,
        "tokens": tokens,
        "id_slot": slot,
        "stop": True,
        "model": model,
        "tokens_predicted": stats.n_generated,
        "tokens_evaluated": stats.n_prompt,
        "generation_settings": settings,
        "prompt": prompt,
        "has_new_line": "\n" in text,
        # llama-server's: the context was shifted, or filled
        "truncated": stats.n_context_shifts > 0 or stats.n_prompt + stats.n_generated >= settings["n_ctx"],
        "stop_type": STOP_TYPES.get(stats.stop_reason, "none"),
        "stopping_word": stopping,
        "tokens_cached": n_cached,
        "timings": timings(stats, n_cached),
    }
