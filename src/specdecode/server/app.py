"""The OpenAI-compatible HTTP API over a Pipeline: routes, request checks, responses.

Requests are checked on the event loop (tokenizing with the loaded pipeline's own tokenizer,
which no generation uses) and turned into a `Job`; generation runs in a slot (see `slots`).
Every refusal is an OpenAI error body with a 4xx status, raised before any slot is taken.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from specdecode.api import Pipeline
from specdecode.errors import SpecdecodeError
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.server.chat import chat_prompt_ids
from specdecode.server.errors import APIError, install_error_handlers, validation_error
from specdecode.server.formats import ChatCompletion, Reply, TextCompletion, sse
from specdecode.server.guards import LimitBodySize, RequireApiKey
from specdecode.server.metrics import Metrics
from specdecode.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from specdecode.server.slots import Job, SlotPool

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed")
CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer
Body = TypeVar("Body", bound=SamplingFields)


@dataclass(frozen=True)
class ServerSettings:
    model_id: str  # the name /v1/models lists and requests may give as "model"
    parallel: int = 4  # slots: generations running at once; more requests wait in a queue
    sampling: SamplingParams = SamplingParams()  # for the fields a request leaves out
    verify: str = "match"
    max_tokens: int = 2048  # the most a request may ask for; also the default when it asks nothing
    max_body_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise SpecdecodeError("--parallel must be >= 1")
        if self.max_tokens < 1:
            raise SpecdecodeError("--max-tokens-limit must be >= 1")
        if self.max_body_bytes < 1:
            raise SpecdecodeError("--max-body-bytes must be >= 1")


class Service:
    """What the routes share: the loaded pipeline, its slots and the counters."""

    def __init__(self, pipeline: Pipeline, settings: ServerSettings) -> None:
        self.front = pipeline
        self.settings = settings
        self.metrics = Metrics(pipeline.spec_types)
        self.slots = SlotPool([pipeline.fork() for _ in range(settings.parallel)], self.metrics)
        self.started = int(time.time())

    # ------------------------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await self._respond(body, self._prompt_ids(body.prompt), TextCompletion(), request)

    async def chat(self, request: Request) -> Response:
        body = await parse_body(request, ChatRequest)
        prompt = chat_prompt_ids(self.front.target, body.messages)
        return await self._respond(body, prompt, ChatCompletion(), request)

    async def models(self) -> dict:
        model = {
            "id": self.settings.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "local",
        }
        return {"object": "list", "data": [model]}

    async def health(self) -> dict:
        return {
            "status": "ok",
            "slots_idle": self.slots.size - self.slots.busy,
            "slots_processing": self.slots.busy,
            "requests_waiting": self.slots.waiting,
        }

    async def prometheus(self) -> PlainTextResponse:
        text = self.metrics.render(self.slots.size, self.slots.busy, self.slots.waiting)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ requests -> jobs

    async def _respond(
        self, body: SamplingFields, prompt: list[int], kind: TextCompletion | ChatCompletion, request: Request
    ) -> Response:
        self._check_model(body.model)
        job = self._job(body, prompt)
        reply = Reply(kind, self.settings.model_id)
        if body.stream:
            return StreamingResponse(self._stream(job, reply), media_type="text/event-stream")
        result = await self._complete(job, reply, request)
        return JSONResponse(result) if result is not None else Response(status_code=CLIENT_CLOSED)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_id:
            raise APIError(
                404,
                f"the model {model!r} is not served here (this server serves {self.settings.model_id!r})",
                param="model",
                code="model_not_found",
            )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt, str):
            return self.front.encode(prompt)
        size = self.front.target.vocab.size
        if not all(0 <= token < size for token in prompt):
            raise APIError(400, f"prompt token ids must be in 0..{size - 1}", param="prompt")
        return list(prompt)

    def _job(self, body: SamplingFields, prompt: list[int]) -> Job:
        n_ctx = self.front.target.n_ctx
        if len(prompt) >= n_ctx:
            raise APIError(
                400,
                f"the prompt is {len(prompt)} tokens, but the context holds only {n_ctx}",
                param="prompt",
                code="context_length_exceeded",
            )
        n_predict = self._n_predict(body.token_limit, len(prompt))
        overrides = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
        try:
            sampling = replace(self.settings.sampling, **overrides)
            config = GenerationConfig(n_predict, body.stop_strings, self.settings.verify)
        except SpecdecodeError as exc:
            raise APIError(400, str(exc)) from None
        return Job(prompt, sampling, config)

    def _n_predict(self, requested: int | None, n_prompt: int) -> int:
        """The request's max_tokens, checked; without one, up to the limit or the context's end."""
        limit, room = self.settings.max_tokens, self.front.target.n_ctx - n_prompt
        if requested is None:
            return min(limit, room)
        if not 1 <= requested <= limit:
            raise APIError(400, f"max_tokens must be in 1..{limit} (got {requested})", param="max_tokens")
        if requested > room:
            raise APIError(
                400,
                f"prompt ({n_prompt} tokens) + max_tokens ({requested}) exceeds the context "
                f"({self.front.target.n_ctx} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    # ------------------------------------------------------------------ running jobs

    async def _stream(self, job: Job, reply: Reply) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step with new text, a last chunk with finish_reason,
        usage and timings, then [DONE]. Cancelled when the client leaves, which stops the job."""
        try:
            async with contextlib.aclosing(self.slots.generate(job)) as events:
                async for event in events:
                    if isinstance(event, Generation):
                        yield sse(reply.last_chunk(event.stats))
                    elif event.text:
                        yield sse(reply.chunk(event.text))
        except Exception as exc:  # the headers are sent: the failure travels as an event
            yield sse(APIError(500, f"generation failed: {exc}", type="server_error").body())
        yield sse("[DONE]")

    async def _complete(self, job: Job, reply: Reply, request: Request) -> dict | None:
        """The whole answer, or None when the client left first (the job is stopped then)."""
        async with contextlib.aclosing(self.slots.generate(job)) as events:
            async for event in events:
                if isinstance(event, Generation):
                    return reply.whole(event.text, event.stats)
                assert isinstance(event, Chunk)
                if await request.is_disconnected():
                    return None
        raise AssertionError("a job ends with its Generation")


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends a form type)."""
    try:
        data = json.loads(await request.body())
    except ValueError as exc:  # also bytes that are not UTF-8
        raise APIError(400, f"the body is not valid JSON ({exc})", code="json_invalid") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def create_app(pipeline: Pipeline, settings: ServerSettings) -> FastAPI:
    """The server's ASGI app; it forks `pipeline` into `settings.parallel` slots."""
    service = Service(pipeline, settings)
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    install_error_handlers(app)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat, methods=["POST"])
    app.add_api_route("/v1/models", service.models, methods=["GET"])
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.prometheus, methods=["GET"])
    app.add_middleware(LimitBodySize, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(RequireApiKey, api_key=settings.api_key)  # added last: runs first
    return app
