"""Response bodies: OpenAI's completion and chat objects, whole or as stream chunks, with
`usage` and llama-server's `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms,
draft_n, draft_n_accepted and the per-token and per-second rates)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from specdecode.stats import GenerationStats

FINISH_REASONS = {"eos": "stop", "stop string": "stop", "n_predict": "length", "context": "length"}


def finish_reason(stats: GenerationStats) -> str:
    return FINISH_REASONS.get(stats.stop_reason, "stop")


def usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.n_prompt,
        "completion_tokens": stats.n_generated,
        "total_tokens": stats.n_prompt + stats.n_generated,
    }


def timings(stats: GenerationStats) -> dict[str, float | int]:
    prompt_ms, predicted_ms = 1e3 * stats.t_prompt, 1e3 * stats.t_generation
    return {
        "prompt_n": stats.n_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / stats.n_prompt if stats.n_prompt else 0.0,
        "prompt_per_second": stats.prompt_tokens_per_second,
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

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        return self.choice(text, finish)


class ChatCompletion:
    """POST /v1/chat/completions bodies: the role goes in the first delta only, as OpenAI does."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

    def delta(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


class Reply:
    """The bodies of one response; every chunk of a stream shares its id and creation time."""

    def __init__(self, kind: TextCompletion | ChatCompletion, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._first = True

    def whole(self, text: str, stats: GenerationStats) -> dict[str, Any]:
        return {
            **self._head(self.kind.object),
            "choices": [self.kind.choice(text, finish_reason(stats))],
            "usage": usage(stats),
            "timings": timings(stats),
        }

    def chunk(self, text: str) -> dict[str, Any]:
        first, self._first = self._first, False
        return {**self._head(self.kind.chunk_object), "choices": [self.kind.delta(text, None, first)]}

    def last_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        """The end of a stream: finish_reason, usage and timings."""
        first, self._first = self._first, False
        return {
            **self._head(self.kind.chunk_object),
            "choices": [self.kind.delta("", finish_reason(stats), first)],
            "usage": usage(stats),
            "timings": timings(stats),
        }

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
