"""The checks that turn a request into a `Job`, each refusal raised before any slot is taken.

Apart from the routes (`app`) so that what a request may ask, and why it is refused, reads in
one place; `Service` inherits these checks and holds what they read.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from specdecode.api import Pipeline
from specdecode.chat import encode
from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.grammars import check_isolated
from specdecode.server.errors import NOT_SUPPORTED, APIError, exceeds_context, shutting_down, validation_error
from specdecode.server.prompts import mixed_ids
from specdecode.server.schemas import NativeCompletionRequest, Prompt, Sampling, SamplingFields
from specdecode.server.settings import ServerSettings
from specdecode.server.slots import Job, SlotPool
from specdecode.server.tokens import Tokenizers
from specdecode.strategies import DraftModelConfig

Body = TypeVar("Body", bound=BaseModel)


class Checks:
    """A request's checks, made on the event loop (tokenizing in a worker thread)."""

    front: Pipeline
    settings: ServerSettings
    n_ctx: int
    slots: SlotPool
    tokenizers: Tokenizers

    def _check(self, body: Sampling) -> None:
        """What can be refused before the prompt is tokenized."""
        if self.slots.closing:
            raise shutting_down("no new generation starts")
        served = self.settings.model_id
        if body.model not in (None, served) and not self.settings.accept_any_model:
            raise APIError(
                404,
                f"the model {body.model!r} is not served here (this server serves {served!r})",
                param="model",
                code="model_not_found",
            )
        field = body.unsupported()
        if field is not None:
            raise APIError(
                400,
                f"{field} is not supported by this server",
                param=field,
                code="unsupported",
                type=NOT_SUPPORTED,
            )
        if isinstance(body, SamplingFields) and body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    async def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids of one prompt: text, ids, or both mixed (see `prompts`)."""
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt, str):
            self.tokenizers.check_length(len(prompt), "prompt")
            return await self.tokenizers.run(encode, prompt)
        if any(isinstance(part, list) for part in prompt):
            raise APIError(400, "a prompt of text and ids holds no lists", param="prompt")
        size = self.front.target.vocab.size
        if not all(0 <= part < size for part in prompt if isinstance(part, int)):
            raise APIError(400, f"prompt token ids must be in 0..{size - 1}", param="prompt")
        self.tokenizers.check_length(sum(len(part) for part in prompt if isinstance(part, str)), "prompt")
        return await self.tokenizers.run(mixed_ids, prompt)

    def _job(self, body: Sampling, prompt: list[int]) -> Job:
        if not prompt:
            raise APIError(400, "the prompt gave no tokens", param="prompt")
        if len(prompt) >= self.n_ctx:
            raise exceeds_context(
                f"the prompt is {len(prompt)} tokens, but the context holds only {self.n_ctx}",
                "prompt",
                self.n_ctx,
                len(prompt),
            )
        limit_field = "n_predict" if isinstance(body, NativeCompletionRequest) else "max_tokens"
        n_predict = self._n_predict(body.token_limit, len(prompt), limit_field)
        try:
            sampling = replace(self.settings.sampling, **body.sampling_overrides())
            ignore_eos = getattr(body, "ignore_eos", False)
            config = GenerationConfig(
                n_predict, body.stop_strings, self.settings.verify, ignore_eos, **self._shift(body)
            )
        except SpecdecodeError as exc:
            raise APIError(400, str(exc)) from None
        return Job(prompt, sampling, config, self._draft(body), getattr(body, "cache_prompt", True))

    async def _constrained(self, body: Sampling, job: Job) -> Job:
        """The job with the request's grammar or schema, checked here (in a worker thread: a
        large schema takes a while) so that a bad one is a 400 before any slot is taken. A new
        one is checked in a child process, where one that crashes or hangs the grammar engine
        takes down the child, not the server (`check_isolated`)."""
        asked = body.constraint()
        if asked is None:
            return job
        spec, field = asked
        target = self.front.target

        def check() -> None:
            check_isolated(spec, target.tokenizer, target.vocab.size, target.vocab.eos_id)

        try:
            await asyncio.to_thread(check)
        except SpecdecodeError as exc:
            raise APIError(400, str(exc), param=field) from None
        return replace(job, constraint=spec)

    def _shift(self, body: Sampling) -> dict[str, Any]:
        """The context shift's settings: the server's --context-shift, /completion's n_keep
        and n_discard."""
        if not self.settings.context_shift:
            return {}
        return {
            "context_shift": True,
            "n_keep": getattr(body, "n_keep", 0),
            "n_discard": getattr(body, "n_discard", 0),
        }

    def _n_predict(self, requested: int | None, n_prompt: int, field: str) -> int:
        """The request's token limit, checked; without one, up to the limit or the context's end
        (with --context-shift, past it: the context shifts)."""
        limit, room = self.settings.max_tokens, self.n_ctx - n_prompt
        if self.settings.context_shift:
            room = limit
        if requested is None:
            return min(limit, room)
        if not 1 <= requested <= limit:
            raise APIError(400, f"{field} must be in 1..{limit} (got {requested})", param=field)
        if requested > room:
            raise exceeds_context(
                f"prompt ({n_prompt} tokens) + {field} ({requested}) exceeds the context "
                f"({self.n_ctx} tokens)",
                field,
                self.n_ctx,
                n_prompt,
            )
        return requested

    def _draft(self, body: Sampling) -> DraftModelConfig | None:
        """The request's drafting settings: at most the server's n_max (--draft-max), n_min at
        most n_max (the server's n_min is lowered to a smaller n_max)."""
        overrides = body.draft_overrides()
        if not overrides:
            return None
        server = self.front.draft_config
        n_max = overrides.setdefault("n_max", server.n_max)
        if n_max > server.n_max:
            raise APIError(
                400,
                f"speculative.n_max must be in 1..{server.n_max} (the server's --spec-draft-n-max)",
                param="speculative.n_max",
            )
        n_min = overrides.setdefault("n_min", min(server.n_min, n_max))
        if n_min > n_max:
            raise APIError(400, "speculative.n_min must be <= speculative.n_max", param="speculative.n_min")
        return replace(server, **overrides)


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends a form type)."""
    try:
        data = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:  # also bytes that are not UTF-8, and deep nesting
        raise APIError(400, f"the body is not valid JSON ({exc})", code="json_invalid") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
