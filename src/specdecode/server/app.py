"""The HTTP API over a Pipeline: OpenAI's endpoints, llama-server's own, request checks.

A request is checked on the event loop, its prompt tokenized in a worker thread (see
`tokens`), and it becomes a `Job`; generation runs in a slot (see `slots`). Every refusal is
an OpenAI error body with a 4xx status, raised before any slot is taken; a streamed answer
sends its headers only once a slot is generating it, so a request refused while it waits
(the server shutting down) still gets a plain 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from specdecode.api import Pipeline
from specdecode.backends.gather import DraftPasses
from specdecode.chat import encode
from specdecode.errors import SpecdecodeError
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.grammars import check_isolated
from specdecode.server.chat import chat_prompt_ids, ending, render, template
from specdecode.server.errors import (
    NOT_SUPPORTED,
    APIError,
    exceeds_context,
    install_error_handlers,
    log,
    server_error,
    shutting_down,
    validation_error,
)
from specdecode.server.formats import (
    Answer,
    ChatCompletion,
    Reply,
    TextCompletion,
    native_chunk,
    native_whole,
    per_token,
    sse,
    stopping_word,
)
from specdecode.server.guards import LimitBodySize, RequireApiKey
from specdecode.server.metrics import Metrics
from specdecode.server.options import (
    Scorer,
    choice_jobs,
    interleaved,
    live_timings,
    logprobs_of,
    only_fields,
    whole_entries,
    with_request_options,
)
from specdecode.server.prompts import MAX_PROMPTS, merged_choices, mixed_ids, split_prompts
from specdecode.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NativeCompletionRequest,
    Prompt,
    Sampling,
    SamplingFields,
    TokenizeRequest,
)
from specdecode.server.settings import ServerSettings
from specdecode.server.slots import Closing, Job, Progress, Run, SlotPool
from specdecode.server.tokens import Tokenizers, decode, pieces
from specdecode.stats import GenerationStats
from specdecode.strategies import DraftModelConfig

CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer
RANDOM_SEED = 0xFFFFFFFF  # how llama-server shows "a random seed" in its settings
# How often a job answered in one piece asks whether its client left: one ask costs more than
# a token's own bookkeeping, so it is not made for every chunk.
DISCONNECT_POLL_S = 0.05
Body = TypeVar("Body", bound=BaseModel)
Rendered = TypeVar("Rendered")

try:
    VERSION = version("specdecode")
except PackageNotFoundError:  # run from a source tree
    VERSION = "source"


class Service:
    """What the routes share: the loaded pipeline, its slots, the tokenizers, the counters."""

    def __init__(self, pipeline: Pipeline, settings: ServerSettings) -> None:
        self.front = pipeline
        self.settings = settings
        self.n_ctx = pipeline.target.n_ctx
        self.metrics = Metrics(pipeline.spec_types)
        rule = pipeline.load_rule() if pipeline.spec_types else None
        passes = DraftPasses() if pipeline.draft is not None or pipeline.eagle3 is not None else None
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

    # ------------------------------------------------------------------ requests -> jobs

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

    # ------------------------------------------------------------------ running jobs

    async def _start(self, job: Job, request: Request) -> Run | None:
        """The job running in a slot, once one is free; None when the client left meanwhile
        (asked at most every DISCONNECT_POLL_S while the job waits for a slot)."""
        acquiring = asyncio.ensure_future(self.slots.acquire(job.prompt if job.cache_prompt else ()))
        try:
            while not acquiring.done():
                await asyncio.wait((acquiring,), timeout=DISCONNECT_POLL_S)
                if not acquiring.done() and await request.is_disconnected():
                    acquiring.cancel()  # a slot handed over meanwhile goes back (see `acquire`)
                    return None
            slot = acquiring.result()
        except Closing:
            raise shutting_down("no new generation starts") from None
        except BaseException:
            acquiring.cancel()
            if acquiring.done() and not acquiring.cancelled() and acquiring.exception() is None:
                self.slots.release(acquiring.result())
            raise
        try:
            if await request.is_disconnected():
                self.slots.release(slot)
                return None
        except BaseException:
            self.slots.release(slot)
            raise
        return self.slots.start(slot, job)

    async def _finish(
        self, run: Run, request: Request, chunks: list[Chunk] | None = None
    ) -> Generation | None:
        """The finished generation, or None when the client left first (the job is stopped);
        its chunks are appended to `chunks`, if given."""
        polled = -DISCONNECT_POLL_S
        async with contextlib.aclosing(run.events()) as events:
            try:
                async for event in events:
                    if isinstance(event, Generation):
                        return event
                    assert isinstance(event, Chunk)
                    if chunks is not None:
                        chunks.append(event)
                    if (now := time.monotonic()) - polled >= DISCONNECT_POLL_S:
                        polled = now
                        if await request.is_disconnected():
                            return None
            except Closing:
                raise shutting_down("the generation was stopped") from None
        raise AssertionError("a job ends with its Generation")

    async def _openai(
        self, body: SamplingFields, prompt: list[int], kind: TextCompletion | ChatCompletion, request: Request
    ) -> Response:
        job = await self._constrained(body, self._job(body, prompt))
        job = await with_request_options(self.tokenizers, self.front.target.vocab.size, body, job)
        reply = Reply(kind, self.settings.model_id, self.fingerprint, body.include_usage)
        jobs = choice_jobs(job, body.n)  # one generation per choice
        scorers = [self._scorer(body, choice) for choice in jobs]
        if body.stream:  # it starts with the first choice; the others join as slots free up
            first = await self._start(jobs[0], request)
            if first is None:
                return Response(status_code=CLIENT_CLOSED)
            stream = self._openai_stream(first, jobs[1:], request, reply, scorers, body.timings_per_token)
            return StreamingResponse(stream, media_type="text/event-stream")
        runs: list[Run] = []
        try:
            for choice in jobs:
                run = await self._start(choice, request)
                if run is None:
                    self._stop(runs)
                    return Response(status_code=CLIENT_CLOSED)
                runs.append(run)
        except BaseException:
            self._stop(runs)
            raise
        chunks: list[list[Chunk]] = [[] for _ in runs]
        try:
            generations = await asyncio.gather(
                *(self._finish(run, request, kept) for run, kept in zip(runs, chunks, strict=True))
            )
        finally:
            self._stop(runs)
        answers = []
        for generation, kept, scorer in zip(generations, chunks, scorers, strict=True):
            if generation is None:
                return Response(status_code=CLIENT_CLOSED)
            logprobs = None
            if scorer is not None:
                entries = await whole_entries(scorer, kept)
                logprobs = logprobs_of(scorer, entries, isinstance(kind, ChatCompletion))
            answers.append(Answer(generation.text, generation.stats, logprobs))
        return JSONResponse(reply.whole(answers, runs[0].n_cached))

    def _stop(self, runs: list[Run]) -> None:
        """Stop runs whose answer will not be sent (a run already finished ignores it)."""
        for run in runs:
            run.stop.set()

    def _scorer(self, body: Sampling, job: Job) -> Scorer | None:
        # an end-of-generation token that ends the answer adds no text, so it gets no entry
        ends = frozenset() if job.config.ignore_eos else self.front.target.vocab.eog_ids
        return Scorer.for_request(self.tokenizers, ends, body, job)

    async def _openai_stream(
        self,
        first: Run,
        later: list[Job],
        request: Request,
        reply: Reply,
        scorers: list[Scorer | None],
        per_token: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a role-only opening chunk per choice (chat), a chunk per step with
        new text (and its tokens' logprobs, its timings so far), a chunk per choice with
        finish_reason and timings, the usage chunk if asked, then [DONE]; the choices' chunks
        interleave as their steps come, each with its index. The first choice runs already;
        the `later` ones start as slots free up, so a choice waiting for a slot holds back no
        other. A cut generation (or a choice refused a slot at shutdown) ends with an error
        event and [DONE]. Cancelled when the client leaves, which stops the jobs."""
        chat = isinstance(reply.kind, ChatCompletion)
        runs: list[Run | None] = [first, *(None for _ in later)]
        for index in range(len(runs)):
            opening = reply.opening(index)
            if opening is not None:
                yield sse(opening)
        finished: dict[int, GenerationStats] = {}
        choices = [self._events(first), *(self._started_events(job, request) for job in later)]
        async for index, event in interleaved(choices):
            if isinstance(event, Run):
                runs[index] = event
                continue
            run, scorer = runs[index], scorers[index]
            if isinstance(event, dict):
                yield sse(event)
            elif isinstance(event, Progress):
                yield sse(reply.progress_chunk(event.body()))
            elif isinstance(event, Generation):
                assert run is not None, "a choice's Run comes before its events"
                finished[index] = event.stats
                yield sse(reply.last_chunk(event.stats, run.n_cached, index))
            else:
                assert run is not None, "a choice's Run comes before its events"
                logprobs = None
                if scorer is not None and (scored := await scorer.add(event)):
                    logprobs = logprobs_of(scorer, scored, chat)
                if event.text or logprobs:
                    chunk = reply.chunk(event.text, index, logprobs)
                    yield sse({**chunk, "timings": live_timings(run)} if per_token else chunk)
        if reply.include_usage and len(finished) == len(runs):
            yield sse(reply.usage_chunk(*(finished[index] for index in range(len(runs)))))
        yield sse("[DONE]")

    async def _native_stream(
        self, run: Run, scorer: Scorer | None, per_token_timings: bool
    ) -> AsyncIterator[str]:
        """llama-server's /completion stream: a chunk per token, a speculative step's tokens
        one by one (with its probability, the timings so far), then the whole answer's fields
        with stop: true (no [DONE], as llama-server sends none there)."""
        async for event in self._events(run):
            if isinstance(event, dict):
                yield sse(event)
            elif isinstance(event, Progress):
                yield sse({**native_chunk("", [], run.slot.id), "prompt_progress": event.body()})
            elif isinstance(event, Generation):
                yield sse(await self._native_whole(run, event, "", []))
            elif event.text or event.tokens:
                for piece in per_token(event):
                    chunk = native_chunk(piece.text, piece.tokens, run.slot.id)
                    if scorer is not None:
                        chunk["completion_probabilities"] = scorer.native(await scorer.add(piece))
                    if per_token_timings:
                        chunk["timings"] = live_timings(run)
                    yield sse(chunk)

    async def _started_events(
        self, job: Job, request: Request
    ) -> AsyncIterator[Run | Chunk | Generation | Progress | dict[str, Any]]:
        """A streamed choice that waits for a slot: its Run once started, then its events (see
        `_events`); an error event instead when the server shuts down meanwhile, nothing when
        the client left."""
        try:
            run = await self._start(job, request)
        except APIError as exc:
            yield exc.body()
            return
        if run is None:
            return
        try:
            yield run
            async for event in self._events(run):
                yield event
        finally:
            run.stop.set()  # the stream ended before the generation (a finished one ignores it)

    async def _events(self, run: Run) -> AsyncIterator[Chunk | Generation | Progress | dict[str, Any]]:
        """A run's events for a stream whose headers are sent: a failure ends it with an error
        event (the details of the server's own failures go to the log)."""
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    yield event
        except Closing:
            yield shutting_down("the generation was stopped").body()
        except Exception:
            log.exception("generation failed")
            yield server_error().body()

    async def _native_whole(
        self, run: Run, generation: Generation, text: str, tokens: list[int]
    ) -> dict[str, Any]:
        stops = run.job.config.stop
        stopping = ""
        if generation.stats.stop_reason == "stop string":
            whole = await self.tokenizers.run(decode, generation.tokens, True)
            stopping = stopping_word(generation.text, whole, stops)
        return native_whole(
            text,
            tokens,
            generation.stats,
            n_cached=run.n_cached,
            slot=run.slot.id,
            model=self.settings.model_id,
            prompt=await self.tokenizers.run(decode, run.job.prompt),
            stopping=stopping,
            settings={"n_ctx": self.n_ctx, **self._params(run.job)},
        )

    # ------------------------------------------------------------------ llama-server's views

    def _params(self, job: Job | None) -> dict[str, Any]:
        """A job's settings as llama-server shows them (the defaults without a job)."""
        sampling = job.sampling if job is not None else self.settings.sampling
        n_predict = job.config.n_predict if job is not None else -1
        draft = (job.draft if job is not None else None) or self.front.draft_config
        return {
            "n_predict": n_predict,
            "seed": sampling.seed if sampling.seed is not None else RANDOM_SEED,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "repeat_last_n": sampling.repeat_last_n,
            "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "stop": list(job.config.stop) if job is not None else [],
            "max_tokens": n_predict,
            "ignore_eos": job.config.ignore_eos if job is not None else False,
            "n_probs": (job.n_probs or 0) if job is not None else 0,
            "speculative.n_max": draft.n_max,
            "speculative.n_min": draft.n_min,
            "speculative.p_min": draft.p_min,
        }

    def _slot_state(self, run: Run | None, slot: int) -> dict[str, Any]:
        n_predict = run.job.config.n_predict if run is not None else -1
        n_decoded = run.n_decoded if run is not None else 0
        return {
            "id": slot,
            "id_task": run.task if run is not None else -1,
            "n_ctx": self.n_ctx,
            "speculative": bool(self.front.spec_types),
            "is_processing": run is not None,
            "params": self._params(run.job if run is not None else None),
            "next_token": {
                "has_next_token": run is not None,
                "n_remain": n_predict - n_decoded if n_predict > 0 else -1,
                "n_decoded": n_decoded,
            },
        }


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
