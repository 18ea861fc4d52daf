"""Running a checked job in a slot and answering with it: whole, or streamed as server-sent events.

Apart from the routes (`app`) and the request checks (`checks`): this is where a request
waits for a slot, notices a client that left, and turns a run's events into OpenAI's or
llama-server's answers (see `formats`). `Service` inherits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdecode.generate import Chunk, Generation
from specdecode.server.checks import Checks
from specdecode.server.errors import APIError, log, server_error, shutting_down
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
from specdecode.server.options import (
    Scorer,
    choice_jobs,
    interleaved,
    live_timings,
    logprobs_of,
    whole_entries,
    with_request_options,
)
from specdecode.server.schemas import Sampling, SamplingFields
from specdecode.server.slots import Closing, Job, Progress, Run
from specdecode.server.tokens import decode
from specdecode.stats import GenerationStats

CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer
RANDOM_SEED = 0xFFFFFFFF  # how llama-server shows "a random seed" in its settings
# How often a job answered in one piece asks whether its client left: one ask costs more than
# a token's own bookkeeping, so it is not made for every chunk.
DISCONNECT_POLL_S = 0.05


class Answers(Checks):
    """Jobs run in slots, and their answers."""

    fingerprint: str

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
