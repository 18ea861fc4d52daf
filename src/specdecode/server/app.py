"""The HTTP API over a Pipeline: OpenAI's endpoints, llama-server's own, and the app.

A request is checked on the event loop (see `checks`), its prompt tokenized in a worker
thread (see `tokens`), and it becomes a `Job`; generation runs in a slot (see `slots`), and
`answers` sends what it generates. Every refusal is an OpenAI error body with a 4xx status,
raised before any slot is taken; a streamed answer sends its headers only once a slot is
generating it, so a request refused while it waits (the server shutting down) still gets a
plain 503.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel

from specdecode.api import Pipeline
from specdecode.backends.gather import DraftPasses
from specdecode.chat import encode
from specdecode.errors import SpecdecodeError
from specdecode.generate import Chunk
from specdecode.server.answers import CLIENT_CLOSED, Answers
from specdecode.server.chat import chat_prompt_ids, ending, render, template
from specdecode.server.checks import parse_body
from specdecode.server.errors import APIError, install_error_handlers
from specdecode.server.formats import ChatCompletion, TextCompletion
from specdecode.server.guards import LimitBodySize, RequireApiKey
from specdecode.server.metrics import Metrics
from specdecode.server.options import only_fields, whole_entries, with_request_options
from specdecode.server.prompts import MAX_PROMPTS, merged_choices, split_prompts
from specdecode.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NativeCompletionRequest,
    TokenizeRequest,
)
from specdecode.server.settings import ServerSettings
from specdecode.server.slots import SlotPool
from specdecode.server.tokens import Tokenizers, decode, pieces
from specdecode.verdicts import start_verdicts

Rendered = TypeVar("Rendered")

try:
    VERSION = version("specdecode")
except PackageNotFoundError:  # run from a source tree
    VERSION = "source"


class Service(Answers):
    """What the routes share: the loaded pipeline, its slots, the tokenizers, the counters."""

    def __init__(self, pipeline: Pipeline, settings: ServerSettings) -> None:
        self.front = pipeline
        self.settings = settings
        self.n_ctx = pipeline.target.n_ctx
        self.metrics = Metrics(pipeline.spec_types, start_verdicts(pipeline.target, pipeline.spec_types))
        rule = pipeline.load_rule() if pipeline.spec_types else None
        models = (pipeline.draft, pipeline.eagle3, pipeline.mtp)
        passes = DraftPasses() if any(model is not None for model in models) else None
        forks = pipeline.forks(settings.parallel, passes)  # one context for all where the backend can
        self.slots = SlotPool(
            forks,
            self.metrics,
            rule,
            passes,
            gate=bool(pipeline.spec_types),
            similarity=settings.slot_prompt_similarity,
        )
        tokenizer = pipeline.target.tokenizer
        self.tokenizers = Tokenizers(tokenizer, settings.parallel, self.n_ctx)
        self.n_texts = len(tokenizer)  # ids the tokenizer can decode
        self.chat_template = template(tokenizer)
        self.started = int(time.time())
        # OpenAI's system_fingerprint: what, besides the request, decides the answer.
        setup = [VERSION, settings.model_id, pipeline.spec_types, pipeline.draft_config, settings.verify]
        self.fingerprint = "fp_" + hashlib.sha256(repr(setup).encode()).hexdigest()[:10]

    # ------------------------------------------------------------------ OpenAI's routes

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self._check(body)
        prompts = split_prompts(body.prompt)
        if len(prompts) != 1:
            return await self._several(body, prompts, request)
        return await self._completion_of(body, await self._prompt_ids(prompts[0]), request)

    async def chat(self, request: Request) -> Response:
        body = await parse_body(request, ChatRequest)
        self._check(body)
        prompt = await self._chat_prompt(body, chat_prompt_ids)
        return await self._openai(body, prompt, ChatCompletion(), request)

    async def apply_template(self, request: Request) -> dict:
        """POST /apply-template (llama-server's): a chat request's prompt, as the chat route
        renders it."""
        body = await parse_body(request, ChatRequest)
        return {"prompt": await self._chat_prompt(body, render)}

    async def _chat_prompt(self, body: ChatRequest, work: Callable[..., Rendered]) -> Rendered:
        """work(tokenizer, messages, ending, check) in a tokenizer thread: the rendered prompt or
        its ids, a rendering too long for the context refused by `check` before it is tokenized."""
        self.tokenizers.check_length(sum(len(message.text) for message in body.messages), "messages")
        end = ending(body)
        try:
            return await self.tokenizers.run(work, body.messages, end, self.tokenizers.check_length)
        except SpecdecodeError as exc:  # a template fails on the messages, or renders nothing
            raise APIError(400, str(exc), param="messages") from None

    async def models(self) -> dict:
        model = {
            "id": self.settings.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "local",
        }
        return {"object": "list", "data": [model]}

    # ------------------------------------------------------------------ llama-server's routes

    async def completion(self, request: Request) -> Response:
        """POST /completion: llama-server's request and answer."""
        body = await parse_body(request, NativeCompletionRequest)
        self._check(body)
        prompts = split_prompts(body.prompt)
        if len(prompts) != 1:
            return await self._several(body, prompts, request)
        return await self._native(body, await self._prompt_ids(prompts[0]), request)

    async def _native(self, body: NativeCompletionRequest, prompt: list[int], request: Request) -> Response:
        """/completion's answer to one prompt (its ids)."""
        job = await self._constrained(body, self._job(body, prompt))
        job = await with_request_options(self.tokenizers, self.front.target.vocab.size, body, job)
        run = await self._start(job, request)
        if run is None:
            return Response(status_code=CLIENT_CLOSED)
        scorer = self._scorer(body, job)
        if body.stream:
            stream = self._native_stream(run, scorer, body.timings_per_token)
            return StreamingResponse(stream, media_type="text/event-stream")
        chunks: list[Chunk] = []
        generation = await self._finish(run, request, chunks)
        if generation is None:
            return Response(status_code=CLIENT_CLOSED)
        tokens = generation.tokens if body.return_tokens else []
        whole = await self._native_whole(run, generation, generation.text, tokens)
        if scorer is not None:
            whole["completion_probabilities"] = scorer.native(await whole_entries(scorer, chunks))
        if body.response_fields:  # none listed: every field, as llama-server answers
            whole = only_fields(whole, body.response_fields)
        return JSONResponse(whole)

    async def tokenize(self, request: Request) -> dict:
        body = await parse_body(request, TokenizeRequest)
        self.tokenizers.check_length(len(body.content), "content")
        ids = await self.tokenizers.run(encode, body.content, body.add_special, body.parse_special)
        return {"tokens": await self.tokenizers.run(pieces, ids) if body.with_pieces else ids}

    async def detokenize(self, request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest)
        if not all(0 <= token < self.n_texts for token in body.tokens):
            raise APIError(400, f"token ids must be in 0..{self.n_texts - 1}", param="tokens")
        return {"content": await self.tokenizers.run(decode, body.tokens)}

    async def props(self) -> dict:
        return {
            "default_generation_settings": self._slot_state(None, 0),
            "total_slots": self.slots.size,
            "model_path": self.settings.model_path or self.front.target.name,
            "chat_template": self.chat_template,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"specdecode {VERSION}",
            "is_sleeping": False,
            "speculation": {
                "policy": self.front.spec_policy,
                "strategies": list(self.front.spec_types),
                # why drafting is little or held short now (empty: it runs freely)
                "verdicts": [verdict.to_dict() for verdict in self.metrics.speculation()],
            },
        }

    async def slot_states(self) -> list[dict]:
        return [self._slot_state(slot.run, slot.id) for slot in self.slots.slots]

    # ------------------------------------------------------------------ the server's own

    async def health(self) -> dict:
        return {
            "status": "ok",
            "slots_idle": self.slots.size - self.slots.busy,
            "slots_processing": self.slots.busy,
            "requests_waiting": self.slots.waiting,
        }

    async def prometheus(self) -> PlainTextResponse:
        text = self.metrics.render(
            self.slots.size, self.slots.busy, self.slots.waiting, self.front.shared.suffix
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ several prompts

    async def _several(
        self, body: CompletionRequest | NativeCompletionRequest, prompts: list, request: Request
    ) -> Response:
        """Several prompts, each run as a request of its own: a list of answers (/completion) or
        one answer with a choice per prompt (/v1/completions). Every prompt is checked before any
        runs; streaming them is refused."""
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        if body.stream:
            raise APIError(400, "several prompts cannot be streamed: send one request each", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
        ids = [await self._prompt_ids(prompt) for prompt in prompts]
        for prompt in ids:
            self._job(body, prompt)
        native = isinstance(body, NativeCompletionRequest)
        answer = self._native if native else self._completion_of
        replies = await asyncio.gather(*(answer(body, prompt, request) for prompt in ids))
        for reply in replies:
            if reply.status_code != 200:
                return reply
        answers = [json.loads(reply.body) for reply in replies]
        return JSONResponse(answers if native else merged_choices(answers))

    async def _completion_of(self, body: CompletionRequest, prompt: list[int], request: Request) -> Response:
        """/v1/completions' answer to one prompt (its ids)."""
        return await self._openai(body, prompt, TextCompletion(), request)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI description of a body a route parses itself (see `publish_bodies`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def publish_bodies(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """/openapi.json with the request bodies' schemas: routes parse their bodies themselves
    (for OpenAI-style 400s whatever the Content-Type), so FastAPI does not know them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(pipeline: Pipeline, settings: ServerSettings) -> FastAPI:
    """The server's ASGI app; it forks `pipeline` into `settings.parallel` slots."""
    service = Service(pipeline, settings)
    app = FastAPI(title="specdecode", version=VERSION, docs_url=None, redoc_url=None)
    app.state.service = service
    install_error_handlers(app)
    posts = {
        ("/v1/completions", "/completions"): (service.completions, CompletionRequest),
        ("/v1/chat/completions", "/chat/completions"): (service.chat, ChatRequest),
        ("/completion",): (service.completion, NativeCompletionRequest),
        ("/apply-template",): (service.apply_template, ChatRequest),
        ("/tokenize",): (service.tokenize, TokenizeRequest),
        ("/detokenize",): (service.detokenize, DetokenizeRequest),
    }
    for paths, (handler, body) in posts.items():
        for path in paths:
            app.add_api_route(path, handler, methods=["POST"], openapi_extra=request_body(body))
    gets = {
        ("/v1/models", "/models"): service.models,
        ("/props",): service.props,
        ("/slots",): service.slot_states,
        ("/health",): service.health,
        ("/metrics",): service.prometheus,
    }
    for paths, handler in gets.items():
        for path in paths:
            app.add_api_route(path, handler, methods=["GET"])
    publish_bodies(app, [body for _, body in posts.values()])
    app.add_middleware(LimitBodySize, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(RequireApiKey, api_key=settings.api_key)
    if settings.cors_origins:  # added last, so it runs first: preflights need no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the headers a preflight asks for, as llama-server allows any
            allow_credentials=True,  # the request's Origin is sent back, never "*", as llama-server does
            max_age=600,
        )
    return app
