"""Request options that shape the answer rather than the tokens: token probabilities (`n_probs`,
`logprobs`), `logit_bias` (which does shape them, as plain generation with it would), `n`
choices, per-token timings, prompt progress and `response_fields`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from specdecode.generate import Chunk
from specdecode.sampling import SamplingParams
from specdecode.server.formats import timings
from specdecode.server.probs import (
    Pieces,
    Scored,
    chat_logprobs,
    legacy_logprobs,
    logit_bias,
    native,
    score,
    with_text,
    within_text,
)
from specdecode.server.schemas import NativeCompletionRequest, Sampling
from specdecode.server.slots import Job, Run
from specdecode.server.tokens import Tokenizers

T = TypeVar("T")


async def with_request_options(tokenizers: Tokenizers, vocab_size: int, body: Sampling, job: Job) -> Job:
    """The job with the request's logit bias (texts tokenized in a worker thread), the token
    probabilities it asks for, and whether it reports progress (a stream)."""
    sampling = job.sampling
    if body.logit_bias is not None:
        bias = await tokenizers.run(logit_bias, body.logit_bias, vocab_size)
        sampling = replace(sampling, logit_bias=bias)
    return replace(
        job,
        sampling=sampling,
        n_probs=body.top_n,
        progress=body.return_progress and body.stream,
    )


def choice_jobs(job: Job, n: int) -> list[Job]:
    """`n` jobs for `n` choices: the first with the request's seed (so n = 1 is the request
    alone), the others with seeds spawned from it; greedy choices are all the same."""
    seed = job.sampling.seed
    jobs = [job]
    for index in range(1, n):
        spawned = None
        if seed is not None:
            sequence = np.random.SeedSequence(seed, spawn_key=(index - 1,))
            spawned = int(sequence.generate_state(1, np.uint32)[0])
        jobs.append(replace(job, sampling=replace(job.sampling, seed=spawned)))
    return jobs


@dataclass
class Scorer:
    """Token probabilities for one generation, chunk by chunk: `n` alternatives, from the
    softmax or (`sampling`) after sampling; tokens in `eog_ids` (those ending the answer, which
    add no text) have no entry."""

    tokenizers: Tokenizers
    n: int
    history: list[int]  # the tokens before the next chunk's (for penalties after sampling)
    eog_ids: frozenset[int]
    sampling: SamplingParams | None = None
    offset: int = 0  # characters of text the entries so far cover (OpenAI's text_offset)
    entries: list[Scored] = field(default_factory=list)
    pieces: Pieces = field(default_factory=Pieces)
    text: str = ""  # the chunks' text so far
    covered: int = 0  # characters of it the entries' texts add up to
    given: int = 0  # entries handed out: those whose text the chunks' text holds
    given_chars: int = 0  # characters their texts add up to

    @classmethod
    def for_request(
        cls, tokenizers: Tokenizers, eog_ids: frozenset[int], body: Sampling, job: Job
    ) -> Scorer | None:
        if job.n_probs is None:
            return None
        post = isinstance(body, NativeCompletionRequest) and body.post_sampling_probs
        return cls(tokenizers, job.n_probs, list(job.prompt), eog_ids, job.sampling if post else None)

    async def add(self, chunk: Chunk) -> list[Scored]:
        """The entries the answer's text now holds, in order (all are kept in `entries`): a
        token's entry is handed out once its whole text has been, so one whose text is held
        back for a stop string waits, and the tokens a stop string cut never get one."""
        assert chunk.logits is not None, "a job that scores tokens keeps their logits"
        history = list(self.history)
        self.history.extend(chunk.tokens)
        scored = await self.tokenizers.run(
            score, chunk.logits, chunk.tokens, history, self.n, self.pieces, self.sampling
        )
        scored = [entry for entry in scored if entry.token.id not in self.eog_ids]
        self.text += chunk.text
        covered = self.covered + sum(len(entry.token.text) for entry in scored)
        if scored and covered < len(self.text):
            # the answer ended inside a character: its last token adds what the text shows there
            scored[-1] = with_text(scored[-1], self.text[covered:])
            covered = len(self.text)
        self.covered = covered
        self.entries.extend(scored)
        ready = within_text(self.entries[self.given :], len(self.text) - self.given_chars)
        self.given += len(ready)
        self.given_chars += sum(len(entry.token.text) for entry in ready)
        return ready

    def native(self, scored: list[Scored]) -> list[dict[str, Any]]:
        """llama-server's completion_probabilities for these entries."""
        return native(scored, self.sampling is not None)

    def legacy(self, scored: list[Scored]) -> dict[str, Any]:
        """OpenAI's completions logprobs for the next entries, text offsets running on."""
        body = legacy_logprobs(scored, self.offset)
        self.offset += sum(len(entry.token.text) for entry in scored)
        return body


def logprobs_of(scorer: Scorer, scored: list[Scored], chat: bool) -> dict[str, Any]:
    return chat_logprobs(scored) if chat else scorer.legacy(scored)


async def whole_entries(scorer: Scorer, chunks: Sequence[Chunk]) -> list[Scored]:
    """Entries for a whole answer: those of the tokens its text holds."""
    for chunk in chunks:
        await scorer.add(chunk)
    return scorer.entries[: scorer.given]


def live_timings(run: Run) -> dict[str, float | int]:
    """llama-server's timings of a generation still running: predicted_ms so far."""
    generation = run.generation
    assert generation is not None, "a run that sent a chunk was admitted"
    stats = generation.stats
    elapsed = time.perf_counter() - run.admitted - stats.t_prompt
    return timings(replace(stats, t_generation=max(elapsed, 0.0)), run.n_cached)


def only_fields(whole: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's response_fields: each path found in the answer ("a/b": b inside a),
    under the path itself; paths not found are left out."""
    kept: dict[str, Any] = {}
    for path in paths:
        value: Any = whole
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            kept[path] = value
    return kept


async def interleaved(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The events of several streams as they come, each with its stream's index; leaving the
    loop early closes every stream."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    ended = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        finally:
            queue.put_nowait((index, ended))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is ended:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
